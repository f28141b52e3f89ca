"""Following a live scan with every engine and part: LSQML, AD and rPIE through two slices, with
refined positions, a varying probe and on tiles.

A two-slice electron scan (:func:`~daskpty.simulate.multislice.simulate_multislice`, known
slices) is written block by block through :class:`daskpty.ScanWriter` and ended; the follower
takes it in cycles set by frames (``snapshot_frames``), so each cycle runs on more frames
than the last. Each run must use every frame, grow its snapshots and fall in loss.
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.io.results import Reconstruction
from daskpty.simulate.multislice import simulate_multislice

SPACING, MIN, STEP, PER_CYCLE, EPOCHS = 2e-9, 40, 30, 2, 4   # cycles on 40, 70, 100 frames


@pytest.fixture(scope="module")
def live_scan(tmp_path_factory):
    ds = simulate_multislice(n_slices=2, noise=True, seed=3)              # 10 x 10 positions of 32²
    g = ds.geometry
    path = tmp_path_factory.mktemp("live") / "scan.zarr"
    writer = daskpty.ScanWriter(path, pattern_shape=ds.intensities.shape[1:], dtype="uint32",
                                planned_frames=len(ds.positions), chunk_bytes=10 * 32 * 32 * 4,
                                wavelength_m=g.wavelength_m, object_pixel_size_m=g.pixel_size_m,
                                electron_voltage_v=300e3, convergence_semiangle_rad=25e-3)
    for start in range(0, len(ds.positions), 10):
        writer.append(np.rint(ds.intensities[start:start + 10]).astype(np.uint32), ds.positions[start:start + 10])
    writer.close()
    return path, len(ds.positions)


def positions_of(path):
    return np.asarray(daskpty.open_data(path).positions)


CASES = {
    "lsqml, positions": dict(engine="lsqml", refine_positions=True),
    "ad, varying probe": dict(engine="ad", opr_modes=2, probe_model={"start_epoch": 3}),
    "rpie": dict(engine="rpie"),
    "lsqml, tiles": dict(engine="lsqml", execution={"tiles": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_engine_and_part_follows_a_live_scan(live_scan, client, tmp_path, case):
    from daskpty.workflows import follow

    path, n_frames = live_scan
    seen = []
    rec = follow(path, tmp_path / "r.zarr", EPOCHS, min_frames=MIN, snapshot_frames=STEP, snapshot_epochs=PER_CYCLE,
                 client=client, slices=2, slice_spacing_m=SPACING, probe="aperture",
                 sample={"aperture": {"defocus_m": 6e-9}}, check_data=False, progress=False,
                 on_snapshot=lambda r: seen.append(r.live["frames_used"]), **CASES[case])
    stored = Reconstruction.from_zarr(tmp_path / "r.zarr")
    assert seen[:3] == [40, 70, 100], seen
    assert stored.live["frames_used"] == n_frames and stored.epochs == 3 * PER_CYCLE + EPOCHS
    assert rec.object.shape[0] == 2                                         # both slices kept
    losses = [h["loss"] / h.get("n", 1) for h in stored.history]
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[PER_CYCLE], losses
    if "opr_modes" in CASES[case]:          # every pattern's weights, fitted (not the start's)
        weights = stored.probe_weights
        assert weights.shape == (n_frames, 2) and np.ptp(weights[:, 1]) > 0, weights
    if "refine_positions" in CASES[case]:
        assert stored.positions.shape == (n_frames, 2) and np.abs(stored.positions - positions_of(path)).max() > 0
