"""Fused element-wise kernels for the hot chains of the LSQML chunk step and the AD gradient.

Each function has two paths: the NumPy expression it replaces (its reference, and what runs on
the CPU and on CuPy when fusion is off) and a CuPy ``ElementwiseKernel`` / ``ReductionKernel``
path that visits each pixel once (complex64 CuPy arrays only). CuPy is imported lazily and the
kernels are built once, on first use, and cached at module level.

Switch: :func:`set_fused` (this process) or ``DASKPTY_FUSED_KERNELS=0`` in the environment
(read at import, so it reaches dask worker processes started after it is set); default on. The
fused path is also skipped when the ``cupy`` module has no kernel classes (the NumPy-backed
stand-in of tests/test_device_code_path.py).
"""
from __future__ import annotations

import os
import sys

import numpy as np

from .backend import get_xp, is_cupy, real_dots
from .noise import DEFAULT_EPS, _poisson_alpha64, _poisson_loss64, model_intensity
from .noise import far_field_update as _far_field_update_numpy
from .noise_models import get_noise_model, noise_model_names

#: the AD losses: every registered noise model (:mod:`daskpty.physics.noise_models`)
LOSS_NAMES = noise_model_names()

_FUSED = os.environ.get("DASKPTY_FUSED_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")
_KERNELS: dict = {}


def set_fused(enabled: bool) -> None:
    """Turn the fused CuPy kernels on or off in this process (the NumPy expressions run instead)."""
    global _FUSED
    _FUSED = bool(enabled)


def fused_enabled() -> bool:
    """Whether the fused CuPy kernels are switched on (they still need complex64 CuPy arrays)."""
    return _FUSED


def uses_fused(*arrays, dtype=np.complex64) -> bool:
    """True when the fused path runs for these arrays: switched on, all CuPy, the first of
    ``dtype``, and a ``cupy`` module with kernel classes."""
    if not _FUSED or not arrays or not all(is_cupy(a) for a in arrays) or arrays[0].dtype != dtype:
        return False
    cupy = sys.modules.get("cupy")
    return hasattr(cupy, "ElementwiseKernel") and hasattr(cupy, "ReductionKernel")


# --------------------------------------------------------------------------------------------------
# Kernel sources (CUDA C++ through CuPy). Far fields are raw (B, M, n, n) complex64, C-contiguous;
# the loop index i runs over the (B, n, n) pixels: pattern b = i / npix, pixel p = i % npix, mode k
# at (b·M + k)·npix + p. A thread reads all modes of its pixel before writing any of them.

_PIXEL_INTENSITY = r"""
const ptrdiff_t b_ = i / npix, p_ = i - b_ * npix, base_ = b_ * modes * npix + p_;
float s_ = 0.f;
for (int k_ = 0; k_ < modes; ++k_) {
  const complex<float> c_ = far[base_ + k_ * npix];
  s_ += c_.real() * c_.real() + c_.imag() * c_.imag();
}
if (has_bg) s_ += bg[bg_full ? p_ : 0];
const float m_ = has_mask ? mask[p_] : 1.f;
"""

_SCALE_MODES = r"""
for (int k_ = 0; k_ < modes; ++k_) {
  const ptrdiff_t j_ = base_ + k_ * npix;
  far[j_] = far[j_] * f_;
}
"""

# Inputs are const in CuPy's kernels: far fields that a kernel scales in place are a raw *output*.
_FAR_PARAMS = ("raw float32 bg, raw float32 mask, int32 modes, int32 npix, int32 has_bg, int32 bg_full, "
               "int32 has_mask")

_NEWTON_PREAMBLE = r"""
__device__ complex<double> daskpty_newton_terms(float yhat, float y, float m, double alpha, double eps) {
  const double h = yhat, g = m * (1.0 - (double)y / (h + eps));
  double u = 1.0 - alpha * g;
  if (u < 1e-6) u = 1e-6;
  const double yg = (double)y * g, inv = 1.0 / u;
  return complex<double>(yg * inv - g * h * u, g * g * h + yg * g * inv * inv);
}
"""

