"""Figures of merit: aligned NRMSE, Fourier ring correlation, probe error; half-set FRC.

Half-set FRC (:func:`half_set_frc`, :func:`registered_frc`, :func:`split_halves`; implemented in
:mod:`daskpty.half_set`) needs no ground truth: it compares reconstructions of two halves of the data.

Pure NumPy/SciPy, host arrays only (pass ``cupy.asnumpy(x)`` for device arrays; only
:func:`half_set_frc`, which runs reconstructions, imports dask, when called). Reductions run in
float64 / complex128 whatever the input precision.

Conventions
-----------
A shift ``s = (sy, sx)`` in pixels acts as ``S_s x(r) = x(r - s)``, applied as a periodic Fourier shift
``F^-1[F[x] exp(-2πi f·s)]`` (the same convention as :mod:`daskpty.physics.shifts`). A linear phase ramp
of frequency ``k = (ky, kx)`` in cycles/pixel multiplies by ``exp(+2πi k·r)`` with ``r`` the pixel index
(the origin only changes a constant phase, which the complex scale absorbs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Alignment", "FRCResult", "HalfSetFRC", "align", "frc", "half_set_frc", "nrmse", "probe_error",
           "registered_frc", "split_halves"]

# Half-set FRC lives in daskpty/half_set.py (it runs reconstructions); its names are served from
# here lazily, so that importing either module first works.
_HALF_SET = ("BAND", "HalfSetFRC", "common_region", "half_set_frc", "illumination_map", "registered_frc",
             "split_halves")


def __getattr__(name):
    if name in _HALF_SET:
        from . import half_set

        return getattr(half_set, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Zoom stages of the sub-pixel peak search: (step, half-width in steps), in units of one coarse bin
# (one pixel for shifts, one FFT bin 1/H, 1/W for ramps); the last grid is refined by a quadratic fit.
_ZOOM = ((0.1, 15), (0.01, 10), (0.001, 10))
_MAX_ITER = 8


@dataclass(frozen=True)
class Alignment:
    """Parameters found by :func:`align`.

    Attributes
    ----------
    shift : tuple of float
        ``(sy, sx)`` in pixels, applied to the estimate (``x(r) -> x(r - s)``).
    ramp : tuple of float
        ``(ky, kx)`` in cycles/pixel; the estimate is multiplied by ``exp(2πi k·r)``.
    scale : complex
        Global complex factor applied last.
    """

    shift: tuple[float, float]
    ramp: tuple[float, float]
    scale: complex


@dataclass(frozen=True)
class FRCResult:
    """Result of :func:`frc`.

    Attributes
    ----------
    frequency : ndarray
        Ring centre frequencies in cycles/pixel, 0 … 0.5.
    frc : ndarray
        Fourier ring correlation per ring.
    half_bit : ndarray
        ½-bit threshold per ring (van Heel & Schatz 2005).
    n_pixels : ndarray
        Number of Fourier pixels in each ring.
    resolution : float or None
        First frequency (above DC, linearly interpolated between rings) where ``frc`` drops below
        ``half_bit``; ``None`` if it never does.
    """

    frequency: np.ndarray
    frc: np.ndarray
    half_bit: np.ndarray
    n_pixels: np.ndarray
    resolution: float | None


# --------------------------------------------------------------------------------------------------
# helpers


def _as_image(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    while x.ndim > 2 and x.shape[0] == 1:  # e.g. a (1, H, W) single-slice object
        x = x[0]
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D image (H, W); got shape {x.shape}")
    return x


def _check_pair(estimate, truth, names=("estimate", "truth")):
    a = _as_image(estimate, names[0])
    b = _as_image(truth, names[1])
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {names[0]} has shape {a.shape}, {names[1]} has shape {b.shape}")
    return a, b


def _check_mask(mask, shape) -> np.ndarray:
    if mask is None:
        return np.ones(shape, dtype=bool)
    m = _as_image(mask, "mask")
    if m.shape != tuple(shape):
        raise ValueError(f"shape mismatch: mask has shape {m.shape}, images have shape {tuple(shape)}")
    m = m.astype(bool)
    if not m.any():
        raise ValueError("mask selects no pixels")
    return m


def _fourier_shift(x: np.ndarray, s) -> np.ndarray:
    """Periodic shift ``x(r) -> x(r - s)``; exact ``np.roll`` for integer shifts."""
    sy, sx = float(s[0]), float(s[1])
    if sy == round(sy) and sx == round(sx):
        return np.roll(x, (int(round(sy)), int(round(sx))), axis=(0, 1))
    fy = np.fft.fftfreq(x.shape[0])[:, None]
    fx = np.fft.fftfreq(x.shape[1])[None, :]
    ramp = np.exp(-2j * np.pi * fy * sy) * np.exp(-2j * np.pi * fx * sx)
    return np.fft.ifft2(np.fft.fft2(x) * ramp)


def _phase_ramp(shape, k) -> np.ndarray:
    ry = np.exp(2j * np.pi * float(k[0]) * np.arange(shape[0]))[:, None]
    rx = np.exp(2j * np.pi * float(k[1]) * np.arange(shape[1]))[None, :]
    return ry * rx


def _dft(x: np.ndarray, u, w, vy, vx, sign: float) -> np.ndarray:
    """``sum_ab x[a, b] exp(sign 2πi (vy u_a + vx w_b))`` on the grid ``vy × vx`` (matrix-product DFT)."""
    ey = np.exp(sign * 2j * np.pi * np.outer(vy, u))
    ex = np.exp(sign * 2j * np.pi * np.outer(w, vx))
    return ey @ x @ ex


def _signed_peak(index, n):
    """Map an FFT index to the signed range [-n/2, n/2)."""
    return index - n if index >= (n + 1) // 2 else index


def _zoom(objective, v0, unit) -> np.ndarray:
    """Maximise ``objective(vy_grid, vx_grid) -> 2-D array`` by successively finer grids around ``v0``."""
    v = np.array(v0, dtype=np.float64)
    unit = np.asarray(unit, dtype=np.float64)
    for step, half in _ZOOM:
        g = np.arange(-half, half + 1) * step
        vy = v[0] + g * unit[0]
        vx = v[1] + g * unit[1]
        vals = objective(vy, vx)
        i, j = np.unravel_index(np.argmax(vals), vals.shape)
        v = np.array([vy[i], vx[j]])
    if 0 < i < len(vy) - 1 and 0 < j < len(vx) - 1:
        v = v + _quadratic_vertex(vals[i - 1 : i + 2, j - 1 : j + 2]) * step * unit
    return v


def _quadratic_vertex(f) -> np.ndarray:
    """Vertex (in steps, clipped to ±1) of the 2-D quadratic least-squares fit to a 3×3 patch."""
    f = f / np.max(np.abs(f))
    y, x = np.mgrid[-1:2, -1:2]
    y, x = y.ravel().astype(float), x.ravel().astype(float)
    basis = np.stack([np.ones(9), y, x, y * y, x * x, x * y], axis=1)
    c = np.linalg.lstsq(basis, f.ravel(), rcond=None)[0]
    hess = np.array([[2 * c[3], c[5]], [c[5], 2 * c[4]]])
    if not (hess[0, 0] < 0 and np.linalg.det(hess) > 0):  # not a maximum: keep the grid point
        return np.zeros(2)
    return np.clip(np.linalg.solve(hess, -c[1:3]), -1.0, 1.0)


class _Problem:
    """Joint estimate of shift ``s`` and ramp ``k`` maximising the explained energy

    ``|<S_s(R_k y), m t>|^2 / ||m S_s(R_k y)||^2`` (the fraction of ``m t`` a complex scale can fit).
    """

    def __init__(self, y, t, m):
        self.y, self.shape = y, y.shape
        h, w = y.shape
        self.n = h * w
        self.fy, self.fx = np.fft.fftfreq(h), np.fft.fftfreq(w)
        self.ry, self.rx = np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64)
        self.mt = m * t
        self.MT = np.fft.fft2(self.mt)
        # ||m S_s y||^2 = sum_r m(r) |y|^2(r - s): a cross-correlation of m with |y|^2
        # (|S_s y|^2 ~ S_s |y|^2, exact for images band-limited to half the Nyquist frequency).
        self.E = np.fft.fft2(m.astype(np.float64)) * np.conj(np.fft.fft2(np.abs(y) ** 2))

    # -- shift given ramp ---------------------------------------------------------------------------
    def _shift_ratio(self, c, e):
        e = np.real(e)
        tiny = 1e-12 * max(float(np.max(np.abs(e))), np.finfo(float).tiny)
        return np.where(e > tiny, np.abs(c) ** 2 / np.maximum(e, tiny), 0.0)

    def shift_map(self, k):
        """Objective on the integer shift grid (FFT ordering)."""
        X = np.fft.fft2(self.y * _phase_ramp(self.shape, k))
        c = np.fft.ifft2(self.MT * np.conj(X))
        e = np.fft.ifft2(self.E)
        return self._shift_ratio(c, e), X

    def shift_global(self, k):
        vals, X = self.shift_map(k)
        i, j = np.unravel_index(np.argmax(vals), vals.shape)
        return np.array([_signed_peak(i, self.shape[0]), _signed_peak(j, self.shape[1])], float), X

    def shift_refine(self, k, s0):
        X = np.fft.fft2(self.y * _phase_ramp(self.shape, k))
        cross = self.MT * np.conj(X)

        def objective(vy, vx):
            c = _dft(cross, self.fy, self.fx, vy, vx, +1.0) / self.n
            e = _dft(self.E, self.fy, self.fx, vy, vx, +1.0) / self.n
            return self._shift_ratio(c, e)

        return _zoom(objective, s0, (1.0, 1.0))

    def shift_init_ramp_invariant(self):
        """Integer shift from cross-correlating the products x(r + e) conj(x(r)) (e = unit step in y
        and x): a linear phase ramp only multiplies them by a constant, so this is ramp-invariant."""
        score = np.zeros(self.shape)
        for ax in (0, 1):
            qt = np.roll(self.mt, -1, axis=ax) * np.conj(self.mt)
            qy = np.roll(self.y, -1, axis=ax) * np.conj(self.y)
            score += np.abs(np.fft.ifft2(np.fft.fft2(qt) * np.conj(np.fft.fft2(qy))))
        i, j = np.unravel_index(np.argmax(score), score.shape)
        return np.array([_signed_peak(i, self.shape[0]), _signed_peak(j, self.shape[1])], float)

    # -- ramp given shift ---------------------------------------------------------------------------
    def _ramp_product(self, s):
        # <S_s R_k y, m t> = <R_k y, S_{-s}(m t)> = sum_r p(r) exp(-2πi k·r)
        return np.conj(self.y) * _fourier_shift(self.mt, -np.asarray(s))

    def ramp_global(self, s):
        p = self._ramp_product(s)
        vals = np.abs(np.fft.fft2(p))
        i, j = np.unravel_index(np.argmax(vals), vals.shape)
        h, w = self.shape
        return np.array([_signed_peak(i, h) / h, _signed_peak(j, w) / w])

    def ramp_refine(self, s, k0):
        p = self._ramp_product(s)

        def objective(vy, vx):
            return np.abs(_dft(p, self.ry, self.rx, vy, vx, -1.0))

        return _zoom(objective, k0, (1.0 / self.shape[0], 1.0 / self.shape[1]))


def _estimate(y, t, m, subpixel: bool, ramp: bool):
    prob = _Problem(y, t, m)
    k = np.zeros(2)
    if not ramp:
        s, _ = prob.shift_global(k)
        if subpixel:
            s = prob.shift_refine(k, s)
        return s, k
    # Two starts: the ramp-invariant shift (robust to large ramps) and the plain cross-correlation
    # peak (robust for smooth objects with masks); keep the fit that explains more of the truth.
    best = None
    for s0 in (prob.shift_init_ramp_invariant(), prob.shift_global(k)[0]):
        s, k_fit = _iterate(prob, s0, y.shape, subpixel)
        score = _fit_fraction(y, t, m, s, k_fit)
        if best is None or score > best[0]:
            best = (score, s, k_fit)
    return best[1], best[2]


def _fit_fraction(y, t, m, s, k) -> float:
    a = _fourier_shift(y * _phase_ramp(y.shape, k), s)[m]
    den = float(np.sum(np.abs(a) ** 2)) * float(np.sum(np.abs(t[m]) ** 2))
    return float(np.abs(np.vdot(a, t[m])) ** 2 / den) if den > 0 else 0.0


def _iterate(prob, s, shape, subpixel):
    k = np.zeros(2)
    for it in range(_MAX_ITER):
        k_new = prob.ramp_global(s) if it == 0 else k
        k_new = prob.ramp_refine(s, k_new)
        if subpixel:
            s_new = prob.shift_refine(k_new, s)
        else:
            s_new, _ = prob.shift_global(k_new)
        done = it > 0 and np.all(np.abs(s_new - s) < 2e-3) and np.all(
            np.abs(k_new - k) * np.array(shape) < 2e-3
        )
        s, k = s_new, k_new
        if done:
            break
    return s, k


def _align(estimate, truth, mask, subpixel, ramp):
    """complex128 aligned estimate, its parameters, truth (complex128) and the boolean mask."""
    y, t = _check_pair(estimate, truth)
    m = _check_mask(mask, t.shape)
    if not np.all(np.isfinite(t)):
        raise ValueError("truth contains non-finite values")
    if not np.all(np.isfinite(y)):
        raise ValueError("estimate contains non-finite values")
    y = y.astype(np.complex128)
    t = t.astype(np.complex128)
    s, k = _estimate(y, t, m, bool(subpixel), bool(ramp))
    if not subpixel:
        s = np.round(s)
    # Ramp removed before the shift: equal to "shift, then ramp" up to a constant phase (absorbed by
    # the scale), and a periodic shift of the de-ramped image adds no wrap-around phase jump.
    a = _fourier_shift(y * _phase_ramp(y.shape, k), s)
    den = float(np.sum(np.abs(a[m]) ** 2))
    c = complex(np.vdot(a[m], t[m]) / den) if den > 0 else 0j
    a *= c
    params = Alignment(shift=(float(s[0]), float(s[1])), ramp=(float(k[0]), float(k[1])), scale=c)
    return a, params, t, m


# --------------------------------------------------------------------------------------------------
# public API


def align(estimate, truth, *, mask=None, subpixel=True, ramp=True, return_params=False):
    """Align ``estimate`` to ``truth`` up to translation, linear phase ramp and complex scale.

    The shift ``s``, ramp ``k`` and scale ``c`` maximise the fit of ``c S_s(R_k estimate)`` to
    ``truth`` inside ``mask``. The shift comes from the peak of the (mask-normalised) cross-correlation,
    refined by matrix-product DFT upsampling (grids down to 1e-3 px, then a quadratic fit); it is initialised by a cross-correlation of
    neighbour products ``x(r+1) conj(x(r))``, which is invariant to phase ramps, so large ramps do not
    spoil it. The ramp is the peak of ``|DFT[conj(estimate) · S_{-s}(mask · truth)]|``, refined the same
    way (no phase unwrapping). Shift and ramp are refined alternately until they settle; the scale is
    the least-squares ``c = <a, truth>_mask / <a, a>_mask``.

    Parameters
    ----------
    estimate, truth : array_like, shape (H, W)
        Complex (or real) images; leading length-1 axes are dropped.
    mask : array_like of bool, shape (H, W), optional
        Pixels that count (e.g. the well-illuminated region). Default: all.
    subpixel : bool
        Refine the shift below one pixel (Fourier shift); otherwise an integer ``np.roll``.
    ramp : bool
        Remove a linear phase ramp.
    return_params : bool
        Also return the :class:`Alignment` found.

    Returns
    -------
    aligned : ndarray, shape (H, W)
        The transformed estimate, complex64 for single-precision input, else complex128. The shift is
        periodic: pixels within ``|s|`` of the border wrap around, so keep them out of ``mask``.
    params : Alignment
        Only if ``return_params``.

    Raises
    ------
    ValueError
        On shape mismatch, non-2-D input, an empty mask or non-finite values.
    """
    a, params, _, _ = _align(estimate, truth, mask, subpixel, ramp)
    dtype = np.result_type(np.asarray(estimate).dtype, np.complex64)
    a = a.astype(dtype, copy=False)
    return (a, params) if return_params else a


def nrmse(estimate, truth, *, mask=None, subpixel=True, ramp=True) -> float:
    """Normalised RMS error after :func:`align`.

    ``sqrt( sum_mask |align(estimate) - truth|^2 / sum_mask |truth|^2 )``: 0 for a perfect
    reconstruction, about 1 for an unrelated image.

    Parameters
    ----------
    estimate, truth : array_like, shape (H, W)
        Complex (or real) images of equal shape.
    mask : array_like of bool, shape (H, W), optional
        Pixels that count. Default: all.
    subpixel, ramp : bool
        Passed to :func:`align`.

    Returns
    -------
    float
        ``nan`` if ``estimate`` contains non-finite values (a diverged reconstruction).

    Raises
    ------
    ValueError
        On shape mismatch, an empty mask or a truth that is zero (or non-finite) inside the mask.
    """
    y, t = _check_pair(estimate, truth)
    m = _check_mask(mask, t.shape)
    if not np.all(np.isfinite(t)):
        raise ValueError("truth contains non-finite values")
    if not np.all(np.isfinite(y)):
        return float("nan")
    norm = float(np.sum(np.abs(t[m].astype(np.complex128)) ** 2))
    if norm == 0:
        raise ValueError("truth is zero inside the mask")
    a, _, t, m = _align(y, t, m, subpixel, ramp)
    return float(np.sqrt(np.sum(np.abs(a[m] - t[m]) ** 2) / norm))


def frc(a, b, *, n_bins=None, window=True) -> FRCResult:
    """Fourier ring correlation of two images with the ½-bit threshold.

    ``FRC(ring) = Re sum A conj(B) / sqrt(sum |A|^2 sum |B|^2)`` over the Fourier pixels of each ring
    (``A``, ``B`` the 2-D DFTs). The real part is the standard (unbiased) definition; for complex
    reconstructions remove the global phase first (e.g. with :func:`align`). Threshold
    ``T(n) = (0.2071 + 1.9102/sqrt(n)) / (1.2071 + 0.9102/sqrt(n))`` with ``n`` the ring's pixel count
    (van Heel & Schatz 2005).

    Parameters
    ----------
    a, b : array_like, shape (H, W)
        Real or complex images of equal shape (e.g. two independent reconstructions).
    n_bins : int, optional
        Number of rings between 0 and 0.5 cycles/pixel; ring ``i`` collects pixels with
        ``round(|f| / (0.5/n_bins)) == i``. Default ``min(H, W) // 2`` (one-pixel rings). Corner
        pixels beyond 0.5 cycles/pixel are ignored, as are empty rings.
    window : bool or float
        Apodise both images with a separable Tukey window before the DFT to suppress the edge
        discontinuity of non-periodic images. ``True`` uses taper fraction 0.25; a float in (0, 1]
        sets it (1 = Hann). ``False``: no window.

    Returns
    -------
    FRCResult
    """
    a, b = _check_pair(a, b, names=("a", "b"))
    h, w = a.shape
    a = a.astype(np.complex128)
    b = b.astype(np.complex128)
    if window is not False and window is not None:
        alpha = 0.25 if window is True else float(window)
        if not 0 < alpha <= 1:
            raise ValueError(f"window taper fraction must lie in (0, 1]; got {window}")
        from scipy.signal.windows import tukey

        win = tukey(h, alpha)[:, None] * tukey(w, alpha)[None, :]
        a = a * win
        b = b * win
    A = np.fft.fft2(a)
    B = np.fft.fft2(b)
    if n_bins is None:
        n_bins = max(min(h, w) // 2, 1)
    n_bins = int(n_bins)
    if n_bins < 1:
        raise ValueError(f"n_bins must be positive; got {n_bins}")
    width = 0.5 / n_bins
    radius = np.hypot(np.fft.fftfreq(h)[:, None], np.fft.fftfreq(w)[None, :])
    idx = np.rint(radius / width).astype(np.int64)
    keep = idx <= n_bins
    idx = idx[keep]
    count = np.bincount(idx, minlength=n_bins + 1)
    num = np.bincount(idx, weights=np.real(A * np.conj(B))[keep], minlength=n_bins + 1)
    pa = np.bincount(idx, weights=(np.abs(A) ** 2)[keep], minlength=n_bins + 1)
    pb = np.bincount(idx, weights=(np.abs(B) ** 2)[keep], minlength=n_bins + 1)
    ring = np.nonzero(count)[0]
    den = np.sqrt(pa[ring] * pb[ring])
    values = np.divide(num[ring], den, out=np.zeros(ring.size), where=den > 0)
    n = count[ring].astype(np.float64)
    rn = np.sqrt(n)
    half_bit = (0.2071 + 1.9102 / rn) / (1.2071 + 0.9102 / rn)
    freq = ring * width

    resolution = None
    below = np.nonzero((values < half_bit) & (ring > 0))[0]
    if below.size:
        i = int(below[0])
        resolution = float(freq[i])
        if i > 0 and ring[i - 1] > 0:  # interpolate the crossing between the previous ring and this one
            d0 = values[i - 1] - half_bit[i - 1]
            d1 = values[i] - half_bit[i]
            resolution = float(freq[i - 1] + (freq[i] - freq[i - 1]) * d0 / (d0 - d1))
    return FRCResult(frequency=freq, frc=values, half_bit=half_bit, n_pixels=count[ring], resolution=resolution)


def probe_error(estimate, truth) -> float:
    """Error of probe modes up to mode mixing, global phase and global scale.

    Mixed-state probes are only defined up to a unitary mixing of the modes, so the comparison is made
    on the density matrices ``rho = sum_k p_k p_k^H`` (``p_k`` a mode flattened to a vector). With
    ``C = <rho_e, rho_t>_F / (||rho_e||_F ||rho_t||_F)`` (the cosine similarity, in [0, 1]) the error is
    ``sqrt(1 - C)``. For single modes ``C = |<e, t>|^2 / (||e||^2 ||t||^2)``, so this equals the usual
    relative error ``min_c ||c e - t|| / ||t||`` after a global complex scale fit. In general it relates
    to the relative Frobenius error of the density matrices after a scale fit,
    ``e_F = min_s ||s rho_e - rho_t||_F / ||rho_t||_F = sqrt(1 - C^2)``, by ``sqrt(1 - C) = e_F / sqrt(1 + C)``
    (about ``e_F / sqrt(2)`` for small errors).

    The n² × n² density matrices are never formed: with ``E`` (M_e × n²) and ``T`` (M_t × n²) the mode
    matrices, ``||rho_e||_F = ||conj(E) E^T||_F`` and ``<rho_e, rho_t>_F = ||conj(E) T^T||_F^2`` use only
    the small Gram matrices.

    Parameters
    ----------
    estimate, truth : array_like, shape (M, n, n) or (n, n)
        Probe modes; the mode counts may differ (e.g. an extra, empty mode), the mode shape may not.

    Returns
    -------
    float
        0 when ``rho_e`` is proportional to ``rho_t``; 1 for probes with orthogonal supports.

    Raises
    ------
    ValueError
        On mismatched mode shapes or an all-zero probe.
    """
    e = np.asarray(estimate)
    t = np.asarray(truth)
    if e.ndim == 2:
        e = e[None]
    if t.ndim == 2:
        t = t[None]
    if e.ndim != 3 or t.ndim != 3:
        raise ValueError(f"probes must have shape (M, n, n) or (n, n); got {np.shape(estimate)} and {np.shape(truth)}")
    if e.shape[1:] != t.shape[1:]:
        raise ValueError(f"shape mismatch: estimate modes are {e.shape[1:]}, truth modes are {t.shape[1:]}")
    E = e.reshape(e.shape[0], -1).astype(np.complex128)
    T = t.reshape(t.shape[0], -1).astype(np.complex128)
    ne, nt = np.linalg.norm(E), np.linalg.norm(T)
    if ne == 0 or nt == 0:
        raise ValueError("probe is identically zero")
    E /= ne
    T /= nt
    gee = np.linalg.norm(np.conj(E) @ E.T)
    gtt = np.linalg.norm(np.conj(T) @ T.T)
    get = np.linalg.norm(np.conj(E) @ T.T) ** 2
    cos = min(max(get / (gee * gtt), 0.0), 1.0)
    return float(np.sqrt(1.0 - cos))


#: Objects larger than this (pixels per side, in the truth frame) are compared on a central crop of
#: this side: the alignment's FFTs and zoomed DFTs then cost the same at any object size.
NRMSE_CROP = 2048


def _frame_offset(positions, truth_positions=None, origin=None) -> tuple[int, int]:
    """Integer offset ``(dy, dx)`` from the truth frame to the reconstruction's frame."""
    if truth_positions is not None and np.shape(truth_positions) == np.shape(positions):
        offset = np.round(np.median(np.asarray(positions) - np.asarray(truth_positions), axis=0))
    else:
        offset = np.round(np.asarray(origin if origin is not None else (0, 0), dtype=np.float64))
    oy, ox = (int(v) for v in offset)
    return oy, ox


