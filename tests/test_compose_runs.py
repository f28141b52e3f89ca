"""Issue 33 through ``reconstruct``: every combination of the forward model's parts runs in LSQML
and AD — {1 slice, 2 slices, near field} × {fixed, refined positions} × {constant probe, OPR +
intensity factors + background} × {1, 2 modes} — and each part earns its keep against ground
truth on data that needs it (refinement beats the nominal positions through slices and in the
near field; intensity factors beat a constant probe on a flickering beam through slices); the
fullest combination gives on 2 workers what 1 gives and resumes bit for bit."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

import daskpty
from daskpty import metrics
from daskpty.physics.geometry import NearFieldGeometry
from daskpty.physics.multislice import multislice_intensities
from daskpty.physics.propagation import near_field_kernel
from daskpty.simulate.multislice import simulate_multislice

SPACING = 2e-9
VARYING = dict(opr_modes=2, fit_intensity=True, background="constant", probe_model={"start_epoch": 0})


def _electron(n_slices, *, grid=6, flicker=0.0, error=0.6, seed=4):
    """A small electron scan through ``n_slices`` weak-phase slices; nominal positions off by
    ``error`` px rms; each pattern's flux times (1 ± ``flicker``)."""
    ds = simulate_multislice(n=32, n_slices=n_slices, grid=grid, step=3.0, noise=True, photons=1e6, seed=seed)
    rng = np.random.default_rng(seed + 1)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))   # as recorded: DC at the centre
    y = np.fft.fftshift(y, axes=(-2, -1)) * (1 + flicker * rng.uniform(-1, 1, len(y)))[:, None, None]
    nominal = ds.positions + error * rng.standard_normal(ds.positions.shape)
    g = ds.geometry
    data = daskpty.from_arrays(y.astype(np.float32), nominal, wavelength_m=g.wavelength_m,
                               object_pixel_size_m=g.pixel_size_m, electron_voltage_v=300e3,
                               convergence_semiangle_rad=25e-3)
    return ds, data, nominal


def _near_field(error=0.8, seed=0):
    rng = np.random.default_rng(seed)
    n = 32
    geometry = NearFieldGeometry(n, 1.12, 55e-6, 3.65e-3, wavelength_m=0.9795e-10)
    detector = near_field_kernel(n, 55e-6, 0.9795e-10, 1.12, 3.65e-3)
    obj = np.exp(1j * gaussian_filter(rng.standard_normal((72, 72)), 1.5) * 4).astype(np.complex64)
    phase = gaussian_filter(rng.standard_normal((n, n)), 3)
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = np.exp(3j * phase / np.abs(phase).max()) * np.exp(-(yy**2 + xx**2) / (2 * (n / 3.5) ** 2))
    probe = (probe * np.sqrt(1e5 / (np.abs(probe) ** 2).sum()))[None].astype(np.complex64)
    g = np.arange(6) * 6.0
    true = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 4 + rng.uniform(-1, 1, (36, 2))
    y = rng.poisson(multislice_intensities(obj[None], probe, true, detector=detector)).astype(np.float32)
    nominal = true + error * rng.standard_normal(true.shape)
    data = daskpty.from_arrays(y, nominal, probe=probe, geometry=geometry)
    return obj, true, data, nominal


@pytest.fixture(scope="module")
def sets():
    return {"one": _electron(1, grid=5), "slices": _electron(2, grid=5), "near": _near_field()}


def _sample(kind):
    return dict(slices=2, slice_spacing_m=SPACING) if kind == "slices" else {}


def _run(data, client, **kw):
    kw.setdefault("check_data", False)
    kw.setdefault("progress", False)
    if "wavelength_m" in (data.metadata or {}) and "electron_voltage_v" in data.metadata:
        kw.setdefault("probe", "aperture")
        kw.setdefault("sample", {"aperture": {"defocus_m": 6e-9}})
    return daskpty.reconstruct(data, client=client, **kw)


def _position_rms(positions, true):
    d = positions - true
    return float(np.sqrt(((d - d.mean(axis=0)) ** 2).sum(axis=1).mean()))


