"""Multislice LSQML (per-slice directions and step lengths) per chunk, through the forward model
of :mod:`.forward_model` (K slices, the near-field detector). The object is (K, H, W); a partial
holds K boxed slices as one (K, h, w) :class:`BoxedArray`. No dask in here.

LSQML multislice (after Odstrčil et al., Opt. Express 26, 3108, 2018, and the multislice LSQML of
PtychoShelves' GPU_MS), per chunk:

1. forward through the slices keeping the incident waves φ_k; far-field update → exit residual χ;
2. χ is carried back through the slices with the exact adjoint chain (physics.multislice_vjp),
   giving per slice the object numerator Σ_j Σ_m conj(φ_kjm) χ_kjm and illumination Σ|φ_k|² on the
   box, and at the entrance surface the probe direction Σ_j S_{−f_j}(conj(O_1j) χ_1j) (as single
   slice);
3. step lengths: each direction — ΔÔ_k φ_k per slice, S_f ΔP̂ · O_1 for the probe — is carried to
   the exit by the remaining slices (T_k, physics.transmit), and per pattern the (K + 1) × (K + 1)
   least-squares system Re⟨T_i d_i, T_l d_l⟩ α = Re⟨T_i d_i, χ⟩ is solved (K + 1 unknowns: one
   step per slice and the probe's), regularised and clipped as the single-slice 2 × 2 system of
   :mod:`.lsqml`, then trimmed means over the chunk. Solving jointly keeps slices that explain the
   same part of χ (the low spatial frequencies) from each taking the whole step.

With K = 1 every step is the single-slice LSQML step of :func:`daskpty.engines.lsqml.chunk_step`
(same equations; that function stays the K = 1 code path). Working set per chunk: about 2K + 4
exit-wave-sized (B, M, n, n) arrays (single slice: ~3); the chunk is processed as one batch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..physics import get_xp, ifft2, model_intensity
from ..physics.backend import asarray_like, is_cupy, real_dots
from ..physics.multislice import (detector_forward, multislice_forward,  # noqa: F401  (the tests' names)
                                  multislice_vjp, slice_windows, transmit)
from ..physics.kernels import far_field_update  # fused on the GPU (the NumPy reference on the CPU)
from . import lsqml
from .forward_model import ForwardModel
from .lsqml import LSQMLOptions, LSQMLState, begin_epoch, rescale_probe  # noqa: F401  (re-exported)
from .multislice_positions import position_sums
from .partials import BoxedArray, Partial
from .positions import accumulate_affine, accumulate_window

#: With K > 1 slices :func:`chunk_step` solves the per-pattern step system on a sample of the
#: chunk's patterns, every s-th (see :func:`step_sample_stride`): only the trimmed mean of the
#: per-pattern step lengths is used, and carrying the K + 1 directions to the exit costs
#: (K − 1)(K + 2) / 2 propagations per pattern (5 for K = 3: a third of the step's transforms).
STEP_STRIDE = 4
#: ... leaving at least this many patterns for the trimmed mean.
STEP_SAMPLE_MIN = 16


def step_sample_stride(n_patterns: int, n_slices: int) -> int:
    """s of the step system's sample, every s-th pattern of a chunk: the largest s ≤
    :data:`STEP_STRIDE` that leaves ≥ :data:`STEP_SAMPLE_MIN` patterns; 1 (all) for one slice,
    where the directions need no transforms."""
    if n_slices < 2:
        return 1
    return max(1, min(STEP_STRIDE, n_patterns // STEP_SAMPLE_MIN))


def SliceChunk(obj, probe, intensities, positions, kernel, detector, cdtype=np.complex64, variable=None):
    """The whole chunk as one block of the forward model through ``kernel``'s slices to
    ``detector`` (:class:`~.forward_model.Block`: box, windows, ramps, S_f P, the incident, exit and
    detected waves); obj (K, H, W) or (H, W)."""
    obj = obj[None] if obj.ndim == 2 else obj
    c = ForwardModel(obj.shape[0], kernel, detector).chunk(obj, probe, intensities, positions, cdtype=cdtype,
                                                           variable=variable, whole=True)
    return c.forward(c.blocks[0])


def pattern_sums(y, yhat, valid, xp):
    mask = None if valid is None else asarray_like(valid, y).astype(np.float64)
    if mask is None:
        return float(y.sum(dtype=np.float64)), float(yhat.sum(dtype=np.float64))
    return float((y * mask).sum(dtype=np.float64)), float((yhat * mask).sum(dtype=np.float64))


def _preconditioner(illum, delta: float, peak=None):
    """√(W² + (δ max W)²) per slice of W (K, h, w); ``peak``: the (K,) float32 maxima when
    ``illum`` is only a tile of the object's."""
    xp = get_xp(illum)
    peak = illum.reshape(illum.shape[0], -1).max(axis=1) if peak is None else xp.asarray(peak, np.float32)
    floor = ((np.float32(delta) * peak) ** 2).astype(np.float32)[:, None, None]
    return xp.sqrt(illum * illum + floor).astype(np.float32, copy=False)


