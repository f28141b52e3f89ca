"""LSQML's epoch boundaries: the start-of-epoch copy, momentum on the epoch's change, probe-mode
orthogonalisation and the scale-ambiguity removal (:func:`end_epoch`), in place where the object
is the epoch's own (tiles, the client's round-by-round epochs). Split from :mod:`.lsqml`, which
re-exports these functions. No dask here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..physics import orthogonalize_modes
from ..physics.backend import get_xp

if TYPE_CHECKING:
    from .lsqml import LSQMLOptions, LSQMLState

def begin_epoch(state: LSQMLState, options: LSQMLOptions) -> LSQMLState:
    """Remember the object at the start of the epoch (for momentum) and reset illumination."""
    if options.object_momentum > 0:
        state.epoch_start_object = state.object.copy()
    state.illumination = None
    state.affine_sums = None
    return state


def begin_owned_epoch(state: LSQMLState, options: LSQMLOptions) -> LSQMLState:
    """After :func:`begin_epoch`: give the epoch an object of its own to write into
    (:func:`~.lsqml.apply_in_place`; tiles, the client's round-by-round epochs).

    The state's arrays are shared with the previous epoch's end (which the client may still
    fetch), so the update may not write into them. With momentum :func:`begin_epoch` just copied
    the object as the epoch's start: the copy becomes the object and the shared array the
    (read-only) start — the same values, no extra copy."""
    if options.object_momentum > 0 and state.epoch_start_object is not None:
        state.object, state.epoch_start_object = state.epoch_start_object, state.object
    else:
        state.object = state.object.copy()
    return state


def owned_at_end(state: LSQMLState, options: LSQMLOptions, in_place: bool) -> tuple:
    """The arrays an in-place epoch end may write into: the epoch's own object, and the
    velocity once momentum has made it anew (before that it is the previous epoch's)."""
    if not in_place:
        return ()
    return ("object", "velocity") if options.object_momentum > 0 and state.epoch_start_object is not None else ("object",)


#: Rows at a time of an in-place epoch end's momentum step (its temporaries stay small).
MOMENTUM_BLOCK_ROWS = 256


def _add_momentum(obj, change, velocity, momentum: float) -> None:
    """O += μ v and Δ += μ v in place, block by block of rows (the bits of the whole-array form)."""
    for a in range(0, obj.shape[-2], MOMENTUM_BLOCK_ROWS):
        rows = (..., slice(a, a + MOMENTUM_BLOCK_ROWS), slice(None))
        moved = momentum * velocity[rows]
        obj[rows] += moved
        change[rows] += moved


def end_epoch(state: LSQMLState, options: LSQMLOptions, *, agree: bool | None = None,
              scales=None, in_place: bool = False) -> LSQMLState:
    """Momentum on the object's change, probe-mode orthogonalisation, scale-ambiguity removal.

    An (H, W) or a (K, H, W) object (K slices, or the near field: each slice's scale removed on
    its own). ``agree`` (the momentum test: does the change point along the velocity?) and
    ``scales`` (the normalisation's mean |O_k| over the lit region) come from outside when the state holds
    only a tile of the object (:mod:`daskpty.execution.tile_numbers`); None: computed here.
    ``in_place``: the object is the epoch's own (after :func:`begin_owned_epoch`) and is written into, as is the
    new velocity — the same bits, two object-sized temporaries fewer."""
    owned = owned_at_end(state, options, in_place)
    if options.object_momentum > 0 and state.epoch_start_object is not None:
        change = state.object - state.epoch_start_object
        if state.velocity is not None:
            if agree is None:
                agree = float(get_xp(change).vdot(state.velocity, change).real) > 0
            if agree and in_place:
                _add_momentum(state.object, change, state.velocity, options.object_momentum)
                state.velocity = change
            elif agree:
                state.object = (state.object + options.object_momentum * state.velocity).astype(np.complex64)
                state.velocity = (change + options.object_momentum * state.velocity).astype(np.complex64)
            else:
                state.velocity = change if in_place else change.astype(np.complex64)
        else:
            state.velocity = change if in_place else change.astype(np.complex64)
    state.epoch_start_object = None  # only needed within the epoch (keeps gathered states small)
    return close_epoch(state, options, scales, owned)


def normalizes_now(state, options) -> bool:
    """Whether this epoch's end removes the scale ambiguity (every ``options.normalize_every``)."""
    return bool(options.normalize_every) and (state.epoch + 1) % options.normalize_every == 0


def close_epoch(state, options, scales=None, owned: tuple = ()):
    """The end of every engine's epoch that keeps LSQML's state: probe-mode orthogonalisation
    (``options.orthogonalize``), scale-ambiguity removal every ``options.normalize_every``
    epochs (``scales``: see :func:`normalize_scale`), and the epoch counter."""
    if options.orthogonalize and state.probe.shape[0] > 1:
        state.probe = orthogonalize_modes(state.probe)
    if normalizes_now(state, options):
        normalize_scale(state, scales, owned)
    state.epoch += 1
    return state


def _lit_mean(obj, illumination) -> float:
    """Mean |O| where ``illumination`` exceeds half its largest (0.0: nothing lit)."""
    lit = illumination > 0.5 * illumination.max()
    return float(get_xp(obj).abs(obj[lit]).mean()) if bool(lit.any()) else 0.0


def normalize_scale(state: LSQMLState, scales=None, owned: tuple = ()) -> None:
    """Remove the scale ambiguity O_k c_k, P / Π c_k: mean |O_k| = 1 where slice k is lit, slice by
    slice for a (K, H, W) object (one c for an (H, W) one). ``scales``: those means (one per
    slice, 0: nothing lit) when the state holds only a tile of the object. ``owned``: the arrays
    it may divide in place ("object", "velocity")."""
    if state.illumination is None and scales is None:
        return
    obj = state.object if "object" in owned else state.object.copy()
    layers = obj if obj.ndim == 3 else obj[None]
    velocity_owned = "velocity" in owned
    total = 1.0
    for k in range(layers.shape[0]):
        if scales is not None:
            c = float(scales[k])
        else:
            w = state.illumination if state.illumination.ndim == 2 else state.illumination[k]
            c = _lit_mean(layers[k], w)
        if c > 0 and np.isfinite(c):
            layers[k] /= np.float32(c)
            total *= c
            if state.velocity is not None:
                if not velocity_owned:  # (once: a copy per slice cost K of them)
                    state.velocity, velocity_owned = state.velocity.copy(), True
                velocity = state.velocity if state.velocity.ndim == 3 else state.velocity[None]
                velocity[k] /= np.float32(c)
    state.object = obj
    state.probe = (state.probe * np.float32(total)).astype(np.complex64)
    if state.eigen_probes is not None:  # they scale with the mean probe (weights unchanged)
        state.eigen_probes = (state.eigen_probes * np.float32(total)).astype(np.complex64)
