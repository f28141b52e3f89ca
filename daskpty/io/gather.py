"""Patterns in any order, read straight from their Zarr store, chunk by chunk.

The execution layer orders the patterns (compact chunks for replicas, rows for tiles) and, for
data read from their store every round, used to apply the order as a dask fancy index. dask
(2024+) takes such an index by a shuffle: every output chunk reads, decompresses and splits
each whole source chunk it touches. A 120-pattern chunk by row of a Morton-ordered store
decompressed 24 source chunks (0.12 s; the patterns it needs sit in 16 of the store's inner
chunks). :func:`gathered` instead gives each output chunk one task that reads just the inner
chunks holding its patterns, each once (:func:`read_rows`). On a store in acquisition (raster)
order a chunk of whole rows is then a few contiguous inner chunks.
"""
from __future__ import annotations

import dask.array as da
from dask.base import tokenize
import numpy as np


def read_rows(reader, rows: np.ndarray) -> np.ndarray:
    """``reader[rows]`` for integer ``rows`` in any order: one orthogonal selection of the sorted
    rows (``reader.take``: zarr decodes each inner chunk holding some of them once, several at a
    time), put back in the order asked."""
    wanted, back = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
    take = getattr(reader, "take", None)
    block = take(wanted) if take is not None else reader[wanted]
    return block[back.reshape(-1)]


def gathered(reader, order: np.ndarray | None, length: int) -> da.Array:
    """The patterns of ``reader`` (an array-like over a store, shape (N, H, W)) taken in
    ``order`` (None: as stored) as a dask array of ``length``-pattern chunks, each read by one
    task with :func:`read_rows` (its own rows only: a chunk's culled graph holds its
    indices and the reader, a few kB)."""
    n_total = int(reader.shape[0])
    order = np.arange(n_total) if order is None else np.asarray(order, dtype=np.int64)
    length = max(int(length), 1)
    bounds = list(range(0, len(order), length)) + [len(order)]
    name = "gather-zarr-" + tokenize(getattr(reader, "store", None), getattr(getattr(reader, "arr", None), "path", None),
                                     reader.shape, str(reader.dtype), order, length)
    graph = {(name, k, 0, 0): (read_rows, reader, order[a:b]) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))}
    chunks = (tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])),) + tuple((int(s),) for s in reader.shape[1:])
    return da.Array(graph, name, chunks, meta=np.empty((0,) * len(reader.shape), dtype=reader.dtype))


__all__ = ["gathered", "read_rows"]
