"""Tiles on data read from their Zarr store every round (``persist=False``, issue 34).

Each worker reads its own contiguous run of chunks inside its round's task, one chunk at a
time, so no chunk is kept between rounds. The chunks are contiguous runs of the stored order
taken by row (``ordering.stored_runs``: one contiguous read each), so W workers give the bits
of one; the persisted run orders single patterns by row, so with one update per epoch and the
same patterns per chunk it agrees to float32 rounding.
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.engines.positions import PositionOptions
from synthetic import make_dataset


def _store(tmp_path, client):
    """A 12 x 12 raster stored bottom row first (so the chunks are taken in reverse)."""
    ds = make_dataset(grid=12, seed=3)
    nominal = ds.positions + np.random.default_rng(1).normal(0, 0.4, ds.positions.shape)
    stored = np.argsort(-ds.positions[:, 0], kind="stable")
    path = tmp_path / "scan.zarr"
    daskpty.from_arrays(ds.intensities[stored], nominal[stored]).to_zarr(path, client=client)
    return ds, str(path)


def _data_chunks_held(dask_worker) -> int:
    """How many diffraction-data chunks (real (B, n, n) arrays, B > 2) the worker holds in memory."""
    held = getattr(dask_worker.data, "fast", dask_worker.data)
    return sum(1 for v in list(held.values())
               if isinstance(v, np.ndarray) and v.ndim == 3 and v.shape[0] > 2 and not np.iscomplexobj(v))


@pytest.mark.parametrize("engine,refine", [("lsqml", None), ("lsqml", PositionOptions(start_epoch=1)),
                                           ("ad", None), ("rpie", None)])
def test_tiles_out_of_core_on_three_workers_equal_one(tmp_path, three_workers, one_worker, engine, refine):
    ds, path = _store(tmp_path, three_workers)
    held = []

    def watch(epoch, state, metrics):
        held.append(sum(three_workers.run(_data_chunks_held).values()))

    kw = dict(engine=engine, epochs=4, rounds_per_epoch=3, chunk_length=25, tiles=True, persist=False,
              check_data=False, object=np.ones_like(ds.truth.object), refine_positions=refine)
    three = daskpty.reconstruct(path, client=three_workers, callback=watch, **kw)
    assert three.options["persist"] is False and held and max(held) == 0  # no chunk kept between rounds
    one = daskpty.reconstruct(path, client=one_worker, **kw)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    np.testing.assert_array_equal(three.positions, one.positions)
    assert three.history[-1]["loss"] < three.history[0]["loss"]
    if refine is not None:
        assert np.abs(three.positions - three.nominal_positions).max() > 0.01


def test_tiles_out_of_core_agree_with_persisted_tiles(tmp_path, three_workers):
    """One update per epoch from every pattern, chunks of two whole scan rows (runs of the store
    here, single patterns by row when persisted: the same patterns per chunk, as LSQML's step
    statistics are formed per chunk): only the order of the sums differs."""
    ds, path = _store(tmp_path, three_workers)
    kw = dict(engine="lsqml", epochs=4, rounds_per_epoch=1, chunk_length=24, tiles=True, check_data=False,
              object=np.ones_like(ds.truth.object))
    stored = daskpty.reconstruct(path, client=three_workers, persist=False, **kw)
    kept = daskpty.reconstruct(path, client=three_workers, persist=True, **kw)
    scale = np.abs(kept.object).max()
    np.testing.assert_allclose(stored.object, kept.object, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(stored.probe, kept.probe, rtol=0, atol=1e-4 * np.abs(kept.probe).max())


def test_the_callback_sees_persisted_chunks_held(tmp_path, three_workers):
    """The control of the test above: with persist=True the same probe does find the chunks."""
    ds, path = _store(tmp_path, three_workers)
    held = []
    daskpty.reconstruct(path, "lsqml", 2, client=three_workers, persist=True, tiles=True, chunk_length=24,
                        rounds_per_epoch=3, check_data=False, object=np.ones_like(ds.truth.object),
                        callback=lambda e, s, m: held.append(sum(three_workers.run(_data_chunks_held).values())))
    assert min(held) >= 6  # 144 patterns in chunks of 24


def test_stored_runs_are_contiguous_short_and_taken_by_row():
    """On a Morton-ordered scan (as ``simulate`` writes it) the runs stay compact: none spans
    much more than a square of chunk_len positions, though the stored order jumps between
    quadrants; together they are every pattern once."""
    from daskpty.io.scan import morton_order
    from daskpty.execution.ordering import stored_runs

    y, x = np.meshgrid(np.arange(64) * 10.0, np.arange(64) * 10.0, indexing="ij")
    grid = np.stack([y.ravel(), x.ravel()], axis=1)
    stored = grid[morton_order(grid, 10.0)]
    runs = stored_runs(stored, 100)
    assert all(0 < b - a <= 100 for a, b in runs)
    np.testing.assert_array_equal(np.sort(np.concatenate([np.arange(a, b) for a, b in runs])), np.arange(len(grid)))
    rows = [stored[a:b, 0].mean() for a, b in runs]
    assert rows == sorted(rows)
    assert max(np.ptp(stored[a:b, 0]) for a, b in runs) <= 1.5 * 10 * np.sqrt(100) + 1e-9
    assert stored_runs(stored[:50], 100) is None