def _place(obj, illuminated, offset, window):
    """The reconstruction's pixels (1 outside it) and the mask of ``illuminated`` (a boolean array
    or a callable on a slice of the object's frame) on ``window = (y0, y1, x0, x1)`` of the truth
    frame; only the window is allocated."""
    oy, ox = offset
    y0, y1, x0, x1 = window
    est = np.ones((y1 - y0, x1 - x0), dtype=np.result_type(obj.dtype, np.complex64))
    mask = np.zeros(est.shape, dtype=bool)
    ys, xs = max(y0 + oy, 0), max(x0 + ox, 0)  # the window in the object's frame, clipped to it
    ye, xe = min(y1 + oy, obj.shape[0]), min(x1 + ox, obj.shape[1])
    if ye > ys and xe > xs:
        inside = (slice(ys - oy - y0, ye - oy - y0), slice(xs - ox - x0, xe - ox - x0))
        est[inside] = obj[ys:ye, xs:xe]
        region = (slice(ys, ye), slice(xs, xe))
        mask[inside] = illuminated(region) if callable(illuminated) else np.asarray(illuminated)[region]
    return est, mask


def truth_frame(obj, positions, illuminated, truth_object, truth_positions=None, origin=None):
    """Place a reconstructed object into the ground truth's pixel frame.

    The integer offset between the frames is the median of ``positions - truth_positions``
    (rounded), or ``origin`` when truth positions are not given. Pixels the reconstruction does not
    cover are 1 and lie outside the returned mask. Returns ``(estimate, mask, (dy, dx))``.
    """
    offset = _frame_offset(positions, truth_positions, origin)
    ty, tx = np.shape(truth_object)[-2:]
    est, mask = _place(np.asarray(obj), illuminated, offset, (0, ty, 0, tx))
    return est, mask, offset