_DOTS_PREAMBLE = r"""
__device__ complex<double> daskpty_dots_chi(complex<float> d, complex<float> q, complex<float> bb,
                                             complex<float> c) {
  const float ar = d.real() * q.real() - d.imag() * q.imag(), ai = d.real() * q.imag() + d.imag() * q.real();
  return complex<double>((double)ar * c.real() + (double)ai * c.imag(),
                         (double)bb.real() * c.real() + (double)bb.imag() * c.imag());
}
__device__ complex<double> daskpty_dots_norms(complex<float> d, complex<float> q, complex<float> bb) {
  const float ar = d.real() * q.real() - d.imag() * q.imag(), ai = d.real() * q.imag() + d.imag() * q.real();
  return complex<double>((double)ar * ar + (double)ai * ai,
                         (double)bb.real() * bb.real() + (double)bb.imag() * bb.imag());
}
__device__ double daskpty_dots_cross(complex<float> d, complex<float> q, complex<float> bb) {
  const float ar = d.real() * q.real() - d.imag() * q.imag(), ai = d.real() * q.imag() + d.imag() * q.real();
  return (double)ar * bb.real() + (double)ai * bb.imag();
}
__device__ complex<double> daskpty_dots_object(complex<float> d, complex<float> g, float w) {
  return complex<double>((double)d.real() * g.real() + (double)d.imag() * g.imag(),
                         ((double)d.real() * d.real() + (double)d.imag() * d.imag()) * w);
}
"""