def _step_lengths(gram, rhs, options: LSQMLOptions, update_probe: bool, xp):
    """Per-pattern LSQ steps (B, D) from Gram (B, D, D) and right-hand sides (B, D), regularised as
    lsqml's 2 × 2 (with probe: + λ·mean diagonal; without: diagonal · (1 + λ)), clipped ≥ 0."""
    d = gram.shape[-1]
    eye = xp.eye(d)
    diag = xp.diagonal(gram, axis1=1, axis2=2)                     # (B, D)
    if update_probe:
        gram = gram + (options.tikhonov * diag.mean(axis=0) + 1e-30)[None, :, None] * eye
    else:
        gram = gram + (options.tikhonov * diag + 1e-30)[:, :, None] * eye
    alpha = xp.linalg.solve(gram, rhs[..., None])[..., 0]
    return xp.clip(alpha, 0.0, None)


def chunk_step(obj, probe, intensities, positions, *, options: LSQMLOptions, kernel=None, detector=None,
               update_probe: bool = True, valid=None, position_terms: bool = False, variable=None,
               window_sums: bool = False, step_stride: int | None = None, reuse=None) -> Partial:
    """One multislice LSQML step for one chunk of patterns, as an additive partial.

    obj (K, H, W) complex64 (or (H, W): K = 1); probe (M, n, n); intensities (B, n, n) (far field:
    zero frequency at index 0; near field: as recorded); positions (B, 2) (y, x) object pixels;
    kernel: slice-to-slice transfer function (n, n) (``SliceGeometry.kernel``; unused for K = 1);
    detector: None (far field) or the near-field kernel (n, n); valid: optional (n, n) bool mask;
    step_stride: the step lengths α come from every s-th pattern's step system (default
    :func:`step_sample_stride`; 1: every pattern's).

    Returns a :class:`Partial` with ``boxes["object"]`` (K, h, w) = α_k Σ conj(φ_k) χ_k per slice
    and ``boxes["illumination"]`` (K, h, w) = Σ|φ_k|², ``arrays["probe"]`` = α_P Σ_j S_{−f}(conj(O_1) χ_1)
    when updating the probe, ``arrays["alpha_slices"]`` (K,) = α_k B, and the scalars of
    :func:`daskpty.engines.lsqml.chunk_step` (``alpha_object`` is the mean of the α_k, times B).

    The parts of :func:`daskpty.engines.lsqml.chunk_step` compose here the same way:

    * ``position_terms``: the LSQML position shift's sums in ``local["shift_terms"]``: Re⟨d_a, χ⟩
      and ‖d_a‖² of the exit wave's exact change per unit position d_a, carried through the
      slices, and with ``window_sums`` the windows' deformation sums in ``arrays``
      (:func:`~.multislice_positions.position_sums`; ``reuse``: an earlier epoch's carried
      sums, :class:`~.multislice_positions.ReusedSums`).
    * ``variable``: a :class:`~daskpty.engines.pattern_probes.PatternProbes` (OPR, intensity
      factors, background): each pattern's own probe at the entrance, the background in the
      detector's model, the probe sums weighted by ∂P_j/∂P, the eigen-probe and weight terms from
      the entrance-plane spectra G_j (exact: the exit wave is linear in the entrance wave), the
      intensity factors' terms from the exit wave Re⟨ψ_j, χ_j⟩ / ‖ψ_j‖²; the weights' curvature
      is sampled with the entrance slice (an approximation of its Gauss–Newton preconditioner).
    """
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    if variable is not None:
        variable.begin(n_patterns, n_patterns, update_probe)
    c = SliceChunk(obj, probe, intensities, positions, kernel, detector, variable=variable)
    xp, n_slices, every = c.xp, c.n_slices, slice(0, n_patterns)
    y = xp.asarray(intensities).astype(np.float32, copy=False)
    if valid is not None:
        valid = asarray_like(valid, intensities)

    exit_waves, incident, far = c.exit, c.incident, c.detected
    background = None if variable is None else variable.background
    delta_far, yhat, loss = far_field_update(options.noise, far, y, valid, options.eps, overwrite=True,
                                             background=background)
    chi = c.chunk.to_exit(c, delta_far)                                 # χ at the exit surface
    if variable is not None:                    # brightness_first: the brightness steps first
        variable.brightness_step(every, c.patches[0], c.shifted, chi, psi=exit_waves)
        variable.pattern_terms(every, c.patches[0], None, None, intensity=False)
        if variable.want_intensity and not variable.steps_brightness_first:
            variable.exit_terms(every, exit_waves, chi)
    grads, g_q, _ = multislice_vjp(chi, c.patches, incident, c.kernel)
    obj_num = c.boxes(grads, np.complex64)
    lit = xp.empty((n_slices, n_patterns) + incident[0].shape[2:], np.float32)   # Σ_m |φ_k|²
    for k in range(n_slices):
        lit[k] = model_intensity(incident[k])
    illum = c.boxes(lit, np.float32)
    obj_dir = obj_num * (np.float32(1.0) / _preconditioner(illum, options.object_delta))   # ΔÔ_k
    shift_terms = window = None
    if position_terms:
        shift_terms, window = position_sums(c, grads, incident, positions=positions, lit=lit,
                                            scattered=obj_num if window_sums else None, reuse=reuse)

    # Directions carried to the exit, then the per-pattern (K + 1)-unknown step system, on the
    # step lengths' sample of patterns (step_sample_stride: only their trimmed mean is used).
    directions = []
    if step_stride is None:
        step_stride = step_sample_stride(n_patterns, n_slices)
    pick = slice(0, None, max(1, int(step_stride)))
    sample = c.patches[:, pick]
    dir_patches = slice_windows(c.index, obj_dir, pick)
    for k in range(n_slices):
        directions.append(transmit(dir_patches[k][:, None] * incident[k][pick], sample, c.kernel, k))
    probe_sum = None
    if update_probe:
        spectra_sum = c.probe_gradient_spectra(c.pattern_spectra(g_q))  # F Σ_j (∂P_j/∂P) S_{−f_j} g_Qj
        probe_sum = ifft2(spectra_sum)
        b = ifft2(c.ramps[pick][:, None] * (spectra_sum / np.float32(n_patterns))[None], overwrite=True)
        if variable is not None:                # pattern j's probe moves by (∂P_j/∂P) ΔP̂
            b *= variable.mode_factors_xp(every)[pick][:, :, None, None]
        directions.append(transmit(b * sample[0][:, None], sample, c.kernel, 0))
    d = len(directions)
    n_sample = directions[0].shape[0]
    gram = xp.empty((n_sample, d, d))
    rhs = xp.empty((n_sample, d))
    for i in range(d):
        rhs[:, i] = real_dots(directions[i], chi[pick])
        for l in range(i, d):
            gram[:, i, l] = gram[:, l, i] = real_dots(directions[i], directions[l])
    alpha = _step_lengths(gram, rhs, options, update_probe, xp)
    steps = [lsqml._trimmed_mean(alpha[:, i], xp) for i in range(d)]
    alpha_slices = np.asarray(steps[:n_slices])
    alpha_p = steps[n_slices] if update_probe else 0.0

    obj_num *= xp.asarray(alpha_slices.astype(np.float32))[:, None, None]
    sum_measured, sum_model = pattern_sums(y, yhat, valid, xp)
    part = Partial(
        boxes={"object": BoxedArray(c.origin, obj_num), "illumination": BoxedArray(c.origin, illum)},
        arrays={"alpha_slices": alpha_slices * n_patterns},
        scalars={"loss": float(loss.sum()), "n": float(n_patterns),
                 "alpha_object": float(alpha_slices.mean()) * n_patterns, "alpha_probe": alpha_p * n_patterns,
                 "sum_measured": sum_measured, "sum_model": sum_model},
    )
    if probe_sum is not None:
        part.arrays["probe"] = (np.float32(alpha_p) * probe_sum).astype(np.complex64, copy=False)
    if shift_terms is not None:
        part.local["shift_terms"] = shift_terms
    if window is not None:
        part.arrays.update(window)
    if variable is not None:
        variable.finish(part, *pixel_sums(y, yhat))
    return part if is_cupy(obj) else part.to_numpy()  # partials stay where the state lives


