"""Issue 14 wiring: multislice and near field through ``reconstruct``, the stores, the CLI, results.

Small simulated 2-slice electron data (daskpty.simulate.multislice: 300 kV, 0.25 Å pixels, slices
2 nm apart) on the shared test cluster: each slice recovered far better than a 1-slice fit of the
same data (LSQML and AD), 1 vs 2 workers identical, resume bit-identical, (K, H, W) result store;
near field through a store with ``detector="near_field"``; bad input one line (CLI exit 2).
"""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty import metrics
from daskpty.cli import main
from daskpty.simulate.multislice import simulate_multislice

SPACING = 2e-9


@pytest.fixture(scope="module")
def two_slices():
    ds = simulate_multislice(n_slices=2, noise=True, seed=2)
    g = ds.geometry
    data = daskpty.from_arrays(ds.intensities.astype(np.float32), ds.positions, wavelength_m=g.wavelength_m,
                               object_pixel_size_m=g.pixel_size_m, electron_voltage_v=300e3,
                               convergence_semiangle_rad=25e-3)
    return ds, data


def _run(data, client, **kw):
    kw.setdefault("epochs", 25)
    kw.setdefault("probe", "aperture")
    kw.setdefault("sample", {"aperture": {"defocus_m": 6e-9}})
    return daskpty.reconstruct(data, client=client, check_data=False, **kw)


def _phase_nrmse(estimate, truth, mask):
    """Phase NRMSE after alignment (shift, ramp, complex scale): ‖Δφ‖ / ‖φ − mean φ‖ on the mask."""
    a = metrics.align(estimate, truth, mask=mask)
    pa, pt = np.angle(a), np.angle(truth)
    pa, pt = pa - pa[mask].mean(), pt - pt[mask].mean()
    return float(np.sqrt(((pa - pt)[mask] ** 2).sum() / (pt[mask] ** 2).sum()))


def _in_truth_frame(array, origin, shape):
    y, x = (int(round(v)) for v in origin)
    return array[..., y:y + shape[0], x:x + shape[1]]


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
@pytest.mark.slow
def test_each_slice_recovered_far_better_than_a_one_slice_fit(two_slices, client, engine):
    ds, data = two_slices
    multi = _run(data, client, engine=engine, slices=2, slice_spacing_m=SPACING)
    single = _run(data, client, engine=engine)
    assert multi.object.shape[0] == 2 and multi.object.ndim == 3 and single.object.ndim == 2
    assert multi.illumination.shape == multi.object.shape
    assert multi.options["sample"]["slices"] == 2 and "sample" not in single.options
    shape = ds.truth.slices.shape[1:]
    ms_obj = _in_truth_frame(multi.object, multi.origin, shape)
    one = _in_truth_frame(single.object, single.origin, shape)
    illum = _in_truth_frame(multi.illumination[0], multi.origin, shape)
    lit = illum > 0.3 * illum.max()
    err_multi = [_phase_nrmse(ms_obj[k], ds.truth.slices[k], lit) for k in range(2)]
    err_single = [_phase_nrmse(one, ds.truth.slices[k], lit) for k in range(2)]
    print(f"{engine}: per-slice phase NRMSE 2 slices {np.round(err_multi, 3)} vs 1 slice "
          f"{np.round(err_single, 3)}; loss {multi.history[-1]['loss']:.4g} vs {single.history[-1]['loss']:.4g}")
    assert max(err_multi) < 0.2
    assert max(err_multi) < 0.4 * min(err_single)
    assert multi.history[-1]["loss"] < 0.5 * single.history[-1]["loss"]


def test_one_and_two_workers_identical_and_resume_bit_identical(two_slices, client, tmp_path):
    from distributed import Client, LocalCluster

    _, data = two_slices
    kw = dict(slices=2, slice_spacing_m=SPACING, epochs=6, rounds_per_epoch=2, chunk_length=25)
    two = _run(data, client, **kw)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as one_client:
        one = _run(data, one_client, **kw)
    assert np.array_equal(one.object, two.object) and np.array_equal(one.probe, two.probe)

    # resume: 3 epochs to a checkpoint, then 3 more from it == 6 at once, bit for bit
    first = _run(data, client, **{**kw, "epochs": 3}, checkpoint=str(tmp_path / "ck.zarr"))
    stored = daskpty.Reconstruction.from_zarr(str(tmp_path / "ck.zarr"))
    assert stored.object.shape == first.object.shape == (2,) + first.object.shape[1:]
    assert stored.illumination.shape == stored.object.shape and "velocity" in stored.engine_state
    resumed = _run(data, client, **kw, resume=str(tmp_path / "ck.zarr"))
    assert resumed.epochs == 6
    assert np.array_equal(resumed.object, two.object) and np.array_equal(resumed.probe, two.probe)
    with pytest.raises(ValueError, match="2 object slice"):
        _run(data, client, epochs=6, resume=str(tmp_path / "ck.zarr"))


