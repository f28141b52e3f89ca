"""The AD engine's chunk gradient through K slices or to a near-field detector (no dask).

The same forward model as :mod:`.multislice` (its :class:`~.multislice.SliceChunk`), the loss of
:mod:`daskpty.engines.ad` and its exact gradient w.r.t. every slice, the probe and — composed
as in the single-slice :func:`daskpty.engines.ad.chunk_gradient` — the patterns' positions
(``want_positions``) and a varying probe (``variable``, a
:class:`~daskpty.engines.pattern_probes.PatternProbes`). Gradient convention of the AD engine
(g = ∂L/∂Re z + i ∂L/∂Im z).
"""
from __future__ import annotations

import numpy as np

from ..physics import ifft2, model_intensity
from ..physics.backend import asarray_like, is_cupy, real_dots, to_numpy
from ..physics.multislice import detector_forward, multislice_forward, multislice_vjp
from .ad.gradient import window_chi_factor
from .ad.losses import DEFAULT_EPS, _far_field_loss
from .multislice import SliceChunk, pixel_sums, pattern_sums, detector_adjoint
from .multislice_positions import position_sums
from .partials import BoxedArray, Partial


def _loss_settings(options, loss, eps):
    """(loss name, ε) from an :class:`~daskpty.engines.ad.ADOptions` or the plain keywords."""
    if options is not None:
        return options.loss, options.eps
    return loss or "gaussian", DEFAULT_EPS if eps is None else eps


def _dtypes(obj, probe):
    wide = any(np.dtype(a.dtype) == np.complex128 for a in (obj, probe))
    return (np.complex128, np.float64) if wide else (np.complex64, np.float32)


def chunk_gradient(obj, probe, intensities, positions, *, options=None, kernel=None, detector=None,
                   loss: str | None = None, valid=None, eps: float | None = None, want_object: bool = True,
                   want_probe: bool = True, want_positions: bool = False, variable=None,
                   window_sums: bool = False, reuse=None) -> Partial:
    """Loss and exact gradients of one chunk through K slices, as an additive partial.

    Inputs as :func:`daskpty.engines.multislice.chunk_step`; ``options`` an ADOptions (or
    ``loss`` / ``eps``: gaussian = amplitude least squares Σ(√(ŷ+ε) − √y)², poisson, intensity);
    complex128 object or probe works in complex128 (else complex64). Returns
    ``boxes["object_grad"]`` (with ``want_object``) and ``boxes["illumination"]`` (K, h, w),
    ``arrays["probe_grad"]`` (M, n, n) and ``arrays["probe_illumination"]`` (n, n) = Σ_j |O_1j|²
    when ``want_probe``, ``arrays["position_grad"]`` (B, 2) ∂L/∂(y, x) when ``want_positions``
    (exact: :func:`_position_gradient`), the probe model's
    gradients with ``variable``, ``scalars`` loss, n, sum_measured, sum_model, and with
    ``window_sums`` (and the object gradient) the windows' deformation sums through the slices
    (:func:`~.multislice_positions.position_sums`) with LSQML's χ taken as −∂L/∂ψ* over the
    loss's curvature (:func:`~daskpty.engines.ad.gradient.window_chi_factor`), as one slice does
    (``reuse``: without the normal matrix, :class:`~.multislice_positions.ReusedSums`).
    """
    loss, eps = _loss_settings(options, loss, eps)
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    cdtype, rdtype = _dtypes(obj, probe)
    if variable is not None:
        variable.begin(n_patterns, n_patterns, want_probe)
    c = SliceChunk(obj, probe, intensities, positions, kernel, detector, cdtype, variable=variable)
    xp, every = c.xp, slice(0, n_patterns)
    y = xp.asarray(intensities).astype(rdtype, copy=False)
    if valid is not None:
        valid = asarray_like(valid, intensities)
    exit_waves, incident = multislice_forward(c.shifted, c.patches, c.kernel)
    far = detector_forward(exit_waves, c.detector)
    background = None if variable is None else variable.background
    per_pattern, g_far, yhat = _far_field_loss(loss, far, y, valid, eps, True, background=background)  # keeps far
    g_exit = detector_adjoint(g_far, c.detector)
    if variable is not None:
        if variable.want_background:
            variable.background_terms(loss, yhat, y, valid, eps)
        variable.pattern_terms(every, c.patches[0], None, None, intensity=False)
        variable.exit_terms(every, exit_waves, g_exit)     # Re⟨ψ_j, g_ψj⟩ = s_j ∂L/∂s_j, ‖ψ_j‖²
    grads, g_q, _ = multislice_vjp(g_exit, c.patches, incident, c.kernel, want_slices=want_object)
    sum_measured, sum_model = pattern_sums(y, yhat, valid, xp)
    part = Partial(scalars={"loss": float(per_pattern.sum()), "n": float(n_patterns),
                            "sum_measured": sum_measured, "sum_model": sum_model})
    if want_object:
        part.boxes["object_grad"] = BoxedArray(c.origin, c.boxes(grads, cdtype))
    part.boxes["illumination"] = BoxedArray(
        c.origin, c.boxes(xp.stack([model_intensity(incident[k]) for k in range(c.n_slices)]), rdtype))
    if want_probe or variable is not None:
        spectra = c.pattern_spectra(g_q)
        probe_grad = ifft2(c.probe_gradient_spectra(spectra)).astype(cdtype, copy=False)
        if want_probe:
            part.arrays["probe_grad"] = probe_grad
            power = xp.abs(c.patches[0]) ** 2
            part.arrays["probe_illumination"] = power.sum(axis=0).astype(rdtype)
    if want_positions:
        part.arrays["position_grad"] = _position_gradient(c, g_q, g_far, far)
    factor = window_chi_factor(loss) if window_sums and want_object else None
    if factor is not None:
        _, window = position_sums(c, grads, incident, positions=positions, shifts=False,
                                  scattered=part.boxes["object_grad"].data, reuse=reuse)
        part.arrays.update(window, window_num=window["window_num"] * factor)
    if variable is not None:
        variable.finish(part, *pixel_sums(y, yhat))
    if is_cupy(obj):  # partials stay where the state lives; the positions' optimiser is on the host
        return part
    return part.to_numpy()


