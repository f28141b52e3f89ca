"""Binds the LSQML engine (:mod:`daskpty.engines.lsqml`) to the round loop, with every part of
the forward model composed in one adapter.

:class:`LSQMLAdapter` holds its parts: the sample (:class:`~daskpty.engines.sample_model.SampleModel`:
K slices and/or a near-field detector; None for one slice in the far field), position
refinement (:class:`~daskpty.engines.positions.PositionOptions`; None: fixed) and the probe
model (:class:`~.probe_model_part.ProbeModelPart`; None: one probe for all patterns). The chunk
function picks the sample's chunk step and passes it to the refining and varying-probe steps,
so every combination runs through the same code. Protocol: :mod:`.engine_protocol`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..engines import lsqml, lsqml_opr, lsqml_tiles
from ..engines import sample_model as sm
from ..engines.multislice_positions import initial_ratios
from ..engines.tile_frame import TileFrame, frame_of
from ..engines.positions import (epoch_parameters, step_maps, PositionOptions, finish_epoch, initial_local, note_epoch_start,
                                 options_for, restore_rules, settle_start, start_arrays, start_from_arrays)
from ..engines.probe_model import ProbeModelOptions
from .probe_model_part import ProbeModelPart
from .rounds import ChunkedData, map_reduce


@dataclass
class LSQMLPayload:
    object: np.ndarray
    probe: np.ndarray
    options: lsqml.LSQMLOptions
    update_probe: bool
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


def lsqml_chunk(intensities, positions, payload: LSQMLPayload, local=None):
    """The LSQML chunk step of the payload's sample; with ``local`` (refined positions, probe
    model state) the refining / varying-probe step, ``positions`` being the nominal ones."""
    step = sm.lsqml_step(payload.sample)
    if payload.model is not None:
        return lsqml_opr.variable_chunk_step(
            payload.object, payload.probe, intensities, positions, local, options=payload.options,
            model=payload.model, eigen=payload.eigen, transform=payload.transform, background=payload.background,
            epoch=payload.epoch, update_probe=payload.update_probe, valid=payload.valid,
            positions=payload.positions, affine=payload.affine, step=step, frame=payload.frame)
    if local is not None:
        return lsqml.refining_chunk_step(payload.object, payload.probe, intensities, positions, local,
                                         options=payload.options, positions=payload.positions,
                                         epoch=payload.epoch, affine=payload.affine,
                                         update_probe=payload.update_probe, valid=payload.valid, step=step,
                                         frame=payload.frame)
    return step(payload.object, payload.probe, intensities, positions, options=payload.options,
                update_probe=payload.update_probe, valid=payload.valid)


def forward_sums_chunk(intensities, positions, payload):
    """Σ measured and Σ model intensity of a chunk (LSQML and AD payloads alike)."""
    return sm.forward_sums(payload.sample)(payload.object, payload.probe, intensities, positions,
                                           valid=payload.valid)


class LSQMLAdapter:
    """Binds :mod:`daskpty.engines.lsqml` to the round loop, for every sample, position model and
    probe model (see the module docstring)."""

    name = "lsqml"
    chunk_function = staticmethod(lsqml_chunk)

    def __init__(self, options: lsqml.LSQMLOptions, valid: np.ndarray | None = None,
                 positions: PositionOptions | None = None, *, probe_model: ProbeModelPart | None = None,
                 sample: sm.SampleModel | None = None):
        self.options = options
        self.valid = valid
        self.positions = positions
        self.probe_model = probe_model
        self.sample = sample

    @property
    def device_fields(self) -> tuple:
        """What lives in device memory on GPU workers (see :mod:`.device_state`); the probe
        model's state stays on the host."""
        if self.probe_model is not None:
            return ()
        return ("object", "probe", "velocity", "illumination", "epoch_start_object")

    @property
    def local_state(self) -> bool:
        """Per-pattern state (refined positions, probe-model weights) kept with each chunk."""
        return self.positions is not None or (self.probe_model is not None and self.probe_model.per_pattern)

    def initial_local(self, nominal) -> dict:
        local = {} if self.positions is None else initial_local(nominal, self.positions)
        if self.positions is not None and sm.carries_position_sums(self.sample):
            local.update(initial_ratios(len(nominal)))
        if self.probe_model is not None:
            local.update(self.probe_model.initial_local(len(nominal)))
        return local

    def payload(self, state: lsqml.LSQMLState) -> LSQMLPayload:
        affine = step_maps(state)
        model = {} if self.probe_model is None else self.probe_model.payload_fields(state)
        return LSQMLPayload(state.object, state.probe, self.options, state.update_probe(self.options), self.valid,
                            options_for(self.positions, state), state.epoch, affine, self.sample, **model,
                            frame=frame_of(state))

    def epoch_scalars(self, state) -> dict:
        """The fitted affine map's, the windows' and the probe model's parameters, for the history."""
        out = epoch_parameters(state)
        return out if self.probe_model is None else {**out, **self.probe_model.epoch_scalars(state)}

    def apply(self, state, total):
        state = sm.lsqml_apply(self.sample)(state, total, self.options)
        if self.probe_model is not None and total is not None:
            lsqml_opr.apply(state, total, self.probe_model.model, self.options.object_delta, self.valid)
        return state

    def begin_epoch_owned(self, state):
        """``begin_epoch``, then arrays of the epoch's own for :meth:`apply_in_place` (see
        :func:`~daskpty.engines.lsqml_tiles.begin_epoch`)."""
        return lsqml_tiles.begin_epoch(self.begin_epoch(state), self.options)

    def apply_in_place(self, state, total):
        """``apply`` writing into the arrays :meth:`begin_epoch_owned` made the epoch's own."""
        state = lsqml_tiles.apply_in_place(state, total, self.options) if total is not None else state
        if self.probe_model is not None and total is not None:
            lsqml_opr.apply(state, total, self.probe_model.model, self.options.object_delta, self.valid)
        return state

    @staticmethod
    def copy_state(state):
        """``apply`` only rebinds the state's arrays, so a shallow copy protects the original."""
        return copy.copy(state)

    def begin_epoch(self, state):
        state = lsqml.begin_epoch(state, self.options)
        if self.positions is not None:
            note_epoch_start(state, self.positions)
        return state

    def end_epoch(self, state, in_place: bool = False):
        """The epoch's end; ``in_place``: after :meth:`begin_epoch_owned`, writing into the
        epoch's own object (:meth:`end_epoch_owned`)."""
        if self.probe_model is not None:
            lsqml_opr.end_epoch(state, self.probe_model.model)
        if self.positions is not None:
            finish_epoch(state, self.positions, lsqml.resample_object_state)
        state = sm.lsqml_end_epoch(self.sample)(state, self.options, in_place=in_place)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def end_epoch_owned(self, state):
        return self.end_epoch(state, in_place=True)

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        """A state from an object, a probe and (when resuming) the saved engine arrays."""
        engine_state = engine_state or {}
        state = lsqml.LSQMLState(object=sm.as_slices(obj, self.sample), probe=probe, epoch=epoch,
                                 velocity=engine_state.get("velocity"), affine=engine_state.get("affine"),
                                 affine_boost=engine_state.get("affine_boost"),
                                 window_map=engine_state.get("window_map"),
                                 window_gram=engine_state.get("window_gram"),
                                 positions_start=start_from_arrays(engine_state))
        restore_rules(state, engine_state)
        if self.probe_model is not None:
            self.probe_model.attach(state, probe, engine_state)
        return state

    def engine_state(self, state) -> dict:
        """Arrays beyond object and probe needed to continue exactly (for checkpoints)."""
        out = {} if state.velocity is None else {"velocity": state.velocity}
        for name in ("affine", "affine_boost", "window_map", "window_gram"):
            if getattr(state, name) is not None:
                out[name] = getattr(state, name)
        out = {**out, **start_arrays(state)}
        return out if self.probe_model is None else {**out, **self.probe_model.stored(state)}

    # Tiles (:mod:`.tile_graph`; protocol: :class:`~.engine_protocol.RunsOnTiles`)
    tile_fields = ("object", "velocity", "epoch_start_object", "illumination")
    tile_sums_function = staticmethod(forward_sums_chunk)  # the first epoch's sums (initialise)
    tile_round_stages = 1
    tile_warped_fields = ("object", "velocity")  # what the window correction resamples

    def tiles_unsupported(self) -> str | None:
        """Why this adapter's parts cannot run on tiles yet (None: they can)."""
        return None

    def tile_finish_positions(self, state) -> None:
        """The refinement's epoch end on a tile (window fit and resampling, affine fit), in place."""
        finish_epoch(state, self.positions, lsqml.resample_object_state)

    def tile_initialise(self, state, sums):
        """The first-epoch probe rescale from ``tile_sums_function``'s reduced sums."""
        before = state.probe
        state = lsqml.rescale_probe(state, sums)
        return state if self.probe_model is None else self.probe_model.rescaled(state, before)

    def tile_begin_epoch(self, state):
        return self.begin_epoch_owned(state)

    def tile_round_sums(self, state, total, own):
        return lsqml_tiles.round_sums(state, total, own)

    def tile_apply(self, state, total, shares):
        state = lsqml_tiles.apply(state, total, self.options, shares)
        if self.probe_model is not None and total is not None:
            lsqml_opr.apply(state, total, self.probe_model.model, self.options.object_delta, self.valid)
        return state

    def tile_end_sums(self, state, own):
        return lsqml_tiles.end_sums(state, self.options, own)

    def tile_end_epoch(self, state, shares):
        """``end_epoch`` on a tile, after :meth:`tile_finish_positions` when refining."""
        if self.probe_model is not None:
            lsqml_opr.end_epoch(state, self.probe_model.model)
        state = lsqml_tiles.end_epoch(state, self.options, shares)
        if self.positions is not None:
            settle_start(state, self.positions)
        return state

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy (the eigen-probes follow)."""
        before = state.probe
        sums = map_reduce(client, data, forward_sums_chunk, self.payload(state), split_every=split_every)
        state = lsqml.rescale_probe(state, sums)
        return state if self.probe_model is None else self.probe_model.rescaled(state, before)