def test_one_slice_far_field_keeps_the_single_slice_path(two_slices, client):
    """K = 1 in the far field: the 2-D adapter, the 2-D object and the same numbers as before."""
    from daskpty.engines.forward_model import THIN
    from daskpty.execution.parts import sample_model
    from daskpty.options import SampleOptions

    _, data = two_slices
    thin = SampleOptions().resolve(data.metadata, 32)
    assert not thin.multislice and thin.working_factor == 1.0 and sample_model(thin) is THIN
    a = daskpty.reconstruct(data, client=client, epochs=3, check_data=False)
    b = daskpty.reconstruct(data, client=client, epochs=3, check_data=False, slices=1)
    assert a.object.shape == b.object.shape and a.object.ndim == 2
    assert np.array_equal(a.object, b.object) and a.options == b.options


def test_near_field_store_reconstructs(client, tmp_path):
    """A near-field data set (metadata detector="near_field"): holograms as recorded, no shift."""
    from scipy.ndimage import gaussian_filter

    from daskpty.physics.geometry import NearFieldGeometry
    from daskpty.physics.multislice import multislice_intensities
    from daskpty.physics.propagation import near_field_kernel
    from synthetic import smooth_object

    rng = np.random.default_rng(0)
    n = 48
    geometry = NearFieldGeometry(n, 1.12, 55e-6, 3.65e-3, wavelength_m=0.9795e-10)
    detector = near_field_kernel(n, 55e-6, 0.9795e-10, 1.12, 3.65e-3)
    obj = smooth_object(96, rng, sigma=1.5)
    phase = gaussian_filter(rng.standard_normal((n, n)), 3)
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = np.exp(3j * phase / np.abs(phase).max()) * np.exp(-(yy**2 + xx**2) / (2 * (n / 3.5) ** 2))
    probe = (probe * np.sqrt(1e5 / (np.abs(probe) ** 2).sum()))[None].astype(np.complex64)
    g = np.arange(6) * 7.0
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 6 + rng.uniform(-1, 1, (36, 2))
    y = multislice_intensities(obj[None], probe, pos, detector=detector).astype(np.float32)
    data = daskpty.from_arrays(y, pos, probe=probe, geometry=geometry).to_zarr(str(tmp_path / "nf.zarr"))
    assert data.metadata["detector"] == "near_field"
    assert data.metadata["object_pixel_size_m"] == pytest.approx(geometry.object_pixel_size_m)
    rec = daskpty.reconstruct(str(tmp_path / "nf.zarr"), client=client, epochs=60, momentum=0.0,
                              probe_start_epoch=5, rounds_per_epoch=1, check_data=False)
    assert rec.object.ndim == 2 and rec.options["sample"]["slices"] == 1
    est = _in_truth_frame(rec.object, rec.origin, obj.shape)
    illum = _in_truth_frame(rec.illumination, rec.origin, obj.shape)
    lit = illum > 0.3 * illum.max()
    err, start = metrics.nrmse(est, obj, mask=lit), metrics.nrmse(np.ones_like(obj), obj, mask=lit)
    print(f"near field via reconstruct: NRMSE {err:.3f} (flat start {start:.3f})")
    assert err < 0.15 and err < 0.6 * start


def test_metadata_geometry_keys_and_errors():
    from daskpty.io.validate import DataError

    y, pos = np.ones((4, 16, 16), np.float32), np.random.default_rng(0).random((4, 2)) * 3 + 8
    meta = daskpty.from_arrays(y, pos, electron_voltage_v=300e3, reciprocal_pixel_rad=2e-3).metadata
    lam = meta["wavelength_m"]
    assert lam == pytest.approx(1.9687e-12, rel=1e-4)
    assert meta["object_pixel_size_m"] == pytest.approx(lam / (16 * 2e-3))
    assert "detector" not in daskpty.from_arrays(y, pos).metadata  # absent = far field
    with pytest.raises(DataError, match="300 kV is 300000"):
        daskpty.from_arrays(y, pos, electron_voltage_v=300)
    with pytest.raises(DataError, match="detector"):
        daskpty.from_arrays(y, pos, detector="nearfield")


