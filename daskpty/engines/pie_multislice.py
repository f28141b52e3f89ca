"""rPIE through K slices and/or a near-field detector: 3PIE (Maiden, Humphry & Rodenburg, JOSA A
29, 1606, 2012) with rPIE's regularised denominators, in the same minibatch rounds as :mod:`.pie`.

The forward model is :mod:`daskpty.physics.multislice` (K slices Δz apart, entrance first, incident
waves φ_k, exit wave ψ_K) and the detector operator (far field, or the near-field kernel). Per
pattern, the exit wave's change Δψ_K = χ (the noise model's correction, as :mod:`.pie`) is carried
back slice by slice, k = K … 1:

    object slice k:   numerator Σ_m conj(φ_k) Δψ_k, denominator Σ_m |φ_k|² (summed over the round,
                      divided in :func:`daskpty.engines.pie.apply` slice by slice, as single slice);
    incident wave:    Δφ_k = conj(O_k) Δψ_k / ((1 − α_P)|O_k|² + α_P max|O_k|²)  (rPIE's probe rule);
    previous slice:   Δψ_{k−1} = 𝒫ᴴ Δφ_k;

and Δφ_1, shifted back by −f, is the pattern's probe update. With α_P = 1 this is 3PIE; with K = 1
in the far field it is :func:`daskpty.engines.pie.chunk_step`. The slices share the exit wave's
correction: each slice's object numerator is divided by K. Every slice's full step explains
nearly the same χ (its low frequencies above all), so together they overshoot K-fold: on a
2-slice electron scan (tests/test_compose_runs.py's, 49 patterns, 4 rounds) rPIE with full
steps diverged in epoch 4 (loss 2.7e3 → 6.7e6), with 1/K it fell monotonically (1982 after 12
epochs, one slice 2541); batched, the sums stand in for Maiden's sequential per-pattern order. Position refinement takes the
multislice LSQML's shift terms (the exit wave's exact change per unit position through the
slices, :func:`daskpty.engines.multislice_positions.position_sums`, with the windows' deformation sums). No dask here.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..physics import ifft2
from ..physics.backend import asarray_like
from ..physics.kernels import far_field_update
from ..physics.multislice import detector_forward, multislice_forward, multislice_vjp
from ..physics.propagation import angular_spectrum_adjoint
from . import multislice as ms
from .multislice_positions import position_sums
from .lsqml import LSQMLState, close_epoch
from .partials import BoxedArray, Partial


def chunk_step(obj, probe, intensities, positions, *, options, kernel=None, detector=None, update_probe: bool = True,
               valid=None, position_terms: bool = False, window_sums: bool = False, reuse=None) -> Partial:
    """The 3PIE / rPIE sums of one chunk through the slices, as an additive partial.

    obj (K, H, W) complex64 (or (H, W)), probe (M, n, n), intensities (B, n, n) (far field: zero
    frequency at index 0; near field: as recorded), positions (B, 2), ``kernel`` the slice-to-slice
    transfer function (K > 1), ``detector`` None (far field) or the near-field kernel, ``options``
    :class:`~daskpty.engines.pie.PIEOptions`. Boxes (K, h, w): ``object_num``, ``illumination``;
    ``probe_num`` (M, n, n) when ``update_probe``; scalars ``loss``, ``n``, ``sum_model``.
    ``position_terms``: the LSQML shift sums in ``local["shift_terms"]`` and with
    ``window_sums`` the windows' deformation sums in ``arrays``, through the slices as in
    multislice LSQML (:func:`~.multislice_positions.position_sums`; ``reuse``: an earlier
    epoch's carried sums, :class:`~.multislice_positions.ReusedSums`).
    """
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    c = ms.SliceChunk(obj, probe, intensities, positions, kernel, detector)
    xp, n_slices = c.xp, c.n_slices
    y = xp.asarray(intensities).astype(np.float32, copy=False)
    if valid is not None:
        valid = asarray_like(valid, intensities)

    exit_waves, incident = multislice_forward(c.shifted, c.patches, c.kernel)
    far = detector_forward(exit_waves, c.detector)
    delta, yhat, loss = far_field_update(options.noise, far, y, valid, options.eps, overwrite=True)
    chi = ms.detector_adjoint(delta, c.detector)                    # Δψ_K: the exit wave's change

    obj_num = xp.zeros(c.obj_box.shape, np.complex64)
    illum = xp.zeros(c.obj_box.shape, np.float32)
    change = chi
    for k in range(n_slices - 1, -1, -1):
        phi, o = incident[k], c.patches[k]
        c.index.scatter_add(obj_num[k], (xp.conj(phi) * change).sum(axis=1))
        c.index.scatter_add(illum[k], (phi.real ** 2 + phi.imag ** 2).sum(axis=1).astype(np.float32, copy=False))
        if k == 0 and not update_probe:
            break
        power = o.real ** 2 + o.imag ** 2
        top = power.reshape(n_patterns, -1).max(axis=1)[:, None, None]
        weight = xp.conj(o) / xp.maximum((1 - options.probe_alpha) * power + options.probe_alpha * top,
                                         np.float32(1e-30))
        change = weight[:, None] * change                             # Δφ_k
        if k:
            change = angular_spectrum_adjoint(change, c.kernel)       # Δψ_{k−1}
    if n_slices > 1:   # the slices share the exit wave's correction (module docstring)
        obj_num *= np.float32(1.0 / n_slices)
    part = Partial(boxes={"object_num": BoxedArray(c.origin, obj_num), "illumination": BoxedArray(c.origin, illum)},
                   scalars={"loss": float(loss.sum()), "n": float(n_patterns),
                            "sum_model": float((yhat if valid is None else yhat * valid).sum(dtype=np.float64))})
    if update_probe:                       # Σ_j S_−f Δφ_1j: each pattern's update shifted back
        part.arrays["probe_num"] = ifft2(c.pattern_spectra(change).sum(axis=0)).astype(np.complex64, copy=False)
    if position_terms:
        grads = multislice_vjp(chi, c.patches, incident, c.kernel)[0] if n_slices > 1 else \
            (xp.conj(incident[0]) * chi).sum(axis=1)[None]
        part.local["shift_terms"], window = position_sums(
            c, grads, incident, positions=positions, scattered=c.boxes(grads, np.complex64) if window_sums else None,
            reuse=reuse)
        if window is not None:
            part.arrays.update(window)
    return part


def end_epoch(state: LSQMLState, options) -> LSQMLState:
    """Probe-mode orthogonalisation, the slices' scale ambiguity removed slice by slice
    (:func:`daskpty.engines.multislice.normalize_scale`), the epoch counter."""
    state = close_epoch(state, dataclasses.replace(options, normalize_every=0))
    if options.normalize_every and state.epoch % options.normalize_every == 0:
        ms.normalize_scale(state)
    return state

