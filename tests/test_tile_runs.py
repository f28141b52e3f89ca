"""Epochs on tiles (issue 34): each worker holds a row tile of the object, only borders travel.

W tiles equal 1 tile bit for bit, and the replicated graph on the same pattern order to float32
rounding (the scale
normalisation's mean is summed tile by tile); a worker receives less than replicas exchange;
a real run through ``reconstruct`` (a Zarr store, worker processes) resumes bit-identically;
what tiles cannot do yet is refused in one line (position refinement on tiles: test_tile_positions.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.engines import lsqml
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from daskpty.engines.probe_model import ProbeModelOptions
from daskpty.execution.engine_registry import engine_spec
from daskpty.execution.tile_graph import TilesUnsupported, crop_state, stitch_states
from synthetic import make_dataset

LSQMLAdapter = engine_spec("lsqml").adapter

OPTIONS = lsqml.LSQMLOptions(noise="poisson", momentum=0.5, normalize_every=2)


def _run(client, ds, tiles: bool, epochs=4, rounds=3, modes=1, model=None):
    with client.as_current():
        data = prepare_data(client, ds.intensities, ds.positions, chunk_length=24, persist=True, row_bands=True)
    adapter = LSQMLAdapter(OPTIONS, probe_model=model)
    probe = ds.truth.probe.copy() if modes == 1 else np.concatenate([ds.truth.probe, 0.1 * ds.truth.probe])
    start = adapter.new_state(np.ones_like(ds.truth.object), probe)
    return run_epochs(client, data, adapter, start, epochs=epochs, rounds_per_epoch=rounds, split_every=2,
                      tiles=tiles)


def test_crop_and_stitch_give_the_state_back():
    state = lsqml.LSQMLState(np.arange(60, dtype=np.complex64).reshape(6, 10), np.ones((1, 4, 4), np.complex64),
                             illumination=np.arange(60, dtype=np.float32).reshape(6, 10))
    fields = LSQMLAdapter.tile_fields
    parts = [crop_state(state, fields, a, b) for a, b in ((0, 2), (2, 5), (5, 6))]
    back = stitch_states(parts, fields)
    np.testing.assert_array_equal(back.object, state.object)
    np.testing.assert_array_equal(back.illumination, state.illumination)
    assert back.velocity is None and parts[1].object.shape == (3, 10)


VARYING = ProbeModelOptions(opr_modes=2, fit_intensity=True, background="constant", start_epoch=1)


@pytest.mark.parametrize("modes,model", [(1, None), (2, None), (1, VARYING)], ids=["1 mode", "2 modes", "OPR"])
def test_three_tiles_equal_one_tile_and_the_replicas(three_workers, one_worker, modes, model):
    ds = make_dataset(grid=12, seed=3)
    one, _ = _run(one_worker, ds, tiles=True, modes=modes, model=model)
    three, hist = _run(three_workers, ds, tiles=True, modes=modes, model=model)
    replicas, r_hist = _run(three_workers, ds, tiles=False, modes=modes, model=model)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    if model is not None:  # the per-pattern weights and factors come back from every tile
        assert sorted(three.chunk_local) == sorted(replicas.chunk_local) == sorted(one.chunk_local)
        for i, local in three.chunk_local.items():
            for name, value in local.items():
                np.testing.assert_array_equal(value, one.chunk_local[i][name])
                np.testing.assert_allclose(value, replicas.chunk_local[i][name], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(three.eigen_probes, one.eigen_probes)
    assert three.epoch == replicas.epoch == 4
    scale = np.abs(replicas.object).max()
    np.testing.assert_allclose(three.object, replicas.object, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(three.probe, replicas.probe, rtol=0, atol=2e-5 * np.abs(replicas.probe).max())
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in r_hist], rtol=1e-6)
    # the tiles are borders: a worker receives less than the replicas' whole partial sums
    tiles_bytes = [h["exchanged_bytes_per_round"] for h in hist]
    assert all(0 < t < r["exchanged_bytes_per_round"] for t, r in zip(tiles_bytes, r_hist))
    # and the reconstruction is a reconstruction: closer to the truth than the start
    from daskpty.metrics import nrmse

    assert nrmse(three.object, ds.truth.object) < nrmse(np.ones_like(ds.truth.object), ds.truth.object)


@pytest.mark.parametrize("engine", ["lsqml", "rpie"])
def test_reconstruct_on_tiles_from_a_store_resumes_bit_identically(tmp_path, three_workers, engine):
    ds = make_dataset(grid=10, seed=5)
    store = tmp_path / "data.zarr"
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(store, client=three_workers)
    common = dict(client=three_workers, tiles=True, rounds_per_epoch=2, chunk_length=25, persist=True)
    whole = daskpty.reconstruct(str(store), engine, 6, checkpoint=tmp_path / "a.zarr", **common)
    daskpty.reconstruct(str(store), engine, 3, checkpoint=tmp_path / "b.zarr", **common)
    resumed = daskpty.reconstruct(str(store), engine, 6, checkpoint=tmp_path / "b.zarr",
                                  resume=tmp_path / "b.zarr", **common)
    np.testing.assert_array_equal(resumed.object, whole.object)
    np.testing.assert_array_equal(resumed.probe, whole.probe)
    assert [h["epoch"] for h in resumed.history] == list(range(1, 7))
    assert whole.options["tiles"] is True and daskpty.Reconstruction.from_zarr(tmp_path / "a.zarr").options["tiles"]


def _in_tile_order(data, chunk_length: int):
    """``data`` with its patterns in the tiles' order (:func:`row_band_order`), which a tiled run
    then keeps; a replicated run given it with ``sort=False`` cuts the same chunks (the step
    lengths are formed per chunk, so other chunks give another, equally valid, result)."""
    import dataclasses

    from daskpty.execution.ordering import row_band_order

    order = row_band_order(data.positions, chunk_length, data.pattern_shape[0])
    if order is None:
        return data
    return dataclasses.replace(data, intensities=data.intensities[order], positions=data.positions[order])


@pytest.mark.parametrize("engine,kind", [("lsqml", "slices"), ("lsqml", "near field"), ("ad", "slices"),
                                         ("rpie", "slices"), ("rpie", "near field")])
def test_slices_and_the_near_field_on_tiles(three_workers, one_worker, engine, kind):
    """K slices (per-slice maxima and scales) and the near-field detector on tiles: 3 tiles equal
    1 tile bit for bit, and the replicas with the same chunks to float32 rounding (compact
    LSQML: one update per epoch, so only the order of the sums differs)."""
    from test_compose_runs import SPACING, VARYING, _electron, _near_field

    data = _electron(2, grid=6)[1] if kind == "slices" else _near_field()[2]
    extra = dict(slices=2, slice_spacing_m=SPACING) if kind == "slices" else {}
    kw = dict(engine=engine, epochs=4, rounds_per_epoch=1, chunk_length=6, persist=True, **extra,
              **({} if engine == "rpie" else VARYING))  # (PIE takes no probe model)
    data = _in_tile_order(data, kw["chunk_length"])  # the replicas then get the tiles' chunks
    one = daskpty.reconstruct(data, client=one_worker, tiles=True, **kw)
    three = daskpty.reconstruct(data, client=three_workers, tiles=True, **kw)
    replicas = daskpty.reconstruct(data, client=three_workers, sort=False, **kw)
    assert three.object.shape == replicas.object.shape and three.object.ndim == (3 if kind == "slices" else 2)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    np.testing.assert_allclose(three.object, replicas.object, rtol=0, atol=1e-4 * np.abs(replicas.object).max())
    np.testing.assert_allclose(three.probe, replicas.probe, rtol=0, atol=1e-4 * np.abs(replicas.probe).max())
    assert [h["loss"] for h in three.history][-1] < [h["loss"] for h in three.history][0]


@pytest.mark.parametrize("engine,settings,expected", [
    ("ad", {"optimizer": "cg"}, "the CG optimiser"),
])
def test_what_tiles_cannot_do_yet_is_refused_in_one_line(one_worker, engine, settings, expected):
    ds = make_dataset(grid=6, seed=1)
    with pytest.raises(TilesUnsupported, match=expected) as info:
        daskpty.reconstruct(ds, engine, 1, client=one_worker, tiles=True, **{"persist": True, **settings})
    assert "\n" not in str(info.value) and "tiles=False" in str(info.value)


def test_every_engine_adapter_declares_the_tile_protocol(one_worker):
    from daskpty.engines import ad
    from daskpty.execution.engine_protocol import RunsOnTiles

    assert isinstance(LSQMLAdapter(OPTIONS), RunsOnTiles)
    assert isinstance(engine_spec("ad").adapter(ad.ADOptions()), RunsOnTiles)
    assert isinstance(engine_spec("rpie").adapter(), RunsOnTiles)


@pytest.mark.parametrize("modes", [1, 2])
def test_rpie_on_three_tiles_equals_one_tile_and_the_replicas(three_workers, one_worker, modes):
    """rPIE in minibatch rounds on tiles: the denominator's max D and the scale's mean |O| over
    every tile. 3 tiles equal 1 tile bit for bit, and the replicas to float32 rounding."""
    from daskpty.engines.pie import PIEOptions

    PIEAdapter = engine_spec("rpie").adapter
    ds = make_dataset(grid=12, seed=4)
    probe = ds.truth.probe.copy() if modes == 1 else np.concatenate([ds.truth.probe, 0.1 * ds.truth.probe])

    def run(client, tiles):
        with client.as_current():
            data = prepare_data(client, ds.intensities, ds.positions, chunk_length=24, persist=True, row_bands=True)
        adapter = PIEAdapter(PIEOptions(alpha=0.2, probe_start_epoch=1))
        start = adapter.new_state(np.ones_like(ds.truth.object), probe)
        return run_epochs(client, data, adapter, start, epochs=4, rounds_per_epoch=3, split_every=2, tiles=tiles)

    one, _ = run(one_worker, True)
    three, hist = run(three_workers, True)
    replicas, _ = run(three_workers, False)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    np.testing.assert_allclose(three.object, replicas.object, rtol=0, atol=1e-4 * np.abs(replicas.object).max())
    np.testing.assert_allclose(three.probe, replicas.probe, rtol=0, atol=1e-4 * np.abs(replicas.probe).max())
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert max(h["exchanged_bytes_per_round"] for h in hist) > 0


@pytest.mark.parametrize("workers", [2, 3, 4, 8])
def test_row_band_order_gives_each_worker_a_band_of_rows(workers):
    """With tiles the chunks a worker holds cover a band of rows: its share of the rows, the slab
    of a chunk where it meets a neighbour, and the windows' reach (a Morton order over the whole
    scan gave 4 workers its quadrants: each held half the rows)."""
    from daskpty.execution.ordering import compact_order, row_band_order
    from daskpty.execution.placement import balanced_worker
    from daskpty.execution.tiles import TileLayout

    y, x = np.mgrid[0:64, 0:64] * 10.0 + 40
    positions = np.stack([y.ravel(), x.ravel()], axis=1)
    positions += np.random.default_rng(1).uniform(-1, 1, positions.shape)  # a jittered raster
    shuffled = positions[np.random.default_rng(0).permutation(len(positions))]  # as the scan came
    chunk, n, height = 96, 32, 700
    slab = np.ceil(chunk / 64) * 10.0 + 2  # the rows a chunk's positions span

    def most_rows(p):
        chunks = [p[s:s + chunk] for s in range(0, len(p), chunk)]
        owners = [balanced_worker(i, len(chunks), workers) for i in range(len(chunks))]
        layout = TileLayout.from_chunks(chunks, owners, n, height)
        return max(t.held_stop - t.held_start for t in layout.tiles)

    order = row_band_order(shuffled, chunk, n)
    assert sorted(order) == list(range(len(positions)))
    held = most_rows(shuffled[order])
    assert held <= height / workers + 2 * (slab + n / 2 + 2)
    if workers == 4:
        assert most_rows(shuffled[compact_order(shuffled, chunk, n)]) >= height / 2 > held


def test_band_chunks_keep_their_windows_compact():
    """With windows many scan steps tall (the user's 128² patterns at a 14.6 px step), chunks
    of single rows span a row of windows each: their sums' boxes are mostly window. Bands of a
    few rows, taken column by column, keep a chunk's box near a square chunk's."""
    from daskpty.execution.ordering import footprint_area, row_band_order

    y, x = np.mgrid[0:48, 0:256] * 14.6 + 70
    positions = np.stack([y.ravel(), x.ravel()], axis=1)
    positions += np.random.default_rng(2).uniform(-1, 1, positions.shape)
    chunk, n = 408, 128
    bands = footprint_area(positions[row_band_order(positions, chunk, n)], chunk, n)
    by_row = footprint_area(positions[np.lexsort((positions[:, 1], np.round(positions[:, 0] / 14.6)))], chunk, n)
    squares = len(positions) / chunk * (np.sqrt(chunk) * 14.6 + n) ** 2
    assert bands < 0.5 * by_row
    assert bands < 1.6 * squares


def _killing_chunk(intensities, positions, payload, local=None):
    """lsqml_chunk, but the 12th call in a worker process exits that process (once per test:
    the marker file named in DASKPTY_TILE_KILL)."""
    import os

    from daskpty.execution.adapter import chunk as lsqml_chunk

    marker = os.environ.get("DASKPTY_TILE_KILL")
    if marker:
        calls = int(os.environ.get("DASKPTY_TILE_CALLS", "0")) + 1
        os.environ["DASKPTY_TILE_CALLS"] = str(calls)
        if calls == 12:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(1)
    return lsqml_chunk(intensities, positions, payload, local) if local is not None else \
        lsqml_chunk(intensities, positions, payload)


class _KillingAdapter(LSQMLAdapter):
    chunk_function = staticmethod(_killing_chunk)


@pytest.mark.slow
def test_a_worker_killed_mid_run_on_tiles_gives_the_undisturbed_bits(tmp_path, monkeypatch):
    """A worker process dies in a chunk step; the tiled run restarts from the last state on the
    client, on tiles for the workers there are then, and ends with the bits of an undisturbed run."""
    import os

    ds = make_dataset(grid=12, seed=3)
    marker = tmp_path / "killed-once"
    monkeypatch.setenv("DASKPTY_TILE_KILL", str(marker))
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        results = {}
        for name, cls in (("disturbed", _KillingAdapter), ("undisturbed", LSQMLAdapter)):
            with client.as_current():
                data = prepare_data(client, ds.intensities, ds.positions, chunk_length=24, persist=True,
                                    row_bands=True)
            adapter = cls(OPTIONS)
            start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
            results[name] = run_epochs(client, data, adapter, start, epochs=5, rounds_per_epoch=2,
                                       split_every=2, tiles=True)
            os.environ.pop("DASKPTY_TILE_KILL", None)
    assert marker.exists(), "no worker was killed"
    (a, ha), (b, hb) = results["disturbed"], results["undisturbed"]
    np.testing.assert_array_equal(a.object, b.object)
    np.testing.assert_array_equal(a.probe, b.probe)
    assert [h["epoch"] for h in ha] == [h["epoch"] for h in hb] == [1, 2, 3, 4, 5]


def test_tiles_take_lsqml_options_left_unresolved(client):
    """``LSQMLOptions()`` as built (momentum None: the engine's default, read as
    ``object_momentum``) runs on tiles as on replicas; the epoch end's momentum test read the raw
    None and stopped with a TypeError."""
    ds = make_dataset(grid=10, seed=2)
    runs = {}
    for tiles in (True, False):
        with client.as_current():
            data = prepare_data(client, ds.intensities, ds.positions, chunk_length=20, persist=True, row_bands=True)
        adapter = LSQMLAdapter(lsqml.LSQMLOptions())
        start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
        runs[tiles], _ = run_epochs(client, data, adapter, start, epochs=3, rounds_per_epoch=2, split_every=2,
                                    tiles=tiles)
    assert runs[True].velocity is not None  # the momentum ran on the tiles too
    scale = np.abs(runs[False].object).max()
    np.testing.assert_allclose(runs[True].object, runs[False].object, rtol=0, atol=2e-5 * scale)
