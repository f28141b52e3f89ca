"""LSQML on a tile of the object: the whole-object reductions of its apply and epoch end.

When the object is cut into row tiles (``daskpty.execution.tile_graph``), each worker holds its
tile (its own rows and a halo) and applies a round's update there. Three numbers of LSQML need
the whole object: the preconditioner's floor δ·max W (the round's largest illumination), the
momentum test (does the epoch's change point along the velocity: a dot product) and the scale
normalisation (mean |O| over the lit region, whose threshold is half the epoch's largest
illumination); for a (K, H, W) object (K slices, or the near field) each of them per slice.
Each tile forms its share over its *own* rows (``round_sums``, ``end_sums``);
the execution layer hands every tile the shares of all tiles in worker order, and
``apply`` / ``end_epoch`` combine them in that fixed order, so every tile takes the same
decision. Maxima combine exactly; the sums of the scale agree with one worker's to float32
rounding.

A tile's memory is what limits the object a worker can hold, so its update writes into the
tile's own arrays (:func:`begin_epoch` makes them the epoch's own; :func:`apply`) in blocks of
rows, instead of the engines' copy-and-rebind (three copies of a tile at once). No dask here.
"""
from __future__ import annotations


import numpy as np

from ..physics.backend import get_xp, to_numpy
from . import lsqml
from .partials import Partial
from .position_fits import accumulate_affine, accumulate_window


def _slices(state) -> int | None:
    """K for a (K, H, W) object (the sample model's: K slices or the near field), None for (H, W)."""
    return int(state.object.shape[0]) if state.object.ndim == 3 else None


def _rows(box, own: tuple[int, int]):
    """``box.data``'s rows within ``own`` (the tile's frame), or None when it has none there."""
    (y0, _), (y1, _) = box.offset, box.stop
    a, b = max(own[0], y0), min(own[1], y1)
    return box.data[..., a - y0:b - y0, :] if a < b else None


def round_sums(state, total: Partial | None, own: tuple[int, int]) -> dict:
    """This tile's share of the round's whole-object numbers: the largest illumination of the
    round's total over its own rows (per slice for a (K, H, W) object; 0 where it has none)."""
    k = _slices(state)
    illum = None if total is None else total.boxes.get("illumination")
    rows = None if illum is None else _rows(illum, own)
    if k is None:
        return {"illumination_max": 0.0 if rows is None or rows.size == 0 else float(rows.max())}
    if rows is None or rows.size == 0:
        return {"illumination_max": np.zeros(k, np.float32)}
    return {"illumination_max": to_numpy(rows.reshape(k, -1).max(axis=1)).astype(np.float32)}


def _largest(shares: list, key: str):
    peak = shares[0][key]
    for s in shares[1:]:
        peak = np.maximum(peak, s[key])
    return peak


#: Rows of the object updated at a time: the update's temporaries stay a few MB however large
#: the tile.
BLOCK_ROWS = 64
#: Rows at a time of the epoch end's sums (:func:`end_sums`).
END_BLOCK_ROWS = 256


def begin_epoch(state: lsqml.LSQMLState, options: lsqml.LSQMLOptions) -> lsqml.LSQMLState:
    """After the engine's ``begin_epoch``: give the epoch an object of its own to write into.

    The state's arrays are shared with the previous epoch's end (which the client may still
    fetch), so :func:`apply` may not write into them. With momentum the engine just copied the
    object as the epoch's start: the copy becomes the object and the shared array the (read-only)
    start — the same values, no extra copy. The illumination starts afresh (``None``) anyway."""
    if options.momentum > 0 and state.epoch_start_object is not None:
        state.object, state.epoch_start_object = state.epoch_start_object, state.object
    else:
        state.object = state.object.copy()
    return state


def _add_update(obj, num, illum, options: lsqml.LSQMLOptions, peak) -> None:
    """O += β ΔO / √(W² + (δ·peak)²) on ``num``'s box of ``obj`` (in place), block by block of
    rows: element by element the same arithmetic as :func:`lsqml.apply`."""
    xp = get_xp(obj)
    precondition = lsqml._preconditioner
    (y0, x0), (_, x1) = num.offset, num.stop
    for a in range(0, num.data.shape[-2], BLOCK_ROWS):
        rows = slice(a, a + BLOCK_ROWS)
        scale = precondition(illum.data[..., rows, :], options.object_delta, peak)
        xp.divide(np.float32(options.beta), scale, out=scale)
        step = num.data[..., rows, :] * scale
        obj[..., y0 + a:y0 + a + step.shape[-2], x0:x1] += step


