"""Propagators, the multislice model and its engines: adjoints, gradients, K = 1, ground truth."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty import metrics
from daskpty.engines import ad, lsqml
from daskpty.physics import exit_waves, shift_ramps, split_positions
from daskpty.physics.multislice import (
    SliceGeometry,
    multislice_forward,
    multislice_intensities,
    multislice_vjp,
    transmit,
    transmit_adjoint,
    transmit_sum,
)
from daskpty.physics.propagation import (
    angular_spectrum,
    angular_spectrum_adjoint,
    angular_spectrum_kernel,
    near_field,
    near_field_adjoint,
    near_field_kernel,
)
from daskpty.simulate.multislice import simulate_multislice

from synthetic import make_dataset, slice_model, whole_block

LAM = 1.9687e-12   # 300 kV electrons
DX = 0.25e-10


def crandn(rng, shape, dtype=np.complex128):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def inner(a, b):
    return complex(np.vdot(np.asarray(a, np.complex128).ravel(), np.asarray(b, np.complex128).ravel()))


def adjoint_error(ax, y, x, ahy):
    """|<Ax, y> − <x, Aᴴy>| relative to ‖Ax‖‖y‖."""
    return abs(inner(ax, y) - inner(x, ahy)) / (np.linalg.norm(ax) * np.linalg.norm(y))


# ------------------------------------------------------------------------------------ propagators

def test_angular_spectrum_adjoint_with_an_active_band_limit():
    rng = np.random.default_rng(0)
    n = 48
    kernel = angular_spectrum_kernel(n, 1e-6, 1e-9, 0.2, band_limit=True)   # 2z/L ≈ 8300: cuts
    assert 0 < (kernel == 0).mean() < 1 and kernel.dtype == np.complex64
    x, y = crandn(rng, (3, n, n), np.complex64), crandn(rng, (3, n, n), np.complex64)
    assert adjoint_error(angular_spectrum(x, kernel), y, x, angular_spectrum_adjoint(y, kernel)) < 1e-6
    # with zeros in H the adjoint is not the inverse
    back = angular_spectrum_adjoint(angular_spectrum(x, kernel), kernel)
    assert np.linalg.norm(back - x) > 0.1 * np.linalg.norm(x)


def test_angular_spectrum_kernel_paraxial_limit_composition_and_evanescent_cut():
    n = 64
    k1 = angular_spectrum_kernel(n, DX, LAM, 1e-9, band_limit=False, dtype=np.complex128)
    k2 = angular_spectrum_kernel(n, DX, LAM, 2e-9, band_limit=False, dtype=np.complex128)
    np.testing.assert_allclose(k1 * k1, k2, atol=1e-12)
    u = np.fft.fftfreq(n, d=DX)
    paraxial = np.exp(-1j * np.pi * LAM * 1e-9 * (u[:, None] ** 2 + u[None, :] ** 2))
    theta2 = LAM**2 * (u[:, None] ** 2 + u[None, :] ** 2)                 # θ ≤ 57 mrad at the corner
    next_term = -2 * np.pi * 1e-9 / LAM * theta2**2 / 8                   # exact − paraxial ≈ −k z θ⁴/8
    np.testing.assert_allclose(np.angle(k1 * np.conj(paraxial)), next_term, atol=2e-5)
    assert np.abs(next_term).max() > 3e-3
    back = angular_spectrum_kernel(n, DX, LAM, -1e-9, band_limit=False, dtype=np.complex128)
    np.testing.assert_allclose(k1 * back, 1.0, atol=1e-12)
    evanescent = angular_spectrum_kernel(16, 0.4e-9, 1e-9, 1e-6, band_limit=False)  # λ > 2Δx: |u| ≥ 1/λ exists
    assert (evanescent == 0).any() and evanescent[0, 0] == 1


def test_near_field_operator_geometry_and_adjoint():
    rng = np.random.default_rng(1)
    n, p, lam, z1, z2 = 100, 55e-6, 0.9795e-10, 3.65e-3, 1.12
    kernel = near_field_kernel(n, p, lam, z2, z1)
    m = (z1 + z2) / z1
    ref = angular_spectrum_kernel(n, p / m, lam, z1 * z2 / (z1 + z2))
    np.testing.assert_array_equal(kernel, ref)
    plane = near_field_kernel(n, p, lam, z2)
    np.testing.assert_array_equal(plane, angular_spectrum_kernel(n, p, lam, z2))
    x, y = crandn(rng, (2, n, n), np.complex64), crandn(rng, (2, n, n), np.complex64)
    assert adjoint_error(near_field(x, kernel), y, x, near_field_adjoint(y, kernel)) < 1e-6


# ------------------------------------------------------------------------------------ multislice model

def _ms_inputs(rng, k=3, b=4, m=2, n=24, dtype=np.complex128):
    kernel = angular_spectrum_kernel(n, DX, LAM, 2e-9, dtype=dtype)
    slices = (np.exp(1j * 0.5 * rng.standard_normal((k, b, n, n))) * 0.9).astype(dtype)
    q = crandn(rng, (b, m, n, n), dtype)
    return kernel, slices, q


def test_multislice_adjoint_wrt_probe_waves_and_each_slice():
    rng = np.random.default_rng(2)
    kernel, slices, q = _ms_inputs(rng)
    exit_waves_, incident = multislice_forward(q, slices, kernel)
    y = crandn(rng, exit_waves_.shape)
    grads, g_q, residuals = multislice_vjp(y, slices, incident, kernel, want_residuals=True)
    # linear in the probe waves: <A q, y> = <q, Aᴴ y>
    assert adjoint_error(exit_waves_, y, q, g_q) < 1e-12
    # linear in each slice k separately: ψ_K(O with O_k -> δ) is J_k δ
    for k in range(slices.shape[0]):
        delta = crandn(rng, slices.shape[1:])
        s = slices.copy()
        s[k] = delta
        j_delta, _ = multislice_forward(q, s, kernel, keep=False)
        assert adjoint_error(j_delta, y, delta, grads[k]) < 1e-12, k
    np.testing.assert_array_equal(residuals[-1], y)
    # transmit / transmit_adjoint
    w = crandn(rng, q.shape)
    assert adjoint_error(transmit(w, slices, kernel, 0), y, w, transmit_adjoint(y, slices, kernel, 0)) < 1e-12


def test_transmit_sum_is_every_slice_change_carried_to_the_exit():
    """Σ_k T_k(c_k) by Horner's rule equals the sum of the separate carries, and it is the exit
    wave's derivative when every slice moves at once: central differences of the forward model
    along δO (all slices) match Σ_k T_k(δO_k φ_k)."""
    rng = np.random.default_rng(4)
    kernel, slices, q = _ms_inputs(rng)
    changes = [crandn(rng, q.shape) for _ in range(slices.shape[0])]
    separate = sum(transmit(c, slices, kernel, k) for k, c in enumerate(changes))
    np.testing.assert_allclose(transmit_sum(iter(changes), slices, kernel), separate, rtol=1e-12, atol=1e-12)
    delta = crandn(rng, slices.shape)
    _, incident = multislice_forward(q, slices, kernel)
    carried = transmit_sum((delta[k][:, None] * incident[k] for k in range(slices.shape[0])), slices, kernel)
    t = 1e-4
    plus, _ = multislice_forward(q, slices + t * delta, kernel, keep=False)
    minus, _ = multislice_forward(q, slices - t * delta, kernel, keep=False)
    fd = (plus - minus) / (2 * t)
    assert np.linalg.norm(fd - carried) < 1e-7 * np.linalg.norm(carried)


def test_one_slice_is_the_single_slice_exit_wave():
    ds = make_dataset(n=32, grid=4, modes=2, seed=4, noise=False)
    corners, fractions = split_positions(ds.positions, 32)
    ramps = shift_ramps(fractions, 32)
    psi, q, patches = exit_waves(ds.truth.object, ds.truth.probe, corners, ramps)
    out, _ = multislice_forward(q, patches[None], None)
    np.testing.assert_array_equal(out, psi)
    y = multislice_intensities(ds.truth.object[None], ds.truth.probe, ds.positions)
    np.testing.assert_allclose(np.fft.fftshift(y, axes=(-2, -1)), ds.intensities, rtol=1e-4, atol=1e-3)


def _loss_setup(seed=5, k=2, detector=False):
    rng = np.random.default_rng(seed)
    n = 24
    geom = SliceGeometry(k, 2e-9, LAM, DX)
    kernel = geom.kernel(n, dtype=np.complex128)
    det = near_field_kernel(n, 55e-6, 1e-10, 1.0, 3e-3, dtype=np.complex128) if detector else None
    h = 40
    slices = np.exp(1j * 0.3 * rng.standard_normal((k, h, h))).astype(np.complex128)
    probe = (0.2 * crandn(rng, (2, n, n))).astype(np.complex128)
    pos = rng.uniform(n / 2 + 1, h - n / 2 - 1, (6, 2))
    y = np.abs(crandn(rng, (6, n, n))) ** 2 * 0.1
    return slices, probe, pos, y, kernel, det, rng


@pytest.mark.parametrize("loss,detector", [("gaussian", False), ("poisson", False), ("gaussian", True)])
def test_multislice_gradient_matches_finite_differences(loss, detector):
    slices, probe, pos, y, kernel, det, rng = _loss_setup(detector=detector)
    kw = dict(sample=slice_model(slices, kernel, det), options=ad.ADOptions(loss=loss))
    part = ad.chunk_gradient(slices, probe, y, pos, **kw)
    g_obj = np.zeros_like(slices)
    part.boxes["object_grad"].add_into(g_obj)
    g_probe = part.arrays["probe_grad"]

    def loss_at(s, p):
        return ad.chunk_loss(s, p, y, pos, **kw).scalars["loss"]

    assert loss_at(slices, probe) == pytest.approx(part.scalars["loss"], rel=1e-12)

    eps = 1e-6
    for k in range(slices.shape[0]):
        v = np.zeros_like(slices)
        v[k] = crandn(rng, slices.shape[1:])
        fd = (loss_at(slices + eps * v, probe) - loss_at(slices - eps * v, probe)) / (2 * eps)
        assert fd == pytest.approx(np.vdot(g_obj, v).real, rel=1e-6), k
    v = crandn(rng, probe.shape)
    fd = (loss_at(slices, probe + eps * v) - loss_at(slices, probe - eps * v)) / (2 * eps)
    assert fd == pytest.approx(np.vdot(g_probe, v).real, rel=1e-6)


def test_kernel_shape_is_checked():
    slices, probe, pos, y, kernel, _, _ = _loss_setup()
    with pytest.raises(ValueError, match="kernel must be"):
        ad.chunk_loss(slices, probe, y, pos, sample=slice_model(slices, kernel[:-1]))
    with pytest.raises(ValueError, match="need the slice-to-slice kernel"):
        ad.chunk_loss(slices, probe, y, pos, sample=slice_model(slices))


def test_ad_gradient_with_one_slice_equals_the_ad_engine():
    ds = make_dataset(n=32, grid=4, modes=2, seed=6)
    obj = ds.truth.object * np.complex64(0.9)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    want = ad.chunk_gradient(obj, ds.truth.probe, y, ds.positions)
    got = ad.chunk_gradient(obj[None], ds.truth.probe, y, ds.positions)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(got.boxes["object_grad"].data[0], want.boxes["object_grad"].data) < 1e-5
    assert rel(got.arrays["probe_grad"], want.arrays["probe_grad"]) < 1e-5
    assert got.scalars["loss"] == pytest.approx(want.scalars["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------ LSQML, K = 1

@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
@pytest.mark.parametrize("update_probe", [True, False])
def test_lsqml_with_one_slice_equals_the_single_slice_engine(noise, update_probe):
    ds = make_dataset(n=32, grid=5, modes=2, seed=11)
    rng = np.random.default_rng(0)
    obj = (ds.truth.object * (1 + 0.1 * rng.standard_normal(ds.truth.object.shape))).astype(np.complex64)
    probe = (ds.truth.probe * 0.8).astype(np.complex64)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    valid = rng.random((32, 32)) > 0.1
    options = lsqml.LSQMLOptions(noise=noise)
    want = lsqml.chunk_step(obj, probe, y, ds.positions, options=options, update_probe=update_probe, valid=valid)
    got = lsqml.chunk_step(obj[None], probe, y, ds.positions, options=options, update_probe=update_probe, valid=valid)
    for key in ("object", "illumination"):
        a, b = got.boxes[key], want.boxes[key]
        assert a.offset == b.offset
        assert np.linalg.norm(a.data[0] - b.data) <= 1e-5 * np.linalg.norm(b.data), key
    if update_probe:
        assert np.linalg.norm(got.arrays["probe"] - want.arrays["probe"]) <= 1e-5 * np.linalg.norm(want.arrays["probe"])
    for key, value in want.scalars.items():
        assert got.scalars[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    s1 = lsqml.apply(lsqml.LSQMLState(obj.copy(), probe.copy()), want, options)
    s2 = lsqml.apply(lsqml.LSQMLState(obj[None].copy(), probe.copy()), got, options)
    assert np.linalg.norm(s2.object[0] - s1.object) <= 1e-5 * np.linalg.norm(s1.object)
    np.testing.assert_allclose(s2.illumination[0], s1.illumination, rtol=1e-5, atol=1e-3)


def test_slice_normalisation_keeps_the_model():
    ds = simulate_multislice(n=24, grid=4, step=4.0, seed=3)
    rng = np.random.default_rng(0)
    state = lsqml.LSQMLState((ds.truth.slices * np.array([2.0, 0.5j])[:, None, None]).astype(np.complex64),
                             ds.truth.probe.copy())
    state.illumination = (1 + rng.random(state.object.shape)).astype(np.float32)
    before = multislice_intensities(state.object, state.probe, ds.positions, ds.kernel)
    lsqml.normalize_scale(state)
    after = multislice_intensities(state.object, state.probe, ds.positions, ds.kernel)
    np.testing.assert_allclose(after, before, rtol=2e-4, atol=1e-2)
    for k in range(2):
        assert np.abs(state.object[k]).mean() == pytest.approx(1.0, rel=1e-5)


def test_ad_slice_normalisation_keeps_the_model():
    """AD's scale removal divides each slice by its own lit mean |O_k| and multiplies the probe by
    their product, so the model's intensities stay (one c for all slices changed them by c^(1−K))."""
    ds = simulate_multislice(n=24, grid=4, step=4.0, seed=3)
    rng = np.random.default_rng(0)
    state = ad.ADState(object=(ds.truth.slices * np.array([2.0, 0.5j])[:, None, None]).astype(np.complex64),
                       probe=ds.truth.probe.copy())
    state.illumination = (1 + rng.random(state.object.shape)).astype(np.float32)
    state.optimizer.set("b", "object", np.ones(state.object.shape, np.complex64))
    before = multislice_intensities(state.object, state.probe, ds.positions, ds.kernel)
    ad.normalize_scale(state, ad.ADOptions())
    after = multislice_intensities(state.object, state.probe, ds.positions, ds.kernel)
    np.testing.assert_allclose(after, before, rtol=2e-4, atol=1e-2)
    means = [np.abs(state.object[k]).mean() for k in range(2)]
    assert means == pytest.approx([1.0, 1.0], rel=1e-5)
    momentum = state.optimizer.get("b", "object")   # follows each slice's parameter: × 1 / c_k
    assert np.abs(momentum[0]).mean() < 0.6 < 1.9 < np.abs(momentum[1]).mean()


