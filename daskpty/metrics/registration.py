"""Registration of an estimate to a reference: global complex scale, sub-pixel shift, linear phase ramp.

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