def _build(name: str):
    import cupy  # lazy: optional GPU dependency

    ek, rk = cupy.ElementwiseKernel, cupy.ReductionKernel
    if name == "intensity":
        return ek("raw complex64 far, " + _FAR_PARAMS, "float32 yhat", _PIXEL_INTENSITY + "yhat = s_;", "daskpty_intensity")
    if name == "gaussian_update":   # ΔΨ = Ψ (√y − √(ŷ+ε))/√(ŷ+ε) · mask, residual for the loss
        return ek(_FAR_PARAMS + ", float32 y, float32 eps", "float32 yhat, float32 resid, raw complex64 far",
                  _PIXEL_INTENSITY + r"""
yhat = s_;
const float level_ = sqrtf(s_ + eps);
const float r_ = (sqrtf(y) - level_) * m_;
resid = r_;
const float f_ = r_ / level_;
""" + _SCALE_MODES, "daskpty_gaussian_update")
    if name == "poisson_apply":     # ΔΨ = −α_b (1 − y/(ŷ+ε)) · mask · Ψ
        return ek("float32 yhat, float32 y, raw float64 alpha, raw float32 mask, int32 modes, int32 npix, "
                  "int32 has_mask, float64 eps", "float32 factor, raw complex64 far", r"""
const ptrdiff_t b_ = i / npix, p_ = i - b_ * npix, base_ = b_ * modes * npix + p_;
const double m_ = has_mask ? mask[p_] : 1.0;
const float f_ = (float)(-alpha[b_] * (m_ * (1.0 - (double)y / ((double)yhat + eps))));
factor = f_;
""" + _SCALE_MODES, "daskpty_poisson_apply")
    if name == "ad_loss":           # kind 0 Gaussian, 1 Poisson, 2 intensity: 2h'(ŷ) and the loss term
        return ek(_FAR_PARAMS + ", float32 y, float32 eps, int32 kind, int32 write",
                  "float32 yhat, float32 term, raw complex64 far", _PIXEL_INTENSITY + r"""
yhat = s_;
float f_, t_ = 0.f;
if (kind == 0) {
  const float level_ = s_ + eps, u_ = (1.f - sqrtf(y / level_)) * m_;
  t_ = level_ * u_ * u_;
  f_ = 2.f * u_;
} else if (kind == 1) {
  f_ = (2.f - 2.f * (y / (s_ + eps))) * m_;
} else {
  const float r_ = (s_ - y) * m_;
  t_ = r_ * r_;
  f_ = 4.f * r_;
}
term = t_;
if (write) {
""" + _SCALE_MODES + "}", "daskpty_ad_loss")
    if name == "object_gradient":   # g = Σ_k conj(Q_k) χ_k, w = Σ_k |Q_k|²
        return ek("raw complex64 q, raw complex64 chi, int32 modes, int32 npix", "complex64 g, float32 w", r"""
const ptrdiff_t b_ = i / npix, p_ = i - b_ * npix, base_ = b_ * modes * npix + p_;
float gr_ = 0.f, gi_ = 0.f, s_ = 0.f;
for (int k_ = 0; k_ < modes; ++k_) {
  const complex<float> a_ = q[base_ + k_ * npix], c_ = chi[base_ + k_ * npix];
  gr_ += a_.real() * c_.real() + a_.imag() * c_.imag();
  gi_ += a_.real() * c_.imag() - a_.imag() * c_.real();
  s_ += a_.real() * a_.real() + a_.imag() * a_.imag();
}
g = complex<float>(gr_, gi_);
w = s_;
""", "daskpty_object_gradient")
    if name == "conj_product":      # out = a · conj(b) with b (B, n, n) broadcast over the modes
        return ek("complex64 a, raw complex64 bz, int64 per_item, int64 npix", "complex64 res", r"""
const complex<float> c_ = bz[(i / per_item) * npix + i % npix];
res = complex<float>(a.real() * c_.real() + a.imag() * c_.imag(), a.imag() * c_.real() - a.real() * c_.imag());
""", "daskpty_conj_product")
    if name == "poisson_loss":      # Σ mask (ŷ − y − y (log(ŷ+ε) − log max(y, 1))), float64
        return rk("float32 yhat, float32 y, float32 m, float64 eps", "float64 res",
                  "(double)m * ((double)yhat - (double)y - (double)y * (log((double)yhat + eps)"
                  " - ((double)y > 1.0 ? log((double)y) : 0.0)))", "a + b", "res = a", "0",
                  "daskpty_poisson_loss")
    if name == "poisson_newton":    # (Σ yg/u − gŷu, Σ g²ŷ + yg²/u²): φ'/2 and φ''/2
        return rk("float32 yhat, float32 y, float32 m, float64 alpha, float64 eps", "complex128 res",
                  "daskpty_newton_terms(yhat, y, m, alpha, eps)", "a + b", "res = a", "0",
                  "daskpty_poisson_newton", preamble=_NEWTON_PREAMBLE)
    if name == "dots_chi":
        return rk("complex64 d, complex64 q, complex64 bb, complex64 c", "complex128 res",
                  "daskpty_dots_chi(d, q, bb, c)", "a + b", "res = a", "0", "daskpty_dots_chi",
                  preamble=_DOTS_PREAMBLE)
    if name == "dots_norms":
        return rk("complex64 d, complex64 q, complex64 bb", "complex128 res",
                  "daskpty_dots_norms(d, q, bb)", "a + b", "res = a", "0", "daskpty_dots_norms",
                  preamble=_DOTS_PREAMBLE)
    if name == "dots_cross":
        return rk("complex64 d, complex64 q, complex64 bb", "float64 res",
                  "daskpty_dots_cross(d, q, bb)", "a + b", "res = a", "0", "daskpty_dots_cross",
                  preamble=_DOTS_PREAMBLE)
    if name == "dots_object":
        return rk("complex64 d, complex64 g, float32 w", "complex128 res",
                  "daskpty_dots_object(d, g, w)", "a + b", "res = a", "0", "daskpty_dots_object",
                  preamble=_DOTS_PREAMBLE)
    if name == "sum_squares":
        return rk("float32 x", "float64 res", "(double)x * x", "a + b", "res = a", "0", "daskpty_sum_squares")
    raise KeyError(name)


def _kernel(name: str):
    """The CuPy kernel ``name``, built on first use and cached."""
    k = _KERNELS.get(name)
    if k is None:
        k = _KERNELS[name] = _build(name)
    return k


def _contiguous(a, dtype=None):
    xp = get_xp(a)
    return xp.ascontiguousarray(a, dtype=dtype)


def _far_args(far, valid, background):
    """The arguments of :data:`_FAR_PARAMS` for far fields ``far``, and the (B, n, n) pixel shape."""
    import cupy  # lazy: optional GPU dependency

    b, m = far.shape[0], far.shape[1]
    npix = far.shape[-2] * far.shape[-1]
    dummy = cupy.zeros(1, np.float32)
    bg = dummy if background is None else _contiguous(cupy.asarray(background), np.float32)
    mask = dummy if valid is None else _contiguous(cupy.asarray(valid), np.float32)
    if bg.size not in (1, npix):
        raise ValueError(f"background must be (1, 1) or the pattern shape, got {tuple(bg.shape)}")
    return (bg, mask, np.int32(m), np.int32(npix), np.int32(background is not None),
            np.int32(bg.size == npix), np.int32(valid is not None)), (b,) + tuple(far.shape[-2:])


