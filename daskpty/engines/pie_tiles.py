"""rPIE on a tile of the object: the whole-object numbers of its update and epoch end.

Like :mod:`.lsqml_tiles`, whose reductions it shares: the update's denominator
(1 − α) D + α max D needs the round's largest illumination over the whole object (each tile's
share over its own rows: :func:`round_sums`), and the epoch end's scale normalisation the lit
pixels' count and Σ|O| over every tile (:func:`end_sums`). PIE keeps no momentum. Its update
copies the object and rebinds it (:func:`.pie.apply`), so the previous epoch's end tile is
never written and the epoch needs no arrays of its own. A (K, H, W) object (K slices, or the
near field) takes each number per slice. No dask.
"""
from __future__ import annotations

import numpy as np

from . import lsqml_tiles, pie
from .lsqml_epoch import close_epoch
from .partials import Partial

round_sums = lsqml_tiles.round_sums
end_sums = lsqml_tiles.end_sums


def _update(state, total: Partial, options: pie.PIEOptions, peak):
    return pie.apply(state, total, options, illumination_max=peak)


def apply(state, total: Partial | None, options: pie.PIEOptions, shares: list):
    """:func:`.pie.apply` on a tile with the round's largest illumination over all tiles
    (``shares``: every tile's :func:`round_sums`, in worker order); the epoch's largest is kept
    in ``state.extra`` for the normalisation's threshold."""
    return lsqml_tiles.apply(state, total, options, shares, update=_update)


def end_epoch(state, options: pie.PIEOptions, shares: list):
    """:func:`.pie.end_epoch` (one slice, or a (K, H, W)
    object: K slices or the near field) on a tile, the scale(s) from every tile's
    :func:`end_sums`, in worker order."""
    scales = None
    if "lit" in shares[0]:
        lit = sum(s["lit"] for s in shares)
        total = sum(s["abs_sum"] for s in shares)
        scales = np.where(lit > 0, total / np.maximum(lit, 1), 0.0)
    return close_epoch(state, options, scales)


__all__ = ["apply", "end_epoch", "end_sums", "round_sums"]
