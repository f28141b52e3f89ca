"""Simulator physics and mechanics, on a real (in-process) dask cluster and real Zarr stores."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.io.scan import nearest_neighbour_steps, probe_diameter
from daskpty.physics import extract_patches, mode_powers, model_intensities, shift_probe
from daskpty.physics import shift_ramps, split_positions
from daskpty.simulate import _resolve, _UNSET, make_probe

from conftest import leftovers

N = 32  # probe / pattern size used by the fast tests


def _sim(path, client, **kw):
    if "n_patterns" not in kw:
        kw.setdefault("grid", (8, 8))
    kw.setdefault("probe_size", N)
    return daskpty.simulate(path, "small", client=client, **kw)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, client):
    """Noise-free simulation, two probe modes, several shards."""
    path = tmp_path_factory.mktemp("sim") / "clean.zarr"
    return _sim(path, client, dose=None, modes=2, shard_bytes=16 * N * N * 4)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory, client):
    path = tmp_path_factory.mktemp("sim") / "noisy.zarr"
    return _sim(path, client, grid=(16, 16), dose=2e5, shard_bytes=64 * N * N * 2)


def _expected(data, idx=slice(None), positions=None):
    t = data.truth
    pos = t.positions[idx] if positions is None else positions
    return np.fft.fftshift(model_intensities(t.object, t.probe, pos), axes=(-2, -1))


def test_store_layout_and_metadata(clean):
    assert clean.n_patterns == 64 and clean.pattern_shape == (N, N)
    assert clean.dtype == np.float32
    assert clean.intensities.chunks[0] == (16,) * 4
    sim = clean.metadata["simulation"]
    assert sim["modes"] == 2 and sim["dose"] is None and sim["probe_size"] == N
    assert clean.metadata["object_pixel_size_m"] == pytest.approx(
        sim["wavelength_m"] * sim["detector_distance_m"] / (N * sim["detector_pixel_size_m"]))
    t = clean.truth
    assert t.object.dtype == np.complex64 and t.probe.shape == (2, N, N)
    np.testing.assert_array_equal(t.positions, clean.positions)
    assert clean.probe.shape == (1, N, N)  # the initial guess
    # noise-free data are normalised to a mean of one count per pixel
    assert clean.intensities.sum().compute() / clean.n_patterns == pytest.approx(N * N, rel=1e-4)


def test_parseval_energy_per_pattern(clean):
    """Sum of each pattern == sum over modes of ||shifted probe * object window||^2."""
    t = clean.truth
    corners, frac = split_positions(t.positions, N)
    shifted = shift_probe(t.probe, shift_ramps(frac, N))            # (B, M, n, n)
    windows = extract_patches(t.object, corners, N)                  # (B, n, n)
    energy = (np.abs(shifted * windows[:, None]) ** 2).sum(axis=(1, 2, 3), dtype=np.float64)
    sums = clean.intensities.sum(axis=(1, 2), dtype=np.float64).compute()
    np.testing.assert_allclose(sums, energy, rtol=2e-5)


def test_patterns_equal_forward_model_at_their_positions(clean):
    x = clean.intensities[:10].compute()
    np.testing.assert_allclose(x, _expected(clean, slice(0, 10)), rtol=1e-5, atol=1e-5 * x.max())
    for shift in ([1.0, 0.0], [0.0, 1.0]):
        moved = _expected(clean, positions=clean.truth.positions[:10] + shift)
        assert np.abs(moved - x).max() > 1e-3 * x.max()


def test_dc_at_pattern_centre_for_flat_object(tmp_path, client):
    d = _sim(tmp_path / "flat.zarr", client, grid=(3, 3), dose=None, object="flat")
    x = d.intensities.compute().astype(np.float64)
    yy, xx = np.indices((N, N))
    for p in x:
        cy, cx = (p * yy).sum() / p.sum(), (p * xx).sum() / p.sum()
        assert abs(cy - N / 2) < 1e-3 and abs(cx - N / 2) < 1e-3
    # the pattern of a flat object is the probe's far field, the same for every position
    np.testing.assert_allclose(x, x[:1].repeat(len(x), 0), rtol=1e-4, atol=1e-6 * x.max())


def test_poisson_statistics(noisy):
    y = noisy.intensities.compute().astype(np.float64)
    lam = _expected(noisy).astype(np.float64)
    assert noisy.dtype == np.uint16
    assert np.all(y == np.round(y))
    # mean: over all patterns and pixels, and pattern by pattern
    z_total = (y - lam).sum() / np.sqrt(lam.sum())
    assert abs(z_total) < 4
    z_pattern = (y - lam).sum(axis=(1, 2)) / np.sqrt(lam.sum(axis=(1, 2)))
    assert abs(z_pattern.mean()) < 4 / np.sqrt(len(z_pattern))
    assert 0.7 < z_pattern.std() < 1.3
    # mean counts per pattern = the dose
    assert y.sum(axis=(1, 2)).mean() == pytest.approx(2e5, rel=5e-3)
    # variance = mean, on well-exposed pixels
    bright = lam > 50
    ratio = ((y - lam)[bright] ** 2).sum() / lam[bright].sum()
    assert abs(ratio - 1) < 5 * np.sqrt(2 / bright.sum())


def test_independent_of_worker_count_and_shard_size(tmp_path, noisy):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster, set_as_default=False) as c1:
        one = _sim(tmp_path / "one.zarr", c1, grid=(16, 16), dose=2e5, shard_bytes=100 * N * N * 2)
    assert one.intensities.chunks[0] != noisy.intensities.chunks[0]
    np.testing.assert_array_equal(one.intensities.compute(), noisy.intensities.compute())
    np.testing.assert_array_equal(one.truth.object, noisy.truth.object)


def test_seed_changes_the_noise(tmp_path, client, noisy):
    other = _sim(tmp_path / "s1.zarr", client, grid=(16, 16), dose=2e5, seed=1)
    assert not np.array_equal(other.intensities[:4].compute(), noisy.intensities[:4].compute())


def test_scan_geometry(noisy, tmp_path, client):
    pos = noisy.positions
    sim = noisy.metadata["simulation"]
    step = sim["step_px"]
    # sub-pixel positions
    frac = pos - np.round(pos)
    assert np.abs(frac).max() > 0.3 and np.unique(np.round(frac, 3)).size > 50
    # windows inside the object, overlap in the documented range
    corners, _ = split_positions(pos, N)
    assert corners.min() >= 0 and (corners.max(axis=0) + N <= noisy.truth.object.shape).all()
    assert 0.68 <= sim["linear_overlap"] <= 0.78
    assert probe_diameter(noisy.truth.probe) == pytest.approx(sim["probe_diameter_px"])
    # spatially compact order: consecutive patterns are neighbours, on average
    hops = np.hypot(*np.diff(pos, axis=0).T)
    assert np.median(hops) < 1.5 * step and hops.mean() < 2.5 * step
    # Fermat spiral: requested count, similar density
    f = _sim(tmp_path / "f.zarr", client, scan="fermat", n_patterns=50, dose=None)
    assert f.n_patterns == 50
    nn = nearest_neighbour_steps(f.positions)
    assert 0.6 * step < np.median(nn) < 1.4 * step


def test_object_and_probe_ranges(clean):
    obj = clean.truth.object
    assert 0.49 <= np.abs(obj).min() and np.abs(obj).max() <= 1.0 + 1e-6
    assert -1.0 - 1e-6 <= np.angle(obj).min() and np.angle(obj).max() <= 1.0 + 1e-6
    assert np.angle(obj).std() > 0.2 and np.abs(obj).std() > 0.05  # structured
    p = clean.truth.probe
    gram = np.einsum("kij,lij->kl", p.conj(), p)
    assert abs(gram[0, 1]) < 1e-4 * abs(gram[0, 0])                  # orthogonal modes
    np.testing.assert_allclose(mode_powers(p), [0.8, 0.2], atol=1e-5)
    q = make_probe(64, 3, [0.7, 0.2, 0.1])
    np.testing.assert_allclose(mode_powers(q), [0.7, 0.2, 0.1], atol=1e-5)
    assert np.sum(np.abs(q) ** 2) == pytest.approx(1.0, rel=1e-5)


def test_saturation_is_clipped_and_reported(tmp_path, client):
    with pytest.warns(UserWarning, match="clipped"):
        d = _sim(tmp_path / "sat.zarr", client, grid=(2, 2), dose=1e9)
    assert d.intensities.max().compute() == 65535
    assert d.metadata["simulation"]["saturated_values"] > 0


def test_failed_simulation_leaves_no_store(tmp_path, client, monkeypatch):
    mod = sys.modules["daskpty.simulate"]  # the module: daskpty.simulate is the function
    real = mod.simulate_patterns

    def flaky(obj, probe, positions, start, *args):
        if start > 0:
            raise RuntimeError("worker fell over")
        return real(obj, probe, positions, start, *args)

    monkeypatch.setattr(mod, "simulate_patterns", flaky)
    with pytest.raises(RuntimeError, match="worker fell over"):
        _sim(tmp_path / "broken.zarr", client, shard_bytes=8 * N * N * 2)
    assert not (tmp_path / "broken.zarr").exists()
    assert leftovers(tmp_path) == []


def test_bad_arguments_and_existing_output(tmp_path, client, noisy):
    with pytest.raises(ValueError, match="unknown preset"):
        daskpty.simulate(tmp_path / "a.zarr", "huge")
    with pytest.raises(ValueError, match="either grid or n_patterns"):
        daskpty.simulate(tmp_path / "a.zarr", grid=(2, 2), n_patterns=4)
    with pytest.raises(ValueError, match="float32"):
        daskpty.simulate(tmp_path / "a.zarr", dose=None, dtype="uint16")
    with pytest.raises(ValueError, match="even number"):
        daskpty.simulate(tmp_path / "a.zarr", probe_size=33)
    with pytest.raises(FileExistsError, match="overwrite"):
        daskpty.simulate(noisy.path, client=client)
    assert not (tmp_path / "a.zarr").exists()


def test_presets_resolve_to_the_documented_sizes():
    args = dict(scan=None, grid=None, n_patterns=None, step=None, jitter=None, overlap=None,
                probe_size=None, modes=None, mode_powers=None, dose=_UNSET, dtype=None,
                wavelength_m=None, detector_distance_m=None, detector_pixel_size_m=None, seed=0)
    small, _, _ = _resolve("small", **args)
    medium, _, _ = _resolve("medium", **args)
    large, _, _ = _resolve("large", **args)
    assert (small.n_patterns, small.probe_size) == (576, 64)
    assert (medium.n_patterns, medium.probe_size) == (1600, 128)
    assert (large.n_patterns, large.probe_size, large.dtype) == (262144, 128, "uint16")
    assert large.n_patterns * 128 * 128 * 2 == 8 * 2**30
