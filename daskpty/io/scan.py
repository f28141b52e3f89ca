"""Scan geometry helpers: probe diameter, nearest-neighbour step, overlap, compact ordering.

NumPy/SciPy only (used by the simulator and by ``daskpty info``).
"""
from __future__ import annotations

import numpy as np

#: fraction of the probe power inside the circle whose diameter defines "the probe diameter"
ENCLOSED_POWER = 0.9


def probe_diameter(probe, enclosed: float = ENCLOSED_POWER) -> float:
    """Diameter (pixels) of the circle, centred on the intensity centroid, holding ``enclosed``
    of the total power of all modes. probe: (M, n, n) or (n, n) complex."""
    p = np.asarray(probe)
    if p.ndim == 2:
        p = p[None]
    inten = (np.abs(p.astype(np.complex128)) ** 2).sum(axis=0)
    total = inten.sum()
    if not np.isfinite(total) or total <= 0:
        return float("nan")
    yy, xx = np.indices(inten.shape, dtype=np.float64)
    cy = (inten * yy).sum() / total
    cx = (inten * xx).sum() / total
    r = np.hypot(yy - cy, xx - cx).ravel()
    order = np.argsort(r, kind="stable")
    cum = np.cumsum(inten.ravel()[order]) / total
    k = int(np.searchsorted(cum, enclosed))
    return float(2.0 * r[order][min(k, r.size - 1)])


def nearest_neighbour_steps(positions) -> np.ndarray:
    """Distance (pixels) from each position to its nearest other position, via a KD-tree."""
    from scipy.spatial import cKDTree

    pos = np.asarray(positions, dtype=np.float64)
    if len(pos) < 2:
        return np.full(len(pos), np.nan)
    dist, _ = cKDTree(pos).query(pos, k=2)
    return dist[:, 1]


def linear_overlap(step: float, diameter: float) -> float:
    """Linear overlap 1 − step / diameter of two probe discs ``step`` apart (clipped at 0)."""
    if not np.isfinite(step) or not np.isfinite(diameter) or diameter <= 0:
        return float("nan")
    return float(max(0.0, 1.0 - step / diameter))


def _spread_bits(v: np.ndarray) -> np.ndarray:
    """Insert a zero bit between the bits of 32-bit integers (for Morton codes)."""
    v = v.astype(np.uint64) & np.uint64(0xFFFFFFFF)
    v = (v | (v << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    v = (v | (v << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    v = (v | (v << np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    v = (v | (v << np.uint64(2))) & np.uint64(0x3333333333333333)
    v = (v | (v << np.uint64(1))) & np.uint64(0x5555555555555555)
    return v


def morton_order(positions, cell: float) -> np.ndarray:
    """Permutation that sorts positions along a Z-order (Morton) curve of cells of size ``cell``.

    Consecutive patterns are then spatially close, so every contiguous chunk of the data set
    covers a compact patch of the object. Ties (same cell) keep (y, x) order.
    """
    pos = np.asarray(positions, dtype=np.float64)
    if len(pos) == 0:
        return np.zeros(0, dtype=np.int64)
    q = np.floor((pos - pos.min(axis=0)) / max(float(cell), 1e-12) + 0.5).astype(np.int64)
    code = _spread_bits(q[:, 0]) << np.uint64(1) | _spread_bits(q[:, 1])
    return np.lexsort((pos[:, 1], pos[:, 0], code))