def central_window(shape, max_side: int | None = NRMSE_CROP, positions=None) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the whole of ``shape``, or a ``max_side``-wide window (per axis where
    the image is larger) centred on the scan (``positions``' bounding box) or on the image."""
    window = []
    for axis, size in enumerate(shape[-2:]):
        size = int(size)
        if not max_side or size <= max_side:
            window += [0, size]
            continue
        if positions is not None and len(positions):
            p = np.asarray(positions)[:, axis]
            centre = 0.5 * (float(p.min()) + float(p.max()))
        else:
            centre = size / 2
        start = int(np.clip(round(centre - max_side / 2), 0, size - max_side))
        window += [start, start + int(max_side)]
    return tuple(window)


def nrmse_vs_truth(obj, positions, illumination, truth, fraction: float = 0.3, *,
                   max_side: int | None = NRMSE_CROP, return_window: bool = False):
    """Object NRMSE against a ground truth (``truth.object``, ``truth.positions``) on the region
    whose illumination exceeds ``fraction`` of its maximum, after :func:`truth_frame`.

    A truth frame wider than ``max_side`` pixels is compared on a central ``max_side``-wide crop
    (:func:`central_window`, on the scan's centre; None: the whole frame), so the cost and the
    memory stay those of the crop: only the crop of ``truth.object`` is read (a Zarr array is
    fine) and no object-sized temporary is made. ``return_window``: also return the window
    ``(y0, y1, x0, x1)`` in the truth frame, or None when it is the whole frame.
    """
    t_obj = truth.object
    t_pos = getattr(truth, "positions", None)
    shape = tuple(np.shape(t_obj))[-2:]
    window = central_window(shape, max_side, t_pos)
    illumination = np.asarray(illumination)
    threshold = fraction * illumination.max()
    est, mask = _place(np.asarray(obj), lambda region: illumination[region] > threshold,
                       _frame_offset(positions, t_pos), window)
    y0, y1, x0, x1 = window
    value = nrmse(est, np.asarray(t_obj[y0:y1, x0:x1]), mask=mask)
    whole = window == (0, shape[0], 0, shape[1])
    return (value, None if whole else window) if return_window else value