@pytest.mark.parametrize("kwargs, match", [
    (dict(slices=2), "slice spacing"),
    (dict(slices=2, slice_spacing_m=-1e-9), "slice spacing must be positive"),
    (dict(slices=2, slice_spacing_m=0.0), "slice spacing must be positive"),
    (dict(slices=0), "slices must be an integer"),
])
def test_bad_sample_options_one_line(two_slices, client, kwargs, match):
    _, data = two_slices
    with pytest.raises(ValueError, match=match) as info:
        daskpty.reconstruct(data, client=client, epochs=1, check_data=False, **kwargs)
    assert "\n" not in str(info.value)


def test_multislice_without_geometry_one_line(client):
    y, pos = np.ones((9, 16, 16), np.float32), np.stack(np.meshgrid(np.arange(3.0), np.arange(3.0)), -1).reshape(-1, 2) * 3 + 8
    with pytest.raises(ValueError, match="needs the wavelength"):
        daskpty.reconstruct(daskpty.from_arrays(y, pos), client=client, epochs=1, slices=2, slice_spacing_m=1e-9)
    with pytest.raises(ValueError, match="object pixel size"):
        daskpty.reconstruct(daskpty.from_arrays(y, pos, wavelength_m=1e-10), client=client, epochs=1, slices=2,
                            slice_spacing_m=1e-9)


@pytest.fixture(scope="module")
def store_without_geometry(tmp_path_factory):
    path = tmp_path_factory.mktemp("ms") / "plain.zarr"
    y = np.ones((9, 16, 16), np.float32)
    pos = np.stack(np.meshgrid(np.arange(3.0), np.arange(3.0)), -1).reshape(-1, 2) * 3 + 8
    daskpty.from_arrays(y, pos).to_zarr(str(path))
    return str(path)


