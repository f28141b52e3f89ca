"""Noise models as a registry: one :class:`NoiseModel` per name, everything about it in one place.

As dask-glm's ``Family``: a model carries its per-pixel loss h(ŷ; y), the gradient factor h'(ŷ; y)
(∇_Ψ L = 2 h'(ŷ) Ψ), the Gauss–Newton curvature h''(ŷ) at a fit (y = ŷ), the Gauss–Newton step per
unit gradient κ, the LSQML far-field correction (None: AD only), the id of its branch in the fused
CuPy kernel (None: the NumPy expressions of this class run on every device) and how its loss value
reads. Engines, the CLI and the API ask :func:`get_noise_model` by name; an unknown name, or a model
an engine cannot use, is one clear error — nothing falls back to another model.

Adding a model: write its ``loss_terms``, ``gradient_factor`` and ``curvature`` (element-wise on
NumPy or CuPy arrays), build a :class:`NoiseModel` and :func:`register_noise_model` it; the AD
engine then runs it (tests/test_noise_models.py checks h' and h'' against finite differences of h).
An LSQML correction and a fused kernel branch are optional speed-ups of the same mathematics.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .backend import get_xp
from .noise import DEFAULT_EPS, gaussian_correction, poisson_correction, poisson_offset_log


@dataclass(frozen=True)
class NoiseModel:
    """One noise model (see the module docstring). Functions take ``(yhat, y, eps)`` arrays."""

    name: str
    description: str
    loss_label: str
    loss_terms: Callable
    gradient_factor: Callable
    curvature: Callable
    gauss_newton_scale: Callable[[float], float]
    lsqml_correction: Callable | None = None
    kernel_id: int | None = None
    window_chi_factor: float | None = None

    def loss(self, yhat, y, valid=None, eps: float = DEFAULT_EPS):
        """The loss per pattern Σ_pixels h(ŷ; y) (float64, shape (B,)); ``valid`` (n, n) masks pixels."""
        xp = get_xp(yhat)
        terms = self.loss_terms(xp.asarray(yhat, dtype=np.float64), xp.asarray(y, dtype=np.float64), eps)
        if valid is not None:
            terms = terms * valid
        return terms.reshape(terms.shape[0], -1).sum(axis=1)

    def background_terms(self, yhat, y, eps: float = DEFAULT_EPS):
        """(h'(ŷ; y), h''(ŷ)) per pixel: the gradient and curvature of the loss w.r.t. an additive
        background in the model intensity."""
        return self.gradient_factor(yhat, y, eps), self.curvature(yhat, y, eps)


def _sqrt(a):
    return get_xp(a).sqrt(a)


GAUSSIAN = NoiseModel(
    name="gaussian",
    description="amplitude least squares Σ (√(ŷ+ε) − √y)²: Gaussian noise on the amplitudes",
    loss_label="amplitude LSQ",
    loss_terms=lambda yhat, y, eps: (_sqrt(yhat + eps) - _sqrt(y)) ** 2,
    gradient_factor=lambda yhat, y, eps: 1 - _sqrt(y / (yhat + eps)),
    curvature=lambda yhat, y, eps: 0.5 / (yhat + eps),
    gauss_newton_scale=lambda mean_model=1.0: 0.5,
    lsqml_correction=gaussian_correction,
    kernel_id=0,
    window_chi_factor=-0.5,
)

POISSON = NoiseModel(
    name="poisson",
    description="Poisson negative log-likelihood up to a constant of the data: Σ ŷ − y − y log((ŷ+ε)/y), "
                "zero where the model equals the counts (half the Poisson deviance)",
    loss_label="Poisson NLL + const",
    loss_terms=lambda yhat, y, eps: yhat - y - y * (get_xp(yhat).log(yhat + eps) - poisson_offset_log(y)),
    gradient_factor=lambda yhat, y, eps: 1 - y / (yhat + eps),
    curvature=lambda yhat, y, eps: 1 / (yhat + eps),
    gauss_newton_scale=lambda mean_model=1.0: 0.25,
    lsqml_correction=poisson_correction,
    kernel_id=1,
    window_chi_factor=-0.25,
)

INTENSITY = NoiseModel(
    name="intensity",
    description="intensity least squares Σ (ŷ − y)²: Gaussian noise of constant variance on the counts",
    loss_label="intensity LSQ",
    loss_terms=lambda yhat, y, eps: (yhat - y) ** 2,
    gradient_factor=lambda yhat, y, eps: 2 * (yhat - y),
    curvature=lambda yhat, y, eps: get_xp(yhat).full_like(yhat, 2.0),
    gauss_newton_scale=lambda mean_model=1.0: 0.125 / max(mean_model, 1e-30),
    kernel_id=2,
    window_chi_factor=None,   # κ follows ŷ: no constant turns −∂L/∂ψ* into the residual χ
)

#: the registered models by name, in the order the CLI lists them
NOISE_MODELS: dict[str, NoiseModel] = {}


def register_noise_model(model: NoiseModel) -> NoiseModel:
    """Add ``model`` to the registry (a name already taken is an error); returns it."""
    if model.name in NOISE_MODELS:
        raise ValueError(f"a noise model named {model.name!r} is already registered")
    NOISE_MODELS[model.name] = model
    return model


for _model in (GAUSSIAN, POISSON, INTENSITY):
    register_noise_model(_model)


def noise_model_names(lsqml: bool = False) -> tuple[str, ...]:
    """The registered names; ``lsqml=True``: only those with an LSQML far-field correction."""
    return tuple(name for name, m in NOISE_MODELS.items() if not lsqml or m.lsqml_correction is not None)


def get_noise_model(name: str, *, lsqml: bool = False, what: str = "noise") -> NoiseModel:
    """The model registered as ``name``; one-line ValueError for an unknown name (with the close
    matches) or, with ``lsqml=True``, for a model LSQML has no correction for."""
    model = NOISE_MODELS.get(name) if isinstance(name, str) else None
    if model is None:
        close = difflib.get_close_matches(str(name), NOISE_MODELS, n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"{what} must be one of {list(NOISE_MODELS)}, got {name!r}{hint}")
    if lsqml and model.lsqml_correction is None:
        raise ValueError(f"no far-field correction exists for the {name!r} noise model ({model.description}); "
                         f"choose one of {list(noise_model_names(lsqml=True))}, or minimise it as the loss "
                         f"of a gradient-based engine (loss={name!r})")
    return model
