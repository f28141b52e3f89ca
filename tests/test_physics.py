"""Tests for daskpty.physics (NumPy backend): adjoints, unitarity, conventions, noise models, modes.

Every operator is checked against an independent reference (slicing, np.fft, np.roll, brute force)
or through the dot-product test <A x, y> = <x, A^H y> with random complex x, y.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskpty.physics import (
    check_windows_inside,
    exit_waves,
    extract_patches,
    far_field,
    far_field_adjoint,
    gaussian_correction,
    gaussian_loss,
    mode_powers,
    model_intensities,
    model_intensity,
    orthogonalize_modes,
    poisson_correction,
    poisson_loss,
    poisson_step_lengths,
    scatter_add_patches,
    shift_images,
    shift_probe,
    shift_probe_adjoint,
    shift_ramps,
    split_positions,
)
from daskpty.physics.noise import DEFAULT_EPS

ADJ_TOL = 1e-5  # relative to ||A x|| ||y||, complex64 arithmetic


# ----------------------------------------------------------------------------------------------
# helpers (independent of the code under test)
# ----------------------------------------------------------------------------------------------

def crandn(rng, shape, dtype=np.complex64):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def inner(a, b):
    """<a, b> = sum conj(a) b, accumulated in complex128."""
    return np.vdot(np.asarray(a, np.complex128).ravel(), np.asarray(b, np.complex128).ravel())


def assert_adjoint(ax, y, x, ahy, tol=ADJ_TOL):
    lhs = inner(ax, y)
    rhs = inner(x, ahy)
    scale = np.linalg.norm(np.asarray(ax, np.complex128)) * np.linalg.norm(np.asarray(y, np.complex128))
    scale2 = np.linalg.norm(np.asarray(x, np.complex128)) * np.linalg.norm(np.asarray(ahy, np.complex128))
    assert abs(lhs - rhs) <= tol * max(scale, scale2), (lhs, rhs, scale)


def gaussian_blob(n, centre, sigma, M=1):
    """Real Gaussian probe(s) (M, n, n) centred at pixel ``centre`` (y, x), float coordinates."""
    i = np.arange(n)
    g = np.exp(-((i[:, None] - centre[0]) ** 2 + (i[None, :] - centre[1]) ** 2) / (2 * sigma**2))
    return np.repeat(g[None], M, axis=0).astype(np.complex64)


def smooth_complex(rng, shape, cutoff=0.2):
    """Band-limited random complex image: Fourier content only below ``cutoff`` cycles/pixel."""
    z = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    fy = np.fft.fftfreq(shape[-2])[:, None]
    fx = np.fft.fftfreq(shape[-1])[None, :]
    keep = (np.abs(fy) < cutoff) & (np.abs(fx) < cutoff)
    return np.fft.ifft2(np.fft.fft2(z) * keep).astype(np.complex64)


def ref_shift(img, f):
    """Reference sub-pixel shift x(r) -> x(r - f) with np.fft (image (..., n, n), f = (fy, fx))."""
    ky = np.fft.fftfreq(img.shape[-2])[:, None]
    kx = np.fft.fftfreq(img.shape[-1])[None, :]
    ramp = np.exp(-2j * np.pi * (ky * f[0] + kx * f[1]))
    return np.fft.ifft2(np.fft.fft2(np.asarray(img, np.complex128)) * ramp)


def ref_model(obj, probe, positions):
    """Independent model intensities: slice, shift with np.fft, |fft2 ortho|^2 summed over modes."""
    n = probe.shape[-1]
    out = []
    for p in np.asarray(positions, float):
        t = p - n / 2
        r = np.floor(t + 0.5).astype(int)
        f = t - r
        win = obj[r[0]:r[0] + n, r[1]:r[1] + n].astype(np.complex128)
        acc = np.zeros((n, n))
        for pk in probe:
            acc += np.abs(np.fft.fft2(ref_shift(pk, f) * win, norm="ortho")) ** 2
        out.append(acc)
    return np.array(out)


def random_corners(rng, B, n, shape):
    return np.stack([rng.integers(0, shape[0] - n + 1, B), rng.integers(0, shape[1] - n + 1, B)],
                    axis=1).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# patches
# ----------------------------------------------------------------------------------------------

def test_extract_patches_matches_slicing():
    rng = np.random.default_rng(0)
    big = crandn(rng, (31, 45))
    obj = big[1:, ::2]  # non-square, non-contiguous view (30, 23)
    n = 7
    corners = random_corners(rng, 9, n, obj.shape)
    corners[0] = (0, 0)
    corners[1] = (obj.shape[0] - n, obj.shape[1] - n)  # touches the bottom-right edge
    patches = extract_patches(obj, corners, n)
    assert patches.shape == (9, n, n)
    assert patches.dtype == obj.dtype
    for b, (r, c) in enumerate(corners):
        np.testing.assert_array_equal(patches[b], obj[r:r + n, c:c + n])


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.float32, np.float64])
def test_scatter_add_matches_loop_and_accumulates(dtype):
    rng = np.random.default_rng(1)
    shape, n = (20, 27), 6
    corners = random_corners(rng, 8, n, shape)
    corners[3] = corners[2]  # identical windows must add twice
    if np.iscomplexobj(np.empty(0, dtype)):
        patches = crandn(rng, (8, n, n), dtype)
        target = crandn(rng, shape, dtype)
    else:
        patches = rng.standard_normal((8, n, n)).astype(dtype)
        target = rng.standard_normal(shape).astype(dtype)
    expected = target.astype(np.complex128 if np.iscomplexobj(target) else np.float64)
    for (r, c), p in zip(corners, patches):
        expected[r:r + n, c:c + n] += p
    out = scatter_add_patches(target, corners, patches)
    assert out is None  # in place
    assert target.dtype == dtype
    tol = 1e-5 if dtype in (np.complex64, np.float32) else 1e-12
    np.testing.assert_allclose(target, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.complex64, np.float32])
def test_scatter_add_gives_the_bits_of_add_at(dtype):
    """The CPU's ordered slice-adds add what np.add.at adds, in its order: the same bits, also
    where many windows overlap (N-worker equivalence and bit-identical resume rely on it)."""
    from daskpty.physics.patches import PatchIndex

    rng = np.random.default_rng(7)
    shape, n, b = (40, 44), 16, 30
    corners = random_corners(rng, b, n, shape)
    patches = (crandn(rng, (b, n, n), dtype) if np.iscomplexobj(np.empty(0, dtype))
               else rng.standard_normal((b, n, n)).astype(dtype))
    index = PatchIndex(corners, n, shape, np)
    got = np.zeros(shape, dtype)
    index.scatter_add(got, patches)
    want = np.zeros(shape, dtype)
    np.add.at(want.reshape(-1), index.flat.reshape(-1), patches.reshape(-1))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["complex", "real"])
def test_extract_scatter_adjoint_fixed(kind):
    rng = np.random.default_rng(2)
    shape, n, B = (33, 29), 9, 12
    corners = random_corners(rng, B, n, shape)
    corners[1] = corners[0]
    corners[2] = corners[0] + 1  # heavily overlapping windows
    if kind == "complex":
        x = crandn(rng, shape)
        y = crandn(rng, (B, n, n))
        target = np.zeros(shape, np.complex64)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
        y = rng.standard_normal((B, n, n)).astype(np.float32)
        target = np.zeros(shape, np.float32)
    ax = extract_patches(x, corners, n)
    scatter_add_patches(target, corners, y)
    assert_adjoint(ax, y, x, target)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 10),
    extra_h=st.integers(0, 14),
    extra_w=st.integers(0, 14),
    B=st.integers(1, 7),
    complex_=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_extract_scatter_adjoint_hypothesis(n, extra_h, extra_w, B, complex_, seed):
    rng = np.random.default_rng(seed)
    shape = (n + extra_h, n + extra_w)
    corners = random_corners(rng, B, n, shape)
    if complex_:
        x, y = crandn(rng, shape), crandn(rng, (B, n, n))
        target = np.zeros(shape, np.complex64)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
        y = rng.standard_normal((B, n, n)).astype(np.float32)
        target = np.zeros(shape, np.float32)
    ax = extract_patches(x, corners, n)
    for b, (r, c) in enumerate(corners):
        np.testing.assert_array_equal(ax[b], x[r:r + n, c:c + n])
    scatter_add_patches(target, corners, y)
    assert_adjoint(ax, y, x, target)


def test_check_windows_inside():
    shape = (20, 30)
    n = 8
    check_windows_inside(np.array([[0, 0], [12, 22]]), n, shape)  # exactly touching the edges
    check_windows_inside(np.zeros((0, 2), np.int64), n, shape)
    for bad in ([[-1, 0]], [[0, -1]], [[13, 0]], [[0, 23]]):
        with pytest.raises(ValueError):
            check_windows_inside(np.array(bad), n, shape)


# ----------------------------------------------------------------------------------------------
# propagation
# ----------------------------------------------------------------------------------------------

def test_far_field_matches_ortho_fft_dc_at_zero():
    rng = np.random.default_rng(3)
    x = crandn(rng, (3, 2, 16, 16))
    y = far_field(x)
    assert y.dtype == np.complex64
    np.testing.assert_allclose(y, np.fft.fft2(x.astype(np.complex128), norm="ortho"), rtol=0, atol=2e-5)
    const = np.full((8, 8), 2.0 + 1.0j, np.complex64)
    fc = far_field(const)
    np.testing.assert_allclose(fc[0, 0], 8 * (2.0 + 1.0j), rtol=1e-6)
    assert np.abs(fc).ravel()[1:].max() < 1e-5


def test_far_field_adjoint_dot_product_and_unitarity():
    rng = np.random.default_rng(4)
    x = crandn(rng, (4, 3, 12, 12))
    y = crandn(rng, (4, 3, 12, 12))
    fx = far_field(x)
    assert_adjoint(fx, y, x, far_field_adjoint(y))
    # norms preserved per image, and the adjoint inverts
    np.testing.assert_allclose(np.linalg.norm(fx, axis=(-2, -1)), np.linalg.norm(x, axis=(-2, -1)),
                               rtol=1e-5)
    np.testing.assert_allclose(far_field_adjoint(fx), x, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# shifts
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [16, 15])
def test_split_positions_convention(n):
    rng = np.random.default_rng(5)
    pos = rng.uniform(-20, 80, (200, 2))
    pos[:4] = [[10.5, 3.5], [n / 2, n / 2], [7.25, -2.75], [0.5 + n / 2, 0.0]]  # half-integer ties
    corners, fractions = split_positions(pos, n)
    assert corners.shape == (200, 2) and corners.dtype == np.int64
    assert fractions.shape == (200, 2) and fractions.dtype == np.float32
    assert np.all(fractions >= -0.5) and np.all(fractions <= 0.5)
    np.testing.assert_allclose(corners + fractions.astype(np.float64), pos - n / 2, rtol=0, atol=1e-5)
    # integer top-left: zero fraction, corner = p - n/2
    c, f = split_positions(np.array([[n / 2 + 3, n / 2 - 1]]), n)
    np.testing.assert_array_equal(c, [[3, -1]])
    np.testing.assert_array_equal(f, [[0.0, 0.0]])


def test_shift_ramps_values():
    n = 8
    fr = np.array([[0.3, -0.2], [0.0, 0.0]])
    ramps = shift_ramps(fr, n)
    assert ramps.shape == (2, n, n) and ramps.dtype == np.complex64
    k = np.fft.fftfreq(n)
    ref = np.exp(-2j * np.pi * (k[:, None] * 0.3 + k[None, :] * -0.2))
    np.testing.assert_allclose(ramps[0], ref, atol=1e-6)
    np.testing.assert_allclose(ramps[1], 1.0, atol=1e-7)


@pytest.mark.parametrize("n", [16, 13])
def test_shift_probe_adjoint_dot_product(n):
    rng = np.random.default_rng(6)
    M, B = 3, 5
    fr = rng.uniform(-0.5, 0.5, (B, 2))
    ramps = shift_ramps(fr, n)
    x = crandn(rng, (M, n, n))
    y = crandn(rng, (B, M, n, n))
    ax = shift_probe(x, ramps)
    assert ax.shape == (B, M, n, n) and ax.dtype == np.complex64
    ahy = shift_probe_adjoint(y, ramps)
    assert ahy.shape == (M, n, n) and ahy.dtype == np.complex64
    assert_adjoint(ax, y, x, ahy)


def test_shift_probe_matches_reference_and_is_unitary():
    rng = np.random.default_rng(7)
    n, M = 16, 2
    probe = crandn(rng, (M, n, n))
    fr = np.array([[0.37, -0.21], [-0.5, 0.5], [0.0, 0.0], [0.1, 0.45]])
    out = shift_probe(probe, shift_ramps(fr, n))
    for b in range(len(fr)):
        for k in range(M):
            np.testing.assert_allclose(out[b, k], ref_shift(probe[k], fr[b]), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(out, axis=(-2, -1)),
                               np.broadcast_to(np.linalg.norm(probe, axis=(-2, -1)), (4, M)), rtol=1e-5)


def test_shift_then_unshift_returns_probe():
    rng = np.random.default_rng(8)
    n, M, B = 16, 3, 6
    probe = crandn(rng, (M, n, n))
    fr = rng.uniform(-0.5, 0.5, (B, 2)).astype(np.float32)
    shifted = shift_probe(probe, shift_ramps(fr, n))
    back = shift_images(shifted, -fr)  # (B, M, n, n) with per-b fractions
    np.testing.assert_allclose(back, np.broadcast_to(probe, (B, M, n, n)), atol=2e-5)
    # and the shift did do something
    assert np.abs(shifted - probe[None]).max() > 0.1


def test_shift_images_integer_is_roll_and_subpixel_sign():
    rng = np.random.default_rng(9)
    n = 16
    imgs = smooth_complex(rng, (4, n, n))
    shifts = np.array([[1, 0], [0, -3], [2, 5], [-4, -1]], dtype=np.float32)
    out = shift_images(imgs, shifts)
    for b, (dy, dx) in enumerate(shifts.astype(int)):
        np.testing.assert_allclose(out[b], np.roll(imgs[b], (dy, dx), axis=(-2, -1)), atol=2e-6)
    # sub-pixel: a band-limited plane wave exp(2 pi i (a y + b x)/n) moved by +f equals the analytic
    # x(r - f) (sign convention S_f P(i) = P(i - f))
    a, b = 3, -2
    iy, ix = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    f = (0.3, -0.4)
    wave = np.exp(2j * np.pi * (a * iy + b * ix) / n)
    expected = np.exp(2j * np.pi * (a * (iy - f[0]) + b * (ix - f[1])) / n)
    got = shift_images(wave[None].astype(np.complex64), np.array([f]))[0]
    np.testing.assert_allclose(got, expected, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# forward model
# ----------------------------------------------------------------------------------------------

def _scan(rng, n, shape, B):
    lo = n / 2 + 0.5
    return np.stack([rng.uniform(lo, shape[0] - n / 2 - 0.5, B),
                     rng.uniform(lo, shape[1] - n / 2 - 0.5, B)], axis=1)


def test_exit_waves_probe_map_adjoint():
    """P -> psi = S_f P . O_window (and P -> F psi) against shift_probe_adjoint(conj(O_window) psi)."""
    rng = np.random.default_rng(10)
    n, M, B, shape = 12, 2, 7, (40, 36)
    obj = crandn(rng, shape)
    corners, fr = split_positions(_scan(rng, n, shape, B), n)
    ramps = shift_ramps(fr, n)
    x = crandn(rng, (M, n, n))
    y = crandn(rng, (B, M, n, n))
    psi, shifted, patches = exit_waves(obj, x, corners, ramps)
    assert psi.shape == (B, M, n, n) and patches.shape == (B, n, n)
    np.testing.assert_allclose(psi, shifted * patches[:, None], rtol=1e-6)
    ahy = shift_probe_adjoint(np.conj(patches)[:, None] * y, ramps)
    assert_adjoint(psi, y, x, ahy)
    # through the far field as well
    ahy_far = shift_probe_adjoint(np.conj(patches)[:, None] * far_field_adjoint(y), ramps)
    assert_adjoint(far_field(psi), y, x, ahy_far)


def test_exit_waves_object_map_adjoint():
    """O -> psi = S_f P . O_window against scatter_add(sum_k conj(S_f P_k) psi_k)."""
    rng = np.random.default_rng(11)
    n, M, B, shape = 10, 3, 9, (30, 34)
    probe = crandn(rng, (M, n, n))
    corners, fr = split_positions(_scan(rng, n, shape, B), n)
    ramps = shift_ramps(fr, n)
    x = crandn(rng, shape)
    y = crandn(rng, (B, M, n, n))
    psi, shifted, _ = exit_waves(x, probe, corners, ramps)
    ahy = np.zeros(shape, np.complex64)
    scatter_add_patches(ahy, corners, (np.conj(shifted) * y).sum(axis=1))
    assert_adjoint(psi, y, x, ahy)
    ahy_far = np.zeros(shape, np.complex64)
    scatter_add_patches(ahy_far, corners, (np.conj(shifted) * far_field_adjoint(y)).sum(axis=1))
    assert_adjoint(far_field(psi), y, x, ahy_far)


def test_probe_centre_lands_on_position():
    """With a unit object, the exit-wave intensity centroid (object coordinates) equals p."""
    n = 32
    probe = gaussian_blob(n, (n / 2, n / 2), 3.0)
    pos = np.array([[20.3, 17.8], [25.5, 30.2], [16.0, 16.0], [19.71, 22.49]])
    corners, fr = split_positions(pos, n)
    obj = np.ones((64, 64), np.complex64)
    psi, _, _ = exit_waves(obj, probe, corners, shift_ramps(fr, n))
    w = np.abs(psi[:, 0]) ** 2
    i = np.arange(n)
    cy = (w.sum(axis=2) * i).sum(axis=1) / w.sum(axis=(1, 2))
    cx = (w.sum(axis=1) * i).sum(axis=1) / w.sum(axis=(1, 2))
    np.testing.assert_allclose(np.stack([cy, cx], 1) + corners, pos, atol=1e-3)


def test_model_intensities_matches_reference_and_parseval():
    rng = np.random.default_rng(12)
    n, M, shape = 16, 2, (48, 40)
    obj = crandn(rng, shape)
    probe = crandn(rng, (M, n, n))
    pos = _scan(rng, n, shape, 6)
    I = model_intensities(obj, probe, pos)
    assert I.shape == (6, n, n) and I.dtype == np.float32
    ref = ref_model(obj, probe, pos)
    np.testing.assert_allclose(I, ref, rtol=1e-4, atol=1e-4 * ref.max())
    # Parseval: total counts = sum_k ||S_f P_k . O_window||^2 (real space)
    corners, fr = split_positions(pos, n)
    real_space = []
    for b, (r, c) in enumerate(corners):
        win = obj[r:r + n, c:c + n].astype(np.complex128)
        real_space.append(sum(np.sum(np.abs(ref_shift(pk, fr[b]) * win) ** 2) for pk in probe))
    np.testing.assert_allclose(I.sum(axis=(1, 2), dtype=np.float64), real_space, rtol=1e-5)


def test_model_intensities_2d_probe_equals_single_mode():
    rng = np.random.default_rng(13)
    n = 8
    obj = crandn(rng, (24, 24))
    probe = crandn(rng, (n, n))
    pos = _scan(rng, n, obj.shape, 3)
    np.testing.assert_array_equal(model_intensities(obj, probe, pos),
                                  model_intensities(obj, probe[None], pos))


def test_flat_object_dc_at_index_zero():
    n = 16
    probe = gaussian_blob(n, (n / 2, n / 2), 2.5)  # real, symmetric about the window centre
    obj = np.full((40, 40), 0.7 - 0.2j, np.complex64)
    pos = np.array([[20.0, 20.0], [17.3, 22.6], [24.5, 15.5]])
    I = model_intensities(obj, probe, pos)
    for b in range(len(pos)):
        assert np.unravel_index(np.argmax(I[b]), I[b].shape) == (0, 0)
        centred = np.fft.fftshift(I[b])
        assert np.unravel_index(np.argmax(centred), centred.shape) == (n // 2, n // 2)
        # a flat object makes every pattern the same (a sub-pixel shift only adds a phase ramp)
        np.testing.assert_allclose(I[b], I[0], rtol=1e-4, atol=1e-5 * I[0].max())


@pytest.mark.parametrize("axis,step", [(0, 1), (1, 1), (0, -1), (1, -1)])
def test_one_pixel_move_equals_object_shift(axis, step):
    rng = np.random.default_rng(14)
    n, shape = 12, (40, 40)
    obj = crandn(rng, shape)
    probe = crandn(rng, (2, n, n))
    pos = rng.uniform(n / 2 + 2, shape[0] - n / 2 - 2, (5, 2))  # generic sub-pixel positions
    moved = pos.copy()
    moved[:, axis] += step
    a = model_intensities(obj, probe, moved)
    b = model_intensities(np.roll(obj, -step, axis=axis), probe, pos)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * a.max())
    # the move does change the patterns (the test could fail)
    assert np.abs(a - model_intensities(obj, probe, pos)).max() > 1e-2 * a.max()


def test_model_intensities_raises_outside():
    rng = np.random.default_rng(15)
    n = 8
    obj = crandn(rng, (20, 20))
    probe = crandn(rng, (1, n, n))
    model_intensities(obj, probe, np.array([[4.0, 4.0], [16.0, 16.0]]))  # edges exactly
    for p in ([[3.4, 10.0]], [[10.0, 3.4]], [[16.6, 10.0]], [[10.0, 16.6]], [[-5.0, 40.0]]):
        with pytest.raises(ValueError):
            model_intensities(obj, probe, np.array(p))


# ----------------------------------------------------------------------------------------------
# noise models
# ----------------------------------------------------------------------------------------------

def _far_and_data(rng, B=5, M=2, n=8):
    far = (crandn(rng, (B, M, n, n)) * 3).astype(np.complex64)
    yhat = (np.abs(far.astype(np.complex128)) ** 2).sum(axis=1)
    y = rng.poisson(yhat * rng.uniform(0.3, 3.0, (B, 1, 1))).astype(np.uint16)
    y[:, 0, 1] = 0  # some zero counts
    valid = rng.random((n, n)) > 0.2
    valid[0, 0] = False
    return far, y, valid


def test_model_intensity_sums_modes():
    rng = np.random.default_rng(16)
    far = crandn(rng, (3, 4, 5, 5))
    np.testing.assert_allclose(model_intensity(far), (np.abs(far) ** 2).sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_gaussian_correction_projection(masked):
    rng = np.random.default_rng(17)
    far, y, valid = _far_and_data(rng)
    v = valid if masked else None
    out, yhat = gaussian_correction(far, y, v)
    assert out.shape == far.shape and out.dtype == np.complex64
    np.testing.assert_allclose(yhat, model_intensity(far), rtol=1e-6)
    m = np.broadcast_to(valid if masked else np.ones_like(valid), y.shape)
    new = model_intensity(out.astype(np.complex128))
    np.testing.assert_allclose(new[m], y[m].astype(np.float64), rtol=2e-5, atol=1e-5)
    # phase kept: Psi' = c Psi with c >= 0 (per pixel, the same c for all modes)
    c = (np.conj(far) * out).astype(np.complex128)
    assert np.all(c.real >= -1e-6)
    np.testing.assert_allclose(c.imag, 0, atol=1e-4 * np.abs(c).max())
    if masked:
        mm = np.broadcast_to(~valid, far.shape)
        np.testing.assert_array_equal(out[mm], far[mm])
        assert not np.allclose(new[~m], y[~m])  # masked pixels were not projected
    # the projection is exact: the amplitude loss after one correction is ~0
    before = gaussian_loss(yhat, y, v)
    after = gaussian_loss(model_intensity(out), y, v)
    assert np.all(before > 1.0)
    assert np.all(after <= 1e-8 * y.astype(np.float64).sum(axis=(1, 2)))


def test_gaussian_correction_is_closest_point_brute_force():
    """Single pixel: the correction is the point of {sum_k |Psi'_k|^2 = y} nearest to Psi."""
    rng = np.random.default_rng(18)
    for M in (1, 3):
        for _ in range(5):
            psi = crandn(rng, (1, M, 1, 1)).astype(np.complex64)
            yv = rng.uniform(0.1, 10.0)
            y = np.full((1, 1, 1), yv, np.float32)
            out, _ = gaussian_correction(psi, y)
            o = out.reshape(M).astype(np.complex128)
            p = psi.reshape(M).astype(np.complex128)
            np.testing.assert_allclose(np.sum(np.abs(o) ** 2), yv, rtol=1e-5)
            d_out = np.linalg.norm(o - p)
            if M == 1:
                # grid over the phase of Psi' on the circle |Psi'| = sqrt(y)
                th = np.linspace(-np.pi, np.pi, 20001)
                cand = np.sqrt(yv) * np.exp(1j * th)
                d = np.abs(cand - p[0])
                assert d_out <= d.min() + 1e-5
                np.testing.assert_allclose(o[0], cand[np.argmin(d)], atol=2e-3 * np.sqrt(yv))
                # and the scaling c of Psi minimising (|c Psi| - sqrt y)^2 is sqrt(y)/|Psi|
                cs = np.linspace(0, 3 * np.sqrt(yv) / abs(p[0]), 20001)
                c_best = cs[np.argmin((cs * abs(p[0]) - np.sqrt(yv)) ** 2)]
                np.testing.assert_allclose(abs(o[0]) / abs(p[0]), c_best, rtol=1e-3)
            else:
                # random points on the sphere, and small perturbations of the answer along it
                cand = rng.standard_normal((20000, M)) + 1j * rng.standard_normal((20000, M))
                cand *= np.sqrt(yv) / np.linalg.norm(cand, axis=1, keepdims=True)
                pert = o[None] + 0.05 * (rng.standard_normal((2000, M)) + 1j * rng.standard_normal((2000, M)))
                pert *= np.sqrt(yv) / np.linalg.norm(pert, axis=1, keepdims=True)
                allc = np.concatenate([cand, pert])
                assert d_out <= np.linalg.norm(allc - p, axis=1).min() + 1e-5


def _phi(alpha, yhat, y):
    """Poisson NLL along the LSQML path (one pattern, valid pixels given as flat arrays)."""
    g = 1.0 - y / yhat
    u = 1.0 - np.asarray(alpha)[:, None] * g[None, :]
    yh = yhat[None, :] * u**2
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(y[None, :] > 0, yh - y[None, :] * np.log(yh), yh)
    return t.sum(axis=1)


def _poisson_cases(rng, n=6, K=32):
    yh, ys = [], []
    for kind in range(K):
        yhat = rng.gamma(rng.uniform(0.5, 3.0), 10 ** rng.uniform(-0.5, 3.0), (n, n)) + 0.05
        if kind % 4 == 0:  # data close to the model
            y = rng.poisson(yhat)
        elif kind % 4 == 1:  # model off by a global factor
            y = rng.poisson(yhat * rng.uniform(0.1, 6.0))
        elif kind % 4 == 2:  # almost no counts
            y = np.zeros((n, n))
            y.flat[rng.integers(0, n * n, 2)] = rng.poisson(4.0, 2)
        else:  # many zeros, pixel-wise mismatch
            y = rng.poisson(yhat * rng.uniform(0.3, 3.0, (n, n)))
            y[rng.random((n, n)) < 0.5] = 0
        yh.append(yhat)
        ys.append(y)
    return np.array(yh), np.array(ys, dtype=np.float64)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", [19, 25])
def test_poisson_step_lengths_brute_force(masked, seed):
    rng = np.random.default_rng(seed + masked)
    n = 6
    yhat, y = _poisson_cases(rng, n)
    valid = None
    if masked:
        valid = rng.random((n, n)) > 0.3
        y[:, ~valid] = 1e4  # wild values on masked pixels must not matter
    alpha = poisson_step_lengths(yhat.astype(np.float32), y.astype(np.float32), valid)
    assert alpha.shape == (len(y),)
    assert np.all((alpha >= 0) & (alpha <= 1))
    grid = np.linspace(0.0, 1.0, 20001)
    vm = np.ones((n, n), bool) if valid is None else valid
    for b in range(len(y)):
        yh_b = yhat[b][vm].astype(np.float32).astype(np.float64)
        phi = _phi(grid, yh_b, y[b][vm])
        a_brute = grid[np.argmin(phi)]
        assert abs(alpha[b] - a_brute) <= 1e-3, (b, alpha[b], a_brute)
        assert _phi([alpha[b]], yh_b, y[b][vm])[0] <= phi.min() + 1e-8 * abs(phi.min()) + 1e-8


def test_poisson_step_lengths_sparse_counts_bright_model():
    """Regression: 4 photons against a model of ~hundreds per pixel (4 Newton steps gave 0.9903 vs 0.9889)."""
    yhat = np.array([[[226.8, 174.1, 305.6, 717.5, 42.6, 805.9],
                      [279.8, 1076.1, 1044.6, 601.2, 213.0, 254.1],
                      [268.4, 528.8, 0.3, 128.3, 58.8, 160.6],
                      [740.4, 4.4, 38.0, 42.9, 365.0, 250.1],
                      [225.5, 1464.6, 191.2, 180.0, 1219.0, 111.4],
                      [410.9, 335.3, 479.4, 35.7, 721.8, 341.8]]])
    y = np.zeros_like(yhat)
    y[0, 3, 1] = 2.0
    y[0, 4, 4] = 2.0
    grid = np.linspace(0, 1, 20001)
    phi = _phi(grid, yhat.ravel(), y.ravel())
    a_brute = grid[np.argmin(phi)]
    alpha = poisson_step_lengths(yhat, y)[0]
    assert abs(alpha - a_brute) <= 1e-3, (alpha, a_brute)
    assert _phi([alpha], yhat.ravel(), y.ravel())[0] <= phi.min() + 1e-8 * abs(phi.min())


def test_poisson_step_lengths_boundaries():
    """The optimum lies in [0, 1]: alpha = 1 when there are no counts, alpha = 0 for a perfect model."""
    rng = np.random.default_rng(21)
    yhat = rng.gamma(2.0, 20.0, (3, 6, 6)) + 0.1
    y = np.zeros_like(yhat)
    np.testing.assert_allclose(poisson_step_lengths(yhat, y), 1.0, atol=1e-9)
    # brute force agrees that alpha = 1 is the minimiser for zero counts
    grid = np.linspace(0, 1, 20001)
    assert grid[np.argmin(_phi(grid, yhat[0].ravel(), y[0].ravel()))] == 1.0
    np.testing.assert_allclose(poisson_step_lengths(yhat, yhat.copy()), 0.0, atol=1e-9)


@pytest.mark.parametrize("masked", [False, True])
def test_poisson_correction(masked):
    rng = np.random.default_rng(22)
    far, y, valid = _far_and_data(rng, B=8)
    v = valid if masked else None
    out, yhat = poisson_correction(far, y, v)
    assert out.shape == far.shape and out.dtype == np.complex64
    alpha = poisson_step_lengths(yhat, y, v)
    factor = 1.0 - alpha[:, None, None] * (1.0 - y / (yhat.astype(np.float64) + DEFAULT_EPS))
    if masked:
        factor = np.where(valid, factor, 1.0)
    np.testing.assert_allclose(out, far * factor[:, None], rtol=1e-5, atol=1e-5 * np.abs(far).max())
    if masked:
        mm = np.broadcast_to(~valid, far.shape)
        np.testing.assert_array_equal(out[mm], far[mm])
    before = poisson_loss(yhat, y, v)
    after = poisson_loss(model_intensity(out), y, v)
    assert np.all(after <= before + 1e-6 * np.abs(before))
    assert np.all(after < before - 1e-3 * np.abs(before))  # and it does improve on these data


def test_losses_match_direct_formulas():
    rng = np.random.default_rng(23)
    B, n = 4, 7
    yhat = (rng.gamma(2.0, 5.0, (B, n, n)) + 0.01).astype(np.float32)
    y = rng.poisson(yhat * 1.3).astype(np.uint32)
    valid = rng.random((n, n)) > 0.25
    for v in (None, valid):
        vm = np.ones((n, n), bool) if v is None else v
        g_ref = [sum((np.sqrt(float(yhat[b, i, j])) - np.sqrt(float(y[b, i, j]))) ** 2
                     for i in range(n) for j in range(n) if vm[i, j]) for b in range(B)]
        p_ref = [sum(float(yhat[b, i, j]) - float(y[b, i, j]) * np.log(float(yhat[b, i, j]) + DEFAULT_EPS)
                     + (float(y[b, i, j]) * np.log(float(y[b, i, j])) if y[b, i, j] > 1 else 0.0) - float(y[b, i, j])
                     for i in range(n) for j in range(n) if vm[i, j]) for b in range(B)]
        gl = gaussian_loss(yhat, y, v)
        pl = poisson_loss(yhat, y, v)
        assert gl.shape == (B,) and gl.dtype == np.float64
        assert pl.shape == (B,) and pl.dtype == np.float64
        np.testing.assert_allclose(gl, g_ref, rtol=1e-10)
        np.testing.assert_allclose(pl, p_ref, rtol=1e-10)


# ----------------------------------------------------------------------------------------------
# probe modes
# ----------------------------------------------------------------------------------------------

def test_orthogonalize_modes():
    rng = np.random.default_rng(24)
    M, n = 4, 12
    base = crandn(rng, (M, n, n))
    mix = crandn(rng, (M, M))  # correlated, non-orthogonal modes of unequal power
    probe = np.einsum("km,mij->kij", mix, base).astype(np.complex64)
    probe[2] *= 0.1
    q = orthogonalize_modes(probe)
    assert q.shape == probe.shape and q.dtype == np.complex64
    a = q.reshape(M, -1).astype(np.complex128)
    gram = a.conj() @ a.T
    off = gram - np.diag(np.diag(gram))
    assert np.abs(off).max() <= 1e-5 * np.abs(np.diag(gram)).max()
    pw = np.real(np.diag(gram))
    assert np.all(np.diff(pw) <= 0)
    # total intensity pointwise and the mutual intensity sum_k P_k P_k^H are unchanged
    np.testing.assert_allclose((np.abs(q) ** 2).sum(0), (np.abs(probe) ** 2).sum(0),
                               rtol=1e-5, atol=1e-5 * (np.abs(probe) ** 2).sum(0).max())
    p0 = probe.reshape(M, -1).astype(np.complex128)
    np.testing.assert_allclose(a.T @ a.conj(), p0.T @ p0.conj(), atol=1e-5 * np.abs(p0.T @ p0.conj()).max())
    # so every model intensity is unchanged
    obj = crandn(rng, (30, 30))
    pos = _scan(rng, n, obj.shape, 4)
    i0 = model_intensities(obj, probe, pos)
    np.testing.assert_allclose(model_intensities(obj, q, pos), i0, rtol=1e-4, atol=1e-5 * i0.max())
    # the input was not orthogonal, so the test could fail
    g0 = p0.conj() @ p0.T
    assert np.abs(g0 - np.diag(np.diag(g0))).max() > 0.1 * np.abs(np.diag(g0)).max()


def test_orthogonalize_single_mode_unchanged():
    rng = np.random.default_rng(25)
    p = crandn(rng, (1, 8, 8))
    np.testing.assert_array_equal(orthogonalize_modes(p), p)


def test_mode_powers():
    rng = np.random.default_rng(26)
    p = crandn(rng, (3, 8, 8))
    p[1] *= 3.0
    w = mode_powers(p)
    assert w.shape == (3,)
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
    ref = (np.abs(p.astype(np.complex128)) ** 2).sum(axis=(1, 2))
    np.testing.assert_allclose(w, ref / ref.sum(), rtol=1e-10)
    q = orthogonalize_modes(p)
    wq = mode_powers(q)
    np.testing.assert_allclose(wq.sum(), 1.0, rtol=1e-12)
    assert np.all(np.diff(wq) <= 0)


@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_far_field_update_matches_correction_and_loss(noise, masked):
    from daskpty.physics.noise import far_field_update
    from daskpty.physics.noise_models import get_noise_model

    rng = np.random.default_rng(5)
    far = (rng.normal(size=(4, 2, 8, 8)) + 1j * rng.normal(size=(4, 2, 8, 8))).astype(np.complex64)
    y = rng.poisson(3.0, size=(4, 8, 8)).astype(np.uint16)
    valid = rng.random((8, 8)) > 0.2 if masked else None
    delta, yhat, loss = far_field_update(noise, far, y, valid)
    corrected, yhat_ref = get_noise_model(noise, lsqml=True).lsqml_correction(far, y, valid)
    np.testing.assert_allclose(delta, corrected - far, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(yhat, yhat_ref, rtol=1e-6)
    reference_loss = poisson_loss if noise == "poisson" else gaussian_loss
    np.testing.assert_allclose(loss, reference_loss(yhat_ref, y, valid), rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# fast-path helpers used by the LSQML chunk step
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [8, 40])
def test_patch_index_sub_batches_match_slicing(n):
    from daskpty.physics.patches import PatchIndex

    rng = np.random.default_rng(30)
    shape, B = (n + 23, n + 17), 9
    corners = random_corners(rng, B, n, shape)
    corners[1] = corners[0]  # identical windows add twice
    obj = crandn(rng, shape)
    index = PatchIndex(corners, n, shape)
    assert index._inside  # gathers through the window view on the CPU
    out = np.empty((4, n, n), np.complex64)
    for batch in (slice(0, 4), slice(4, 8), slice(8, 9)):
        got = index.extract(obj, batch, out=out[:batch.stop - batch.start])
        for b, (r, c) in enumerate(corners[batch]):
            np.testing.assert_array_equal(got[b], obj[r:r + n, c:c + n])
    patches = crandn(rng, (B, n, n))
    for dtype, vals in ((np.complex64, patches), (np.float32, patches.real.copy())):
        target = np.zeros(shape, dtype)
        for batch in (slice(0, 5), slice(5, 9)):
            index.scatter_add(target, vals[batch], batch)
        expected = np.zeros(shape, np.complex128 if dtype == np.complex64 else np.float64)
        for (r, c), p in zip(corners, vals):
            expected[r:r + n, c:c + n] += p
        np.testing.assert_allclose(target, expected, rtol=1e-5, atol=1e-5)


def test_outer_ramps_and_factors_match_shift_ramps_definition():
    from daskpty.physics.shifts import outer_ramps, shift_ramp_factors

    rng = np.random.default_rng(31)
    n, B = 12, 7
    fr = rng.uniform(-0.5, 0.5, (B, 2)).astype(np.float32)
    k = np.fft.fftfreq(n)
    ref = np.exp(-2j * np.pi * (fr[:, 0, None, None] * k[None, :, None] + fr[:, 1, None, None] * k[None, None, :]))
    ry, rx = shift_ramp_factors(fr, n)
    assert ry.dtype == rx.dtype == np.complex64 and ry.shape == rx.shape == (B, n)
    out = np.empty((B + 2, n, n), np.complex64)
    got = outer_ramps(ry[2:5], rx[2:5], out=out[:3])
    assert np.shares_memory(got, out)
    np.testing.assert_allclose(got, ref[2:5], atol=1e-6)
    np.testing.assert_allclose(shift_ramps(fr, n), ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.complex64, np.float32, np.complex128])
@pytest.mark.parametrize("shape", [(5, 3, 7), (4, 2, 1500)])  # one BLAS dot; chunks of 1024 plus a tail
def test_real_dots(dtype, shape):
    from daskpty.physics.backend import real_dots

    rng = np.random.default_rng(32)
    if np.iscomplexobj(np.empty(0, dtype)):
        x, y = crandn(rng, shape, dtype), crandn(rng, shape, dtype)
    else:
        x, y = rng.standard_normal((2, *shape)).astype(dtype)
    ref = (np.conj(x.astype(np.complex128)) * y).real.sum(axis=(1, 2))
    scale = np.abs(x.astype(np.complex128) * y).sum(axis=(1, 2))
    got = real_dots(x, y)
    assert got.dtype == np.float64 and got.shape == (shape[0],)
    assert np.all(np.abs(got - ref) <= 1e-6 * scale)
    shared = real_dots(x, np.broadcast_to(y[0], x.shape))  # a broadcast second operand
    np.testing.assert_allclose(shared, (np.conj(x.astype(np.complex128)) * y[0]).real.sum(axis=(1, 2)),
                               rtol=1e-5, atol=1e-6 * scale.max())


@pytest.mark.parametrize("shape", [(5, 3, 7), (4, 2, 1500), (3, 32, 64)])  # one product; chunks plus a tail; exact chunks
def test_channel_dots_and_real_dots_with(shape):
    """The two batched forms of real_dots equal float64 sums: channel_dots (real weights against two
    real images packed as one complex array) and real_dots_with (every item against a few fixed
    arrays), to the precision real_dots promises."""
    from daskpty.physics.backend import channel_dots, real_dots_with

    rng = np.random.default_rng(33)
    w = rng.random(shape).astype(np.float32)
    packed = crandn(rng, shape, np.complex64)
    ref = np.stack([(w * packed.real.astype(np.float64)).sum(axis=(1, 2)),
                    (w * packed.imag.astype(np.float64)).sum(axis=(1, 2))], 1)
    got = channel_dots(w, packed)
    assert got.dtype == np.float64 and got.shape == (shape[0], 2)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(w[..., None] * np.abs(packed)[..., None]).sum())
    x = crandn(rng, (shape[0], 2) + shape[1:], np.complex64)       # items of two modes
    fixed = [crandn(rng, x.shape[1:], np.complex64) for _ in range(3)]
    ref = np.stack([(np.conj(x.astype(np.complex128)) * f).real.sum(axis=(1, 2, 3)) for f in fixed], 1)
    scale = max(np.abs(x.astype(np.complex128) * f).sum() for f in fixed)
    got = real_dots_with(x, fixed)
    assert got.dtype == np.float64 and got.shape == (shape[0], 3)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