def pixel_sums(y, yhat):
    """Σ_j y_j and Σ_j ŷ_j per detector pixel (n²,) float64 (the probe model's background)."""
    b = y.shape[0]
    return y.reshape(b, -1).sum(axis=0, dtype=np.float64), yhat.reshape(b, -1).sum(axis=0, dtype=np.float64)


def apply(state: LSQMLState, total: Partial, options: LSQMLOptions, illumination_max=None) -> LSQMLState:
    """Add a reduced partial to a (K, H, W) state: O_k += β ΔO_k / √(W_k² + (δ max W_k)²),
    P += β ΔP / N; the epoch's illumination (K, H, W) keeps the largest of its rounds'; the
    positions' affine sums are gathered as in :func:`daskpty.engines.lsqml.apply`.
    ``illumination_max``: the (K,) maxima over the whole object when the state holds a tile."""
    accumulate_affine(state, total)
    accumulate_window(state, total)
    if "object" not in total.boxes:
        return state
    xp = get_xp(state.object)  # NumPy, or CuPy for a state in a GPU worker's memory
    obj = state.object.copy()
    num, illum = total.boxes["object"], total.boxes["illumination"]
    scale = _preconditioner(illum.data, options.object_delta, illumination_max)
    xp.divide(np.float32(options.beta), scale, out=scale)
    BoxedArray(num.offset, num.data * scale).add_into(obj)
    probe = state.probe
    if "probe" in total.arrays:
        probe = (probe + options.beta * total.arrays["probe"] / np.float32(total.scalars["n"])).astype(np.complex64)
    full = xp.zeros(obj.shape, np.float32) if state.illumination is None else state.illumination.copy()
    (y0, x0), (y1, x1) = illum.offset, illum.stop
    xp.maximum(full[:, y0:y1, x0:x1], illum.data, out=full[:, y0:y1, x0:x1])
    state.object, state.probe, state.illumination = obj, probe, full
    return state


