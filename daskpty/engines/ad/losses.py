"""AD losses: value and gradient w.r.t. the far field Ψ (see :mod:`daskpty.engines.ad`)."""
from __future__ import annotations

from ...physics import kernels

DEFAULT_EPS = 1e-6
LOSS_NAMES = kernels.LOSS_NAMES  # the built-in noise models (registry: physics.noise_models)

# --------------------------------------------------------------------------------------------------
# Losses: value and gradient w.r.t. the far field Ψ (B, M, n, n)


def _far_field_loss(name: str, far, y, valid, eps: float, gradient: bool, overwrite: bool = False,
                    background=None):
    """Loss per pattern, ∇_Ψ L and ŷ of far fields ``far`` (B, M, n, n), fused in a few passes.

    Returns ``(per_pattern, grad, yhat)``: per_pattern (B,) float64, grad = 2 h'(ŷ) Ψ (None unless
    ``gradient``; written into ``far`` when ``overwrite``), yhat = Σ_k |Ψ_k|² (B, n, n). The pixel
    terms are formed in the precision of ``far`` (``y`` is cast to it). Gaussian and intensity
    losses are Σ r² of their residuals r = √(ŷ+ε) − √y and ŷ − y, by BLAS dots (single precision:
    float32 over 1024 pixels, float64 across, see :func:`real_dots`); the Poisson loss, whose
    per-pixel terms are large next to their sum's changes, is evaluated in float64.
    ``background`` (n, n), optional: added to ŷ (the returned ŷ included). The chain is
    :func:`daskpty.physics.kernels.far_field_loss` (one fused kernel on the GPU).
    """
    return kernels.far_field_loss(name, far, y, valid, eps, gradient, overwrite, background)


def loss_and_gradient(far, y, *, loss: str = "gaussian", valid=None, eps: float = DEFAULT_EPS,
                      gradient: bool = True):
    """Loss of far fields ``far`` (B, M, n, n) against data ``y`` (B, n, n) (zero frequency at index 0).

    Returns ``(per_pattern_loss, grad)``: the loss per pattern (B,) float64 and ∇_Ψ L (same shape and
    dtype as ``far``; None when ``gradient`` is False). With ŷ = Σ_k |Ψ_k|², ∇_Ψ L = 2 h'(ŷ) Ψ.
    ``valid`` (n, n) bool: masked pixels contribute nothing.
    """
    per_pattern, grad, _ = _far_field_loss(loss, far, y, valid, eps, gradient)
    return per_pattern, grad


def gaussian_loss_gradient(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Amplitude least squares Σ (√(ŷ+ε) − √y)²: returns ``(loss, ∇_Ψ)``, loss a float (float64 sum)."""
    per, g = loss_and_gradient(far, y, loss="gaussian", valid=valid, eps=eps)
    return float(per.sum()), g


def poisson_loss_gradient(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Poisson negative log-likelihood up to a constant of the data
    (:func:`daskpty.physics.noise.poisson_loss`): returns ``(loss, ∇_Ψ)``."""
    per, g = loss_and_gradient(far, y, loss="poisson", valid=valid, eps=eps)
    return float(per.sum()), g


def intensity_loss_gradient(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Intensity least squares Σ (ŷ − y)²: returns ``(loss, ∇_Ψ)``."""
    per, g = loss_and_gradient(far, y, loss="intensity", valid=valid, eps=eps)
    return float(per.sum()), g


LOSS_GRADIENTS = {"gaussian": gaussian_loss_gradient, "poisson": poisson_loss_gradient,
                  "intensity": intensity_loss_gradient}
