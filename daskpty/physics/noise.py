"""Noise models: far-field corrections used by LSQML and the data losses.

All functions take far fields ``far`` (B, M, n, n), measured intensities ``y`` (B, n, n)
(any real dtype, zero frequency at index 0) and an optional ``valid`` mask (n, n) bool
(True = detector pixel is measured). Masked pixels keep the model's far field.
"""
from __future__ import annotations

import numpy as np

from .backend import get_xp

DEFAULT_EPS = 1e-6


def model_intensity(far):
    """ŷ = Σ_k |Ψ_k|² over the mode axis: (B, M, n, n) → (B, n, n)."""
    return (far.real**2 + far.imag**2).sum(axis=1)


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
    log-likelihood φ(α) = Σ ŷ(α) − y log ŷ(α) is convex in α; a fixed number of Newton steps from
    α = 0.5, each clipped to [0, 1], makes it deterministic. Sums run in float64. Four steps are not
    enough when a few counts meet a bright model (Newton then creeps up from near 0, roughly doubling
    α per step, leaving α off by ~1e-3–1e-2); ten reach the 1-D minimum to ~1e-4 in those cases.
    """
    xp = get_xp(yhat)
    yhat = yhat.astype(np.float64)
    y = y.astype(np.float64)
    g = 1.0 - y / (yhat + eps)
    if valid is not None:
        g = g * valid
    alpha = xp.full(yhat.shape[0], 0.5)
    for _ in range(iterations):
        u = xp.maximum(1.0 - alpha[:, None, None] * g, 1e-6)
        d1 = (-2.0 * g * yhat * u + 2.0 * y * g / u).sum(axis=(-2, -1))
        d2 = (2.0 * g * g * yhat + 2.0 * y * g * g / (u * u)).sum(axis=(-2, -1))
        alpha = xp.clip(alpha - d1 / xp.maximum(d2, 1e-30), 0.0, 1.0)
    return alpha


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
    """Poisson negative log-likelihood Σ ŷ − y log(ŷ+ε) per pattern, without the log(y!) constant."""
    yhat = yhat.astype(np.float64)
    y = y.astype(np.float64)
    xp = get_xp(yhat)
    r = yhat - y * xp.log(yhat + eps)
    if valid is not None:
        r = r * valid
    return r.sum(axis=(-2, -1))


CORRECTIONS = {"gaussian": gaussian_correction, "poisson": poisson_correction}
LOSSES = {"gaussian": gaussian_loss, "poisson": poisson_loss}


def far_field_update(noise: str, far, y, valid=None, eps: float = DEFAULT_EPS):
    """The far-field correction as an update ΔΨ = Ψ' − Ψ, with ŷ and the per-pattern loss.

    Same mathematics as :func:`gaussian_correction` / :func:`poisson_correction` and the matching
    loss, fused so that each pixel is visited a few times in float32 (sums in float64) and no
    corrected copy of Ψ is kept. Returns ``(delta, yhat, loss)`` with ``loss`` of shape (B,).
    """
    xp = get_xp(far)
    yhat = model_intensity(far)
    y = y.astype(np.float32, copy=False)
    if noise == "gaussian":
        sqrt_y = xp.sqrt(y)
        sqrt_model = xp.sqrt(yhat + np.float32(eps))
        residual = sqrt_model - sqrt_y
        if valid is not None:
            residual = residual * valid
        loss = (residual * residual).sum(axis=(-2, -1), dtype=np.float64)
        factor = sqrt_y / sqrt_model - np.float32(1.0)
    elif noise == "poisson":
        loss = poisson_loss(yhat, y, valid, eps)
        alpha = poisson_step_lengths(yhat, y, valid, eps).astype(np.float32)
        factor = -alpha[:, None, None] * (np.float32(1.0) - y / (yhat + np.float32(eps)))
    else:
        raise ValueError(f"noise must be one of {sorted(CORRECTIONS)}, got {noise!r}")
    if valid is not None:
        factor = factor * valid
    return far * factor[:, None].astype(np.float32, copy=False), yhat, loss
