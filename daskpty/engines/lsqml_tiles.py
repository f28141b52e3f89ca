"""LSQML on a tile of the object: the whole-object reductions of its apply and epoch end.

When the object is cut into row tiles (``daskpty.execution.tile_graph``), each worker holds its
tile (its own rows and a halo) and applies a round's update there. Three numbers of LSQML need
the whole object: the preconditioner's floor δ·max W (the round's largest illumination), the
momentum test (does the epoch's change point along the velocity: a dot product) and the scale
normalisation (mean |O| over the lit region, whose threshold is half the epoch's largest
illumination). Each tile forms its share over its *own* rows (``round_sums``, ``end_sums``);
the execution layer hands every tile the shares of all tiles in worker order, and
``apply`` / ``end_epoch`` combine them in that fixed order, so every tile takes the same
decision. Maxima combine exactly; the sums of the scale agree with one worker's to float32
rounding. No dask here.
"""
from __future__ import annotations

import numpy as np

from ..physics.backend import get_xp
from . import lsqml
from .partials import Partial


def _rows(box, own: tuple[int, int]):
    """``box.data``'s rows within ``own`` (the tile's frame), or None when it has none there."""
    (y0, _), (y1, _) = box.offset, box.stop
    a, b = max(own[0], y0), min(own[1], y1)
    return box.data[..., a - y0:b - y0, :] if a < b else None


def round_sums(total: Partial | None, own: tuple[int, int]) -> dict:
    """This tile's share of the round's whole-object numbers: the largest illumination of the
    round's total over its own rows (0 when it has none)."""
    illum = None if total is None else total.boxes.get("illumination")
    rows = None if illum is None else _rows(illum, own)
    return {"illumination_max": 0.0 if rows is None or rows.size == 0 else float(rows.max())}


def apply(state: lsqml.LSQMLState, total: Partial | None, options: lsqml.LSQMLOptions,
          shares: list) -> lsqml.LSQMLState:
    """:func:`lsqml.apply` on a tile, with the round's largest illumination over all tiles
    (``shares``: every tile's :func:`round_sums`); the epoch's largest illumination is kept in
    ``state.extra`` for the normalisation's threshold."""
    peak = max(s["illumination_max"] for s in shares)
    first = state.illumination is None  # the epoch's first update (begin_epoch reset it)
    if total is not None:
        state = lsqml.apply(state, total, options, illumination_max=peak)
    before = 0.0 if first else state.extra.get("illumination_max", 0.0)
    state.extra = {**state.extra, "illumination_max": max(before, peak)}
    return state


def end_sums(state: lsqml.LSQMLState, options: lsqml.LSQMLOptions, own: tuple[int, int]) -> dict:
    """This tile's share of the epoch end's whole-object numbers over its own rows: the momentum
    test's dot product, and for the normalisation the lit pixels' count and Σ|O| — for the
    object as it is and as momentum would move it (the test's outcome is not known yet)."""
    rows = slice(*own)
    xp = get_xp(state.object)
    out = {}
    moves = options.momentum > 0 and state.epoch_start_object is not None and state.velocity is not None
    if moves:
        change = state.object[rows] - state.epoch_start_object[rows]
        out["dot"] = float(xp.vdot(state.velocity[rows], change).real)
    if lsqml.normalizes_now(state, options) and state.illumination is not None:
        lit = state.illumination[rows] > 0.5 * np.float32(state.extra.get("illumination_max", 0.0))
        obj = state.object[rows]
        out["lit"] = int(lit.sum())
        out["abs_sum"] = float(xp.abs(obj[lit]).sum(dtype=np.float64))
        if moves:
            moved = (obj + options.momentum * state.velocity[rows]).astype(np.complex64)
            out["abs_sum_moved"] = float(xp.abs(moved[lit]).sum(dtype=np.float64))
    return out


def end_epoch(state: lsqml.LSQMLState, options: lsqml.LSQMLOptions, shares: list) -> lsqml.LSQMLState:
    """:func:`lsqml.end_epoch` on a tile, its momentum test and scale from every tile's
    :func:`end_sums` (``shares``, in worker order)."""
    agree = scale = None
    if "dot" in shares[0]:
        agree = sum(s["dot"] for s in shares) > 0
    if "lit" in shares[0]:
        lit = sum(s["lit"] for s in shares)
        key = "abs_sum_moved" if agree else "abs_sum"
        scale = sum(s[key] for s in shares) / lit if lit else 0.0
    return lsqml.end_epoch(state, options, agree=agree, scale=scale)


__all__ = ["apply", "end_epoch", "end_sums", "round_sums"]
