"""AD with a varying probe: exact gradients of OPR weights, eigen-probes, intensity factors and
background, and their Gauss–Newton-scaled steps.

:func:`daskpty.engines.ad.gradient.chunk_gradient` with a
:class:`~daskpty.engines.pattern_probes.PatternProbes` gathers, per pattern j and eigen-probe k
(complex-gradient convention of :mod:`daskpty.engines.ad`, G_j = conj(ramp_j) F[conj(O_j) g_ψj]):

* ∂L/∂w_jk = s_j Re⟨G_j0, F U_k⟩,      ∂L/∂U_k = F⁻¹ Σ_j s_j w_jk G_j0 (k ≥ 1),
* ∂L/∂c_j = Re⟨ψ_j, g_ψj⟩ / (2 c_j) for the intensity factor c_j = s_j²,
* ∂L/∂b = Σ_j h'(ŷ_j) per detector pixel (summed over pixels for a constant background).

The per-pattern parameters move in the chunk step (they live with their chunk) by
preconditioned gradient steps Δw_j = −κ G_j⁻¹ ∇_w L with the Gram matrix G_j of the weights'
directions (the Gauss–Newton matrix of the amplitude loss up to the factor 2: κ = ½; Poisson ¼;
intensity loss ⅛ŷ̄⁻¹), likewise the eigen-probes (preconditioner Σ_j (s_j w_jk)²|O_j|²) and the
background (its Gauss–Newton curvature) in ``apply``.
"""
from __future__ import annotations

import numpy as np

from ...physics import get_noise_model, ifft2
from ..eigen_probes import EIGEN_TRUST, add_eigen_weight_sums, centred_eigen_terms, limit_eigen_step
from ..pattern_probes import PatternProbes
from ..probe_model import (WEIGHT_TRUST, ProbeModelOptions, check_finite, damp_smooth_norm, eigen_weight_sums,
                           flatten_model_local, model_local, smooth_eigen_weights, solve_weight_steps, step_factors,
                           step_weights)
from .gradient import chunk_gradient, refining_chunk_gradient


def gauss_newton_scale(loss: str, mean_model: float = 1.0) -> float:
    """κ: the Gauss–Newton step per unit (Gram-preconditioned) gradient of each loss."""
    return get_noise_model(loss, what="loss").gauss_newton_scale(mean_model)


def pattern_gradients(variable: PatternProbes) -> dict:
    """∂L/∂(weights) (B, K) and ∂L/∂(intensity factors) (B, 1) of a finished chunk gradient."""
    out = {}
    amp = variable._amp(slice(0, variable.n_patterns))
    if variable.weights is not None and variable.want_weights:
        out["opr_weights"] = variable.rhs * amp[:, None]
    if variable.amplitude is not None and variable.want_intensity:
        out["intensity_scale"] = (variable.int_num / (2 * np.maximum(amp, 1e-30) ** 2))[:, None]
    return out


