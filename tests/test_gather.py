"""Reading patterns in any order straight from a Zarr store (:mod:`daskpty.io.gather`): the same
values as indexing the whole array, and each chunk's task fetches only the inner chunks that hold
its patterns."""
import dask
import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore, WrapperStore

import daskpty
from daskpty.io.gather import gathered, read_rows
from daskpty.io.integrity import NamedReader


class CountingStore(WrapperStore):
    """A local store that adds up the bytes it hands out."""

    fetched = 0

    async def get(self, key, prototype, byte_range=None):
        buf = await super().get(key, prototype, byte_range)
        if buf is not None:
            CountingStore.fetched += len(buf)
        return buf


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A store whose ``intensities`` shards hold 8 inner chunks of 16 patterns each."""
    path = tmp_path_factory.mktemp("gather") / "sharded.zarr"
    values = np.random.default_rng(0).integers(0, 1000, (300, 16, 16), dtype=np.uint16)
    zarr.create_array(str(path), name="intensities", shape=values.shape, dtype=values.dtype,
                      chunks=(16, 16, 16), shards=(128, 16, 16))[:] = values
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("gather") / "scan.zarr"
    daskpty.simulate(path, preset="small", grid=(16, 16), probe_size=32, shard_bytes=256 * 1024)
    return path


def _array(path, counting=False):
    base = LocalStore(str(path), read_only=True)
    return zarr.open_array(CountingStore(base) if counting else base, path="intensities", mode="r")


def test_any_order_and_chunk_length_gives_the_indexed_patterns(sharded):
    store = sharded
    arr = _array(store)
    everything = arr[:]
    rng = np.random.default_rng(3)
    for order in (rng.permutation(arr.shape[0]), np.lexsort(rng.random((2, arr.shape[0]))), None):
        for length in (7, 64, arr.shape[0] + 5):
            x = gathered(NamedReader(arr, str(store)), order, length)
            expected = everything if order is None else everything[order]
            assert x.chunks[0][0] == min(length, arr.shape[0])
            np.testing.assert_array_equal(x.compute(scheduler="sync"), expected)
    rows = np.array([5, 5, 200, 0, 17])  # repeats and any order
    assert read_rows(NamedReader(arr, str(store)), np.array([], int)).shape == (0,) + arr.shape[1:]
    np.testing.assert_array_equal(read_rows(NamedReader(arr, str(store)), rows), everything[rows])


def test_a_chunk_reads_only_the_inner_chunks_holding_its_patterns(sharded):
    store = sharded
    arr = _array(store, counting=True)
    inner = arr.chunks[0]
    assert arr.shards[0] >= 4 * inner  # several inner chunks per shard, or the test proves nothing
    order = np.arange(arr.shape[0])[::inner][:3]  # one pattern from each of three inner chunks
    (block,) = gathered(NamedReader(arr, str(store)), order, len(order)).to_delayed().ravel()
    (culled,) = dask.optimize(block)
    assert len(culled.__dask_graph__()) == 1  # one task: no whole source chunk read and split

    CountingStore.fetched = 0
    block.compute(scheduler="sync")
    gathered_bytes = CountingStore.fetched
    CountingStore.fetched = 0
    for start in order:  # the three inner chunks, each read whole
        arr[start:start + inner]
    cells_bytes = CountingStore.fetched
    CountingStore.fetched = 0
    arr[:arr.shards[0]]  # the first shard whole
    shard_bytes = CountingStore.fetched
    assert gathered_bytes <= cells_bytes
    assert gathered_bytes < 0.5 * shard_bytes


def test_out_of_core_reads_go_through_the_gather(store):
    data = daskpty.open_data(store)
    order = np.arange(data.n_patterns)[::-1]
    x = data.intensities_in_chunks(50, order)
    assert x.name.startswith("gather-zarr-")
    np.testing.assert_array_equal(x[:50].compute(scheduler="sync"), data.intensities[order[:50]].compute())