# ------------------------------------------------------------------------------------ ground truth

def _phase_nrmse(estimate, truth, mask):
    """Phase NRMSE after aligning (shift, ramp, complex scale): ‖Δφ‖ / ‖φ − mean φ‖ on the mask."""
    a = metrics.align(estimate, truth, mask=mask)
    pa, pt = np.angle(a), np.angle(truth)
    pa = pa - pa[mask].mean()
    pt = pt - pt[mask].mean()
    return float(np.sqrt(((pa - pt)[mask] ** 2).sum() / (pt[mask] ** 2).sum()))


def _fit(ds, n_slices, epochs=40):
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    g = ds.geometry
    kernel = SliceGeometry(n_slices, g.spacing_m, g.wavelength_m, g.pixel_size_m).kernel(y.shape[-1])
    options = lsqml.LSQMLOptions(momentum=0.0)
    shape = (n_slices,) + ds.truth.slices.shape[1:]
    # probe from physics with the nominal optics (the simulator's), refined with the object
    state = lsqml.LSQMLState(np.ones(shape, np.complex64), ds.probe0.copy())
    state = lsqml.rescale_probe(state, lsqml.forward_sums(state.object, state.probe, y, ds.positions,
                                                         sample=slice_model(state.object, kernel)))
    for _ in range(epochs):
        state = lsqml.begin_epoch(state, options)
        part = lsqml.chunk_step(state.object, state.probe, y, ds.positions, options=options,
                                sample=slice_model(state.object, kernel))
        state = lsqml.apply(state, part, options)
        state = lsqml.end_epoch(state, options)
    return state, part.scalars["loss"]