def variable_chunk_gradient(obj, probe, intensities, nominal, local: dict | None, *, options, model: ProbeModelOptions,
                            eigen, transform, background, epoch: int, valid=None, want_object: bool = True,
                            want_probe: bool = True, positions=None, affine=None, gradient=None, frame=None,
                            keep_gram: bool = False):
    """One AD chunk gradient with the varying probe; the chunk's weights and intensity factors
    take their step here (``part.local``), the global gradients ride ``part.arrays``; ``gradient``
    the sample's chunk gradient (default :func:`daskpty.engines.ad.chunk_gradient`); ``model``
    resolved for the engine (:meth:`ProbeModelOptions.for_engine`), as everywhere here."""
    mlocal = model_local(local, transform)
    cdtype = np.complex128 if np.dtype(obj.dtype) == np.complex128 or np.dtype(probe.dtype) == np.complex128 \
        else np.complex64
    variable = PatternProbes(model, probe, eigen, mlocal, intensities, active=model.active(epoch),
                             background=background, cdtype=cdtype)
    if positions is not None:
        part = refining_chunk_gradient(obj, probe, intensities, nominal, local, options=options, positions=positions,
                                       epoch=epoch, affine=affine, valid=valid, want_object=want_object,
                                       want_probe=want_probe, variable=variable, gradient=gradient, frame=frame,
                                       keep_gram=keep_gram)
    else:
        part = (gradient or chunk_gradient)(obj, probe, intensities, nominal, options=options, valid=valid,
                                            want_object=want_object, want_probe=want_probe, variable=variable)
    if mlocal and part.scalars:
        mean_model = part.scalars["sum_model"] / max(part.scalars["n"] * variable.n ** 2, 1.0)
        kappa = gauss_newton_scale(options.loss, mean_model)
        grads = pattern_gradients(variable)
        new = {}
        amp = variable._amp(slice(0, variable.n_patterns))
        if variable.weights is not None:
            w, velocity = variable.weights.copy(), variable.velocity
            if "opr_weights" in grads:
                free = slice(0, w.shape[1]) if model.fit_mean_weight else slice(1, w.shape[1])
                if free.stop > free.start:
                    gram = variable.weight_curvature()[:, free, free] * (amp * amp)[:, None, None]
                    step = -model.weight_step * solve_weight_steps(
                        gram, kappa * grads["opr_weights"][:, free], trust=WEIGHT_TRUST / model.weight_step)
                    before = w
                    w, velocity = step_weights(w, step, free, model, velocity)
                    where = part.local.get("positions", (local or {}).get("positions", nominal))
                    if model.weight_smoothing:
                        w = smooth_eigen_weights(w, where, model.weight_smoothing)
                    w, velocity = damp_smooth_norm(before, w, velocity, where, model, variable.n)
            new["opr_weights"] = w
            if velocity is not None:
                new["opr_velocity"] = velocity
        if variable.amplitude is not None:
            c = amp * amp
            if "intensity_scale" in grads:  # Gauss–Newton in c: curvature ‖ψ‖²/(2c)² · 2 … as LSQML
                den = variable.int_den
                curvature = den / np.maximum(4 * c * c, 1e-30)
                step = -model.weight_step * kappa * grads["intensity_scale"][:, 0] / (
                    curvature + 1e-3 * curvature.mean() + 1e-30)
                c, v = step_factors(c, step, model, variable.intensity_velocity)
                if v is not None:
                    new["intensity_velocity"] = v
            new["intensity_scale"] = c[:, None]
        if grads:
            where = part.local.get("positions", (local or {}).get("positions", nominal))
            new = flatten_model_local(new, where, model, variable.n, epoch)
        check_finite(new, model, epoch)
        part.local = {**part.local, **new}
        if "opr_weights" in grads:
            part.scalars.update(eigen_weight_sums(new))
    return part


def apply(state, total, model: ProbeModelOptions, loss: str, delta: float = 0.1) -> None:
    """The probe model's share of ``ad.apply``: eigen-probe and background steps (new arrays)."""
    arrays = total.arrays
    n = max(total.scalars.get("n", 1.0), 1.0)
    pixels = None
    if "opr_eigen_num" in arrays and state.eigen_probes is not None:
        pixels = arrays["opr_eigen_num"].shape[-1] ** 2
        kappa = gauss_newton_scale(loss, total.scalars.get("sum_model", 0.0) / (n * pixels))
        num, den = centred_eigen_terms(arrays, n)
        state.eigen_weight_sums = add_eigen_weight_sums(state.eigen_weight_sums, arrays, n)
        step = kappa * ifft2(np.asarray(num)) / ((1.0 + delta) * np.maximum(den, 1e-30))
        step = limit_eigen_step(model.eigen_step * step, state.probe[0], EIGEN_TRUST)
        state.eigen_probes = (state.eigen_probes - step).astype(state.eigen_probes.dtype)
    if "background_grad" in arrays and state.background is not None:
        grad = np.asarray(arrays["background_grad"], np.float64)
        curv = np.asarray(arrays["background_curvature"], np.float64)
        if np.shape(state.background) == (1, 1):
            delta_b = grad.sum() / max(curv.sum(), 1e-30)
        else:
            side = state.background.shape[-1]
            delta_b = (grad / (curv + 1e-3 * curv.mean() + 1e-30)).reshape(side, side)
        state.background = np.maximum(np.asarray(state.background, np.float64) - model.background_step * delta_b,
                                      0).astype(np.float32)