COMBINATIONS = list(itertools.product(["lsqml", "ad"], ["one", "slices", "near"], [False, True], [False, True],
                                      [1, 2]))


@pytest.mark.slow
@pytest.mark.parametrize("engine, kind, refine, varying, modes", COMBINATIONS)
def test_every_combination_runs(sets, client, engine, kind, refine, varying, modes):
    """Nothing is refused: each combination runs 3 epochs, lowers its loss, stays finite and
    each asked-for part takes effect (slices kept, positions moved, weights and factors fitted)."""
    data = sets[kind][1] if kind != "near" else sets[kind][2]
    extra = dict(optimizer="adam") if engine == "ad" else {}
    positions = dict(start_epoch=0) if refine else None
    rec = _run(data, client, engine=engine, epochs=3, probe_modes=modes, refine_positions=positions,
               **(VARYING if varying else {}), **_sample(kind), **extra)
    losses = [h["loss"] for h in rec.history]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert np.isfinite(rec.object).all() and np.isfinite(rec.probe).all()
    assert rec.object.ndim == (3 if kind == "slices" else 2) and rec.probe.shape[0] == modes
    if refine:
        assert rec.nominal_positions is not None
        assert 0 < float(np.abs(rec.positions - rec.nominal_positions).max()) < 4
    else:
        assert rec.nominal_positions is None
    if varying:
        assert rec.probe_weights is not None and np.isfinite(rec.probe_weights).all()
        assert rec.intensity_scale is not None and np.ptp(rec.intensity_scale) > 0
        assert rec.background is not None


def _slice_nrmse(rec, ds):
    """Mean over the slices of the NRMSE against the true slices (aligned, lit region)."""
    truth = ds.truth.slices
    y, x = (int(round(v)) for v in rec.origin)
    h, w = truth.shape[1:]
    est = rec.object[:, y:y + h, x:x + w]
    illum = rec.illumination[0, y:y + h, x:x + w]
    lit = illum > 0.3 * illum.max()
    return float(np.mean([metrics.nrmse(metrics.align(e, t, mask=lit), t, mask=lit) for e, t in zip(est, truth)]))


