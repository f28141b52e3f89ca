"""Which patterns of a chunk each minibatch round steps through (``rounds.round_rows``)."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.execution.rounds import hilbert_index, round_rows


def _raster(rows: int, cols: int, step: float = 8.0) -> np.ndarray:
    y, x = np.meshgrid(np.arange(rows) * step, np.arange(cols) * step, indexing="ij")
    return np.stack([y.ravel(), x.ravel()], axis=1) + 100.0


@pytest.mark.parametrize("length,rounds", [(512, 16), (100, 16), (144, 3), (7, 4), (5, 5)])
def test_the_rounds_partition_the_chunk_with_the_strides_sizes(length, rounds):
    positions = np.random.default_rng(length).uniform(0, 300, (length, 2))
    subsets = [round_rows(positions, r, rounds) for r in range(rounds)]
    assert [len(s) for s in subsets] == [len(range(r, length, rounds)) for r in range(rounds)]
    np.testing.assert_array_equal(np.sort(np.concatenate(subsets)), np.arange(length))
    assert all(np.all(np.diff(s) > 0) for s in subsets)  # in the chunk's order


def test_a_hilbert_curve_visits_neighbours_in_turn():
    grid = _raster(8, 8, step=1.0)
    walk = grid[np.argsort(hilbert_index(grid))]
    assert np.all(np.abs(np.diff(walk, axis=0)).sum(axis=1) == 1)  # each step to a neighbour


def test_whole_row_shifts_give_the_same_rounds():
    """Tiles move a chunk's positions by whole rows: the rounds must not change."""
    positions = np.random.default_rng(1).uniform(0, 4000, (300, 2))
    for shift in (1.0, 137.0, 3999.0):
        moved = positions - np.array([shift, 0.0])
        for r in range(4):
            np.testing.assert_array_equal(round_rows(moved, r, 4), round_rows(positions, r, 4))


def test_rounds_on_a_raster_are_spread_not_stripes():
    """A 64-column raster in chunks of 512 with 16 rounds: the stride r::16 puts 4 columns in a
    round (stripes 128 px apart); the Hilbert rounds cover the chunk's area evenly — every 4 x 4
    block of neighbouring positions gives each round one pattern."""
    chunk = _raster(8, 64)
    stride_columns = {float(x) for x in chunk[np.arange(3, 512, 16), 1]}
    assert len(stride_columns) == 4  # (the failure mode)
    for r in range(16):
        rows = round_rows(chunk, r, 16)
        taken = np.zeros((8, 64), bool)
        taken.ravel()[rows] = True
        blocks = taken.reshape(2, 4, 16, 4).sum(axis=(1, 3))
        assert np.all(blocks == 1), r
