"""AD's engine core (:mod:`daskpty.engines.core`): its chunk gradients for every part
combination, the optimiser's step as apply (with the CG line search's loss evaluations), on
whole objects and on tiles."""
from __future__ import annotations

import numpy as np

from .. import sample_model as sm
from ..core import EngineCore, TileSteps, chunk_steps
from ..positions import positions_for_step
from ..tile_frame import frame_of
from ..window_deformation import warp_object
from . import opr, state as ad_state
from .gradient import refining_chunk_gradient
from ..lsqml import rescale_probe

#: Adam's memory slots (:class:`daskpty.engines.ad.optimizers.Adam`).
ADAM_SLOTS = ("m", "v")


def _loss(p, intensities, positions, local=None):
    """The loss only (CG line search)."""
    return sm.ad_loss(p.sample)(p.object, p.probe, intensities, positions, options=p.options, valid=p.valid)


def _refining_loss(p, intensities, nominal, local):
    """The loss at the refined positions (none move)."""
    positions = positions_for_step(local, nominal, p.affine, p.positions, p.epoch, p.probe.shape[-1], p.object.shape)
    return _loss(p, intensities, positions)


def warp_object_state(state, matrix, offset) -> None:
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


class ADCore(EngineCore):
    steps = chunk_steps(sm.ad_gradient, refining_chunk_gradient, opr.variable_chunk_gradient, inject="gradient",
                        keep_gram=sm.carries_position_sums)
    loss_steps = {"plain": _loss, "refining": _refining_loss}
    #: the optimiser's memory (Adam's moments) is object- and probe-sized
    device_fields = ("object", "probe", "illumination", "optimizer")
    #: Adam's object learning rate follows the mean |O| where lit
    tiles = TileSteps(("object", "illumination", "optimizer"), ("object", "optimizer"),
                      lambda options: ("peak", "lit_mean") if options.optimizer == "adam" else ("peak",),
                      end_numbers=("scales",))
    begin_epoch = staticmethod(ad_state.begin_epoch)
    new_state = staticmethod(ad_state.ADState.from_arrays)
    rescale_probe = staticmethod(rescale_probe)
    resample = staticmethod(warp_object_state)

    @staticmethod
    def flags(state, options) -> dict:
        return {"want_object": state.active("object", options), "want_probe": state.active("probe", options)}

    @staticmethod
    def stored(state) -> dict:
        return state.to_arrays()

    @staticmethod
    def apply(state, total, run, evaluate=None, peak=None, lit_mean=None):
        """(``peak``: one number over the slices, the preconditioner's floor is one.)"""
        return ad_state.apply(state, total, run.options, evaluate=evaluate,
                              peak=None if peak is None else float(np.max(peak)), lit_mean=lit_mean)

    @staticmethod
    def end_epoch(state, run, scales=None):
        return ad_state.end_epoch(state, run.options, scales=scales)

    @staticmethod
    def apply_probe_model(state, total, model, run) -> None:
        opr.apply(state, total, model, run.options.loss, run.options.delta)

    @staticmethod
    def needs_evaluations(options) -> bool:
        return options.optimizer == "cg"

    @staticmethod
    def unsupported(options, part: str) -> str | None:
        """CG on tiles, and CG with a varying probe (its line search does not move per-pattern parameters)."""
        return "the CG optimiser (optimizer='cg')" if options.optimizer == "cg" else None