@pytest.fixture(scope="module")
def thick():
    return _electron(2, grid=7, error=0.7, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lsqml", "ad"])
def test_refinement_through_slices_beats_the_nominal_positions(thick, client, engine):
    ds, data, nominal = thick
    extra = dict(optimizer="adam") if engine == "ad" else {}
    kw = dict(engine=engine, epochs=25, slices=2, slice_spacing_m=SPACING, **extra)
    fixed = _run(data, client, **kw)
    refined = _run(data, client, refine_positions={"start_epoch": 3}, **kw)
    true = ds.truth.positions + refined.origin
    before, after = _position_rms(refined.nominal_positions, true), _position_rms(refined.positions, true)
    err_fixed, err_refined = _slice_nrmse(fixed, ds), _slice_nrmse(refined, ds)
    print(f"{engine} 2 slices: positions {before:.3f} -> {after:.3f} px rms; slice NRMSE fixed {err_fixed:.3f}, "
          f"refined {err_refined:.3f}")
    assert after < 0.7 * before
    assert err_refined < err_fixed


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lsqml", "rpie", "ad"])
def test_kept_carried_sums_refine_as_well_as_carrying_them_every_epoch(thick, client, engine, monkeypatch):
    """The sums carried through the slices (shift denominators' ratios, the windows' normal
    matrix; AD: the matrix) are formed every SUMS_REFRESH-th epoch and kept in between: the
    positions and slices end as close to the truth as when they are carried every epoch
    (in-process workers see the patched constant), and the kept ratios come back with the
    result's per-pattern state."""
    from daskpty.engines import multislice_positions as mp

    ds, data, _ = thick
    extra = dict(optimizer="adam") if engine == "ad" else {}
    kw = dict(engine=engine, epochs=20, slices=2, slice_spacing_m=SPACING, refine_positions={"start_epoch": 3},
              **extra)
    kept = _run(data, client, **kw)
    monkeypatch.setattr(mp, "SUMS_REFRESH", 1)
    every = _run(data, client, **kw)
    true = ds.truth.positions + kept.origin
    pos_kept, pos_every = _position_rms(kept.positions, true), _position_rms(every.positions, true)
    err_kept, err_every = _slice_nrmse(kept, ds), _slice_nrmse(every, ds)
    print(f"{engine}: positions {pos_kept:.4f} (kept) vs {pos_every:.4f} px (every epoch); "
          f"slices {err_kept:.4f} vs {err_every:.4f}")
    assert not np.array_equal(kept.positions, every.positions)   # the kept sums were used
    assert pos_kept < 1.1 * pos_every + 0.01 and err_kept < 1.05 * err_every
    if engine == "ad":   # AD forms no shift denominators
        assert "position_shift_ratio" not in kept.engine_state
        return
    ratios = kept.engine_state["position_shift_ratio"]
    assert ratios.shape == (len(true), 2) and np.isfinite(ratios).all() and (ratios > 0).all()


@pytest.mark.slow
def test_refinement_in_the_near_field_beats_the_nominal_positions(client):
    obj, true, data, nominal = _near_field(error=0.8, seed=3)
    kw = dict(epochs=40, momentum=0.0, probe_start_epoch=5, rounds_per_epoch=1)
    fixed = _run(data, client, **kw)
    refined = _run(data, client, refine_positions={"start_epoch": 5, "affine": False}, **kw)  # random errors
    before = _position_rms(nominal, true)
    after = _position_rms(refined.positions - refined.origin, true)
    print(f"near field: positions {before:.3f} -> {after:.3f} px rms; data misfit fixed "
          f"{fixed.history[-1]['loss']:.4g}, refined {refined.history[-1]['loss']:.4g}")
    assert after < 0.7 * before
    assert refined.history[-1]["loss"] < fixed.history[-1]["loss"]


@pytest.mark.slow
def test_intensity_factors_through_slices_beat_a_constant_probe(client):
    """A beam whose flux flickers ±25 % from pattern to pattern, through 2 slices."""
    ds, data, _ = _electron(2, grid=7, flicker=0.25, error=0.0, seed=7)
    kw = dict(epochs=25, slices=2, slice_spacing_m=SPACING)
    constant = _run(data, client, **kw)
    fitted = _run(data, client, fit_intensity=True, probe_model={"start_epoch": 2}, **kw)
    a, b = _slice_nrmse(constant, ds), _slice_nrmse(fitted, ds)
    print(f"flickering beam, 2 slices: slice NRMSE constant probe {a:.3f}, intensity factors {b:.3f}")
    assert b < 0.9 * a


FULL = dict(slices=2, slice_spacing_m=SPACING, probe_modes=2, refine_positions={"start_epoch": 1},
            rounds_per_epoch=2, **VARYING)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lsqml", "ad"])
def test_the_fullest_combination_on_two_workers_equals_one_and_resumes_bit_for_bit(sets, client, engine,
                                                                                  tmp_path):
    from distributed import Client, LocalCluster

    _, data, _ = sets["slices"]
    kw = dict(FULL, engine=engine, **(dict(optimizer="adam") if engine == "ad" else {}))
    two = _run(data, client, epochs=4, **kw)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as c1, \
            Client(c1) as one_client:
        one = _run(data, one_client, epochs=4, **kw)
    np.testing.assert_allclose(one.object, two.object, rtol=0, atol=1e-5)
    np.testing.assert_allclose(one.positions, two.positions, rtol=0, atol=1e-6)
    np.testing.assert_allclose(one.probe_weights, two.probe_weights, rtol=0, atol=1e-6)
    _run(data, client, epochs=2, checkpoint=tmp_path / "c.zarr", **kw)
    resumed = _run(data, client, epochs=4, resume=tmp_path / "c.zarr", **kw)
    for name in ("object", "probe", "positions", "probe_weights", "intensity_scale", "eigen_probes"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(two, name), err_msg=name)
