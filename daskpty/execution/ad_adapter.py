"""Binds the AD engine (:mod:`daskpty.engines.ad`) to the round loop of :mod:`daskpty.execution.driver`.

Same protocol as ``LSQMLAdapter``: ``chunk_function`` (module-level, picklable), ``payload``,
``apply``, ``begin_epoch``, ``end_epoch``, ``initialise``, ``new_state``, ``engine_state``. Every round is one optimiser step on the
gradient of that round's patterns (slice ``round_index::rounds`` of every chunk — minibatches).

The CG optimiser's line search needs extra loss-only map-reduces on the same slice. For that the
adapter offers :meth:`ADAdapter.run_round`, which does the gradient map-reduce, the line-search
evaluations and the apply; a driver that finds ``run_round`` on an adapter calls it instead of
``map_reduce`` + ``apply``. Adam and SGD need no extra evaluations and work with either path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines import ad
from ..engines.lsqml import warp_object
from ..engines.positions import (PositionOptions, affine_parameters, finish_epoch, initial_local, note_epoch_start,
                                 options_for, positions_for_step, settle_start, start_parameters, window_parameters)
from .rounds import ChunkedData, map_reduce


@dataclass
class ADPayload:
    object: np.ndarray
    probe: np.ndarray
    options: ad.ADOptions
    want_object: bool
    want_probe: bool
    valid: np.ndarray | None
    positions: PositionOptions | None = None  # position refinement (None: off)
    epoch: int = 0
    affine: tuple | None = None


def ad_gradient_chunk(intensities, positions, payload: ADPayload, local=None):
    """The AD gradient step; with ``local`` (position refinement) at the refined positions, which it
    also moves, ``positions`` being the nominal ones."""
    if local is not None:
        return ad.refining_chunk_gradient(payload.object, payload.probe, intensities, positions, local,
                                          options=payload.options, positions=payload.positions,
                                          epoch=payload.epoch, affine=payload.affine, valid=payload.valid,
                                          want_object=payload.want_object, want_probe=payload.want_probe)
    return ad.chunk_gradient(payload.object, payload.probe, intensities, positions, options=payload.options,
                             valid=payload.valid, want_object=payload.want_object,
                             want_probe=payload.want_probe)


def ad_loss_chunk(intensities, positions, payload: ADPayload, local=None):
    """The loss only (CG line search), at the refined positions when refining (none move)."""
    if local is not None:
        positions = positions_for_step(local, positions, payload.affine, payload.positions, payload.epoch,
                                       payload.probe.shape[-1], payload.object.shape)
    return ad.chunk_loss(payload.object, payload.probe, intensities, positions, options=payload.options,
                         valid=payload.valid)


def ad_forward_sums_chunk(intensities, positions, payload: ADPayload):
    return ad.forward_sums(payload.object, payload.probe, intensities, positions, valid=payload.valid)


class ADAdapter:
    """Binds :mod:`daskpty.engines.ad` to the round loop."""

    name = "ad"
    chunk_function = staticmethod(ad_gradient_chunk)
    #: What lives in device memory on GPU workers (see :mod:`.device_state`); the optimiser's
    #: memory (Adam's moments) is object- and probe-sized.
    device_fields = ("object", "probe", "illumination", "optimizer")
    loss_function = staticmethod(ad_loss_chunk)

    def __init__(self, options: ad.ADOptions | None = None, valid: np.ndarray | None = None,
                 positions: PositionOptions | None = None):
        self.options = options if options is not None else ad.ADOptions()
        self.valid = valid
        self.positions = positions

    @property
    def local_state(self) -> bool:
        """Per-pattern state (refined positions, their optimiser's memory) kept with each chunk."""
        return self.positions is not None

    def initial_local(self, nominal) -> dict:
        return initial_local(nominal, self.positions, "ad")

    def epoch_scalars(self, state) -> dict:
        """The fitted affine map's and the windows' deformation parameters, for the epoch's history entry."""
        out = {} if state.affine is None else affine_parameters(state.affine)
        return {**out, **window_parameters(state.window_deformation), **start_parameters(state)}

    @property
    def needs_evaluations(self) -> bool:
        """True when ``apply`` needs loss evaluations (CG line search): use :meth:`run_round`."""
        return self.options.optimizer == "cg"

    def payload(self, state: ad.ADState, object=None, probe=None) -> ADPayload:
        return ADPayload(state.object if object is None else object,
                         state.probe if probe is None else probe, self.options,
                         state.active("object", self.options), state.active("probe", self.options),
                         self.valid,
                         options_for(self.positions, state),
                         state.epoch,
                         None if state.affine is None and state.window_map is None
                         else (state.affine, state.affine_boost, state.window_map))

    def apply(self, state, total, evaluate=None):
        return ad.apply(state, total, self.options, evaluate=evaluate)

    def begin_epoch(self, state):
        state = ad.begin_epoch(state, self.options)
        if self.positions is not None:
            note_epoch_start(state, self.positions)
        return state

    def end_epoch(self, state):
        if self.positions is not None:
            finish_epoch(state, self.positions, warp_object_state)
        state = ad.end_epoch(state, self.options)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None) -> ad.ADState:
        """A state from an object, a probe and (when resuming) the saved engine arrays."""
        return ad.ADState.from_arrays(obj, probe, epoch, engine_state)

    def engine_state(self, state: ad.ADState) -> dict:
        """Arrays beyond object and probe needed to continue exactly (optimiser memory; for checkpoints)."""
        return state.to_arrays()

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy."""
        sums = map_reduce(client, data, ad_forward_sums_chunk, self.payload(state), split_every=split_every)
        return ad.rescale_probe(state, sums)

    def run_round(self, client, data: ChunkedData, state, *, round_index: int = 0, rounds: int = 1,
                  split_every: int | None = None, local: dict | None = None):
        """Gradient map-reduce, then apply — with loss-only map-reduces on the same slice when the
        optimiser asks for them. Returns ``(state, total)``; ``total.scalars["loss_evaluations"]``
        counts the extra map-reduces; ``total.local`` the chunks' moved positions (with ``local``)."""
        total = map_reduce(client, data, self.chunk_function, self.payload(state),
                           round_index=round_index, rounds=rounds, split_every=split_every, local=local)
        count = 0

        def evaluate(params):
            nonlocal count
            count += 1
            part = map_reduce(client, data, self.loss_function,
                              self.payload(state, params.get("object"), params.get("probe")),
                              round_index=round_index, rounds=rounds, split_every=split_every, local=local)
            return part.scalars.get("loss", float("nan"))

        state = self.apply(state, total, evaluate=evaluate if self.needs_evaluations else None)
        if total is not None:
            total.scalars["loss_evaluations"] = float(count)
        return state, total


#: Adam's memory slots (:class:`daskpty.engines.ad.optimizers.Adam`).
ADAM_SLOTS = ("m", "v")


def warp_object_state(state: ad.ADState, matrix, offset) -> None:
    """The window correction's move of the object, O(x) ← O(matrix · x + offset), and of the
    object optimiser's memory that is a field like it (SGD's momentum, CG's directions). Adam's
    moments stay: its step is their ratio, which a sub-pixel move hardly changes, and moving
    the second moment where it is near zero (outside the lit region) made that ratio blow up."""
    state.object = warp_object(state.object, matrix, offset)
    for key, value in list(state.optimizer.arrays.items()):
        slot, name = key.split("/", 1)
        if name == "object" and slot not in ADAM_SLOTS:
            state.optimizer.arrays[key] = warp_object(value, matrix, offset)
