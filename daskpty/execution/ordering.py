"""Spatially compact ordering of scan positions (no N × N distances; fine at N = 262,144)."""
from __future__ import annotations

import numpy as np

from ..io.scan import morton_order


def footprint_area(positions: np.ndarray, chunk_len: int, n: int) -> float:
    """Sum over chunks of the bounding-box area of their probe windows (pixels²)."""
    p = np.asarray(positions)
    total = 0.0
    for s in range(0, len(p), chunk_len):
        c = p[s:s + chunk_len]
        ext = c.max(axis=0) - c.min(axis=0) + n
        total += float(ext[0] * ext[1])
    return total


def compact_order(positions: np.ndarray, chunk_len: int, n: int) -> np.ndarray | None:
    """A permutation making each chunk of ``chunk_len`` patterns spatially compact, or None.

    Cells of the Morton curve hold about ``chunk_len`` positions; the permutation is returned only
    if it shrinks the summed chunk footprints by more than 20 %.
    """
    p = np.asarray(positions, dtype=np.float64)
    if len(p) <= chunk_len:
        return None
    extent = p.max(axis=0) - p.min(axis=0) + 1.0
    density = len(p) / float(extent[0] * extent[1])
    tile = max(np.sqrt(chunk_len / max(density, 1e-12)) / 4.0, 1.0)
    perm = morton_order(p, tile)
    if footprint_area(p[perm], chunk_len, n) < 0.8 * footprint_area(p, chunk_len, n):
        return perm
    return None