def _position_gradient(c, g_q, g_far, detected):
    """∂L/∂(y, x) per pattern (B, 2) float64: the probe's sub-pixel shift, Re⟨g_Q, ∂_a S_f P⟩, and
    in the near field the detector's translation back by the same fraction, Re⟨g_D, ∂_a D⟩ (g_D
    the gradient at the detector, D the detected waves)."""
    grads = [real_dots(g_q, dq) for dq in c.shift_derivatives()]
    if c.detector is not None:
        grads = [g + real_dots(g_far, dd) for g, dd in zip(grads, c.detector_derivatives(detected))]
    return np.stack([to_numpy(g) for g in grads], axis=1)


def chunk_loss(obj, probe, intensities, positions, *, options=None, kernel=None, detector=None,
               loss: str | None = None, valid=None, eps: float | None = None, variable=None) -> Partial:
    """Loss only (forward model, no adjoint) of one chunk: ``scalars`` loss (float64 sum) and n."""
    loss, eps = _loss_settings(options, loss, eps)
    if intensities.shape[0] == 0:
        return Partial()
    cdtype, rdtype = _dtypes(obj, probe)
    if variable is not None:
        variable.begin(intensities.shape[0], intensities.shape[0], False)
    c = SliceChunk(obj, probe, intensities, positions, kernel, detector, cdtype, variable=variable)
    exit_waves, _ = multislice_forward(c.shifted, c.patches, c.kernel, keep=False)
    y = c.xp.asarray(intensities).astype(rdtype, copy=False)
    valid = None if valid is None else asarray_like(valid, intensities)
    per_pattern, _, _ = _far_field_loss(loss, detector_forward(exit_waves, c.detector), y, valid, eps, False,
                                        background=None if variable is None else variable.background)
    return Partial(scalars={"loss": float(per_pattern.sum()), "n": float(intensities.shape[0])})