@pytest.mark.parametrize("n_slices", [2, 3])
@pytest.mark.slow
def test_multislice_lsqml_recovers_each_slice_far_better_than_one_slice(n_slices):
    from daskpty.physics.probes import electron_probe

    ds = simulate_multislice(n_slices=n_slices, noise=True, seed=n_slices)
    # the simulator's defocus is at the entrance surface; its first slice is half a spacing in
    ds.probe0 = electron_probe(32, DX, ds.wavelength_m, 25e-3, defocus_m=6e-9 + ds.geometry.spacing_m / 2, power=1.0)
    multi, loss_multi = _fit(ds, n_slices)
    single, loss_single = _fit(ds, 1)
    lit = multi.illumination[0] > 0.3 * multi.illumination[0].max()
    err_multi = [_phase_nrmse(multi.object[k], ds.truth.slices[k], lit) for k in range(n_slices)]
    err_single = [_phase_nrmse(single.object[0], ds.truth.slices[k], lit) for k in range(n_slices)]
    cplx_multi = [metrics.nrmse(multi.object[k], ds.truth.slices[k], mask=lit) for k in range(n_slices)]
    cplx_single = [metrics.nrmse(single.object[0], ds.truth.slices[k], mask=lit) for k in range(n_slices)]
    print(f"K={n_slices}: phase NRMSE per slice multislice {np.round(err_multi, 3)} vs one slice "
          f"{np.round(err_single, 3)}; complex NRMSE {np.round(cplx_multi, 4)} vs {np.round(cplx_single, 4)}; "
          f"loss {loss_multi:.4g} vs {loss_single:.4g}")
    assert max(err_multi) < 0.3
    assert max(err_multi) < 0.4 * min(err_single)
    assert max(cplx_multi) < 0.4 * min(cplx_single)
    assert loss_multi < 0.3 * loss_single


