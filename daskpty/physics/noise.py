"""Noise models: far-field corrections used by LSQML and the data losses.

All functions take far fields ``far`` (B, M, n, n), measured intensities ``y`` (B, n, n)
(any real dtype, zero frequency at index 0) and an optional ``valid`` mask (n, n) bool
(True = detector pixel is measured). Masked pixels keep the model's far field.
"""
from __future__ import annotations

import numpy as np

from .backend import get_xp, real_dots

DEFAULT_EPS = 1e-6


def model_intensity(far):
    """ŷ = Σ_k |Ψ_k|² over the mode axis: (B, M, n, n) → (B, n, n)."""
    xp = get_xp(far)
    out = None
    for k in range(far.shape[1]):
        a = xp.abs(far[:, k])  # |Ψ_k| then squared: cheaper than Re² + Im² on the strided views
        a *= a
        if out is None:
            out = a
        else:
            out += a
    return out


def _masked(factor, valid, xp):
    if valid is None:
        return factor
    return xp.where(valid, factor, xp.float32(1.0))


def gaussian_correction(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Amplitude (Gaussian) projection Ψ' = Ψ·√y / √(ŷ + ε) on valid pixels.

    Returns ``(corrected_far, yhat)``.
    """
    xp = get_xp(far)
    yhat = model_intensity(far)
    y = y.astype(np.float32, copy=False)
    factor = xp.sqrt(y) / xp.sqrt(yhat + np.float32(eps))
    factor = _masked(factor, valid, xp).astype(np.float32, copy=False)
    return far * factor[:, None], yhat


def poisson_step_lengths(yhat, y, valid=None, eps: float = DEFAULT_EPS, iterations: int = 10):
    """Per-pattern α ∈ [0, 1] maximising the Poisson likelihood along Ψ' = Ψ(1 − α(1 − y/ŷ)).

    The model intensity along that path is ŷ(α) = ŷ·(1 − α g)², g = 1 − y/(ŷ+ε). The negative
    log-likelihood φ(α) = Σ ŷ(α) − y log ŷ(α) is convex in α; at most ``iterations`` Newton steps
    from α = 0.5, each clipped to [0, 1] (a pattern keeps its α once its step is at most
    :data:`ALPHA_STEP_DONE`: 2–4 steps on most data). Sums run in float64. Four steps are not
    enough when a few counts meet a bright model (Newton then creeps up from near 0, roughly doubling
    α per step, leaving α off by ~1e-3–1e-2); ten reach the 1-D minimum to ~1e-4 in those cases.
    """
    return _poisson_alpha64(yhat.astype(np.float64), y.astype(np.float64), valid, eps, iterations)[0]


#: a pattern's Newton iteration for α stops once its step is at most this (quadratic
#: convergence: the next step would be ~1e-18); the rest go on (:func:`_poisson_alpha64`)
ALPHA_STEP_DONE = 1e-9


def _poisson_alpha64(yhat, y, valid, eps, iterations: int = 10):
    """:func:`poisson_step_lengths` on float64 (B, n, n) arrays; returns ``(alpha, g)`` (g masked).

    With u = max(1 − α g, 10⁻⁶), φ'(α) = −2 Σ gŷ·u + 2 Σ yg/u and φ''(α) = 2 Σ g²ŷ + 2 Σ yg²/u²:
    the α-independent products are formed once, so a Newton step is a few passes plus BLAS dots.
    A pattern whose step falls to :data:`ALPHA_STEP_DONE` keeps its α, and the steps end once
    every pattern's has (most after 2–4 of the ``iterations``).
    """
    xp = get_xp(yhat)
    n_patterns = yhat.shape[0]
    g = yhat + eps
    xp.divide(y, g, out=g)
    xp.subtract(1.0, g, out=g)                       # g = 1 − y/(ŷ+ε)
    if valid is not None:
        g *= valid
    g_yhat = g * yhat
    y_g = y * g
    y_g2 = y_g * g
    curvature = real_dots(g_yhat, g)                 # Σ g²ŷ
    # u < 10⁻⁶ needs α g > 1 − 10⁻⁶: when no pixel can reach it (checked on the CPU), the clamp is
    # skipped and Σ gŷ·u = Σ gŷ − α Σ g²ŷ needs no pass.
    g_max = g.reshape(n_patterns, -1).max(axis=1) if xp is np else None
    g_yhat_sum = g_yhat.reshape(n_patterns, -1).sum(axis=1)
    alpha = xp.full(n_patterns, 0.5)
    going = xp.ones(n_patterns, bool)                # the patterns still stepping
    u = xp.empty_like(g)
    for _ in range(iterations):
        xp.multiply(g, -alpha[:, None, None], out=u)
        u += 1.0
        if g_max is None or bool((alpha * g_max > 1.0 - 2e-6).any()):
            xp.maximum(u, 1e-6, out=u)
            d1 = -2.0 * real_dots(g_yhat, u)
        else:
            d1 = -2.0 * (g_yhat_sum - alpha * curvature)
        xp.divide(1.0, u, out=u)
        d1 += 2.0 * real_dots(y_g, u)
        u *= u
        d2 = 2.0 * curvature + 2.0 * real_dots(y_g2, u)
        stepped = xp.clip(alpha - d1 / xp.maximum(d2, 1e-30), 0.0, 1.0)
        moved = xp.abs(stepped - alpha) > ALPHA_STEP_DONE
        alpha = xp.where(going, stepped, alpha)
        going &= moved
        if xp is np and not going.any():             # (on the GPU: no host sync per step)
            break
    return alpha, g


def poisson_correction(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Poisson-likelihood correction Ψ' = Ψ·(1 − α_j (1 − y/(ŷ+ε))) on valid pixels.

    Returns ``(corrected_far, yhat)``.
    """
    xp = get_xp(far)
    yhat = model_intensity(far)
    y = y.astype(np.float32, copy=False)
    alpha = poisson_step_lengths(yhat, y, valid, eps).astype(np.float32)
    factor = 1.0 - alpha[:, None, None] * (1.0 - y / (yhat + np.float32(eps)))
    factor = _masked(factor, valid, xp).astype(np.float32, copy=False)
    return far * factor[:, None], yhat


def gaussian_loss(yhat, y, valid=None):
    """Amplitude least-squares Σ (√ŷ − √y)² per pattern (float64, shape (B,))."""
    xp = get_xp(yhat)
    r = (xp.sqrt(yhat.astype(np.float64)) - xp.sqrt(y.astype(np.float64))) ** 2
    if valid is not None:
        r = r * valid
    return r.sum(axis=(-2, -1))


def poisson_loss(yhat, y, valid=None, eps: float = DEFAULT_EPS):
    """Poisson negative log-likelihood per pattern, up to a constant of the data:
    Σ ŷ − y log(ŷ+ε) + y log y − y (y log y taken as 0 below one count), that is
    Σ ŷ − y − y log((ŷ+ε)/y): zero for a model equal to the counts and positive otherwise (half
    the Poisson deviance), so its relative changes read like the amplitude loss's."""
    return _poisson_loss64(yhat.astype(np.float64), y.astype(np.float64), valid, eps)


def poisson_offset_log(y):
    """log y where y > 1, else 0: the data's term y log y of :func:`poisson_loss` (NumPy or CuPy)."""
    xp = get_xp(y)
    return xp.log(xp.maximum(y, 1.0))


def _poisson_loss64(yhat, y, valid, eps):
    """:func:`poisson_loss` on float64 (B, n, n) arrays, as Σ ŷ − Σ y (reductions, no
    temporary) minus a dot product Σ y·(log(ŷ+ε) − log y)."""
    xp = get_xp(yhat)
    n_patterns = yhat.shape[0]
    log_ratio = yhat + eps
    xp.log(log_ratio, out=log_ratio)
    log_ratio -= poisson_offset_log(y)
    if valid is None:
        sums = yhat.reshape(n_patterns, -1).sum(axis=1) - y.reshape(n_patterns, -1).sum(axis=1)
        return sums - real_dots(y, log_ratio)
    mask = valid.reshape(-1).astype(np.float64)
    y = y * valid
    return yhat.reshape(n_patterns, -1) @ mask - y.reshape(n_patterns, -1).sum(axis=1) - real_dots(y, log_ratio)


def far_field_update(noise: str, far, y, valid=None, eps: float = DEFAULT_EPS, overwrite: bool = False,
                     background=None):
    """The far-field correction as an update ΔΨ = Ψ' − Ψ, with ŷ and the per-pattern loss.

    Same mathematics as :func:`gaussian_correction` / :func:`poisson_correction` and the matching
    loss, fused so that each pixel is visited a few times in float32 and no corrected copy of Ψ is
    kept. ``overwrite=True`` writes ΔΨ into ``far``. Returns ``(delta, yhat, loss)`` with ``loss``
    of shape (B,) (float64; the Gaussian loss is accumulated by BLAS in float32).
    ``background`` (n, n), optional: added to the model intensity (ŷ = Σ_k |Ψ_k|² + background,
    the returned ŷ included); the correction scales the coherent far fields by the same factor.
    """
    xp = get_xp(far)
    if noise not in ("gaussian", "poisson"):
        raise ValueError(f"LSQML's far-field update exists for 'gaussian' and 'poisson' noise, got {noise!r}")
    yhat = model_intensity(far)
    if background is not None:
        yhat += background
    y = y.astype(np.float32, copy=False)
    if noise == "gaussian":
        # √y/√(ŷ+ε) − 1 = (√y − √(ŷ+ε))/√(ŷ+ε): the loss residual, divided.
        residual = xp.sqrt(y)
        sqrt_model = yhat + np.float32(eps)
        xp.sqrt(sqrt_model, out=sqrt_model)
        residual -= sqrt_model
        if valid is not None:
            residual *= valid
        loss = real_dots(residual, residual)
        factor = xp.divide(residual, sqrt_model, out=sqrt_model)
    else:
        yhat64, y64 = yhat.astype(np.float64), y.astype(np.float64)
        loss = _poisson_loss64(yhat64, y64, valid, eps)
        alpha, g = _poisson_alpha64(yhat64, y64, valid, eps)
        g *= -alpha[:, None, None]                           # −α (1 − y/(ŷ+ε)), masked
        factor = g.astype(np.float32)
    delta = xp.multiply(far, factor[:, None], out=far if overwrite else None)
    return delta, yhat, loss
