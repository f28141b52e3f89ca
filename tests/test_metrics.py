"""Tests for daskpty.metrics: aligned NRMSE, FRC, probe error."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskpty.metrics import Alignment, FRCResult, align, frc, nrmse, probe_error

N = 128


def smooth_image(rng, n=N, sigma=0.05, offset=1.0):
    """Band-limited random complex image (Gaussian spectrum, negligible content above 0.25 cycles/px)."""
    z = rng.normal(size=(n, n)) + 1j * rng.normal(size=(n, n))
    f = np.hypot(np.fft.fftfreq(n)[:, None], np.fft.fftfreq(n)[None, :])
    g = np.fft.ifft2(np.fft.fft2(z) * np.exp(-(f**2) / (2 * sigma**2)))
    g /= np.sqrt(np.mean(np.abs(g) ** 2))
    return offset + 0.5 * g


def fourier_shift(x, s):
    """x(r) -> x(r - s), periodic (independent of the module's implementation)."""
    fy = np.fft.fftfreq(x.shape[0])[:, None]
    fx = np.fft.fftfreq(x.shape[1])[None, :]
    return np.fft.ifft2(np.fft.fft2(x) * np.exp(-2j * np.pi * (fy * s[0] + fx * s[1])))


def phase_ramp(shape, k, origin=(17.0, -5.0)):
    y = np.arange(shape[0])[:, None] - origin[0]
    x = np.arange(shape[1])[None, :] - origin[1]
    return np.exp(2j * np.pi * (k[0] * y + k[1] * x))


def distort(t, shift=(0.0, 0.0), ramp=(0.0, 0.0), scale=1.0):
    """What a reconstruction may differ by: scale · ramp · shifted truth."""
    return scale * phase_ramp(t.shape, ramp) * fourier_shift(t, shift)


def border_mask(n=N, border=16):
    m = np.zeros((n, n), dtype=bool)
    m[border:-border, border:-border] = True
    return m


@pytest.fixture
def truth():
    return smooth_image(np.random.default_rng(1234))


# ------------------------------------------------------------------------------------------ nrmse


def test_nrmse_identity(truth):
    assert nrmse(truth, truth) < 1e-9
    assert nrmse(truth, truth, mask=border_mask()) < 1e-9


@pytest.mark.parametrize(
    "shift, ramp, scale",
    [
        ((0, 0), (0, 0), 0.37 * np.exp(2.1j)),
        ((3, -5), (0, 0), 1.0),
        ((2.3, -1.7), (0, 0), 1.0),
        ((2.3137, -1.7262), (0, 0), 1.0),
        ((0, 0), (0.013, -0.021), 1.0),
        ((2.3137, -1.7262), (0.0137, -0.0213), 2.5 * np.exp(-0.8j)),
        ((-6.481, 4.529), (0.0512, 0.0318), 0.6j),  # several ramp cycles across the field
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_nrmse_invariances(truth, shift, ramp, scale, masked):
    est = distort(truth, shift, ramp, scale)
    mask = border_mask() if masked else None
    assert nrmse(est, truth, mask=mask) < 1e-3
    _, p = align(est, truth, mask=mask, return_params=True)
    assert isinstance(p, Alignment)
    np.testing.assert_allclose(p.shift, -np.asarray(shift, float), atol=1e-2)
    np.testing.assert_allclose(p.ramp, -np.asarray(ramp, float), atol=1e-4)
    assert abs(abs(p.scale) - 1 / abs(scale)) < 1e-3 / abs(scale)


def test_nrmse_not_invariant_when_disabled(truth):
    shifted = distort(truth, shift=(2.37, -1.61))
    assert nrmse(shifted, truth, subpixel=False) > 1e-2  # integer shift only: residual 0.37 px
    assert nrmse(distort(truth, shift=(3, -2)), truth, subpixel=False) < 1e-9
    ramped = distort(truth, ramp=(0.02, 0.01))
    assert nrmse(ramped, truth, ramp=False) > 0.1
    assert nrmse(ramped, truth, ramp=True) < 1e-3


@settings(max_examples=12, deadline=None)
@given(
    sy=st.floats(-8, 8),
    sx=st.floats(-8, 8),
    ky=st.floats(-0.05, 0.05),
    kx=st.floats(-0.05, 0.05),
    phase=st.floats(0, 2 * np.pi),
    amp=st.floats(0.1, 10),
)
def test_nrmse_random_distortions(sy, sx, ky, kx, phase, amp):
    t = smooth_image(np.random.default_rng(7), n=96)
    est = distort(t, (sy, sx), (ky, kx), amp * np.exp(1j * phase))
    assert nrmse(est, t, mask=border_mask(96, 12)) < 1e-3


@pytest.mark.parametrize("sigma", [0.01, 0.05, 0.2])
def test_nrmse_matches_noise_level(truth, sigma):
    rng = np.random.default_rng(5)
    m = border_mask()
    rms = np.sqrt(np.mean(np.abs(truth[m]) ** 2))
    noise = sigma * rms * (rng.normal(size=truth.shape) + 1j * rng.normal(size=truth.shape)) / np.sqrt(2)
    est = distort(truth + noise, shift=(1.37, -2.61), ramp=(0.01, 0.02), scale=0.3j)
    value = nrmse(est, truth, mask=m)
    assert abs(value - sigma) < 0.05 * sigma


def test_nrmse_unrelated_images(truth):
    rng = np.random.default_rng(99)
    a = smooth_image(rng, offset=0.0)
    b = smooth_image(rng, offset=0.0)
    assert nrmse(a, b) > 0.8
    assert nrmse(rng.normal(size=truth.shape), truth, mask=border_mask()) > 0.9


def test_align_dtype_and_shape(truth):
    est = distort(truth, shift=(1.5, 0.25)).astype(np.complex64)
    out = align(est, truth)
    assert out.shape == truth.shape and out.dtype == np.complex64
    assert align(est.astype(np.complex128), truth).dtype == np.complex128
    # a single-slice (1, H, W) object is accepted
    assert nrmse(est[None], truth) < 1e-3


def test_shape_mismatch_raises(truth):
    with pytest.raises(ValueError, match="shape mismatch"):
        nrmse(truth[:-1], truth)
    with pytest.raises(ValueError, match="shape mismatch"):
        align(truth, truth[:, :-2])
    with pytest.raises(ValueError, match="shape mismatch"):
        nrmse(truth, truth, mask=np.ones((4, 4), bool))
    with pytest.raises(ValueError, match="2-D"):
        nrmse(np.stack([truth, truth]), np.stack([truth, truth]))
    with pytest.raises(ValueError, match="no pixels"):
        nrmse(truth, truth, mask=np.zeros(truth.shape, bool))


def test_nrmse_non_finite_estimate_is_nan(truth):
    est = truth.copy()
    est[3, 4] = np.nan
    assert np.isnan(nrmse(est, truth))


# -------------------------------------------------------------------------------------------- frc


@pytest.mark.parametrize("window", [True, False])
@pytest.mark.parametrize("kind", ["real", "complex"])
def test_frc_self_is_one(kind, window):
    rng = np.random.default_rng(3)
    img = rng.normal(size=(128, 96))
    if kind == "complex":
        img = img + 1j * rng.normal(size=img.shape)
    r = frc(img, img, window=window)
    assert isinstance(r, FRCResult)
    assert r.frequency[0] == 0 and r.frequency[-1] == pytest.approx(0.5)
    assert np.all(np.diff(r.frequency) > 0)
    np.testing.assert_allclose(r.frc, 1.0, atol=1e-9)
    assert r.resolution is None


def test_frc_independent_noise_below_threshold():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(256, 256)) + 1j * rng.normal(size=(256, 256))
    b = rng.normal(size=(256, 256)) + 1j * rng.normal(size=(256, 256))
    r = frc(a, b)
    assert np.mean(np.abs(r.frc[1:])) < 0.1
    assert np.mean(r.frc[1:] < r.half_bit[1:]) > 0.9
    assert r.resolution is not None and r.resolution < 0.05


def test_frc_half_bit_curve():
    r = frc(np.ones((64, 64)), np.ones((64, 64)), window=False)
    n = r.n_pixels.astype(float)
    expected = (0.2071 + 1.9102 / np.sqrt(n)) / (1.2071 + 0.9102 / np.sqrt(n))
    np.testing.assert_allclose(r.half_bit, expected)
    assert r.n_pixels[0] == 1 and r.n_pixels.sum() <= 64 * 64
    assert r.half_bit[-1] < r.half_bit[1]


@pytest.mark.parametrize("cutoff", [0.12, 0.3])
@pytest.mark.parametrize("window", [True, False])
def test_frc_resolution_at_noise_cutoff(cutoff, window):
    rng = np.random.default_rng(8)
    n = 256
    f = np.hypot(np.fft.fftfreq(n)[:, None], np.fft.fftfreq(n)[None, :])
    low = f < cutoff

    def noise():
        return rng.normal(size=(n, n)) + 1j * rng.normal(size=(n, n))

    common = np.fft.fft2(noise())
    a = np.fft.ifft2(np.where(low, common, np.fft.fft2(noise())))
    b = np.fft.ifft2(np.where(low, common, np.fft.fft2(noise())))
    r = frc(a, b, window=window)
    assert r.resolution == pytest.approx(cutoff, abs=0.015)
    assert np.all(r.frc[(r.frequency > 0) & (r.frequency < cutoff - 0.02)] > 0.9)


def test_frc_n_bins_and_mismatch():
    rng = np.random.default_rng(9)
    a = rng.normal(size=(64, 64))
    r = frc(a, a, n_bins=8)
    assert len(r.frequency) == 9 and r.frequency[-1] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        frc(a, a[:32])


# ------------------------------------------------------------------------------------ probe_error


def random_modes(rng, m=2, n=32):
    return rng.normal(size=(m, n, n)) + 1j * rng.normal(size=(m, n, n))


def random_unitary(rng, m):
    q, r = np.linalg.qr(rng.normal(size=(m, m)) + 1j * rng.normal(size=(m, m)))
    return q * (np.diag(r) / np.abs(np.diag(r)))


def test_probe_error_invariances():
    rng = np.random.default_rng(10)
    p = random_modes(rng)
    u = random_unitary(rng, 2)
    assert np.allclose(u.conj().T @ u, np.eye(2))
    mixed = 3.7 * np.exp(0.9j) * np.einsum("kl,lij->kij", u, p)
    assert probe_error(p, p) < 1e-6
    assert probe_error(mixed, p) < 1e-6
    assert probe_error(p, mixed) < 1e-6
    # an extra empty mode changes nothing
    padded = np.concatenate([mixed, np.zeros((1,) + p.shape[1:])])
    assert probe_error(padded, p) < 1e-6


def test_probe_error_sensitivity():
    rng = np.random.default_rng(11)
    p = random_modes(rng)
    changed = p.copy()
    changed[1] += 0.1 * (rng.normal(size=p.shape[1:]) + 1j * rng.normal(size=p.shape[1:]))
    e_small = probe_error(changed, p)
    assert 1e-3 < e_small < 0.5
    changed[1] += 0.5 * (rng.normal(size=p.shape[1:]) + 1j * rng.normal(size=p.shape[1:]))
    assert probe_error(changed, p) > e_small
    assert probe_error(p[:1], p) > 0.1  # a missing mode
    # relative weights of the modes matter (not just the subspace)
    weighted = p * np.array([1.0, 0.5])[:, None, None]
    assert probe_error(weighted, p) > 0.05


def test_probe_error_single_mode_is_scaled_nrmse():
    rng = np.random.default_rng(12)
    t = random_modes(rng, 1)[0]
    e = 0.4j * t + 0.2 * (rng.normal(size=t.shape) + 1j * rng.normal(size=t.shape))
    c = np.vdot(e, t) / np.vdot(e, e)  # best complex scale of e onto t
    expected = np.linalg.norm(c * e - t) / np.linalg.norm(t)
    assert probe_error(e, t) == pytest.approx(expected, rel=1e-9)
    assert probe_error(e[None], t[None]) == pytest.approx(expected, rel=1e-9)


def test_probe_error_matches_dense_density_matrices():
    rng = np.random.default_rng(13)
    e = random_modes(rng, 3, 8)
    t = random_modes(rng, 2, 8)
    E = e.reshape(3, -1)
    T = t.reshape(2, -1)
    rho_e = E.T @ E.conj()  # sum_k p_k p_k^H
    rho_t = T.T @ T.conj()
    cos = np.vdot(rho_e, rho_t).real / (np.linalg.norm(rho_e) * np.linalg.norm(rho_t))
    assert probe_error(e, t) == pytest.approx(np.sqrt(1 - cos), rel=1e-9)


def test_probe_error_shape_mismatch():
    rng = np.random.default_rng(14)
    with pytest.raises(ValueError, match="shape mismatch"):
        probe_error(random_modes(rng, 2, 16), random_modes(rng, 2, 32))
    with pytest.raises(ValueError, match="zero"):
        probe_error(np.zeros((1, 8, 8)), random_modes(rng, 1, 8))


def test_truth_frame_places_an_offset_reconstruction_and_nrmse_vs_truth_scores_it():
    from types import SimpleNamespace

    from daskpty.metrics import nrmse_vs_truth, truth_frame

    rng = np.random.default_rng(3)
    truth_obj = (rng.random((40, 40)) + 1j * rng.random((40, 40))).astype(np.complex64)
    truth_pos = rng.random((10, 2)) * 10 + 15
    rec_obj = np.ones((50, 50), np.complex64)
    rec_obj[5:45, 7:47] = 2 * truth_obj  # offset (5, 7), complex scale 2
    illumination = np.zeros((50, 50), np.float32)
    illumination[10:40, 12:42] = 1
    est, mask, offset = truth_frame(rec_obj, truth_pos + (5, 7), illumination > 0.5, truth_obj, truth_pos)
    assert offset == (5, 7)
    np.testing.assert_array_equal(est, 2 * truth_obj)
    assert mask.sum() == 30 * 30 and mask[5:35, 5:35].all()
    truth = SimpleNamespace(object=truth_obj, positions=truth_pos)
    assert nrmse_vs_truth(rec_obj, truth_pos + (5, 7), illumination, truth) < 1e-2  # white noise: sub-pixel refinement residual
    assert nrmse_vs_truth(np.roll(rec_obj, 9, axis=0), truth_pos + (5, 7), illumination, truth) > 0.1