def _mask_broadcast(valid, like):
    """The mask as a float32 array that broadcasts against (B, n, n) (ones (1, 1) when None)."""
    import cupy  # lazy: optional GPU dependency

    if valid is None:
        return cupy.ones((1, 1), np.float32)
    return cupy.asarray(valid).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# Far-field chains


def mode_intensity(far, background=None):
    """ŷ = Σ_k |Ψ_k|² (+ background) of far fields (B, M, n, n) → (B, n, n) float32."""
    if not uses_fused(far):
        yhat = model_intensity(far)
        if background is not None:
            yhat += background
        return yhat
    import cupy  # lazy: optional GPU dependency

    far = _contiguous(far)
    args, shape = _far_args(far, None, background)
    return _kernel("intensity")(far, *args, cupy.empty(shape, np.float32))


def poisson_alpha(yhat, y, valid=None, eps: float = DEFAULT_EPS, iterations: int = 10):
    """Per-pattern Poisson step α ∈ [0, 1] (float64 (B,)) from float32 ŷ and y (B, n, n).

    Reference: :func:`daskpty.physics.noise.poisson_step_lengths` (the same Newton steps from 0.5;
    here each step's two float64 sums are one reduction over the pixels).
    """
    if not (uses_fused(yhat, y, dtype=np.float32)):
        return _poisson_alpha64(yhat.astype(np.float64), y.astype(np.float64), valid, eps, iterations)[0]
    import cupy  # lazy: optional GPU dependency

    yhat = yhat.astype(np.float32, copy=False)
    y = y.astype(np.float32, copy=False)
    mask = _mask_broadcast(valid, yhat)
    kern = _kernel("poisson_newton")
    alpha = cupy.full(yhat.shape[0], 0.5)
    for _ in range(iterations):
        sums = kern(yhat, y, mask, alpha[:, None, None], np.float64(eps), axis=(1, 2))
        d1, d2 = 2.0 * sums.real, 2.0 * sums.imag
        alpha = cupy.clip(alpha - d1 / cupy.maximum(d2, 1e-30), 0.0, 1.0)
    return alpha


def poisson_loss(yhat, y, valid=None, eps: float = DEFAULT_EPS):
    """Σ ŷ − y − y log((ŷ+ε)/y) per pattern (float64 (B,)) over valid pixels (reference:
    :func:`daskpty.physics.noise.poisson_loss`)."""
    if not (uses_fused(yhat, y, dtype=np.float32)):
        return _poisson_loss64(yhat.astype(np.float64), y.astype(np.float64), valid, eps)
    return _kernel("poisson_loss")(yhat.astype(np.float32, copy=False), y.astype(np.float32, copy=False),
                                   _mask_broadcast(valid, yhat), np.float64(eps), axis=(1, 2))


def far_field_update(noise: str, far, y, valid=None, eps: float = DEFAULT_EPS, overwrite: bool = False,
                     background=None):
    """LSQML far-field update ΔΨ = Ψ' − Ψ with ŷ and the per-pattern loss: ``(delta, yhat, loss)``.

    Reference: :func:`daskpty.physics.noise.far_field_update` (same arguments and results). Fused:
    Gaussian in one pass over Ψ plus the loss sum; Poisson as ŷ, the float64 loss, one reduction
    per Newton step of α, and one pass scaling Ψ.
    """
    get_noise_model(noise, lsqml=True)
    if not uses_fused(far) or noise not in ("gaussian", "poisson"):
        return _far_field_update_numpy(noise, far, y, valid, eps, overwrite=overwrite, background=background)
    import cupy  # lazy: optional GPU dependency

    given = far
    far = _contiguous(far) if overwrite else far.copy()
    y = _contiguous(y, np.float32)
    args, shape = _far_args(far, valid, background)
    if noise == "gaussian":
        yhat, resid, _ = _kernel("gaussian_update")(*args, y, np.float32(eps), cupy.empty(shape, np.float32),
                                                    cupy.empty(shape, np.float32), far)
        loss = _kernel("sum_squares")(resid, axis=(1, 2))
    else:
        yhat = _kernel("intensity")(far, *args, cupy.empty(shape, np.float32))
        loss = poisson_loss(yhat, y, valid, eps)
        alpha = poisson_alpha(yhat, y, valid, eps)
        _, mask, modes, npix, _, _, has_mask = args
        _kernel("poisson_apply")(yhat, y, alpha, mask, modes, npix, has_mask, np.float64(eps),
                                 cupy.empty(shape, np.float32), far)
    if overwrite and far is not given:  # a non-contiguous far was updated in a copy
        given[...] = far
        far = given
    return far, yhat, loss


