"""The end phase of a run at scale: the truth NRMSE on a central crop and a result store written
row of chunks by row of chunks, both within a bounded multiple of the crop / a chunk row rather than
of the object (issue 31.7; ``benchmarks/bench_end_phase.py`` measures the whole CLI at scale)."""
from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import zarr

import daskpty
from daskpty.cli.reconstruct import _nrmse_vs_truth
from daskpty.metrics import central_window, nrmse, nrmse_vs_truth
from daskpty.io.results import Reconstruction


def _truth_and_estimate(size, margin=10, seed=0):
    """A smooth complex truth (size²), and an estimate in a frame ``margin`` px larger on each side:
    the truth times a complex scale plus a little noise; positions on a raster over the truth."""
    rng = np.random.default_rng(seed)
    y, x = np.ogrid[:size, :size]
    truth = (np.exp(1j * (np.sin(y / 37.0) + np.cos(x / 23.0))) *
             (0.8 + 0.2 * np.sin((x + y) / 11.0))).astype(np.complex64)
    estimate = np.ones((size + 2 * margin,) * 2, np.complex64)
    estimate[margin:-margin, margin:-margin] = truth * np.complex64(0.5j)
    estimate[margin:-margin, margin:-margin] += (0.01 * rng.standard_normal((size, size))).astype(np.float32)
    grid = np.arange(40.0, size - 40, 30.0)
    positions = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    return truth, estimate, positions, margin


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_truth_nrmse_of_a_large_object_uses_a_central_crop_within_bounded_memory():
    """A 1200² object compared with max_side=128: the value is the NRMSE of the 128² window centred
    on the scan, and the function allocates what the crop needs (~22 crop sizes), far below the
    object (the whole-object alignment allocated ~22 object sizes)."""
    truth, estimate, positions, margin = _truth_and_estimate(1200)
    illumination = np.ones(estimate.shape, np.float32)
    ref = SimpleNamespace(object=truth, positions=positions)
    (value, window), peak = _peak_bytes(lambda: nrmse_vs_truth(
        estimate, positions + margin, illumination, ref, max_side=128, return_window=True))
    centre = 0.5 * (positions.min(axis=0) + positions.max(axis=0))
    y0, y1, x0, x1 = window
    assert (y1 - y0, x1 - x0) == (128, 128)
    assert np.allclose([(y0 + y1) / 2, (x0 + x1) / 2], centre, atol=1)
    crop = estimate[y0 + margin:y1 + margin, x0 + margin:x1 + margin]
    assert value == nrmse(crop, truth[y0:y1, x0:x1])
    assert value < 0.05
    assert peak < 0.5 * estimate.nbytes and peak < 30 * 128 * 128 * 8, (peak, estimate.nbytes)
    # below the crop size the whole frame is compared, and said so (window None)
    small = SimpleNamespace(object=truth[:100, :100], positions=positions[:1])
    whole, none = nrmse_vs_truth(estimate[:120, :120], positions[:1] + margin, illumination[:120, :120], small,
                                 max_side=128, return_window=True)
    assert none is None and whole < 0.05
    assert central_window((1000, 200), 256) == (372, 628, 0, 200)


def test_truth_nrmse_reads_only_the_crop_of_a_zarr_truth(tmp_path):
    """truth.object as a Zarr array on disk: only the compared window is read (the traced peak stays
    well below the truth's size), with the same value as from the in-memory truth."""
    truth, estimate, positions, margin = _truth_and_estimate(1000, seed=1)
    stored = zarr.create_array(str(tmp_path / "truth.zarr"), shape=truth.shape, dtype=truth.dtype,
                               chunks=(128, 128))
    stored[...] = truth
    illumination = np.ones(estimate.shape, np.float32)
    lazy = SimpleNamespace(object=zarr.open_array(str(tmp_path / "truth.zarr"), mode="r"), positions=positions)
    value, peak = _peak_bytes(lambda: nrmse_vs_truth(estimate, positions + margin, illumination, lazy,
                                                     max_side=128))
    in_memory = nrmse_vs_truth(estimate, positions + margin, illumination,
                               SimpleNamespace(object=truth, positions=positions), max_side=128)
    assert value == in_memory
    assert peak < truth.nbytes / 2, (peak, truth.nbytes)


