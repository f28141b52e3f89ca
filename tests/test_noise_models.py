"""The noise-model registry: each model's h', h'' and κ against finite differences of its own loss,
the fused chain's reference against the registry, and a model added by registration alone."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.engines.ad import ADOptions
from daskpty.engines.lsqml import LSQMLOptions
from daskpty.physics import kernels, noise_models
from daskpty.physics.backend import get_xp
from daskpty.physics.noise_models import (
    NOISE_MODELS,
    NoiseModel,
    get_noise_model,
    noise_model_names,
    register_noise_model,
)

EPS = 1e-6


def _anscombe():
    """A model the code base does not know: amplitude least squares after Anscombe's transform."""
    c = 3.0 / 8.0
    return NoiseModel(
        name="anscombe-test",
        description="Anscombe-transformed amplitude least squares (test only)",
        loss_label="Anscombe least squares",
        loss_terms=lambda yhat, y, eps: (get_xp(yhat).sqrt(yhat + c) - get_xp(yhat).sqrt(y + c)) ** 2,
        gradient_factor=lambda yhat, y, eps: 1 - get_xp(yhat).sqrt((y + c) / (yhat + c)),
        curvature=lambda yhat, y, eps: 0.5 / (yhat + c),
        gauss_newton_scale=lambda mean_model=1.0: (mean_model + c) / (2.0 * mean_model),
    )


@pytest.fixture
def anscombe():
    model = register_noise_model(_anscombe())
    yield model
    del NOISE_MODELS[model.name]


def _models():
    return [NOISE_MODELS[name] for name in noise_model_names()] + [_anscombe()]


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_gradient_factor_and_curvature_are_the_loss_derivatives(model):
    rng = np.random.default_rng(1)
    yhat = rng.uniform(0.5, 40.0, size=200)
    y = rng.poisson(yhat * rng.uniform(0.5, 1.5, size=200)).astype(np.float64)
    h = 1e-4 * yhat
    numeric = (model.loss_terms(yhat + h, y, EPS) - model.loss_terms(yhat - h, y, EPS)) / (2 * h)
    np.testing.assert_allclose(model.gradient_factor(yhat, y, EPS), numeric, rtol=1e-5, atol=1e-7)
    # h'' at a fit (y = ŷ): the Gauss–Newton curvature the background and κ are built on
    h = 1e-3 * yhat
    second = (model.loss_terms(yhat + h, yhat, EPS) - 2 * model.loss_terms(yhat, yhat, EPS)
              + model.loss_terms(yhat - h, yhat, EPS)) / h ** 2
    np.testing.assert_allclose(model.curvature(yhat, yhat, EPS), second, rtol=1e-4)


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_gauss_newton_scale_and_window_factor_follow_the_curvature(model):
    for mean in (0.3, 1.0, 25.0, 4000.0):
        m = np.array([mean])
        expected = 1.0 / (4.0 * mean * float(model.curvature(m, m, 0.0)[0]))
        assert model.gauss_newton_scale(mean) == pytest.approx(expected, rel=1e-12)
    if model.window_chi_factor is not None:    # only where κ does not depend on ŷ
        assert model.gauss_newton_scale(0.3) == model.gauss_newton_scale(4000.0)
        assert model.window_chi_factor == -model.gauss_newton_scale(1.0)


@pytest.mark.parametrize("name", noise_model_names())
def test_fused_chain_reference_agrees_with_the_registry(name):
    """The hand-fused loss chain (NumPy reference of the CuPy kernel) computes the model's h and 2h'Ψ."""
    model = get_noise_model(name)
    rng = np.random.default_rng(2)
    far = (rng.normal(size=(3, 2, 8, 8)) + 1j * rng.normal(size=(3, 2, 8, 8))).astype(np.complex128)
    y = rng.poisson(2.0, size=(3, 8, 8)).astype(np.float64)
    valid = rng.random((8, 8)) > 0.2
    value, grad, yhat = kernels.far_field_loss(name, far, y, valid, EPS, gradient=True)
    np.testing.assert_allclose(value, model.loss(yhat, y, valid, EPS), rtol=1e-9)
    factor = 2 * model.gradient_factor(yhat, y, EPS) * valid
    np.testing.assert_allclose(grad, far * factor[:, None], rtol=1e-9, atol=1e-12)


def test_a_registered_model_runs_in_the_ad_chain_with_an_exact_gradient(anscombe):
    """A new model needs no other code: the loss chain uses its h and h', and the gradient is the
    derivative of the loss (finite differences along a random direction)."""
    rng = np.random.default_rng(3)
    far = (rng.normal(size=(2, 1, 8, 8)) + 1j * rng.normal(size=(2, 1, 8, 8))).astype(np.complex128)
    y = rng.poisson(2.0, size=(2, 8, 8)).astype(np.float64)
    value, grad, _ = kernels.far_field_loss(anscombe.name, far, y, None, EPS, gradient=True)
    v = rng.normal(size=far.shape) + 1j * rng.normal(size=far.shape)
    t = 1e-6

    def total(f):
        return kernels.far_field_loss(anscombe.name, f, y, None, EPS, gradient=False)[0].sum()

    numeric = (total(far + t * v) - total(far - t * v)) / (2 * t)
    # ∇_Ψ L as the engine uses it: dL = Re⟨∇, dΨ⟩ (the conjugate Wirtinger gradient times 2)
    assert numeric == pytest.approx(float(np.vdot(grad, v).real), rel=1e-5)
    assert ADOptions(loss=anscombe.name).loss == anscombe.name


def test_unknown_names_are_one_line_with_close_matches():
    with pytest.raises(ValueError, match=r"did you mean 'poisson'"):
        get_noise_model("poison")
    with pytest.raises(ValueError, match=r"loss must be one of .*'huber'"):
        ADOptions(loss="huber")
    with pytest.raises(ValueError, match="did you mean 'gaussian'"):
        LSQMLOptions(noise="gausian")


def test_lsqml_refuses_a_model_without_a_correction_and_says_what_to_do():
    assert "intensity" in noise_model_names() and "intensity" not in noise_model_names(lsqml=True)
    with pytest.raises(ValueError, match=r"no far-field correction.*gradient-based engine \(loss='intensity'\)"):
        LSQMLOptions(noise="intensity")


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_noise_model(noise_models.GAUSSIAN)