@pytest.mark.parametrize("flags, match", [
    (["--slices", "2", "--slice-spacing", "1e-9"], "needs the wavelength"),
    (["--slices", "2"], "slice spacing"),
    (["--slices", "2", "--slice-spacing=-2e-9"], "slice spacing must be positive"),
])
def test_cli_bad_input_exit_2(store_without_geometry, tmp_path, capsys, flags, match):
    code = main(["reconstruct", store_without_geometry, "-o", str(tmp_path / "r.zarr"), "--epochs", "1",
                 "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.zarr").exists()


def test_cli_import_electron_voltage_out_of_range(tmp_path, capsys):
    np.save(tmp_path / "f.npy", np.ones((4, 16, 16), np.float32))
    np.save(tmp_path / "p.npy", np.arange(8.0).reshape(4, 2))
    code = main(["import", str(tmp_path / "f.npy"), "--positions", str(tmp_path / "p.npy"), "--units", "px",
                 "-o", str(tmp_path / "d.zarr"), "--radiation", "electron", "--energy", "300", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "300 keV is 300000" in err and len(err.strip().splitlines()) == 1


def test_chunk_and_rounds_rules_count_the_slices():
    from daskpty.execution.data import auto_rounds, default_chunk_length
    from daskpty.options import SampleOptions

    meta = {"wavelength_m": 2e-12, "object_pixel_size_m": 2.5e-11}
    factor = SampleOptions(slices=4, slice_spacing_m=1e-9).resolve(meta, 128).working_factor
    assert factor == pytest.approx(4.0)  # (2K + 4) / 3
    budget = 512 * 2**20
    assert default_chunk_length(262144, 128, memory_budget=budget) == 409
    assert default_chunk_length(262144, 128, memory_budget=budget, working_factor=factor) == 102
    assert auto_rounds(2000, 64, working_factor=factor) > auto_rounds(2000, 64)
    # several slices: compact LSQML (minibatches walk along the slices' shared low frequencies)
    assert auto_rounds(2000, 64, working_factor=factor, slices=4) == 1 < auto_rounds(2000, 64, slices=1)


def test_auto_rounds_with_slices_runs_compact_lsqml(client):
    ds = simulate_multislice(n_slices=2, grid=24, seed=2)  # 576 patterns: 3 rounds with one slice
    g = ds.geometry
    data = daskpty.from_arrays(ds.intensities.astype(np.float32), ds.positions, wavelength_m=g.wavelength_m,
                               object_pixel_size_m=g.pixel_size_m, electron_voltage_v=300e3,
                               convergence_semiangle_rad=25e-3)
    multi = _run(data, client, epochs=1, slices=2, slice_spacing_m=SPACING)
    single = _run(data, client, epochs=1)
    assert multi.options["rounds_per_epoch"] == 1 and single.options["rounds_per_epoch"] == 3


def test_show_draws_each_slice(two_slices, client, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _, data = two_slices
    _run(data, client, epochs=2, slices=2, slice_spacing_m=SPACING, checkpoint=str(tmp_path / "r.zarr"))
    assert main(["show", str(tmp_path / "r.zarr"), "-o", str(tmp_path / "r.png")]) == 0
    from daskpty.monitor.plot import summary_panels

    names = summary_panels(1, False, False, n_slices=2)
    assert names[:4] == ["object phase", "object amplitude", "slice 1 phase", "slice 2 phase"]
    assert summary_panels(1, False) == summary_panels(1, False, n_slices=1)  # K = 1: the figure as before


def test_low_dose_counts_through_slices_run_without_momentum(client):
    """reconstruct reads the dose from the data: 2-slice counting data at ~15 counts per pixel
    run LSQML's defaults as momentum 0, δ 0.1 (bit-identical to those given) and AD's as
    momentum 0; the same intensities scaled to non-integers (not counts) run as momentum 0.5,
    δ 0.5 (AD: 0.8)."""
    ds = simulate_multislice(n_slices=2, noise=True, photons=1.5e4, grid=6, seed=3)
    g = ds.geometry

    def data(scale):
        return daskpty.from_arrays((ds.intensities * scale).astype(np.float32), ds.positions,
                                   wavelength_m=g.wavelength_m, object_pixel_size_m=g.pixel_size_m,
                                   electron_voltage_v=300e3, convergence_semiangle_rad=25e-3)

    def run(d, **kw):
        return _run(d, client, engine="lsqml", epochs=3, slices=2, slice_spacing_m=SPACING, **kw).object

    counts, scaled = data(1.0), data(1.37)
    stored = _run(counts, client, engine="lsqml", epochs=1, slices=2, slice_spacing_m=SPACING).options
    assert (stored["momentum"], stored["delta"]) == (0.0, 0.1)     # the result says what ran
    np.testing.assert_array_equal(run(counts), run(counts, momentum=0.0, delta=0.1))
    assert not np.array_equal(run(counts), run(counts, momentum=0.5, delta=0.5))
    np.testing.assert_array_equal(run(scaled), run(scaled, momentum=0.5, delta=0.5))

    def ad(d, **kw):
        return _run(d, client, engine="ad", epochs=3, slices=2, slice_spacing_m=SPACING, **kw).object

    np.testing.assert_array_equal(ad(counts), ad(counts, momentum=0.0))
    np.testing.assert_array_equal(ad(scaled), ad(scaled, momentum=0.8))
    assert not np.array_equal(ad(counts), ad(counts, momentum=0.8))


def test_poisson_through_slices_switches_from_the_gaussian_model_after_the_warmup(client):
    """noise="poisson" through 2 slices: the amplitude model for NOISE_WARMUP epochs (the losses of
    an amplitude-only run), then the Poisson one (bit-identical to the warm-up given, stored with
    the result), unlike Poisson from the first epoch."""
    from daskpty.engines.lsqml import NOISE_WARMUP

    ds = simulate_multislice(n_slices=2, noise=True, photons=1.5e4, grid=6, seed=4)
    g = ds.geometry
    counts = daskpty.from_arrays(ds.intensities.astype(np.float32), ds.positions, wavelength_m=g.wavelength_m,
                                 object_pixel_size_m=g.pixel_size_m, electron_voltage_v=300e3,
                                 convergence_semiangle_rad=25e-3)

    def run(**kw):
        kw.setdefault("noise", "poisson")
        return _run(counts, client, engine="lsqml", epochs=NOISE_WARMUP + 2, slices=2, slice_spacing_m=SPACING, **kw)

    rec = run()
    assert rec.options["noise_warmup"] == NOISE_WARMUP
    losses = [h["loss"] for h in rec.history]
    amplitude = [h["loss"] for h in run(noise="gaussian").history]
    assert losses[:NOISE_WARMUP] == amplitude[:NOISE_WARMUP]
    assert all(abs(a - b) > 1e-3 * a for a, b in zip(losses[NOISE_WARMUP:], amplitude[NOISE_WARMUP:]))
    np.testing.assert_array_equal(rec.object, run(noise_warmup=NOISE_WARMUP).object)
    assert not np.array_equal(rec.object, run(noise_warmup=0).object)


def test_info_shows_the_settings_a_low_dose_run_resolved(tmp_path, use_client, capsys):
    """``daskpty info`` on a reconstruction lists the engine's settings as the run resolved
    them: a low-dose electron scan through 3 slices ran LSQML with momentum 0 and δ 0.1."""
    data, out = tmp_path / "e.zarr", tmp_path / "r.zarr"
    assert main(["simulate", str(data), "--preset", "electron", "--grid", "5x5", "--dose", "2e4", "--quiet"]) == 0
    assert main(["reconstruct", str(data), "-o", str(out), "--slices", "3", "--slice-spacing", "2e-9",
                 "--epochs", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    settings = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("settings"))
    assert "momentum=0.0" in settings and "delta=0.1" in settings and "beta=0.9" in settings
