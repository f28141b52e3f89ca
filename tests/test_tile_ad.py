"""The AD engine on tiles (issue 34): the optimiser's step per tile, its whole-object numbers
(the preconditioner's largest illumination, Adam's lit mean, the scale) as shares of every tile.

W tiles equal 1 tile, and the replicated graph to float32 rounding; a run through
``reconstruct`` resumes bit-identically; the CG optimiser is refused in one line.
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.engines import ad
from daskpty.engines.probe_model import ProbeModelOptions
from daskpty.execution.engine_registry import engine_spec
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from daskpty.execution.tile_graph import TilesUnsupported, crop_state, stitch_states
from synthetic import make_dataset

ADAdapter = engine_spec("ad").adapter


def _run(client, ds, options, tiles: bool, model=None, epochs=4, rounds=3):
    with client.as_current():
        data = prepare_data(client, ds.intensities, ds.positions, chunk_length=24, persist=True, row_bands=True)
    adapter = ADAdapter(options, probe_model=model)
    start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    return run_epochs(client, data, adapter, start, epochs=epochs, rounds_per_epoch=rounds, split_every=2,
                      tiles=tiles)


VARYING = ProbeModelOptions(opr_modes=2, fit_intensity=True, start_epoch=1)
CASES = {
    "adam": (ad.ADOptions(optimizer="adam", loss="gaussian", normalize_every=2), None),
    "sgd": (ad.ADOptions(optimizer="sgd", momentum=0.5, normalize_every=1), None),
    "adam OPR": (ad.ADOptions(optimizer="adam", loss="gaussian"), VARYING),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_three_tiles_equal_one_tile_and_the_replicas(three_workers, one_worker, case):
    options, model = CASES[case]
    ds = make_dataset(grid=12, seed=5)
    one, _ = _run(one_worker, ds, options, tiles=True, model=model)
    three, hist = _run(three_workers, ds, options, tiles=True, model=model)
    replicas, r_hist = _run(three_workers, ds, options, tiles=False, model=model)
    np.testing.assert_array_equal(three.object, one.object)
    np.testing.assert_array_equal(three.probe, one.probe)
    for key, value in three.optimizer.arrays.items():  # the optimiser's memory, stitched back
        np.testing.assert_array_equal(value, one.optimizer.arrays[key], err_msg=key)
        np.testing.assert_allclose(value, replicas.optimizer.arrays[key], rtol=2e-3, atol=1e-5 * abs(value).max(),
                                   err_msg=key)
    scale = np.abs(replicas.object).max()
    np.testing.assert_allclose(three.object, replicas.object, rtol=0, atol=2e-4 * scale)
    np.testing.assert_allclose(three.probe, replicas.probe, rtol=0, atol=2e-4 * np.abs(replicas.probe).max())
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in r_hist], rtol=1e-5)
    assert all(h["exchanged_bytes_per_round"] < r["exchanged_bytes_per_round"] for h, r in zip(hist[1:], r_hist[1:]))


def test_the_optimisers_memory_is_cut_and_stitched_with_the_object():
    state = ad.ADState(np.arange(60, dtype=np.complex64).reshape(6, 10), np.ones((1, 4, 4), np.complex64))
    state.optimizer.set("m", "object", np.arange(60, dtype=np.complex64).reshape(6, 10) * 2)
    state.optimizer.set("m", "probe", np.ones((1, 4, 4), np.complex64))
    state.optimizer.scalars["t/object"] = 3.0
    parts = [crop_state(state, ADAdapter.tile_fields, a, b) for a, b in ((0, 2), (2, 5), (5, 6))]
    assert parts[1].optimizer.get("m", "object").shape == (3, 10)
    back = stitch_states(parts, ADAdapter.tile_fields)
    np.testing.assert_array_equal(back.optimizer.get("m", "object"), state.optimizer.get("m", "object"))
    np.testing.assert_array_equal(back.optimizer.get("m", "probe"), state.optimizer.get("m", "probe"))
    assert back.optimizer.scalars == {"t/object": 3.0}


@pytest.mark.slow
def test_ad_on_tiles_resumes_bit_identically_through_reconstruct(tmp_path, three_workers):
    ds = make_dataset(grid=10, seed=2)
    settings = dict(engine="ad", client=three_workers, tiles=True, persist=True, optimizer="adam",
                    rounds_per_epoch=2, seed=0)
    whole = daskpty.reconstruct(ds, epochs=4, **settings)
    daskpty.reconstruct(ds, epochs=2, checkpoint=tmp_path / "ck.zarr", **settings)
    resumed = daskpty.reconstruct(ds, epochs=4, checkpoint=tmp_path / "ck.zarr", resume=tmp_path / "ck.zarr",
                                  **settings)
    np.testing.assert_array_equal(resumed.object, whole.object)
    np.testing.assert_array_equal(resumed.probe, whole.probe)
    assert [h["epoch"] for h in resumed.history] == [1, 2, 3, 4]


def test_the_cg_optimiser_is_refused_on_tiles_in_one_line(one_worker):
    ds = make_dataset(grid=6, seed=1)
    with pytest.raises(TilesUnsupported, match="CG optimiser") as info:
        daskpty.reconstruct(ds, "ad", 1, client=one_worker, tiles=True, persist=True, optimizer="cg")
    assert "\n" not in str(info.value) and "tiles=False" in str(info.value)
