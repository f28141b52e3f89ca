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
    """A permutation for tiles (:mod:`.tile_graph`): bands of a few scan rows, each band taken
    column by column (every other band right to left), so each chunk is a short, wide rectangle
    of positions and a contiguous run of chunks (what one worker holds) a band of rows for any
    number of workers.

    Where two workers meet, only the band they share and the windows' reach are held by both.
    Square chunks (:func:`compact_order`'s Morton curve) hold more rows in common: on a Morton
    curve 4 workers get the 4 quadrants, each holding half the rows (a 27 Mpx object,
    1599-pattern chunks, 4 workers: 214 MiB received per round, where slabs of rows receive
    7.7 MiB). Slabs of single rows, on the other hand, make each chunk's sums span a whole row
    of windows: when the window is many scan steps tall, its box is mostly window
    (262,144 × 128² at a 14.6 px step, 408-pattern chunks: 2.1 kpx of box per pattern against
    0.44 for squares, and the tree's partial sums moved 11 GB a round). The band height is
    the fewest rows (:func:`band_rows`) whose chunk boxes are within 1.5x of a square's.
    The order does not depend on the number of workers, so runs on different numbers of tiles
    sum in the same order. None for a single chunk.
    """
    p = np.asarray(positions, dtype=np.float64)
    if len(p) <= chunk_len:
        return None
    step, per_row = _spacing(p)
    height = band_rows(chunk_len, n, step, per_row) * step
    band = np.floor((p[:, 0] - p[:, 0].min()) / height)
    across = np.where(band % 2 == 0, p[:, 1], -p[:, 1])  # boustrophedon: a chunk that runs over
    return np.lexsort((p[:, 0], across, band))          # a band's end stays compact


def _spacing(p: np.ndarray) -> tuple[float, float]:
    """The scan's mean step (pixels, from its density) and positions per scan row."""
    extent = p.max(axis=0) - p.min(axis=0)
    step = float(np.sqrt(max(extent[0], 1.0) * max(extent[1], 1.0) / len(p)))
    return max(step, 1e-6), max(extent[1] / max(step, 1e-6) + 1.0, 1.0)


def band_rows(chunk_len: int, n: int, step: float, per_row: float, slack: float = 1.5) -> int:
    """Scan rows per band of :func:`row_band_order`: the fewest whose chunk box (its
    positions' extent plus an ``n``-pixel window, per pattern) is within ``slack`` of the
    smallest over all band heights (a square chunk's, when rows are long enough)."""
    def box_per_pattern(rows: int) -> float:
        cols = min(chunk_len / rows, per_row)
        return ((chunk_len / cols) * step + n) * (cols * step + n) / chunk_len

    heights = range(1, int(np.ceil(np.sqrt(chunk_len))) + 1)
    best = min(box_per_pattern(h) for h in heights)
    return next(h for h in heights if box_per_pattern(h) <= slack * best)
