"""Results by tile (issue 34): a large tiled object comes back as a dask array over the workers'
tiles, is written to the store by the workers, and equals the object gathered on the client.

``DASKPTY_LAZY_OBJECT_BYTES=0`` makes every tiled object "large" here (the client reads it when
the run starts, so the worker processes need not see it).
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.io.results import Reconstruction
from synthetic import make_dataset


@pytest.fixture(scope="module")
def store(tmp_path_factory, three_workers):
    ds = make_dataset(grid=10, seed=5)
    path = tmp_path_factory.mktemp("lazy") / "data.zarr"
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(path, client=three_workers)
    return str(path)


COMMON = dict(tiles=True, rounds_per_epoch=2, chunk_length=25, persist=True, progress=False)


def _zarr_read(array) -> bool:
    """True when a dask array's graph reads a Zarr array (and holds no worker futures)."""
    return any("from-zarr" in str(name) or "zarr" in str(name) for name in array.dask.layers)


def test_a_large_tiled_object_is_written_by_tile_and_read_back_lazily(tmp_path, store, three_workers,
                                                                        monkeypatch):
    whole = daskpty.reconstruct(store, "lsqml", 3, client=three_workers, checkpoint=tmp_path / "a.zarr", **COMMON)
    monkeypatch.setenv("DASKPTY_LAZY_OBJECT_BYTES", "0")
    lazy = daskpty.reconstruct(store, "lsqml", 3, client=three_workers, checkpoint=tmp_path / "b.zarr", **COMMON)
    assert not whole.is_lazy and lazy.is_lazy
    assert _zarr_read(lazy.object) and _zarr_read(lazy.engine_state["velocity"])
    np.testing.assert_array_equal(np.asarray(lazy.object), whole.object)
    np.testing.assert_array_equal(np.asarray(lazy.illumination), whole.illumination)
    np.testing.assert_array_equal(lazy.probe, whole.probe)
    stored = Reconstruction.from_zarr(tmp_path / "b.zarr")
    np.testing.assert_array_equal(stored.object, whole.object)
    np.testing.assert_array_equal(stored.engine_state["velocity"], whole.engine_state["velocity"])
    assert [h["epoch"] for h in stored.history] == [1, 2, 3]


def test_without_a_store_the_object_stays_on_the_workers_tiles(store, three_workers, monkeypatch):
    whole = daskpty.reconstruct(store, "lsqml", 2, client=three_workers, **COMMON)
    monkeypatch.setenv("DASKPTY_LAZY_OBJECT_BYTES", "0")
    lazy = daskpty.reconstruct(store, "lsqml", 2, client=three_workers, **COMMON)
    assert lazy.is_lazy and not _zarr_read(lazy.object)
    assert len(lazy.object.chunks[-2]) == 3  # one block of rows per worker's tile
    assert sum(lazy.object.chunks[-2]) == whole.object.shape[-2]
    with three_workers.as_current():
        computed = lazy.computed()
    assert not computed.is_lazy
    np.testing.assert_array_equal(computed.object, whole.object)


def test_a_run_resumes_from_a_store_its_tiles_wrote(tmp_path, store, three_workers, monkeypatch):
    whole = daskpty.reconstruct(store, "lsqml", 4, client=three_workers, **COMMON)
    monkeypatch.setenv("DASKPTY_LAZY_OBJECT_BYTES", "0")
    daskpty.reconstruct(store, "lsqml", 2, client=three_workers, checkpoint=tmp_path / "c.zarr", **COMMON)
    resumed = daskpty.reconstruct(store, "lsqml", 4, client=three_workers, checkpoint=tmp_path / "c.zarr",
                                  resume=tmp_path / "c.zarr", **COMMON)
    np.testing.assert_array_equal(np.asarray(resumed.object), whole.object)
    np.testing.assert_array_equal(resumed.probe, whole.probe)


def test_a_bad_lazy_threshold_is_one_line(monkeypatch):
    from daskpty.execution.tile_results import lazy_object_bytes

    monkeypatch.setenv("DASKPTY_LAZY_OBJECT_BYTES", "lots")
    with pytest.raises(ValueError, match="DASKPTY_LAZY_OBJECT_BYTES must be a number of bytes"):
        lazy_object_bytes()
