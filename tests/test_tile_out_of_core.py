"""Tiles on data read from their Zarr store every round (``persist=False``, issue 34).

Each worker reads its own contiguous run of chunks inside its round's task, one chunk at a
time, so no chunk is kept between rounds; the tiles, the fixed reduction tree and the chunks
are those of the persisted run, so the result is the same bits — on 3 workers and on 1.
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.engines.positions import PositionOptions
from synthetic import make_dataset


def _store(tmp_path, client):
    ds = make_dataset(grid=12, seed=3)
    nominal = ds.positions + np.random.default_rng(1).normal(0, 0.4, ds.positions.shape)
    path = tmp_path / "scan.zarr"
    daskpty.from_arrays(ds.intensities, nominal).to_zarr(path, client=client)
    return ds, str(path)


def _data_chunks_held(dask_worker) -> int:
    """How many diffraction-data chunks (real (B, n, n) arrays, B > 2) the worker holds in memory."""
    held = getattr(dask_worker.data, "fast", dask_worker.data)
    return sum(1 for v in list(held.values())
               if isinstance(v, np.ndarray) and v.ndim == 3 and v.shape[0] > 2 and not np.iscomplexobj(v))


def _until_no_chunk_is_held(client, timeout=20.0):
    """Wait for the chunks an earlier test's persisted run left on the shared workers to be
    released (their futures are dropped with the client's garbage collection, which a loaded
    machine delays), so the count below is this run's alone."""
    import gc
    import time

    deadline = time.monotonic() + timeout
    while sum(client.run(_data_chunks_held).values()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.2)


@pytest.mark.parametrize("engine,refine", [("lsqml", None), ("lsqml", PositionOptions(start_epoch=1)),
                                           ("ad", None), ("rpie", None)])
def test_tiles_out_of_core_equal_persisted_tiles_and_one_worker(tmp_path, three_workers, one_worker, engine, refine):
    ds, path = _store(tmp_path, three_workers)
    _until_no_chunk_is_held(three_workers)
    held = []

    def watch(epoch, state, metrics):
        held.append(sum(three_workers.run(_data_chunks_held).values()))

    kw = dict(engine=engine, epochs=4, rounds_per_epoch=3, chunk_length=24, tiles=True, check_data=False,
              object=np.ones_like(ds.truth.object), refine_positions=refine)
    stored = daskpty.reconstruct(path, client=three_workers, persist=False, callback=watch, **kw)
    assert stored.options["persist"] is False and held and max(held) == 0  # no chunk kept between rounds
    persisted = daskpty.reconstruct(path, client=three_workers, persist=True, **kw)
    one = daskpty.reconstruct(path, client=one_worker, persist=False, **kw)
    for other in (persisted, one):
        np.testing.assert_array_equal(stored.object, other.object)
        np.testing.assert_array_equal(stored.probe, other.probe)
        np.testing.assert_array_equal(stored.positions, other.positions)
    assert stored.history[-1]["loss"] < stored.history[0]["loss"]
    if refine is not None:
        assert np.abs(stored.positions - stored.nominal_positions).max() > 0.01


def test_the_callback_sees_persisted_chunks_held(tmp_path, three_workers):
    """The control of the test above: with persist=True the same probe does find the chunks."""
    ds, path = _store(tmp_path, three_workers)
    held = []
    daskpty.reconstruct(path, "lsqml", 2, client=three_workers, persist=True, tiles=True, chunk_length=24,
                        rounds_per_epoch=3, check_data=False, object=np.ones_like(ds.truth.object),
                        callback=lambda e, s, m: held.append(sum(three_workers.run(_data_chunks_held).values())))
    assert min(held) >= 6  # 144 patterns in chunks of 24


def test_in_memory_data_asked_out_of_core_run_on_tiles(three_workers):
    """``persist=False`` on arrays from memory (scattered to the workers, no store to re-read):
    the chunks stay in worker memory and the tiles run (a tile task's read of a chunk failed with
    ``Missing dependency ndarray-...``); the result is that of the persisted run."""
    ds = make_dataset(grid=8, seed=3)
    kw = dict(engine="lsqml", epochs=2, rounds_per_epoch=2, chunk_length=16, tiles=True, check_data=False,
              object=np.ones_like(ds.truth.object), client=three_workers)
    asked = daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), persist=False, **kw)
    kept = daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), persist=True, **kw)
    np.testing.assert_array_equal(asked.object, kept.object)
    np.testing.assert_array_equal(asked.probe, kept.probe)
