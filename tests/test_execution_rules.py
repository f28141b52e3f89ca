"""Rules of the execution layer: chunk lengths, rounds per epoch, even placement of chunks."""
import collections
import math

import numpy as np
import pytest
from distributed import Client, LocalCluster, futures_of

from daskpty.execution.data import (
    MIN_CHUNK_PIXELS,
    ROUND_PIXELS,
    WORKING_BYTES_PER_PIXEL,
    auto_rounds,
    default_chunk_length,
    prepare_data,
)
from daskpty.execution.rounds import FixedTree
from daskpty.execution.rounds import default_split_every


@pytest.mark.parametrize("n_patterns,n,modes", [(576, 64, 1), (1600, 128, 1), (300, 64, 1), (5000, 32, 2),
                                                (16384, 128, 1), (262144, 256, 1), (4096, 128, 4)])
def test_chunk_length_rule(n_patterns, n, modes):
    length = default_chunk_length(n_patterns, n, modes)
    chunks = math.ceil(n_patterns / length)
    assert length * WORKING_BYTES_PER_PIXEL * modes * n * n <= 512 * 2**20  # one step's memory budget
    if chunks <= 8:  # small sets: a power of two of chunks, each with enough work
        assert chunks & (chunks - 1) == 0
        assert chunks == 1 or length * modes * n * n >= MIN_CHUNK_PIXELS
    assert n_patterns - (chunks - 1) * length > 0  # the last chunk is not empty


def test_auto_rounds_rule():
    assert auto_rounds(576, 64) == 3 and auto_rounds(1600, 128) == 4 and auto_rounds(16384, 128) == 16
    assert auto_rounds(10**6, 128, persisted=False) == 1
    assert auto_rounds(100, 32) == 1  # fewer than 150 patterns: one update per epoch
    for n_patterns, n in [(2000, 64), (3000, 128), (8000, 128), (600, 256)]:
        r = auto_rounds(n_patterns, n)
        assert 1 <= r <= 16 and r <= n_patterns // 150
        assert r <= 3 or n_patterns * n * n / r >= ROUND_PIXELS  # enough work per round


def test_persisted_chunks_spread_evenly_over_workers():
    rng = np.random.default_rng(0)
    intensities = rng.poisson(3.0, size=(96, 16, 16)).astype(np.uint16)
    positions = np.stack(np.meshgrid(np.arange(8) * 3.0 + 20, np.arange(12) * 3.0 + 20), -1).reshape(-1, 2)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        data = prepare_data(client, intensities, positions, chunk_length=12, persist=True)
        assert data.n_chunks == 8
        placement = client.who_has(futures_of(data.intensities))
        per_worker = collections.Counter(tuple(w) for w in placement.values())
        assert sorted(per_worker.values()) == [4, 4]


@pytest.mark.parametrize("n_chunks", [1, 2, 4, 8, 16, 17, 64, 1446])
def test_split_every_rule_leaves_a_level_below_the_root_for_two_workers(n_chunks):
    """With two workers holding contiguous halves, each can pre-sum at least one subtree once
    there are 8 or more chunks (4 inputs per node up to 16 chunks, 8 beyond: fewer levels)."""
    s = default_split_every(n_chunks)
    assert s == (4 if n_chunks <= 16 else 8)
    tree = FixedTree(n_chunks, s)
    if n_chunks >= 8:
        assert len(tree.counts) >= 3  # chunks, at least one level of subtrees, the root
        assert s <= n_chunks // 2  # a subtree fits inside one worker's half