def _far_field_loss_numpy(name, far, y, valid, eps, gradient, overwrite=False, background=None):
    """Reference of :func:`far_field_loss` (the AD engine's loss chain, in a few passes)."""
    xp = get_xp(far)
    rdtype = np.float64 if far.dtype == np.complex128 else np.float32
    if valid is not None:
        valid = xp.asarray(valid)
    yhat = model_intensity(far)
    if background is not None:
        yhat += background
    y = y.astype(rdtype, copy=False)
    factor = None
    if name == "gaussian":      # (√(ŷ+ε) − √y)² = (ŷ+ε) u²,  2h' = 2u,  u = 1 − √(y/(ŷ+ε))
        level = yhat + rdtype(eps)
        u = xp.divide(y, level)
        xp.sqrt(u, out=u)
        xp.subtract(rdtype(1), u, out=u)
        if valid is not None:
            u *= valid
        level *= u
        value = real_dots(level, u)
        if gradient:
            factor = u
            factor *= rdtype(2)
    elif name == "poisson":     # ŷ − y − y log((ŷ+ε)/y),  2h' = 2 (1 − y/(ŷ+ε))
        value = _poisson_loss64(yhat.astype(np.float64, copy=False), y.astype(np.float64, copy=False),
                                valid, eps)
        if gradient:
            factor = yhat + rdtype(eps)
            xp.divide(y, factor, out=factor)
            factor *= rdtype(-2)
            factor += rdtype(2)
            if valid is not None:
                factor *= valid
    elif name == "intensity":   # (ŷ − y)²,  2h' = 4 (ŷ − y)
        residual = yhat - y
        if valid is not None:
            residual *= valid
        value = real_dots(residual, residual)
        if gradient:
            factor = residual
            factor *= rdtype(4)
    else:                       # a registered model without a hand-fused branch: its h and h'
        model = get_noise_model(name, what="loss")
        value = model.loss(yhat, y, valid, eps)
        if gradient:
            factor = model.gradient_factor(yhat, y, rdtype(eps)).astype(rdtype, copy=False)
            factor *= rdtype(2)
            if valid is not None:
                factor *= valid
    grad = None
    if gradient:
        grad = xp.multiply(far, factor[:, None], out=far if overwrite else None)
    return value, grad, yhat


def far_field_loss(name: str, far, y, valid, eps: float, gradient: bool, overwrite: bool = False,
                   background=None):
    """AD loss per pattern, ∇_Ψ L = 2 h'(ŷ) Ψ and ŷ of far fields (B, M, n, n): ``(value, grad, yhat)``.

    ``name``: one of :data:`LOSS_NAMES`. grad is None unless ``gradient``, written into ``far``
    when ``overwrite``. Fused: one pass over Ψ (ŷ, the loss term and the scaled Ψ) plus the loss
    sum (the Poisson loss in float64, as the reference).
    """
    model = get_noise_model(name, what="loss")
    if not uses_fused(far) or model.kernel_id is None:
        return _far_field_loss_numpy(name, far, y, valid, eps, gradient, overwrite, background)
    import cupy  # lazy: optional GPU dependency

    given = far
    far = far.copy() if gradient and not overwrite else _contiguous(far)
    y = _contiguous(y, np.float32)
    args, shape = _far_args(far, valid, background)
    yhat, term, _ = _kernel("ad_loss")(*args, y, np.float32(eps), np.int32(model.kernel_id),
                                       np.int32(gradient), cupy.empty(shape, np.float32),
                                       cupy.empty(shape, np.float32), far)
    if name == "poisson":
        value = poisson_loss(yhat, y, valid, eps)
    else:
        value = term.sum(axis=(1, 2), dtype=np.float64)
    if gradient and overwrite and far is not given:  # a non-contiguous far was updated in a copy
        given[...] = far
        far = given
    return value, (far if gradient else None), yhat


