"""LSQML with a varying probe: OPR eigen-probes and weights, intensity factors, background.

The chunk step is :func:`daskpty.engines.lsqml.chunk_step` with a
:class:`~daskpty.engines.pattern_probes.PatternProbes` (each pattern's own probe spectra; the
least-squares terms of the probe model gathered on the way, no extra FFT). Here:

* :func:`variable_chunk_step` — the chunk's weights moved into the current eigen-probe basis
  (the T of the last epoch), the chunk step (with position refinement when asked), then per
  pattern the damped least-squares steps of the weights, Δw_j = G_j⁻¹ h_j with
  h_jk = Re⟨s_j S_f U_k O_j, χ_j0⟩ = s_j Re⟨F U_k, G_j0⟩ (Parseval, from the probe-update
  spectra) and G_j,kl ≈ s_j² Σ Re(conj U_k U_l) |O_j|², and of the intensity factors,
  Δs_j = s_j Re⟨ψ_j, χ_j⟩ / ‖ψ_j‖² (with ``brightness_first`` taken inside the chunk step, before
  the object's: :meth:`~.pattern_probes.PatternProbes.brightness_step`), each with heavy-ball
  momentum (``weight_momentum``: Δ_j + μ v_j, v_j the pattern's last move);
* :func:`apply` — eigen-probes U_k += step · Σ_j s_j w_jk S_{−f}(conj O_j χ_j0) /
  (Σ_j (s_j w_jk)² |O_j|² + δ max), the least-squares update of each eigen-probe had every
  pattern the same object, at most ``EIGEN_TRUST`` ‖U_0‖ per round; background from the mean
  intensity residual;
* :func:`end_epoch` — orthonormalise the eigen-probes; the state keeps T for the chunks.
"""
from __future__ import annotations

import numpy as np

from ..physics import ifft2
from . import lsqml
from .eigen_probes import (EIGEN_TRUST, add_eigen_weight_sums, centred_eigen_terms, initial_eigen_probes, limit_eigen_step,
                           orthonormalize, recentre)
from .pattern_probes import INTENSITY_TIKHONOV, PatternProbes
from .probe_model import (
    WEIGHT_TRUST,
    ProbeModelOptions,
    check_finite,
    damp_smooth_norm,
    eigen_weight_sums,
    flatten_model_local,
    model_local,
    smooth_eigen_weights,
    solve_weight_steps,
    step_background,
    step_factors,
    step_weights,
)


def new_model_local(variable: PatternProbes, model: ProbeModelOptions, epoch: int, positions=None) -> dict:
    """The patterns' weights (with their momentum) and intensity factors after the step's
    least-squares updates (the eigen-probe weights then smoothed over ``positions`` when
    ``model.weight_smoothing``; the brightness's smooth part over ``positions`` removed,
    :func:`~.probe_model.flatten_model_local`)."""
    new = {}
    amp = variable._amp(slice(0, variable.n_patterns))
    if variable.weights is not None:
        w, velocity = variable.weights.copy(), variable.velocity
        if variable.want_weights:
            stepped = variable.brightness if variable.amplitude is None else None
            if stepped is not None:           # the mode-0 step brightness_first took
                w *= (1 + stepped)[:, None]
            free = slice(0, w.shape[1]) if model.fit_mean_weight and stepped is None else slice(1, w.shape[1])
            if free.stop > free.start:
                gram = variable.weight_curvature()[:, free, free] * (amp * amp)[:, None, None]
                rhs = variable.rhs[:, free] * amp[:, None]
                step = model.weight_step * solve_weight_steps(gram, rhs, trust=WEIGHT_TRUST / model.weight_step)
                before = w
                w, velocity = step_weights(w, step, free, model, velocity)
                if model.weight_smoothing and positions is not None:
                    w = smooth_eigen_weights(w, positions, model.weight_smoothing)
                w, velocity = damp_smooth_norm(before, w, velocity, positions, model, variable.n)
        new["opr_weights"] = w
        if velocity is not None:
            new["opr_velocity"] = velocity
    if variable.amplitude is not None:
        s = variable.amplitude.copy()
        if variable.brightness is not None:   # the step brightness_first took in the chunk step
            s = np.maximum(s * (1 + variable.brightness), 0.0)
        elif variable.want_intensity:
            den = variable.int_den
            ds = s * variable.int_num / (den + INTENSITY_TIKHONOV * den.mean() + 1e-30)
            s, v = step_factors(s, model.weight_step * ds, model, variable.intensity_velocity)
            if v is not None:
                new["intensity_velocity"] = v
        new["intensity_scale"] = (s * s)[:, None]
    if variable.want_weights or variable.want_intensity:
        new = flatten_model_local(new, positions, model, variable.n, epoch)
    check_finite(new, model, epoch)
    return new