def test_far_field_update_overwrite_writes_in_place(noise):
    from daskpty.physics.noise import far_field_update

    rng = np.random.default_rng(33)
    far, y, valid = _far_and_data(rng)
    expected, _, loss_ref = far_field_update(noise, far, y, valid)
    buf = far.copy()
    delta, _, loss = far_field_update(noise, buf, y, valid, overwrite=True)
    assert np.shares_memory(delta, buf)
    np.testing.assert_array_equal(delta, expected)
    np.testing.assert_array_equal(loss, loss_ref)


def _poisson_step_lengths_reference(yhat, y, valid=None, eps=DEFAULT_EPS, iterations=10):
    """The Newton iteration written out directly (float64 throughout)."""
    yhat, y = yhat.astype(np.float64), y.astype(np.float64)
    g = 1.0 - y / (yhat + eps)
    if valid is not None:
        g = g * valid
    alpha = np.full(yhat.shape[0], 0.5)
    for _ in range(iterations):
        u = np.maximum(1.0 - alpha[:, None, None] * g, 1e-6)
        d1 = (-2.0 * g * yhat * u + 2.0 * y * g / u).sum(axis=(-2, -1))
        d2 = (2.0 * g * g * yhat + 2.0 * y * g * g / (u * u)).sum(axis=(-2, -1))
        alpha = np.clip(alpha - d1 / np.maximum(d2, 1e-30), 0.0, 1.0)
    return alpha