def test_near_field_lsqml_recovers_the_object():
    """Single slice, near-field detector operator (PETRA P25-like divergent-beam geometry)."""
    from scipy.ndimage import gaussian_filter

    from synthetic import smooth_object

    rng = np.random.default_rng(0)
    n = 48
    detector = near_field_kernel(n, 55e-6, 0.9795e-10, 1.12, 3.65e-3)   # Δx ≈ 179 nm, N_F ≈ 0.09
    obj = smooth_object(96, rng, sigma=1.5)
    phase = gaussian_filter(rng.standard_normal((n, n)), 3)
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = (np.exp(3j * phase / np.abs(phase).max()) * np.exp(-(yy**2 + xx**2) / (2 * (n / 3.5) ** 2)))
    probe = (probe * np.sqrt(1e5 / (np.abs(probe) ** 2).sum()))[None].astype(np.complex64)
    g = np.arange(6) * 7.0
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 6 + rng.uniform(-1, 1, (36, 2))
    y = multislice_intensities(obj[None], probe, pos, detector=detector)    # holograms, as recorded
    options = lsqml.LSQMLOptions(momentum=0.0)
    state = lsqml.LSQMLState(np.ones((1,) + obj.shape, np.complex64), probe.copy())
    losses = []
    for epoch in range(60):
        state = lsqml.begin_epoch(state, options)
        part = lsqml.chunk_step(state.object, state.probe, y, pos, options=options,
                                sample=slice_model(state.object, detector=detector),
                             update_probe=epoch >= 5)
        state = lsqml.end_epoch(lsqml.apply(state, part, options), options)
        losses.append(part.scalars["loss"])
    lit = state.illumination[0] > 0.3 * state.illumination[0].max()
    start = metrics.nrmse(np.ones_like(obj), obj, mask=lit)
    err = metrics.nrmse(state.object[0], obj, mask=lit)
    print(f"near field: NRMSE {err:.3f} (flat start {start:.3f}), loss {losses[0]:.4g} -> {losses[-1]:.4g}")
    assert err < 0.15 and err < 0.5 * start
    assert losses[-1] < 1e-2 * losses[0]


