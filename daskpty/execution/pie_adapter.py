"""Binds the PIE family (:mod:`daskpty.engines.pie`: rPIE, ePIE) to the round loop, with the
forward model's parts composed as :class:`~.lsqml_adapter.LSQMLAdapter` composes them.

Every round is one rPIE step on that round's patterns (the ``round_index``-th subset of every
chunk): more rounds per epoch, smaller minibatches, closer to the sequential PIE of the papers.
The adapter holds the parts: ``sample`` (:class:`~daskpty.engines.sample_model.SampleModel`:
K slices and/or a near-field detector, the 3PIE step of :mod:`daskpty.engines.pie_multislice`;
None for one slice in the far field) and ``positions``
(:class:`~daskpty.engines.positions.PositionOptions`: refined positions kept with each chunk, the
affine fit and window correction of :mod:`daskpty.engines.positions`; None: fixed). Protocol:
:mod:`.engine_protocol`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..engines import lsqml, pie, pie_multislice, pie_tiles
from ..engines import sample_model as sm
from ..engines.multislice_positions import initial_ratios
from ..engines.tile_frame import TileFrame, frame_of
from ..engines.positions import (epoch_parameters, step_maps, PositionOptions, finish_epoch, initial_local, note_epoch_start,
                                 options_for, restore_rules, settle_start, start_arrays, start_from_arrays)
from .rounds import ChunkedData, map_reduce


@dataclass
class PIEPayload:
    object: np.ndarray
    probe: np.ndarray
    options: pie.PIEOptions
    update_probe: bool
    valid: np.ndarray | None
    positions: PositionOptions | None = None  # position refinement (None: off)
    epoch: int = 0
    affine: tuple | None = None
    sample: sm.SampleModel | None = None      # None: one slice, far field
    frame: TileFrame | None = None             # a tile's place in the object (None: the whole object)


def _step(sample: sm.SampleModel | None):
    """The rPIE chunk step of ``sample`` (one slice in the far field: :func:`pie.chunk_step`)."""
    if sample is None:
        return pie.chunk_step
    return partial(pie_multislice.chunk_step, kernel=sample.kernel, detector=sample.detector)


def pie_chunk(intensities, positions, payload: PIEPayload, local=None):
    """The rPIE sums of one chunk's slice; with ``local`` (the refined positions) the refining
    step, ``positions`` being the nominal ones."""
    step = _step(payload.sample)
    if local is not None:
        return pie.refining_chunk_step(payload.object, payload.probe, intensities, positions, local,
                                       options=payload.options, positions=payload.positions, epoch=payload.epoch,
                                       affine=payload.affine, update_probe=payload.update_probe,
                                       valid=payload.valid, step=step, frame=payload.frame)
    return step(payload.object, payload.probe, intensities, positions, options=payload.options,
                update_probe=payload.update_probe, valid=payload.valid)


def pie_forward_sums_chunk(intensities, positions, payload: PIEPayload):
    return sm.forward_sums(payload.sample)(payload.object, payload.probe, intensities, positions,
                                           valid=payload.valid)


class PIEAdapter:
    """Binds :mod:`daskpty.engines.pie` to the round loop, for every sample and position model."""

    chunk_function = staticmethod(pie_chunk)
    #: what lives in device memory on GPU workers (see :mod:`.device_state`)
    device_fields = ("object", "probe", "illumination")

    def __init__(self, options: pie.PIEOptions | None = None, valid: np.ndarray | None = None,
                 name: str = "rpie", positions: PositionOptions | None = None, *,
                 sample: sm.SampleModel | None = None):
        self.options = options if options is not None else pie.PIEOptions()
        self.valid = valid
        self.name = name
        self.positions = positions
        self.sample = sample

    @property
    def local_state(self) -> bool:
        """Per-pattern state (the refined positions) kept with each chunk."""
        return self.positions is not None

    def payload(self, state) -> PIEPayload:
        affine = step_maps(state)
        return PIEPayload(state.object, state.probe, self.options, pie.updates_probe(state, self.options),
                          self.valid, options_for(self.positions, state), state.epoch, affine, self.sample, frame_of(state))

    def epoch_scalars(self, state) -> dict:
        """The fitted affine map's and the windows' parameters, for the history."""
        return epoch_parameters(state)

    def initial_local(self, nominal) -> dict:
        if self.positions is None:
            return {}
        local = initial_local(nominal, self.positions)
        if sm.carries_position_sums(self.sample):
            local.update(initial_ratios(len(nominal)))
        return local

    def apply(self, state, total):
        return pie.apply(state, total, self.options)

    @staticmethod
    def copy_state(state):
        """``pie.apply`` only rebinds the state's arrays, so a shallow copy protects the original."""
        return copy.copy(state)

    def begin_epoch(self, state):
        state = pie.begin_epoch(state, self.options)
        if self.positions is not None:
            note_epoch_start(state, self.positions)
        return state

    def end_epoch(self, state):
        if self.positions is not None:
            finish_epoch(state, self.positions, lsqml.resample_object_state)
        state = (pie.end_epoch if self.sample is None else pie_multislice.end_epoch)(state, self.options)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        """A state from an object, a probe and (when resuming) the saved position arrays."""
        engine_state = engine_state or {}
        return restore_rules(lsqml.LSQMLState(
            object=sm.as_slices(obj, self.sample), probe=probe, epoch=epoch,
            affine=engine_state.get("affine"), affine_boost=engine_state.get("affine_boost"),
            window_map=engine_state.get("window_map"), window_gram=engine_state.get("window_gram"),
            positions_start=start_from_arrays(engine_state)), engine_state)

    def engine_state(self, state) -> dict:
        """PIE keeps no memory beyond the object and the probe but the positions' fits."""
        out = {name: getattr(state, name) for name in ("affine", "affine_boost", "window_map", "window_gram")
               if getattr(state, name) is not None}
        return {**out, **start_arrays(state)}

    # Tiles (:mod:`.tile_graph`; protocol: :class:`~.engine_protocol.RunsOnTiles`)
    tile_fields = ("object", "illumination")
    tile_sums_function = staticmethod(pie_forward_sums_chunk)  # the first epoch's sums (initialise)
    tile_round_stages = 1
    tile_warped_fields = ("object",)  # what the window correction resamples

    def tiles_unsupported(self) -> str | None:
        """Why this adapter's parts cannot run on tiles yet (None: they can)."""
        return None

    def tile_finish_positions(self, state) -> None:
        """The refinement's epoch end on a tile (window fit and resampling, affine fit), in place."""
        finish_epoch(state, self.positions, lsqml.resample_object_state)

    def tile_initialise(self, state, sums):
        return lsqml.rescale_probe(state, sums)

    def tile_begin_epoch(self, state):
        return self.begin_epoch(state)  # (PIE's update copies: nothing of the last epoch is written)

    def tile_round_sums(self, state, total, own):
        return pie_tiles.round_sums(state, total, own)

    def tile_apply(self, state, total, shares):
        return pie_tiles.apply(state, total, self.options, shares)

    def tile_end_sums(self, state, own):
        return pie_tiles.end_sums(state, self.options, own)

    def tile_end_epoch(self, state, shares):
        """``end_epoch`` on a tile, after :meth:`tile_finish_positions` when refining."""
        state = pie_tiles.end_epoch(state, self.options, shares)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy."""
        sums = map_reduce(client, data, pie_forward_sums_chunk, self.payload(state), split_every=split_every)
        return lsqml.rescale_probe(state, sums)
