"""Issue 34 groundwork: the object's row strips per worker (execution/tiles.py): every chunk's
windows fall inside its worker's held rows, the pieces of a partial sum add up to it exactly,
and on the issue's 256 x 256 scan at 20 px steps the bytes a worker receives per round follow
the border, not the object's area."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.engines.partials import BoxedArray
from daskpty.execution.placement import balanced_worker
from daskpty.execution.tiles import TileLayout, chunk_bands


def _raster(grid, step, n, chunk_length, margin=4):
    g = np.arange(grid) * step + n / 2 + margin
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    chunks = [pos[i:i + chunk_length] for i in range(0, len(pos), chunk_length)]
    size = int(np.ceil(g[-1] + n / 2 + margin))
    return chunks, size


@pytest.mark.parametrize("workers", [1, 2, 4, 7])
def test_strips_cover_the_object_and_hold_every_window(workers):
    n, reach = 32, 3.0
    chunks, size = _raster(24, 6.0, n, 40)
    owner = [balanced_worker(i, len(chunks), workers) for i in range(len(chunks))]
    layout = TileLayout.from_chunks(chunks, owner, n, size, reach)
    rows = layout.owner_of_rows()
    assert sorted(set(rows.tolist())) == list(range(workers))
    assert all(np.all(np.diff(np.flatnonzero(rows == k)) == 1) for k in range(workers))   # one strip each
    for (lo, hi), k in zip(np.clip(chunk_bands(chunks, n, reach), 0, size), owner):
        t = layout.tiles[k]
        assert t.held_start <= lo and hi <= t.held_stop
    if workers == 1:
        assert layout.tiles[0].halo_rows == 0


@pytest.mark.parametrize("strategy", ["owner", "halo"])
def test_pieces_add_up_to_the_partial(strategy):
    rng = np.random.default_rng(0)
    n = 16
    chunks, size = _raster(12, 4.0, n, 18)
    owner = [balanced_worker(i, len(chunks), 3) for i in range(len(chunks))]
    layout = TileLayout.from_chunks(chunks, owner, n, size, 2.0)
    box = BoxedArray((5, 7), (rng.standard_normal((2, 30, 20)) + 1j * rng.standard_normal((2, 30, 20))))
    whole = np.zeros((2, size, size), complex)
    box.add_into(whole)
    assembled = np.zeros_like(whole)
    for worker, piece in layout.pieces(box, strategy).items():
        t = layout.tiles[worker]
        lo, hi = (t.start, t.stop) if strategy == "owner" else (t.held_start, t.held_stop)
        assert lo <= piece.offset[0] and piece.stop[0] <= hi
        frame = np.zeros_like(whole)
        piece.add_into(frame)
        if strategy == "owner":
            assembled += frame
        else:   # every worker holding a row has it whole
            np.testing.assert_array_equal(frame[:, lo:hi][:, max(lo, 5) - lo:min(hi, 35) - lo],
                                          whole[:, max(lo, 5):min(hi, 35)])
    if strategy == "owner":
        np.testing.assert_array_equal(assembled, whole)


def test_the_issue_scan_exchanges_borders_not_the_object():
    """256 x 256 positions of 64² patterns at 20 px (a ~5,200² = 27 Mpx object) on W = 4: per round
    (R = 4 rounds, each chunk's every 4th pattern) the most any worker receives is <= 10 % of the
    object's complex64 bytes and of what replicas exchange; replicas grow with W, tiles do not."""
    n, step, grid = 64, 20.0, 256
    chunks, size = _raster(grid, step, n, 637)
    object_bytes = size * size * 8
    figures = {}
    for workers in (2, 4, 8):
        owner = [balanced_worker(i, len(chunks), workers) for i in range(len(chunks))]
        layout = TileLayout.from_chunks(chunks, owner, n, size, reach=4.0)
        boxes = {}
        for c, k in zip(chunks, owner):
            p = c[0::4]
            y0, x0 = np.floor(p.min(axis=0) - n / 2).astype(int)
            y1, x1 = np.ceil(p.max(axis=0) + n / 2).astype(int) + 1
            boxes.setdefault(k, []).append((y0, x0, y1, x1))
        merged = {k: [(min(b[0] for b in v), min(b[1] for b in v), max(b[2] for b in v), max(b[3] for b in v))]
                  for k, v in boxes.items()}       # each worker's subtree sums its chunks into one box
        figures[workers] = {s: layout.received_bytes(merged, 12.0, s, width=size).max()
                            for s in ("replicas", "owner", "halo")}
    four = figures[4]
    assert four["owner"] <= 0.10 * object_bytes and four["halo"] <= 0.10 * object_bytes
    assert four["owner"] <= 0.10 * four["replicas"]
    print({w: {s: round(b / 2**20, 1) for s, b in f.items()} for w, f in figures.items()}, "MiB")
    # replicas grow with W; a strip has at most two borders, whatever W
    assert figures[8]["replicas"] > 1.5 * figures[2]["replicas"]
    assert figures[8]["halo"] <= 2.05 * figures[2]["halo"] and figures[8]["owner"] <= 2.05 * figures[2]["owner"]


def test_rows_meant_for_others_count_what_whole_round_results_would_bring():
    """Worker 0 would receive, from workers 1 and 2, each one's piece for the other: the rows both
    hold (18–22), twice; the middle worker's neighbours share no rows."""
    from daskpty.execution.tiles import Tile

    layout = TileLayout(30, (Tile(0, 0, 10, 0, 12), Tile(1, 10, 20, 8, 22), Tile(2, 20, 30, 18, 30)))
    assert layout.rows_meant_for_others() == 8
    two = TileLayout(30, (Tile(0, 0, 15, 0, 20), Tile(1, 15, 30, 10, 30)))
    assert two.rows_meant_for_others() == 0