def test_cli_nrmse_line_names_the_crop(tmp_path):
    """The reconstruct command's NRMSE text, on a real data-set store with truth/: a crop is named
    in the line ("central 128² crop"); an object within the limit gets no note."""
    truth, estimate, positions, margin = _truth_and_estimate(400, seed=2)
    n = 16
    intensities = np.ones((len(positions), n, n), np.float32)
    store = tmp_path / "data.zarr"
    daskpty.from_arrays(intensities, positions, truth={"object": truth, "positions": positions}
                        ).to_zarr(str(store))
    data = daskpty.open_data(str(store))
    rec = Reconstruction(object=estimate, probe=np.ones((1, n, n), np.complex64), positions=positions + margin,
                         origin=np.full(2, float(margin)), illumination=np.ones(estimate.shape, np.float32))
    cropped = _nrmse_vs_truth(rec, data, max_side=128)
    expected = nrmse_vs_truth(estimate, positions + margin, rec.illumination,
                              SimpleNamespace(object=truth, positions=positions), max_side=128)
    assert cropped == f", object NRMSE vs truth {expected:.4f} (central 128² crop)"
    whole = _nrmse_vs_truth(rec, data, max_side=1024)
    assert whole.startswith(", object NRMSE vs truth ") and "crop" not in whole


def test_result_store_is_written_one_row_of_chunks_at_a_time(tmp_path):
    """An 8192 × 1024 complex64 object (64 MiB, eight rows of 1024² chunks): to_zarr allocates a
    few rows' worth, well under the object's size (writing it whole made zarr copy all of it,
    1.2 object sizes), and reads back equal."""
    rng = np.random.default_rng(3)
    obj = (rng.standard_normal((8192, 1024), np.float32) + 1j).astype(np.complex64)
    rec = Reconstruction(object=obj, probe=np.ones((1, 8, 8), np.complex64), positions=np.zeros((4, 2)),
                         origin=np.zeros(2), illumination=np.abs(obj))
    path = str(tmp_path / "rec.zarr")
    _, peak = _peak_bytes(lambda: rec.to_zarr(path))
    row = obj.nbytes // 8
    assert peak < 4 * row, (peak, row)
    back = Reconstruction.from_zarr(path)
    assert np.array_equal(back.object, obj) and np.array_equal(back.illumination, rec.illumination)


def _carry(size):
    from daskpty.execution.epoch_graph import EpochCarry

    rng = np.random.default_rng(4)
    state = SimpleNamespace(object=(rng.standard_normal((size, size)) + 1j).astype(np.complex64),
                            illumination=rng.random((size, size), np.float32),
                            probe=np.ones((1, 8, 8), np.complex64), epoch=3, velocity=None)
    return EpochCarry(state=state, scalars={"loss": 1.0})


def test_state_is_fetched_with_its_large_arrays_in_row_blocks(client):
    """fetch_state (EpochState.get's path for host states): arrays above the limit arrive in row
    blocks into one client array, equal to the worker's; small ones and other attributes as they are."""
    from daskpty.execution.fetch import _big_arrays, fetch_state

    future = client.submit(_carry, 300, pure=False)
    expected = future.result().state
    assert set(client.submit(_big_arrays, future, 100_000, pure=False).result()) == {"object", "illumination"}
    state = fetch_state(future, limit=100_000)  # 300² complex64 = 720 kB: 8 blocks of 41 rows
    assert np.array_equal(state.object, expected.object) and state.object.flags.writeable
    assert np.array_equal(state.illumination, expected.illumination)
    assert np.array_equal(state.probe, expected.probe) and state.epoch == 3 and state.velocity is None
    assert future.result().state.object is not None  # the worker's state is left whole
