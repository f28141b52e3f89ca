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


def row_band_order(positions: np.ndarray, chunk_len: int, n: int) -> np.ndarray | None:
    """A permutation for tiles (:mod:`.tile_graph`): square cells that hold about ``chunk_len``
    positions each, taken row by row, and a Morton curve inside each cell.

    Each chunk then covers a compact patch, as with :func:`compact_order`, and a contiguous run
    of chunks (what one worker holds) covers a band of rows for any number of workers — where a
    Morton curve over the whole scan gives four workers its four quadrants, so each would hold
    half the object's rows. The order does not depend on the number of workers, so runs on
    different numbers of tiles sum in the same order. None for a single chunk.
    """
    p = np.asarray(positions, dtype=np.float64)
    if len(p) <= chunk_len:
        return None
    extent = p.max(axis=0) - p.min(axis=0) + 1.0
    density = len(p) / float(extent[0] * extent[1])
    side = max(np.sqrt(chunk_len / max(density, 1e-12)), 1.0)
    cell = np.floor((p - p.min(axis=0)) / side).astype(np.int64)
    inner = np.empty(len(p), dtype=np.int64)
    inner[morton_order(p, side / 4.0)] = np.arange(len(p))  # each position's rank on the curve
    return np.lexsort((inner, cell[:, 1], cell[:, 0]))