@pytest.mark.parametrize("masked", [False, True])
def test_poisson_step_lengths_match_direct_newton(masked):
    """Including patterns that drive α to 1 (no counts: the u ≥ 1e-6 clamp is active)."""
    rng = np.random.default_rng(34)
    yhat, y = _poisson_cases(rng, n=8)
    y[:3] = 0
    y[3, 0, 0] = 1
    y[4] = -1.0  # negative (background-subtracted) data: g > 1
    valid = rng.random((8, 8)) > 0.3 if masked else None
    got = poisson_step_lengths(yhat.astype(np.float32), y.astype(np.float32), valid)
    ref = _poisson_step_lengths_reference(yhat.astype(np.float32), y.astype(np.float32), valid)
    assert np.all(got[:3] == 1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


def test_the_poisson_loss_is_zero_at_the_counts_and_positive_elsewhere():
    """poisson_loss is Σ ŷ − y log(ŷ+ε) plus a constant of the data that makes it vanish where the
    model equals the counts: positive for any other model, the same offset for every model."""
    rng = np.random.default_rng(3)
    y = rng.poisson(rng.gamma(1.0, 6.0, (4, 8, 8))).astype(np.float32)

    def raw(yhat):
        return (yhat - y * np.log(yhat + DEFAULT_EPS)).sum(axis=(1, 2))

    np.testing.assert_allclose(poisson_loss(y.astype(np.float64), y), 0.0, atol=1e-3)
    models = [y * 1.2 + 0.5, y * 0.8 + 0.2, np.full_like(y, y.mean())]
    assert all((poisson_loss(m, y) > 1.0).all() for m in models)
    offsets = [poisson_loss(m, y) - raw(m.astype(np.float64)) for m in models]
    np.testing.assert_allclose(offsets[0], offsets[1], rtol=1e-9)
    np.testing.assert_allclose(offsets[0], offsets[2], rtol=1e-9)
