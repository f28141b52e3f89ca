"""The whole-object numbers of an engine's update when the object is cut into row tiles.

A worker that holds a tile of the object (:mod:`.tile_graph`) runs the engine's own update on
the arrays it owns; what that update reads from the whole object comes from here. The engine
core names the numbers (:class:`daskpty.engines.core.TileSteps`); each tile forms its share
over its *own* rows, every tile gets the shares of all tiles in worker order and combines them
in that fixed order, so every tile takes the same decision (maxima combine exactly, sums agree
with one worker's to float rounding). The numbers, as keywords of the core's update:

- round ``peak``: the round's largest illumination (per slice of a (K, H, W) object);
- round ``lit_mean``: the mean |O| where the round's illumination exceeds half its largest,
  over all slices (AD's Adam learning rate; a second stage of shares, after the peak);
- end ``agree``: the momentum test, does the epoch's change point along the velocity;
- end ``scales``: per slice, the mean |O_k| where the epoch's illumination exceeds half its
  largest (as momentum moves the object when ``agree``), in blocks of rows.

The epoch's largest illumination is kept in the state's ``extra`` for the end's threshold.
No dask here.
"""
from __future__ import annotations

import numpy as np

from ..engines.lsqml_epoch import normalizes_now
from ..physics.backend import get_xp, to_numpy

_EPOCH_PEAK = "illumination_max"
#: Rows at a time of the epoch end's sums: whole, the momentum's moved copy and its temporaries
#: took ~30 B per pixel of the tile at once (a spike that restarted small workers).
END_BLOCK_ROWS = 256


def stages(names: tuple) -> int:
    """Rounds of shares the round's numbers ``names`` need (``lit_mean`` waits for the peak)."""
    return 2 if "lit_mean" in names else 1


def _rows(data, offset, own: tuple):
    """The rows of ``data`` (placed at row ``offset``) within ``own``, or None when none are."""
    a, b = max(own[0], offset), min(own[1], offset + data.shape[-2])
    return (data[..., a - offset:b - offset, :], a, b) if a < b else None


def _peak_share(state, total, own: tuple):
    """The largest illumination of the round's total over the own rows (per slice; 0 where none)."""
    k = int(state.object.shape[0]) if state.object.ndim == 3 else None
    box = None if total is None else total.boxes.get("illumination")
    rows = None if box is None else _rows(box.data, box.offset[0], own)
    if rows is None or rows[0].size == 0:
        return 0.0 if k is None else np.zeros(k, np.float32)
    rows = rows[0]
    return float(rows.max()) if k is None else to_numpy(rows.reshape(k, -1).max(axis=1)).astype(np.float32)


def _largest(values: list):
    peak = values[0]
    for v in values[1:]:
        peak = np.maximum(peak, v)
    return peak


def _lit_share(obj, illum, offset: tuple, own: tuple, peak) -> dict:
    """Count of the own rows' pixels where ``illum`` (placed at ``offset``) > peak / 2, and Σ|O|
    over them (float64), all slices at once."""
    rows = None if illum is None else _rows(illum, offset[0], own)
    if rows is None:
        return {"lit": 0, "abs_sum": 0.0}
    data, a, b = rows
    lit = data > 0.5 * peak
    values = get_xp(obj).abs(obj[..., a:b, offset[1]:offset[1] + illum.shape[-1]][lit])
    return {"lit": int(lit.sum()), "abs_sum": float(values.sum(dtype=np.float64))}


def _lit_mean(shares: list) -> float:
    """The mean |O| where lit over all tiles (1.0 when nothing is lit)."""
    lit = sum(s["lit"] for s in shares)
    return sum(s["abs_sum"] for s in shares) / lit if lit else 1.0


def round_share(names: tuple, state, total, own: tuple, *earlier) -> dict:
    """This tile's share of the round's numbers ``names`` over its own rows: the largest
    illumination first; given every tile's first shares (``earlier``), the lit sums."""
    if not earlier:
        return {"peak": _peak_share(state, total, own)}
    box = None if total is None else total.boxes.get("illumination")
    peak = np.float32(float(np.max(_largest([s["peak"] for s in earlier[0]]))))
    return _lit_share(state.object, None if box is None else box.data, (0, 0) if box is None else box.offset,
                      own, peak)


