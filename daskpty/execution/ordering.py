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


def chunk_band_order(positions: np.ndarray, chunk_len: int) -> np.ndarray | None:
    """The chunks' order for tiles on data read from their store every round: whole chunks of
    ``chunk_len`` patterns in the stored order, taken by their mean row (stable), so a
    contiguous run of chunks is a band of rows and each chunk is still one contiguous read.

    :func:`row_band_order` sorts single patterns by row; read from a store every round, a chunk
    of that order gathers its patterns from dozens of stored chunks (a 65,536-pattern raster in
    chunks of 120: ~60 stored chunks, 0.3–0.4 s per chunk read instead of ~5 ms). Here each
    chunk keeps its stored patterns, so a band is as compact as the store's chunks are: rows of a
    raster, cells of a Morton-ordered scan. Returns the chunks' permutation (stored chunk
    indices), or None when the stored order already is the band order or there is one chunk.
    """
    p = np.asarray(positions, dtype=np.float64)
    if len(p) <= chunk_len:
        return None
    starts = np.arange(0, len(p), chunk_len)
    rows = np.array([p[s:s + chunk_len, 0].mean() for s in starts])
    chunks = np.argsort(rows, kind="stable")
    return None if np.array_equal(chunks, np.arange(len(chunks))) else chunks


def patterns_of_chunks(chunks: np.ndarray, chunk_len: int, n_patterns: int) -> np.ndarray:
    """The pattern permutation that takes whole ``chunk_len``-pattern chunks in the order ``chunks``."""
    return np.concatenate([np.arange(j * chunk_len, min((j + 1) * chunk_len, n_patterns)) for j in chunks])
