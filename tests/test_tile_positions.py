"""Position refinement on tiles (issue 34): refined positions stay in the object's frame, the
windows move across tile borders inside the halo, and the window correction's resampling takes
each halo's rows from their owner.

3 tiles equal 1 tile bit for bit and the replicated graph (same pattern order) to float32
rounding, for LSQML, rPIE and AD; without the halo refresh they would not (the test's halo is
narrow, so stale rows reach the windows within its epochs); a run resumes bit-identically; a
window that leaves its tile's halo stops the run in one line.
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.engines import ad, lsqml
from daskpty.engines.pie import PIEOptions
from daskpty.engines.positions import PositionOptions
from daskpty.engines.tile_frame import PositionsLeftTile, TileFrame
from daskpty.execution.engine_registry import engine_spec
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from synthetic import make_dataset

ADAdapter = engine_spec("ad").adapter
LSQMLAdapter = engine_spec("lsqml").adapter
PIEAdapter = engine_spec("rpie").adapter

#: a narrow halo (3 px beyond the windows): without each epoch's refresh, the resampling's
#: stale edge rows would reach the windows within these epochs
REFINE = PositionOptions(start_epoch=1, max_displacement=3.0, window_every=1)
EPOCHS = 8


def _scan():
    """A scan whose nominal positions are rotated (0.8°), scaled (1 %) and jittered (0.5 px)."""
    ds = make_dataset(grid=12, seed=3)
    centre = ds.positions.mean(axis=0)
    turn = np.radians(0.8)
    rotation = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
    noise = np.random.default_rng(1).normal(0, 0.5, ds.positions.shape)
    return ds, (ds.positions - centre) @ rotation.T * 1.01 + centre + noise


def _adapter(engine: str):
    refine = REFINE.for_engine(engine)
    if engine == "lsqml":
        return LSQMLAdapter(lsqml.LSQMLOptions(noise="poisson", momentum=0.5), positions=refine)
    if engine == "rpie":
        return PIEAdapter(PIEOptions(alpha=0.2, probe_start_epoch=1), positions=refine)
    return ADAdapter(ad.ADOptions(optimizer="sgd"), positions=refine)


def _run(client, ds, nominal, engine, tiles):
    with client.as_current():
        data = prepare_data(client, ds.intensities, nominal, chunk_length=24, persist=True, row_bands=True)
    adapter = _adapter(engine)
    start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    state, history = run_epochs(client, data, adapter, start, epochs=EPOCHS, rounds_per_epoch=3, split_every=2,
                                tiles=tiles)
    return state, history, data


def _positions(state) -> np.ndarray:
    return np.concatenate([state.chunk_local[i]["positions"] for i in sorted(state.chunk_local)])


@pytest.mark.parametrize("engine", ["lsqml", "rpie", "ad"])
def test_refinement_on_three_tiles_equals_one_tile_and_the_replicas(three_workers, one_worker, engine):
    ds, nominal = _scan()
    one, _, _ = _run(one_worker, ds, nominal, engine, tiles=True)
    three, hist, data = _run(three_workers, ds, nominal, engine, tiles=True)
    replicas, r_hist, _ = _run(three_workers, ds, nominal, engine, tiles=False)
    # the window correction resampled the object (so the halos were refreshed) in some epochs
    assert any("affine_window_rotation_deg" in h for h in hist)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    refined = _positions(three)
    np.testing.assert_array_equal(refined, _positions(one))
    scale = np.abs(replicas.object).max()
    np.testing.assert_allclose(three.object, replicas.object, rtol=0, atol=1e-3 * scale)
    np.testing.assert_allclose(refined, _positions(replicas), rtol=0, atol=1e-2)  # (px; 3.5e-3 seen)
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in r_hist], rtol=1e-4)
    # the windows moved (whether towards the truth is test_positions.py's business: here the
    # object starts flat and the run is short)
    assert np.abs(refined - data.positions_host).max() > 0.05


def test_a_window_beyond_its_tiles_halo_stops_in_one_line():
    frame = TileFrame(origin=100, shape=(400, 300))
    positions = np.array([[130.0, 50.0], [160.4, 70.0]])  # windows: rows 114..146, 144..176
    inside = frame.to_tile(positions, n=32, held_rows=80)
    np.testing.assert_array_equal(inside, positions - [100, 0])  # (whole rows: exact)
    with pytest.raises(PositionsLeftTile) as info:
        frame.to_tile(np.array([[130.0, 50.0], [170.0, 70.0]]), n=32, held_rows=80)
    assert "\n" not in str(info.value) and "tiles=False" in str(info.value)


def test_refinement_on_tiles_resumes_bit_identically(tmp_path, three_workers):
    ds, nominal = _scan()
    store = tmp_path / "data.zarr"
    daskpty.from_arrays(ds.intensities, nominal).to_zarr(store, client=three_workers)
    common = dict(client=three_workers, tiles=True, rounds_per_epoch=2, chunk_length=25, persist=True,
                  refine_positions=REFINE, check_data=False)
    whole = daskpty.reconstruct(str(store), "lsqml", 6, checkpoint=tmp_path / "a.zarr", **common)
    daskpty.reconstruct(str(store), "lsqml", 3, checkpoint=tmp_path / "b.zarr", **common)
    resumed = daskpty.reconstruct(str(store), "lsqml", 6, checkpoint=tmp_path / "b.zarr",
                                  resume=tmp_path / "b.zarr", **common)
    np.testing.assert_array_equal(resumed.object, whole.object)
    np.testing.assert_array_equal(resumed.probe, whole.probe)
    np.testing.assert_array_equal(resumed.positions, whole.positions)
    assert np.abs(whole.positions - whole.nominal_positions).max() > 0.05


@pytest.mark.parametrize("engine,kind", [("lsqml", "slices"), ("lsqml", "near field"), ("ad", "slices")])
def test_the_electron_recipe_on_three_tiles_equals_one_tile(three_workers, one_worker, engine, kind):
    """Position refinement with K slices (or the near field) and the varying probe (OPR,
    intensity factors, background) on tiles — every part at once: 3 tiles equal 1 tile bit for
    bit, and the refined positions moved."""
    from test_compose_runs import SPACING, VARYING, _electron, _near_field

    data = _electron(2, grid=6)[1] if kind == "slices" else _near_field()[2]
    extra = dict(slices=2, slice_spacing_m=SPACING) if kind == "slices" else {}
    kw = dict(engine=engine, epochs=5, rounds_per_epoch=2, chunk_length=6, persist=True, check_data=False,
              refine_positions=PositionOptions(start_epoch=1), **extra, **VARYING)
    one = daskpty.reconstruct(data, client=one_worker, tiles=True, **kw)
    three = daskpty.reconstruct(data, client=three_workers, tiles=True, **kw)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    np.testing.assert_array_equal(three.positions, one.positions)
    assert np.abs(three.positions - three.nominal_positions).max() > 0.01
