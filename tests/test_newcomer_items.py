"""What a new user meets first: the progress line's ETA, exporting a result's geometry without its
data, and the layout chosen when whole-object replicas do not fit a worker."""
from __future__ import annotations

import io


def test_eta_ignores_the_first_epochs_start_up():
    """Epoch 1 takes 10x the others (cluster, data, first graph): after it the line says ``ETA ...``,
    and from epoch 2 on the estimate is the later epochs' pace (9 epochs x 1 s), not 10x too long."""
    from daskpty.monitor.progress import ProgressPrinter

    ends = iter([0.0] + [10.0 + k for k in range(11)])  # start, then the end of epochs 1..11
    out = io.StringIO()
    printer = ProgressPrinter(11, 10, stream=out, every=1, clock=lambda: next(ends))
    for epoch in range(1, 12):
        printer(epoch, None, {"loss": 1.0, "patterns_per_second": 10.0})
    etas = [line.rsplit("ETA ", 1)[1] for line in out.getvalue().splitlines()]
    assert etas[0] == "..."
    assert etas[1:] == [f"{n} s" for n in range(9, -1, -1)]


def test_the_progress_line_names_the_amplitude_loss_during_a_poisson_warmup():
    """With LSQML's Poisson model after a 2-epoch warm-up the first two lines name the amplitude
    loss they show, the later ones the Poisson loss; without a warm-up every line names Poisson."""
    from daskpty.monitor.progress import ProgressPrinter

    def labels(warmup):
        out = io.StringIO()
        printer = ProgressPrinter(4, 10, stream=out, every=1, loss="poisson", warmup=warmup)
        for epoch in range(1, 5):
            printer(epoch, None, {"loss": 1.0, "patterns_per_second": 10.0})
        return ["amplitude" in line for line in out.getvalue().splitlines()]

    assert labels(2) == [True, True, False, False]
    assert labels(0) == [False] * 4


def test_export_without_data_writes_the_geometry_the_store_was_reconstructed_with(tmp_path, client, capsys):
    """A near-field reconstruction store records its data's geometry: ``daskpty export`` without
    ``--data`` writes the near-field geometry into CXI and HDF5 and says nothing is missing."""
    import h5py
    import numpy as np

    import daskpty
    from daskpty.cli import main
    from daskpty.physics.geometry import NearFieldGeometry
    from daskpty.physics.multislice import multislice_intensities
    from daskpty.physics.propagation import near_field_kernel
    from synthetic import smooth_object

    n, z1, z2, pixel, wavelength = 32, 3.65e-3, 1.12, 55e-6, 0.9795e-10
    rng = np.random.default_rng(0)
    obj = smooth_object(64, rng, sigma=1.5)
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = (np.exp(-(yy**2 + xx**2) / (2 * (n / 3.5) ** 2)) * 300.0)[None].astype(np.complex64)
    g = np.arange(4) * 5.0
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 4
    y = multislice_intensities(obj[None], probe, pos, detector=near_field_kernel(n, pixel, wavelength, z2, z1))
    data, recon = str(tmp_path / "nf.zarr"), str(tmp_path / "nf-recon.zarr")
    daskpty.from_arrays(y.astype(np.float32), pos, probe=probe,
                        geometry=NearFieldGeometry(n, z2, pixel, z1, wavelength_m=wavelength)).to_zarr(data)
    daskpty.reconstruct(data, client=client, epochs=1, checkpoint=recon, check_data=False)

    assert main(["export", recon, str(tmp_path / "nf.cxi")]) == 0
    assert main(["export", recon, str(tmp_path / "nf.h5")]) == 0
    assert capsys.readouterr().err == ""
    m = (z1 + z2) / z1
    with h5py.File(tmp_path / "nf.cxi", "r") as f:
        det = f["entry_1/instrument_1/detector_1"]
        assert det["propagation"][()] == b"near_field"
        assert det["focus_to_sample_distance"][()] == np.float64(z1)
        assert abs(det["magnification"][()] - m) < 1e-9 * m
        assert f["entry_1/instrument_1/source_1/wavelength"][()] == np.float64(wavelength)
        assert abs(f["entry_1/image_1/x_pixel_size"][()] - pixel / m) < 1e-9 * pixel
    with h5py.File(tmp_path / "nf.h5", "r") as f:
        assert f.attrs["detector"] == "near_field"
        assert f.attrs["detector_distance_m"] == z2 and f.attrs["focus_to_sample_m"] == z1


def _limit_between_tiles_and_replicas(shape, n, workers):
    """A worker memory limit whose pause threshold lies halfway between what one of ``workers``
    row tiles beside a short step needs and what the whole object alone needs."""
    from daskpty.execution.memory import SHORT_STEP, held_shape, state_bytes, step_bytes

    short = step_bytes(SHORT_STEP, n)
    whole, tile = state_bytes(shape), state_bytes(held_shape(shape, n, workers)) + short
    assert tile < whole
    return int((whole + tile) / 2 / 0.8)


def test_tiles_are_chosen_where_replicas_do_not_fit_and_tiles_do(tmp_path, recwarn):
    """Workers too small for the whole object but large enough for a row tile each: a run that
    chose no layout runs on tiles, with one warning line saying so, and reconstructs; an explicit
    tiles=False keeps the refusal that names tiles."""
    import dask
    import numpy as np
    import pytest
    from distributed import Client, LocalCluster

    import daskpty
    from daskpty.engines.initial import object_frame
    from synthetic import make_dataset

    n = 16
    ds = make_dataset(n=n, grid=18, step=10.0, seed=3)
    shape = object_frame(ds.positions, n)[0]
    limit = _limit_between_tiles_and_replicas(shape, n, 2)
    data = str(tmp_path / "scan.zarr")  # (read chunk by chunk: the data are not kept beside the tiles)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(data)
    off = {f"distributed.worker.memory.{k}": False for k in ("target", "spill", "pause", "terminate")}
    with dask.config.set(off), LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                            memory_limit=limit, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        with pytest.raises(ValueError, match="tiles=True"):
            daskpty.reconstruct(data, epochs=1, client=c, tiles=False, check_data=False)
        recwarn.clear()
        rec = daskpty.reconstruct(data, epochs=3, client=c, check_data=False)
    said = [str(w.message) for w in recwarn if "row tiles" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "tiles=False" in said[0]
    assert rec.options["tiles"] is True
    losses = [h["loss"] for h in rec.history]
    assert np.all(np.isfinite(np.asarray(rec.object))) and losses[-1] < losses[0]
