"""Binds the AD engine (:mod:`daskpty.engines.ad`) to the round loop of :mod:`daskpty.execution.driver`.

Same protocol as ``LSQMLAdapter``: ``chunk_function`` (module-level, picklable), ``payload``,
``apply``, ``begin_epoch``, ``end_epoch``, ``initialise``, ``new_state``, ``engine_state``. Every round is one optimiser step on the
gradient of that round's patterns (subset ``round_index`` of every chunk, :func:`~.rounds.round_rows` — minibatches).

The CG optimiser's line search needs extra loss-only map-reduces on the same slice. For that the
adapter offers :meth:`ADAdapter.run_round`, which does the gradient map-reduce, the line-search
evaluations and the apply; a driver that finds ``run_round`` on an adapter calls it instead of
``map_reduce`` + ``apply``. Adam and SGD need no extra evaluations and work with either path.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..engines import ad, lsqml_opr
from ..engines import sample_model as sm
from ..engines.tile_frame import TileFrame, frame_of
from ..engines.ad import opr as ad_opr
from ..engines.ad import tiles as ad_tiles
from ..engines.window_deformation import warp_object
from ..engines.positions import (epoch_parameters, step_maps, PositionOptions, finish_epoch, initial_local, note_epoch_start,
                                 options_for, positions_for_step, settle_start)
from ..engines.probe_model import ProbeModelOptions
from .lsqml_adapter import forward_sums_chunk
from .probe_model_part import ProbeModelPart
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
    sample: sm.SampleModel | None = None      # None: one slice, far field
    model: ProbeModelOptions | None = None    # the varying probe (None: off) and its arrays
    eigen: np.ndarray | None = None
    transform: np.ndarray | None = None
    background: np.ndarray | None = None
    frame: TileFrame | None = None             # a tile's place in the object (None: the whole object)


def ad_gradient_chunk(intensities, positions, payload: ADPayload, local=None):
    """The AD gradient of the payload's sample; with ``local`` (refined positions, probe-model
    state) at the refined positions, which it also moves, ``positions`` being the nominal ones."""
    gradient = sm.ad_gradient(payload.sample)
    if payload.model is not None:
        return ad_opr.variable_chunk_gradient(
            payload.object, payload.probe, intensities, positions, local, options=payload.options,
            model=payload.model, eigen=payload.eigen, transform=payload.transform, background=payload.background,
            epoch=payload.epoch, valid=payload.valid, want_object=payload.want_object,
            want_probe=payload.want_probe, positions=payload.positions, affine=payload.affine, gradient=gradient,
            frame=payload.frame, keep_gram=sm.carries_position_sums(payload.sample))
    if local is not None:
        return ad.refining_chunk_gradient(payload.object, payload.probe, intensities, positions, local,
                                          options=payload.options, positions=payload.positions,
                                          epoch=payload.epoch, affine=payload.affine, valid=payload.valid,
                                          want_object=payload.want_object, want_probe=payload.want_probe,
                                          gradient=gradient, frame=payload.frame,
                                          keep_gram=sm.carries_position_sums(payload.sample))
    return gradient(payload.object, payload.probe, intensities, positions, options=payload.options,
                    valid=payload.valid, want_object=payload.want_object, want_probe=payload.want_probe)


def ad_loss_chunk(intensities, positions, payload: ADPayload, local=None):
    """The loss only (CG line search), at the refined positions when refining (none move)."""
    if local is not None:
        positions = positions_for_step(local, positions, payload.affine, payload.positions, payload.epoch,
                                       payload.probe.shape[-1], payload.object.shape)
    return sm.ad_loss(payload.sample)(payload.object, payload.probe, intensities, positions,
                                      options=payload.options, valid=payload.valid)


class ADAdapter:
    """Binds :mod:`daskpty.engines.ad` to the round loop with its parts composed: the sample
    (``sample``), position refinement (``positions``) and a varying probe (``probe_model``), as
    :class:`~.lsqml_adapter.LSQMLAdapter`."""

    name = "ad"
    chunk_function = staticmethod(ad_gradient_chunk)
    loss_function = staticmethod(ad_loss_chunk)

    def __init__(self, options: ad.ADOptions | None = None, valid: np.ndarray | None = None,
                 positions: PositionOptions | None = None, *, probe_model: ProbeModelPart | None = None,
                 sample: sm.SampleModel | None = None):
        self.options = options if options is not None else ad.ADOptions()
        self.valid = valid
        self.positions = positions
        self.sample = sample
        self.probe_model = probe_model
        if probe_model is not None:
            check_probe_model_optimizer(self.options)

    @property
    def device_fields(self) -> tuple:
        """What lives in device memory on GPU workers (see :mod:`.device_state`); the optimiser's
        memory (Adam's moments) is object- and probe-sized; the probe model's state stays on the host."""
        return () if self.probe_model is not None else ("object", "probe", "illumination", "optimizer")

    @property
    def local_state(self) -> bool:
        """Per-pattern state (refined positions and their optimiser's memory, probe-model weights)."""
        return self.positions is not None or (self.probe_model is not None and self.probe_model.per_pattern)

    def initial_local(self, nominal) -> dict:
        local = {} if self.positions is None else initial_local(nominal, self.positions, gradient_based=True)
        if self.probe_model is not None:
            local.update(self.probe_model.initial_local(len(nominal)))
        return local

    def epoch_scalars(self, state) -> dict:
        """The fitted affine map's, the windows' and the probe model's parameters, for the history."""
        out = epoch_parameters(state)
        return out if self.probe_model is None else {**out, **self.probe_model.epoch_scalars(state)}

    @property
    def needs_evaluations(self) -> bool:
        """True when ``apply`` needs loss evaluations (CG line search): use :meth:`run_round`."""
        return self.options.optimizer == "cg"

    def payload(self, state: ad.ADState, object=None, probe=None) -> ADPayload:
        affine = step_maps(state)
        model = {} if self.probe_model is None else self.probe_model.payload_fields(state)
        return ADPayload(state.object if object is None else object,
                         state.probe if probe is None else probe, self.options,
                         state.active("object", self.options), state.active("probe", self.options),
                         self.valid, options_for(self.positions, state), state.epoch, affine, self.sample, **model,
                         frame=frame_of(state))

    @staticmethod
    def copy_state(state):
        """A deep copy: the optimiser's memory is updated in place."""
        return copy.deepcopy(state)

    def apply(self, state, total, evaluate=None):
        state = ad.apply(state, total, self.options, evaluate=evaluate)
        if self.probe_model is not None and total is not None:
            ad_opr.apply(state, total, self.probe_model.model, self.options.loss, self.options.delta)
        return state

    def begin_epoch(self, state):
        state = ad.begin_epoch(state, self.options)
        if self.positions is not None:
            note_epoch_start(state, self.positions)
        return state

    def end_epoch(self, state):
        if self.probe_model is not None:              # the same orthonormalisation and T as LSQML
            lsqml_opr.end_epoch(state, self.probe_model.model)
        if self.positions is not None:
            finish_epoch(state, self.positions, warp_object_state)
        state = ad.end_epoch(state, self.options)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None) -> ad.ADState:
        """A state from an object, a probe and (when resuming) the saved engine arrays."""
        state = ad.ADState.from_arrays(sm.as_slices(obj, self.sample), probe, epoch, engine_state)
        if self.probe_model is not None:
            self.probe_model.attach(state, probe, engine_state)
        return state

    def engine_state(self, state: ad.ADState) -> dict:
        """Arrays beyond object and probe needed to continue exactly (optimiser memory; for checkpoints)."""
        out = state.to_arrays()
        return out if self.probe_model is None else {**out, **self.probe_model.stored(state)}

    # Tiles (:mod:`.tile_graph`; protocol: :class:`~.engine_protocol.RunsOnTiles`)
    tile_fields = ("object", "illumination", "optimizer")  # (the optimiser's memory cuts its object rows)
    tile_warped_fields = ("object", "optimizer")  # what the window correction resamples
    tile_sums_function = staticmethod(forward_sums_chunk)

    @property
    def tile_round_stages(self) -> int:
        return ad_tiles.round_stages(self.options)

    def tiles_unsupported(self) -> str | None:
        """Why this adapter's parts cannot run on tiles yet (None: they can)."""
        return "the CG optimiser (optimizer='cg')" if self.options.optimizer == "cg" else None

    def tile_finish_positions(self, state) -> None:
        """The refinement's epoch end on a tile (window fit and resampling, affine fit), in place."""
        finish_epoch(state, self.positions, warp_object_state)

    def tile_initialise(self, state, sums):
        before = state.probe
        state = ad.rescale_probe(state, sums)
        return state if self.probe_model is None else self.probe_model.rescaled(state, before)

    def tile_begin_epoch(self, state):
        return self.begin_epoch(state)  # (copy_state is a deep copy: nothing shared to protect)

    def tile_round_sums(self, state, total, own, *earlier):
        return ad_tiles.round_sums(state, total, own, *earlier)

    def tile_apply(self, state, total, shares):
        state = ad_tiles.apply(state, total, self.options, shares)
        if self.probe_model is not None and total is not None:
            ad_opr.apply(state, total, self.probe_model.model, self.options.loss, self.options.delta)
        return state

    def tile_end_sums(self, state, own):
        return ad_tiles.end_sums(state, self.options, own)

    def tile_end_epoch(self, state, shares):
        """``end_epoch`` on a tile, after :meth:`tile_finish_positions` when refining."""
        if self.probe_model is not None:
            lsqml_opr.end_epoch(state, self.probe_model.model)
        state = ad_tiles.end_epoch(state, self.options, shares)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy (the eigen-probes follow)."""
        before = state.probe
        sums = map_reduce(client, data, forward_sums_chunk, self.payload(state), split_every=split_every)
        state = ad.rescale_probe(state, sums)
        return state if self.probe_model is None else self.probe_model.rescaled(state, before)

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


def check_probe_model_optimizer(options: ad.ADOptions) -> None:
    """A varying probe moves per-pattern parameters in the chunk steps, which CG's line search cannot."""
    if options.optimizer == "cg":
        raise ValueError("opr_modes / fit_intensity / background with engine='ad' need optimizer "
                         "'sgd' or 'adam' (the CG line search does not move per-pattern parameters)")


#: Adam's memory slots (:class:`daskpty.engines.ad.optimizers.Adam`).
ADAM_SLOTS = ("m", "v")


def warp_object_state(state: ad.ADState, matrix, offset) -> None:
    """The window correction's move of the object, O(x) ← O(matrix · x + offset), and of the
    object optimiser's memory that is a field like it (SGD's momentum, CG's directions). Adam's
    moments stay: its step is their ratio, which a sub-pixel move hardly changes, and moving
    the second moment where it is near zero (outside the lit region) made that ratio blow up."""
    frame = frame_of(state)  # (on a tile: rows placed in the whole object)
    state.object = warp_object(state.object, matrix, offset, frame)
    for key, value in list(state.optimizer.arrays.items()):
        slot, name = key.split("/", 1)
        if name == "object" and slot not in ADAM_SLOTS:
            state.optimizer.arrays[key] = warp_object(value, matrix, offset, frame)
