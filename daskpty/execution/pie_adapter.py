"""Binds the PIE family (:mod:`daskpty.engines.pie`: rPIE, ePIE) to the round loop.

Same protocol as ``LSQMLAdapter`` (``chunk_function``, ``payload``, ``apply``, ``begin_epoch``,
``end_epoch``, ``initialise``, ``new_state``, ``engine_state``, ``copy_state``). Every round is one
rPIE step on that round's patterns (slice ``round_index::rounds`` of every chunk): more rounds per
epoch, smaller minibatches, closer to the sequential PIE of the papers.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..engines import lsqml, pie
from .rounds import ChunkedData, map_reduce


@dataclass
class PIEPayload:
    object: np.ndarray
    probe: np.ndarray
    options: pie.PIEOptions
    update_probe: bool
    valid: np.ndarray | None


def pie_chunk(intensities, positions, payload: PIEPayload, local=None):
    """The rPIE sums of one chunk's slice (no per-pattern state)."""
    return pie.chunk_step(payload.object, payload.probe, intensities, positions, options=payload.options,
                          update_probe=payload.update_probe, valid=payload.valid)


def pie_forward_sums_chunk(intensities, positions, payload: PIEPayload):
    return lsqml.forward_sums(payload.object, payload.probe, intensities, positions, valid=payload.valid)


class PIEAdapter:
    """Binds :mod:`daskpty.engines.pie` to the round loop."""

    chunk_function = staticmethod(pie_chunk)
    #: what lives in device memory on GPU workers (see :mod:`.device_state`)
    device_fields = ("object", "probe", "illumination")
    positions = None        # position refinement is not offered by the PIE engines yet
    local_state = False

    def __init__(self, options: pie.PIEOptions | None = None, valid: np.ndarray | None = None,
                 name: str = "rpie"):
        self.options = options if options is not None else pie.PIEOptions()
        self.valid = valid
        self.name = name

    def payload(self, state) -> PIEPayload:
        return PIEPayload(state.object, state.probe, self.options, pie.updates_probe(state, self.options),
                          self.valid)

    def epoch_scalars(self, state) -> dict:
        return {}

    def initial_local(self, nominal) -> dict:
        return {}   # no per-pattern state (local_state is False)

    def apply(self, state, total):
        return pie.apply(state, total, self.options)

    @staticmethod
    def copy_state(state):
        """``pie.apply`` only rebinds the state's arrays, so a shallow copy protects the original."""
        return copy.copy(state)

    def begin_epoch(self, state):
        return pie.begin_epoch(state, self.options)

    def end_epoch(self, state):
        return pie.end_epoch(state, self.options)

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        return lsqml.LSQMLState(object=obj, probe=probe, epoch=epoch)

    def engine_state(self, state) -> dict:
        """PIE keeps no memory beyond the object and the probe."""
        return {}

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy."""
        sums = map_reduce(client, data, pie_forward_sums_chunk, self.payload(state), split_every=split_every)
        return lsqml.rescale_probe(state, sums)
