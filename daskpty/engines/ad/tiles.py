"""AD on a tile of the object: the whole-object numbers of its optimiser step and epoch end.

When the object is cut into row tiles (``daskpty.execution.tile_graph``), each worker holds its
tile (its own rows and a halo, the object optimiser's memory cut likewise) and takes the round's
optimiser step there. Element by element the step is the same; what needs the whole object:

- the preconditioner's floor δ·max W — the round's largest illumination (first share);
- Adam's object learning rate, scaled by the mean |O| where the round's illumination exceeds half
  its largest (second share: the lit pixels' count and Σ|O| over a tile's own rows, once the
  largest is known);
- the epoch end's scale normalisation: the same mean over the epoch's illumination, whose
  largest the rounds' first shares already gave (one share).

Each tile forms its shares over its *own* rows; the execution layer hands every tile the shares
of all tiles in worker order, so every tile takes the same step. Maxima combine exactly, the sums
agree with one worker's to float rounding. The CG optimiser's line search evaluates the loss of
trial objects, which tiles cannot do yet. No dask here.
"""
from __future__ import annotations

import numpy as np

from ...physics.backend import get_xp
from ..partials import Partial
from . import state as ad_state


def _rows(box, own: tuple[int, int]):
    """``box.data``'s rows within ``own`` (the tile's frame), or None when it has none there."""
    (y0, _), (y1, _) = box.offset, box.stop
    a, b = max(own[0], y0), min(own[1], y1)
    return box.data[..., a - y0:b - y0, :] if a < b else None


def round_stages(options: ad_state.ADOptions) -> int:
    """How many rounds of shares a round's step needs: Adam's learning rate needs the largest
    illumination before its lit mean (2), SGD only the largest (1)."""
    return 2 if options.optimizer == "adam" else 1


def round_sums(state: ad_state.ADState, total: Partial | None, own: tuple[int, int], *earlier) -> dict:
    """This tile's share of the round's whole-object numbers over its own rows: the largest
    illumination first; given every tile's first shares (``earlier``), the lit pixels' count and
    Σ|O| (Adam's learning rate)."""
    illum = None if total is None else total.boxes.get("illumination")
    rows = None if illum is None else _rows(illum, own)
    if not earlier:
        return {"illumination_max": 0.0 if rows is None or rows.size == 0 else float(rows.max())}
    peak = max(s["illumination_max"] for s in earlier[0])
    return _lit_share(state.object, illum, own, np.float32(peak))


def _lit_share(obj, illum, own: tuple[int, int], peak) -> dict:
    """Count of the own rows' pixels where ``illum`` > peak / 2, and Σ|O| over them (float64)."""
    if illum is None:
        return {"lit": 0, "abs_sum": 0.0}
    (y0, x0), (y1, x1) = illum.offset, illum.stop
    a, b = max(own[0], y0), min(own[1], y1)
    if a >= b:
        return {"lit": 0, "abs_sum": 0.0}
    xp = get_xp(obj)
    lit = illum.data[..., a - y0:b - y0, :] > 0.5 * peak
    values = xp.abs(obj[..., a:b, x0:x1][lit])
    return {"lit": int(lit.sum()), "abs_sum": float(values.sum(dtype=np.float64))}


def _lit_mean(shares: list) -> float:
    """The mean |O| where lit over all tiles (1.0 when nothing is lit, as the engine's)."""
    lit = sum(s["lit"] for s in shares)
    return sum(s["abs_sum"] for s in shares) / lit if lit else 1.0


def apply(state: ad_state.ADState, total: Partial | None, options: ad_state.ADOptions, shares: list) -> ad_state.ADState:
    """:func:`ad.apply <daskpty.engines.ad.state.apply>` on a tile, its whole-object numbers from
    every tile's :func:`round_sums` (``shares``, in worker order); the epoch's largest
    illumination is kept in ``state.extra`` for the end's normalisation."""
    if total is None:
        return state
    if options.optimizer == "cg":
        raise ValueError("the CG optimiser cannot run on tiles (its line search needs the loss of the whole object)")
    peak = max(s["illumination_max"] for s in shares)
    first = state.illumination is None
    before = 0.0 if first else state.extra.get("illumination_max", 0.0)
    state.extra = {**state.extra, "illumination_max": max(before, peak)}
    lit_mean = _lit_mean(shares) if "lit" in shares[0] else None
    return ad_state.apply(state, total, options, peak=peak, lit_mean=lit_mean)


def end_sums(state: ad_state.ADState, options: ad_state.ADOptions, own: tuple[int, int]) -> dict:
    """This tile's share of the epoch end's normalisation: the lit pixels' count and Σ|O| over
    its own rows, lit meaning above half the epoch's largest illumination."""
    if not (ad_state.normalizes_now(state, options) and state.illumination is not None):
        return {}
    whole = _Box(state.illumination)
    return _lit_share(state.object, whole, own, np.float32(state.extra.get("illumination_max", 0.0)))


class _Box:
    """A whole array seen as a box at the origin (for :func:`_lit_share`)."""

    def __init__(self, data):
        self.data, self.offset = data, (0, 0)
        self.stop = tuple(data.shape[-2:])


def end_epoch(state: ad_state.ADState, options: ad_state.ADOptions, shares: list) -> ad_state.ADState:
    """:func:`ad.end_epoch <daskpty.engines.ad.state.end_epoch>` on a tile, its scale from every
    tile's :func:`end_sums` (``shares``, in worker order)."""
    scale = _lit_mean(shares) if shares and "lit" in shares[0] else None
    state = ad_state.end_epoch(state, options, scale=scale)
    state.extra = {k: v for k, v in state.extra.items() if k != "illumination_max"}
    return state


__all__ = ["apply", "end_epoch", "end_sums", "round_stages", "round_sums"]