def variable_chunk_step(obj, probe, intensities, nominal, local: dict | None, *, options, model: ProbeModelOptions,
                        eigen, transform, background, epoch: int, update_probe: bool, valid=None,
                        positions=None, affine=None, step=None, frame=None):
    """One LSQML chunk step with the varying probe (and refined positions when ``positions``);
    ``step`` the sample's chunk step (default: :func:`daskpty.engines.lsqml.chunk_step`);
    ``model`` resolved for the engine (:meth:`ProbeModelOptions.for_engine`), as everywhere here."""
    mlocal = model_local(local, transform)
    variable = PatternProbes(model, probe, eigen, mlocal, intensities, active=model.active(epoch),
                             background=background)
    if positions is not None:
        part = lsqml.refining_chunk_step(obj, probe, intensities, nominal, local, options=options,
                                         positions=positions, epoch=epoch, affine=affine,
                                         update_probe=update_probe, valid=valid, variable=variable, step=step,
                                         frame=frame)
    else:
        part = (step or lsqml.chunk_step)(obj, probe, intensities, nominal, options=options,
                                          update_probe=update_probe, valid=valid, variable=variable)
    if mlocal and part.scalars:
        where = part.local.get("positions", local.get("positions", nominal)) if local else nominal
        new = new_model_local(variable, model, epoch, where)
        part.local = {**part.local, **new}
        if variable.want_weights:
            part.scalars.update(eigen_weight_sums(new))
    return part


def apply(state, total, model: ProbeModelOptions, delta: float = 0.1, valid=None) -> None:
    """The probe model's share of ``lsqml.apply``: eigen-probe and background updates (new arrays)."""
    arrays = total.arrays
    if "opr_eigen_num" in arrays and state.eigen_probes is not None:
        num, den = centred_eigen_terms(arrays, total.scalars.get("n", 1.0))
        state.eigen_weight_sums = add_eigen_weight_sums(state.eigen_weight_sums, arrays, total.scalars.get("n", 1.0))
        num = ifft2(np.asarray(num, np.complex64))
        step = num / np.float32(1.0 + delta) / np.maximum(den, 1e-30).astype(np.float32)
        step = limit_eigen_step(np.float32(model.eigen_step) * step, state.probe[0], EIGEN_TRUST)
        state.eigen_probes = (state.eigen_probes + step).astype(np.complex64)
    if "background_residual" in arrays and state.background is not None:
        state.background = step_background(state.background, arrays["background_residual"],
                                           total.scalars.get("n", 1.0), model, valid)


def end_epoch(state, model: ProbeModelOptions) -> None:
    """Before ``lsqml.end_epoch`` (and AD's): after an epoch that moved the eigen-probes, move
    the eigen-weights' mean over the epoch into the mean probe (:func:`~.eigen_probes.recentre`)
    and orthonormalise the eigen-probes; ``state.weight_transform`` is the product T every chunk
    applies to its weights at its next visit.

    Before the first epoch that fits them (``start_epoch``) the eigen-probes start afresh from
    the mean probe as it is then (:func:`~.eigen_probes.initial_eigen_probes`): the probe the
    run began with may look nothing like it, and every weight of theirs is still zero, so no
    pattern's probe changes."""
    state.weight_transform = None
    if state.eigen_probes is None or not len(state.eigen_probes):
        return
    sums, state.eigen_weight_sums = state.eigen_weight_sums, None
    if model.active(state.epoch):
        shift = None
        mean = None if sums is None else sums[1:] / max(sums[0], 1.0)
        if mean is not None and np.any(mean):
            probe = state.probe.copy()
            probe[0], shift = recentre(probe[0], state.eigen_probes, mean)
            state.probe = probe
        state.eigen_probes, state.weight_transform = orthonormalize(state.probe[0], state.eigen_probes)
        if shift is not None:
            state.weight_transform = shift @ state.weight_transform
    elif state.epoch + 1 == model.start_epoch:
        state.eigen_probes = initial_eigen_probes(state.probe[0], len(state.eigen_probes))