def test_device_code_path_matches_cpu(monkeypatch):
    """The CuPy branches (flat-index gathers, cupyx.scatter_add, .get()) through the NumPy-backed
    stand-in of tests/test_device_code_path.py: same partials as on the CPU."""
    from test_device_code_path import _on_device, install_fake_cupy

    ds = simulate_multislice(n=24, grid=5, step=3.0, noise=True, seed=1)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    obj = (ds.truth.slices * np.complex64(0.95)).astype(np.complex64)
    options = lsqml.LSQMLOptions()
    sample = slice_model(obj, ds.kernel)
    cpu = lsqml.chunk_step(obj, ds.truth.probe, y, ds.positions, options=options, sample=sample)
    cpu_grad = ad.chunk_gradient(obj, ds.truth.probe, y, ds.positions, sample=sample)
    calls = install_fake_cupy(monkeypatch)
    dev = lsqml.chunk_step(obj, ds.truth.probe, _on_device(y), ds.positions, options=options, sample=sample)
    dev_grad = ad.chunk_gradient(obj, ds.truth.probe, _on_device(y), ds.positions, sample=sample)
    assert calls.get("fft", 0) > 0 and calls.get("scatter_add", 0) > 0
    for d, c in ((dev, cpu), (dev_grad, cpu_grad)):
        for key in c.boxes:
            assert type(d.boxes[key].data) is np.ndarray
            assert np.linalg.norm(d.boxes[key].data - c.boxes[key].data) <= 2e-4 * np.linalg.norm(c.boxes[key].data)
        for key in c.arrays:
            assert np.linalg.norm(d.arrays[key] - c.arrays[key]) <= 2e-4 * np.linalg.norm(c.arrays[key]), key
        for key, value in c.scalars.items():
            assert d.scalars[key] == pytest.approx(value, rel=2e-4, abs=1e-9), key


