"""Spatially compact ordering of scan positions (no N × N distances; fine at N = 262,144)."""
from __future__ import annotations

import numpy as np


def _interleave_bits(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.uint64) & np.uint64(0xFFFFFFFF)
    for shift, mask in ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, 0x0F0F0F0F0F0F0F0F),
                        (2, 0x3333333333333333), (1, 0x5555555555555555)):
        v = (v | (v << np.uint64(shift))) & np.uint64(mask)
    return v


def morton_order(positions: np.ndarray, tile: float) -> np.ndarray:
    """Permutation sorting positions by the Z-order (Morton) index of ``tile``-sized cells.

    Within a cell the original order is kept (stable sort), so raster scans stay rasters.
    """
    p = np.asarray(positions, dtype=np.float64)
    cells = np.floor((p - p.min(axis=0)) / max(tile, 1e-9)).astype(np.int64)
    code = (_interleave_bits(cells[:, 0]) << np.uint64(1)) | _interleave_bits(cells[:, 1])
    return np.argsort(code, kind="stable")


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