def round_numbers(names: tuple, state, shares: list) -> dict:
    """The round's numbers ``names`` from every tile's shares; the epoch's largest illumination
    is kept in ``state.extra`` (before the update: ``state.illumination`` None at its first)."""
    peak = _largest([s["peak"] for s in shares])
    before = peak * 0 if state.illumination is None else state.extra.get(_EPOCH_PEAK, peak * 0)
    state.extra = {**state.extra, _EPOCH_PEAK: np.maximum(before, peak)}
    numbers = {"peak": peak}
    if "lit_mean" in names:
        numbers["lit_mean"] = _lit_mean(shares) if "lit" in shares[0] else None
    return numbers


def _slice_sums(state, own: tuple, moves: bool, momentum: float) -> dict:
    """Per slice, the lit pixels' count and Σ|O| over the own rows (as the object is, and as
    momentum moves it), block by block of rows."""
    xp, peak = get_xp(state.object), state.extra.get(_EPOCH_PEAK, 0.0)
    k = int(state.object.shape[0]) if state.object.ndim == 3 else None
    blocks = [slice(a, min(a + END_BLOCK_ROWS, own[1])) for a in range(own[0], own[1], END_BLOCK_ROWS)]
    sums = []
    for j in ([None] if k is None else range(k)):
        threshold = np.float32(0.5) * np.float32(peak if j is None else peak[j])
        total = (0, 0.0, 0.0)
        for rows in blocks:
            pick = (lambda a, rows=rows: a[..., rows, :]) if j is None else (lambda a, j=j, rows=rows: a[j, rows, :])
            lit, obj = pick(state.illumination) > threshold, pick(state.object)
            part = (int(lit.sum()), float(xp.abs(obj[lit]).sum(dtype=np.float64)))
            if moves:
                moved = (obj + momentum * pick(state.velocity)).astype(np.complex64)
                part += (float(xp.abs(moved[lit]).sum(dtype=np.float64)),)
            total = tuple(t + v for t, v in zip(total, part + ((part[1],) if not moves else ())))
        sums.append(total)
    return dict(zip(("lit", "abs_sum", "abs_sum_moved"), (np.array(v) for v in zip(*sums))))


def end_share(names: tuple, state, options, own: tuple) -> dict:
    """This tile's share of the epoch end's numbers ``names`` over its own rows."""
    out = {}
    # (the engine's resolved momentum, as its own epoch end reads it: LSQML's None is its default)
    momentum = float(getattr(options, "object_momentum", getattr(options, "momentum", 0.0)) or 0.0) \
        if "agree" in names else 0.0
    moves = momentum > 0 and state.epoch_start_object is not None and state.velocity is not None
    if moves:
        xp, dot = get_xp(state.object), 0.0
        for a in range(own[0], own[1], END_BLOCK_ROWS):
            rows = (..., slice(a, min(a + END_BLOCK_ROWS, own[1])), slice(None))
            dot += float(xp.vdot(state.velocity[rows], state.object[rows] - state.epoch_start_object[rows]).real)
        out["dot"] = dot
    if "scales" in names and normalizes_now(state, options) and state.illumination is not None:
        out.update(_slice_sums(state, own, moves, momentum))
    return out


def end_numbers(names: tuple, state, shares: list) -> dict:
    """The epoch end's numbers ``names`` from every tile's :func:`end_share` (in worker order);
    the epoch's largest illumination leaves the state's ``extra``."""
    state.extra = {k: v for k, v in state.extra.items() if k != _EPOCH_PEAK}
    numbers = {}
    if "agree" in names:
        numbers["agree"] = sum(s["dot"] for s in shares) > 0 if "dot" in shares[0] else None
    if "scales" in names:
        numbers["scales"] = None
        if "lit" in shares[0]:
            lit = sum(s["lit"] for s in shares)
            total = sum(s["abs_sum_moved" if numbers.get("agree") else "abs_sum"] for s in shares)
            numbers["scales"] = np.where(lit > 0, total / np.maximum(lit, 1), 0.0)
    return numbers