def apply_in_place(state: lsqml.LSQMLState, total: Partial, options: lsqml.LSQMLOptions, peak=None):
    """:func:`lsqml.apply` writing into the state's object and illumination
    (the epoch's own: see :func:`begin_epoch`), the same bits. ``peak``: the round's largest
    illumination over the whole object (per slice for a (K, H, W) one) when the state is a tile;
    None: the round's own (the state holds the whole object)."""
    accumulate_affine(state, total)
    accumulate_window(state, total)
    if "object" not in total.boxes:
        return state
    xp = get_xp(state.object)
    num, illum = total.boxes["object"], total.boxes["illumination"]
    if peak is None:  # as the engines' preconditioners take it, before the update goes by blocks
        peak = (float(illum.data.max()) if state.object.ndim == 2
                else illum.data.reshape(illum.data.shape[0], -1).max(axis=1))
    _add_update(state.object, num, illum, options, peak)
    if "probe" in total.arrays:
        state.probe = (state.probe + options.beta * total.arrays["probe"]
                       / np.float32(total.scalars["n"])).astype(np.complex64)
    if state.illumination is None:  # the epoch's first round: W of its own
        state.illumination = xp.zeros(state.object.shape, np.float32)
    (y0, x0), (y1, x1) = illum.offset, illum.stop
    frame = state.illumination[..., y0:y1, x0:x1]
    xp.maximum(frame, illum.data, out=frame)
    return state


def apply(state: lsqml.LSQMLState, total: Partial | None, options: lsqml.LSQMLOptions,
          shares: list, update=None) -> lsqml.LSQMLState:
    """:func:`lsqml.apply` (an (H, W) or (K, H, W) object) on a tile, in place (after :func:`begin_epoch`), with the round's largest
    illumination over all tiles (``shares``: every tile's :func:`round_sums`); the epoch's
    largest illumination is kept in ``state.extra`` for the normalisation's threshold.
    ``update(state, total, options, peak)``: another engine's update (:mod:`.pie_tiles`)."""
    peak = _largest(shares, "illumination_max")
    first = state.illumination is None  # the epoch's first update (begin_epoch reset it)
    if total is not None:
        state = (update or apply_in_place)(state, total, options, peak)
    before = peak * 0 if first else state.extra.get("illumination_max", peak * 0)
    state.extra = {**state.extra, "illumination_max": np.maximum(before, peak)}
    return state


def _lit_sums(obj, velocity, lit, momentum: float, moves: bool, xp) -> tuple:
    """Count of lit pixels and Σ|O| over them, for the object as it is and as momentum moves it."""
    out = (int(lit.sum()), float(xp.abs(obj[lit]).sum(dtype=np.float64)))
    if moves:
        moved = (obj + momentum * velocity).astype(np.complex64)
        return out + (float(xp.abs(moved[lit]).sum(dtype=np.float64)),)
    return out + (out[1],)


def end_sums(state: lsqml.LSQMLState, options: lsqml.LSQMLOptions, own: tuple[int, int]) -> dict:
    """This tile's share of the epoch end's whole-object numbers over its own rows: the momentum
    test's dot product, and for the normalisation the lit pixels' count and Σ|O| (per slice for a
    (K, H, W) object) — for the object as it is and as momentum would move it (the test's
    outcome is not known yet)."""
    xp = get_xp(state.object)
    out = {}
    momentum = getattr(options, "momentum", 0.0)  # (PIE keeps none: pie_tiles)
    moves = momentum > 0 and state.epoch_start_object is not None and state.velocity is not None
    # block by block of rows: whole, the momentum's moved copy and its temporaries took ~30 B per
    # pixel of the tile at once (a spike that restarted 800 MiB workers at each epoch's end)
    blocks = [slice(a, min(a + END_BLOCK_ROWS, own[1])) for a in range(own[0], own[1], END_BLOCK_ROWS)]
    if moves:
        dot = 0.0
        for rows in blocks:
            change = state.object[..., rows, :] - state.epoch_start_object[..., rows, :]
            dot += float(xp.vdot(state.velocity[..., rows, :], change).real)
        out["dot"] = dot
    if not (lsqml.normalizes_now(state, options) and state.illumination is not None):
        return out
    peak = state.extra.get("illumination_max", 0.0)
    k = _slices(state)
    sums = []
    for j in ([None] if k is None else range(k)):
        threshold = np.float32(0.5) * np.float32(peak if j is None else peak[j])
        total = (0, 0.0, 0.0)
        for rows in blocks:
            pick = (lambda a, rows=rows: a[..., rows, :]) if j is None else (lambda a, j=j, rows=rows: a[j, rows, :])
            lit = pick(state.illumination) > threshold
            part = _lit_sums(pick(state.object), None if state.velocity is None else pick(state.velocity), lit,
                             momentum, moves, xp)
            total = tuple(t + v for t, v in zip(total, part))
        sums.append(total)
    out["lit"], out["abs_sum"], out["abs_sum_moved"] = (np.array(v) for v in zip(*sums))
    return out


def end_epoch(state: lsqml.LSQMLState, options: lsqml.LSQMLOptions, shares: list) -> lsqml.LSQMLState:
    """``end_epoch`` of the state's layout on a tile, its momentum test and scale(s) from every
    tile's :func:`end_sums` (``shares``, in worker order); in place (the epoch's own object)."""
    agree = scales = None
    if "dot" in shares[0]:
        agree = sum(s["dot"] for s in shares) > 0
    if "lit" in shares[0]:
        lit = sum(s["lit"] for s in shares)
        key = "abs_sum_moved" if agree else "abs_sum"
        total = sum(s[key] for s in shares)
        scales = np.where(lit > 0, total / np.maximum(lit, 1), 0.0)
    return lsqml.end_epoch(state, options, agree=agree, scales=scales, in_place=True)


__all__ = ["apply", "apply_in_place", "begin_epoch", "end_epoch", "end_sums", "round_sums"]