def _gradient_descent_fit(ds, n_slices, iterations=40, lr=0.5):
    """Illumination-preconditioned gradient descent on the multislice amplitude loss (AD gradients)."""
    from daskpty.physics.probes import electron_probe

    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    g = ds.geometry
    kernel = SliceGeometry(n_slices, g.spacing_m, g.wavelength_m, g.pixel_size_m).kernel(y.shape[-1])
    obj = np.ones((n_slices,) + ds.truth.slices.shape[1:], np.complex64)
    probe = electron_probe(32, DX, ds.wavelength_m, 25e-3, defocus_m=6e-9 + g.spacing_m / 2,  # at the first slice
                           power=float(y.sum(axis=(1, 2)).mean()))
    for it in range(iterations):
        part = ad.chunk_gradient(obj, probe, y, ds.positions, sample=slice_model(obj, kernel))
        grad = np.zeros_like(obj)
        part.boxes["object_grad"].add_into(grad)
        illum = np.zeros(obj.shape, np.float32)
        part.boxes["illumination"].add_into(illum)
        obj = (obj - lr * grad / illum.max(axis=(1, 2), keepdims=True)).astype(np.complex64)
        if it >= 10:
            step = 0.5 * lr / part.arrays["probe_illumination"].max()
            probe = (probe - step * part.arrays["probe_grad"]).astype(np.complex64)
    return obj, illum, part.scalars["loss"]


def test_multislice_ad_gradient_descent_recovers_each_slice():
    ds = simulate_multislice(n_slices=2, noise=True, seed=2)
    multi, illum, loss_multi = _gradient_descent_fit(ds, 2)
    single, _, loss_single = _gradient_descent_fit(ds, 1)
    lit = illum[0] > 0.3 * illum[0].max()
    err_multi = [_phase_nrmse(multi[k], ds.truth.slices[k], lit) for k in range(2)]
    err_single = [_phase_nrmse(single[0], ds.truth.slices[k], lit) for k in range(2)]
    print(f"AD K=2: phase NRMSE per slice {np.round(err_multi, 3)} vs one slice {np.round(err_single, 3)}; "
          f"loss {loss_multi:.4g} vs {loss_single:.4g}")
    assert max(err_multi) < 0.2
    assert max(err_multi) < 0.4 * min(err_single)
    assert loss_multi < 0.5 * loss_single


