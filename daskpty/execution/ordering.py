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
    """A permutation for tiles (:mod:`.tile_graph`): the positions by row (y, then x), so each
    chunk is a slab of rows and a contiguous run of chunks (what one worker holds) a band of rows
    for any number of workers. Where two workers meet, only the slab they share and the windows'
    reach are held by both: the border is a chunk's height plus a window, not more.

    Square chunks (:func:`compact_order`'s Morton curve) hold more rows in common: on a Morton
    curve 4 workers get the 4 quadrants, each holding half the rows; square cells taken row by row
    still left a whole cell row at every border (a 27 Mpx object, 1599-pattern chunks, 4 workers:
    214 MiB received per round, where slabs of rows receive 7.7 MiB). A slab's windows cover more
    area than a square's (the sums each chunk forms: up to ~1.5x for chunks shorter than a scan
    row), but on tiles those sums stay on their worker but for the border. The order does not
    depend on the number of workers, so runs on different numbers of tiles sum in the same order.
    None for a single chunk.
    """
    p = np.asarray(positions, dtype=np.float64)
    if len(p) <= chunk_len:
        return None
    return np.lexsort((p[:, 1], p[:, 0]))