# --------------------------------------------------------------------------------------------------
# Update numerators, illumination and step-length dot products


def object_gradient(shifted, chi, out=None, overwrite: bool = False):
    """Object-update numerator g = Σ_k conj(S_f P_k) χ_k and illumination w = Σ_k |S_f P_k|².

    shifted, chi: (B, M, n, n). Returns ``(g, w)``, (B, n, n) complex and real. ``out``: buffer for
    g; ``overwrite``: with no ``out``, the reference writes g into ``shifted[:, 0]`` (the fused path
    allocates). w is formed before ``shifted`` changes.
    """
    xp = get_xp(shifted)
    if not uses_fused(shifted, chi):
        w = model_intensity(shifted)
        g = out if out is not None else (shifted[:, 0] if overwrite else None)
        g = xp.conj(shifted[:, 0], out=g)
        g *= chi[:, 0]
        for k in range(1, shifted.shape[1]):
            g += xp.conj(shifted[:, k]) * chi[:, k]
        return g, w
    b, m = shifted.shape[:2]
    npix = shifted.shape[-2] * shifted.shape[-1]
    shape = (b,) + tuple(shifted.shape[-2:])
    if out is None:
        out = xp.empty(shape, np.complex64)
    return _kernel("object_gradient")(_contiguous(shifted), _contiguous(chi), np.int32(m), np.int32(npix),
                                      out, xp.empty(shape, np.float32))


def conj_product(a, b, out=None):
    """a · conj(b)[:, None] for a (B, M, n, n) and b (B, n, n); ``b`` may be overwritten (the
    reference conjugates it in place). ``out`` may be ``a``."""
    xp = get_xp(a)
    if not uses_fused(a, b):
        return xp.multiply(a, xp.conj(b, out=b)[:, None], out=out)
    if out is None:
        out = xp.empty(a.shape, np.complex64)
    npix = a.shape[-2] * a.shape[-1]
    return _kernel("conj_product")(a, _contiguous(b), np.int64(a.shape[1] * npix), np.int64(npix), out)


def step_dots(d, shifted, bb, chi, work=None):
    """LSQML step-length sums per pattern with a_j = ΔÔ_j S_f P_j (d (B, n, n), shifted (B, M, n, n))
    and b_j = ``bb`` (B, M, n, n): ``(Re⟨a,χ⟩, Re⟨b,χ⟩, ⟨a,a⟩, ⟨b,b⟩, Re⟨a,b⟩)``, each (B,) float64.

    ``work``: (B, M, n, n) buffer for a in the reference; the fused path never forms a.
    """
    xp = get_xp(d)
    if not uses_fused(d, shifted, bb, chi):
        ab = xp.multiply(d[:, None], shifted, out=work)
        return (real_dots(ab, chi), real_dots(bb, chi), real_dots(ab, ab), real_dots(bb, bb),
                real_dots(ab, bb))
    axes = (1, 2, 3)
    d4 = d[:, None]
    with_chi = _kernel("dots_chi")(d4, shifted, bb, chi, axis=axes)
    norms = _kernel("dots_norms")(d4, shifted, bb, axis=axes)
    cross = _kernel("dots_cross")(d4, shifted, bb, axis=axes)
    return with_chi.real.copy(), with_chi.imag.copy(), norms.real.copy(), norms.imag.copy(), cross


def object_step_dots(d, g, w):
    """Object-only step sums per pattern: ``(Re⟨ΔÔ_j, g_j⟩, ⟨|ΔÔ_j|², w_j⟩)``, each (B,) float64,
    for d, g (B, n, n) complex and w (B, n, n) real."""
    xp = get_xp(d)
    if not uses_fused(d, g, w):
        d2 = xp.square(d.real)
        d2 += xp.square(d.imag)
        return real_dots(d, g), real_dots(d2, w)
    sums = _kernel("dots_object")(d, g, w.astype(np.float32, copy=False), axis=(1, 2))
    return sums.real.copy(), sums.imag.copy()