@pytest.mark.parametrize("update_probe", [True, False])
def test_sampled_step_system_gives_the_full_step_lengths(update_probe):
    """The step lengths α_k (and α_P) from every s-th pattern's step system are close to those
    from every pattern's, on simulated data near the truth; everything else is the same sum."""
    ds = simulate_multislice(n_slices=3, n=24, grid=7, step=3.0, noise=True, seed=5)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    rng = np.random.default_rng(1)
    start = (ds.truth.slices * np.exp(0.3j * rng.random(ds.truth.slices.shape))).astype(np.complex64)
    options = lsqml.LSQMLOptions()
    assert lsqml.step_sample_stride(len(y), 3) > 1 and lsqml.step_sample_stride(len(y), 1) == 1
    assert lsqml.step_sample_stride(lsqml.STEP_SAMPLE_MIN * 2 - 1, 3) == 1   # too few patterns to sample
    full = lsqml.chunk_step(start, ds.truth.probe, y, ds.positions, options=options,
                            sample=slice_model(start, ds.kernel), update_probe=update_probe, step_stride=1)
    sampled = lsqml.chunk_step(start, ds.truth.probe, y, ds.positions, options=options,
                               sample=slice_model(start, ds.kernel), update_probe=update_probe)
    a_full, a_sampled = full.arrays["alpha_slices"], sampled.arrays["alpha_slices"]
    assert np.all(a_full > 0)
    np.testing.assert_allclose(a_sampled, a_full, rtol=0.15)
    if update_probe:
        assert sampled.scalars["alpha_probe"] == pytest.approx(full.scalars["alpha_probe"], rel=0.15)
    scale = (a_sampled / a_full).astype(np.float32)[:, None, None]
    np.testing.assert_allclose(sampled.boxes["object"].data, full.boxes["object"].data * scale, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(sampled.boxes["illumination"].data, full.boxes["illumination"].data)
    assert sampled.scalars["loss"] == full.scalars["loss"]


def test_slices_take_one_step_the_least_squares_step_of_their_changes_together():
    """Through slices every slice takes α_O, the trimmed mean over the patterns of
    Re⟨a_j, χ_j⟩ / ‖a_j‖²: a_j the exit wave's change when every slice moves along its
    direction ΔÔ_k = g_k / √(W_k² + (δ max W_k)²) at once (here by central differences of the
    forward model in double precision), χ_j the exit residual of the Gaussian model."""
    from daskpty.engines.state import trimmed_mean
    from daskpty.physics.noise import far_field_update

    ds = simulate_multislice(n_slices=3, n=24, grid=5, step=3.0, noise=True, seed=5)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1)).astype(np.float64)
    rng = np.random.default_rng(1)
    start = (ds.truth.slices * np.exp(0.3j * rng.random(ds.truth.slices.shape))).astype(np.complex64)
    options = lsqml.LSQMLOptions(tikhonov=0.0).for_slices(3)
    part = lsqml.chunk_step(start, ds.truth.probe, y.astype(np.float32), ds.positions, options=options,
                            sample=slice_model(start, ds.kernel), update_probe=False, step_stride=1)
    alphas = part.arrays["alpha_slices"] / part.scalars["n"]
    assert alphas[0] > 0 and np.all(alphas == alphas[0])

    num, lit = part.boxes["object"], part.boxes["illumination"].data.astype(np.float64)
    floor = (options.object_delta * lit.reshape(3, -1).max(axis=1))[:, None, None] ** 2
    direction = np.zeros(start.shape, np.complex128)
    (y0, x0), (y1, x1) = num.offset, num.stop
    direction[:, y0:y1, x0:x1] = num.data / alphas[0] / np.sqrt(lit ** 2 + floor)

    obj, probe = start.astype(np.complex128), ds.truth.probe.astype(np.complex128)

    def exit_waves(o):
        return whole_block(o, probe, y, ds.positions, ds.kernel, cdtype=np.complex128).exit

    here = whole_block(obj, probe, y, ds.positions, ds.kernel, cdtype=np.complex128)
    update, _, _ = far_field_update("gaussian", here.detected.copy(), y)
    chi = np.fft.ifft2(update, norm="ortho")
    t = 1e-4
    a = (exit_waves(obj + t * direction) - exit_waves(obj - t * direction)) / (2 * t)
    b = len(y)
    steps = np.clip(np.real(np.sum(np.conj(a) * chi, axis=(1, 2, 3))) / np.sum(np.abs(a) ** 2, axis=(1, 2, 3)), 0, None)
    assert steps.reshape(b).std() > 0.05 * steps.mean()    # the patterns' own steps differ
    assert alphas[0] == pytest.approx(trimmed_mean(steps, np), rel=1e-5)