def end_epoch(state: LSQMLState, options: LSQMLOptions, *, agree: bool | None = None,
              scales=None, in_place: bool = False) -> LSQMLState:
    """:func:`daskpty.engines.lsqml.end_epoch` (momentum, mode orthogonalisation) with the scale
    ambiguity removed slice by slice (:func:`normalize_scale`). ``agree`` and ``scales`` (the
    slices' mean |O_k| where lit) come from outside when the state holds a tile; ``in_place``
    as :func:`daskpty.engines.lsqml.end_epoch`."""
    owned = lsqml.owned_at_end(state, options, in_place)
    state = lsqml.end_epoch(state, dataclasses.replace(options, normalize_every=0), agree=agree, in_place=in_place)
    if options.normalize_every and state.epoch % options.normalize_every == 0:
        normalize_scale(state, scales, owned)
    return state


def normalize_scale(state: LSQMLState, scales=None, owned: tuple = ()) -> None:
    """Remove the slices' scale ambiguity O_k c_k, P / Π c_k: mean |O_k| = 1 where slice k is lit
    (``scales``: those means, when the state holds only a tile of the object; ``owned``: the
    arrays it may divide in place, "object" and "velocity")."""
    if state.illumination is None and scales is None:
        return
    obj = state.object if "object" in owned else state.object.copy()
    velocity_owned = "velocity" in owned
    total = 1.0
    for k in range(obj.shape[0]):
        if scales is not None:
            c = float(scales[k])
        else:
            w = state.illumination[k]
            lit = w > 0.5 * w.max()
            c = float(get_xp(obj).abs(obj[k][lit]).mean()) if bool(lit.any()) else 0.0
        if c > 0 and np.isfinite(c):
            obj[k] /= np.float32(c)
            total *= c
            if state.velocity is not None:
                if not velocity_owned:  # (once: a copy per slice cost K of them)
                    state.velocity, velocity_owned = state.velocity.copy(), True
                state.velocity[k] /= np.float32(c)
    state.object = obj
    state.probe = (state.probe * np.float32(total)).astype(np.complex64)
    if state.eigen_probes is not None:  # they scale with the mean probe (weights unchanged)
        state.eigen_probes = (state.eigen_probes * np.float32(total)).astype(np.complex64)


def forward_sums(obj, probe, intensities, positions, *, kernel=None, detector=None, valid=None) -> Partial:
    """Σ measured and Σ model intensity of one chunk (for :func:`rescale_probe`)."""
    obj = obj[None] if obj.ndim == 2 else obj
    return lsqml.forward_sums(obj, probe, intensities, positions, sample=ForwardModel(obj.shape[0], kernel, detector),
                              valid=valid)
