"""LSQML engine (Odstrčil, Menzel & Guizar-Sicairos, Opt. Express 26, 3108, 2018).

Two pure functions around an additive :class:`~daskpty.engines.partials.Partial`:

* :func:`chunk_step` — for one chunk of patterns and the current object/probe, compute the
  exit-wave residuals, the object and probe update directions, the per-pattern optimal
  step lengths (2 × 2 least-squares system) and return a partial holding the step-scaled
  object numerator and illumination on the chunk's bounding box, the step-scaled probe sum,
  and loss / step statistics.
* :func:`apply` — add the reduced partial to the state with the illumination preconditioner.

Plus :func:`end_epoch` (momentum, probe-mode orthogonalisation, scale-ambiguity removal) and
:func:`forward_sums` (for the first-epoch probe intensity rescale). No dask in here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..physics import (
    fft2,
    get_noise_model,
    get_xp,
    ifft2,
    model_intensity,
    split_positions,
)
from ..physics.backend import asarray_like, channel_dots, is_cupy, real_dots, to_numpy
from ..physics.patches import PatchIndex
from ..physics.shifts import outer_ramps, shift_ramp_factors
from ..physics import kernels
from .lsqml_epoch import (begin_epoch, close_epoch, end_epoch, normalize_scale,  # noqa: F401 (re-exported)
                          normalizes_now, owned_at_end)
from .partials import BoxedArray, Partial
from .forward_model import THIN, ForwardModel
from .position_sums import refining_step
from .forward_model import fft_in_place as _fft_in_place
from .state import EngineState, trimmed_mean as _trimmed_mean
from .window_deformation import WindowDeformation, squared_gradients, warp_object
from .tile_frame import frame_of
from .positions import (
    PositionOptions,
    accumulate_affine,
    accumulate_window,
    central_gradients,
)


#: the illumination preconditioner's δ for one slice, and for K > 1 slices (LSQMLOptions.delta)
DELTA, SLICES_DELTA = 0.1, 0.5


@dataclass(frozen=True)
class LSQMLOptions:
    """Settings of the LSQML engine.

    noise: ``"gaussian"`` (amplitude) or ``"poisson"`` far-field correction.
    beta: damping of the optimal step (0 < beta ≤ 1).
    delta: illumination-preconditioner regularisation, relative to max illumination. None:
        0.1 for one slice, 0.5 for K > 1 slices (:meth:`for_slices`; read as
        :attr:`object_delta`). Through slices the larger floor keeps the deeper slices, lit by
        a spread beam, from taking noisy steps where they are barely lit (per-slice NRMSE
        15–20 % lower on four of five multislice sets: docs/benchmarks.md).
    tikhonov: relative regularisation of the 2 × 2 step system.
    probe_start_epoch: first epoch in which the probe is updated (None: never).
    momentum: heavy-ball momentum on the object's per-epoch change (0 disables).
    orthogonalize: SVD-orthogonalise probe modes after each epoch.
    normalize_every: remove the object/probe scale ambiguity every this many epochs (0: never).
    eps: small number added where intensities are divided.
    """

    noise: str = "gaussian"
    beta: float = 0.9
    delta: float | None = None
    tikhonov: float = 1e-2
    probe_start_epoch: int | None = 0
    momentum: float = 0.5
    orthogonalize: bool = True
    normalize_every: int = 1
    eps: float = 1e-6

    def __post_init__(self):
        get_noise_model(self.noise, lsqml=True)
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must lie in (0, 1], got {self.beta}")
        if not (self.delta is None or self.delta > 0):
            raise ValueError(f"delta must be positive or None, got {self.delta}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum}")

    @property
    def object_delta(self) -> float:
        """The preconditioner's δ (``delta``, or one slice's default when unresolved)."""
        return DELTA if self.delta is None else float(self.delta)

    def for_slices(self, n_slices: int) -> "LSQMLOptions":
        """These options with ``delta`` None resolved for an object of ``n_slices`` slices."""
        if self.delta is not None:
            return self
        return dataclasses.replace(self, delta=SLICES_DELTA if n_slices > 1 else DELTA)


#: the state of LSQML (and of the PIE engines): :class:`~.state.EngineState`
LSQMLState = EngineState


def resample_object_state(state, matrix, offset) -> None:
    """O(x) ← O(matrix · x + offset) for the object and its momentum buffer, where the state
    lives (NumPy or CuPy): the window correction's move of the object (:func:`warp_object`)."""
    frame = frame_of(state)  # (on a tile: rows placed in the whole object)
    state.object, state.velocity = (warp_object(a, matrix, offset, frame) for a in (state.object, state.velocity))


def _preconditioner(illum, delta: float, peak: float | None = None):
    """√(W² + (δ max W)²); ``peak``: max W when ``illum`` is only a tile of the object's."""
    xp = get_xp(illum)
    floor = np.float32((delta * (float(illum.max()) if peak is None else peak)) ** 2)
    out = illum * illum
    out += floor
    return xp.sqrt(out, out=out).astype(np.float32, copy=False)


#: Target size of one sub-batch (b, M, n, n) complex64 block on the CPU: small enough that a
#: block's temporaries stay in the L2/L3 caches between the FFTs and the element-wise passes.
CPU_BLOCK_BYTES = 1 << 20


def chunk_step(obj, probe, intensities, positions, *, options: LSQMLOptions, update_probe: bool = True,
               valid=None, position_terms: bool = False, variable=None, window_sums: bool = True) -> Partial:
    """One LSQML step for one chunk of patterns, returned as an additive partial.

    obj: (H, W) complex64 (whole object; only the chunk's bounding box is read).
    probe: (M, n, n) complex64. intensities: (B, n, n), zero frequency at index 0, any real dtype
    (counts stay integer until here). positions: (B, 2) float (y, x) in object pixels.
    valid: optional (n, n) bool detector mask (zero frequency at index 0).

    Two passes over sub-batches of the chunk (on the CPU sized to stay in cache, on the GPU the
    whole chunk). Pass 1: exit waves, far-field update, residual χ, object gradient
    g_j = Σ_k conj(S_f P_k) χ_jk and illumination scattered into the box, and the sum of the
    probe-gradient spectra G_j = conj(ramp_j) · F(conj(O_j) χ_j) (F of the probe update). Pass 2:
    the step-length system with a_j = ΔÔ_j S_f P and b_j = S_f ΔP̂ · O_j. Kept between the passes:
    S_f P and χ when the probe is updated (pass 2 forms Re⟨a_j, χ_j⟩ and Re⟨b_j, χ_j⟩ from them:
    two arrays of the exit-wave shape, not three, which matters because the chunk's share of
    them outgrows the caches); else g_j and Σ_k |S_f P_k|², with Re⟨a_j, χ_j⟩ = Re⟨ΔÔ_j, g_j⟩.

    ``position_terms``: also the two sums of the LSQML position shift of every pattern, in
    ``local["shift_terms"]`` (each (B, 2); see :func:`~.positions.lsqml_shift`):
    Re Σ_k conj(S_f P_k ∂_a O_j) χ_jk and Σ_k |S_f P_k ∂_a O_j|², formed in pass 1 as
    Re⟨∂_a O_j, g_j⟩ and ⟨|∂_a O_j|², Σ_k |S_f P_k|²⟩ (∂_a O by central differences on the
    box, |∂_y O|² and |∂_x O|² formed there once and packed in one complex image): three
    gathers and four dot products per pattern, no FFT. With them the window
    deformation's sums (:class:`WindowDeformation`; ``window_sums``) in ``arrays``.

    ``variable``: a :class:`~daskpty.engines.pattern_probes.PatternProbes` when the probe varies from
    pattern to pattern (OPR weights, intensity factors, background; None: one probe for all, this
    very code path). Each pattern then uses its own probe spectra, the probe sums are weighted by
    how each pattern's probe depends on the shared modes, and the variable model's per-pattern
    least-squares terms are left on ``variable`` (see :mod:`daskpty.engines.lsqml_opr`).
    """
    xp = get_xp(intensities)
    n = probe.shape[-1]
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    corners, fractions = split_positions(to_numpy(positions), n)
    box0 = corners.min(axis=0)
    box1 = corners.max(axis=0) + n
    # Only the chunk's bounding box of the object travels to the device.
    obj_box = asarray_like(obj[box0[0]:box1[0], box0[1]:box1[1]], intensities)
    obj_box = xp.ascontiguousarray(obj_box, dtype=np.complex64)
    probe = asarray_like(probe, intensities).astype(np.complex64, copy=False)
    n_modes = probe.shape[0]
    if valid is not None:
        valid = asarray_like(valid, intensities)
    index = PatchIndex(corners - box0, n, obj_box.shape, xp)  # reused by every gather/scatter
    ry, rx = shift_ramp_factors(fractions, n, xp)
    probe_ft = fft2(probe)
    intensities = xp.asarray(intensities)
    step = n_patterns if xp is not np else max(1, min(n_patterns, CPU_BLOCK_BYTES // (8 * n_modes * n * n)))
    blocks = [slice(s, min(s + step, n_patterns)) for s in range(0, n_patterns, step)]
    if variable is not None:
        variable.begin(step, n_patterns, update_probe)

    wave_shape = (n_patterns, n_modes, n, n)
    work = xp.empty((step, n_modes, n, n), np.complex64)
    if update_probe:
        shifted = xp.empty(wave_shape, np.complex64)        # S_f P, kept for pass 2
        chis = xp.empty(wave_shape, np.complex64)           # χ, kept for pass 2
        grad = xp.empty((step, n, n), np.complex64)         # g_j of one sub-batch
        spectra_sum = xp.zeros(n_modes * n * n, np.complex64)
    else:
        shifted = xp.empty((step, n_modes, n, n), np.complex64)
        obj_grad = xp.empty((n_patterns, n, n), np.complex64)   # g_j, kept for pass 2
        illum_patches = xp.empty((n_patterns, n, n), np.float32)
    obj_num = xp.zeros(obj_box.shape, dtype=np.complex64)
    patches = xp.empty((step, n, n), np.complex64)
    illum = xp.zeros(obj_box.shape, dtype=np.float32)
    ramp = xp.empty((step, n, n), np.complex64)
    ones = xp.ones(step, np.float32)
    ones_c = ones.astype(np.complex64)
    measured = xp.zeros(n * n)  # Σ_j y_j and Σ_j ŷ_j per pixel (the mask is applied at the end)
    model = xp.zeros(n * n)
    loss = 0.0
    if position_terms:
        box_d = central_gradients(obj_box, xp)
        box_squares = squared_gradients(box_d, xp)              # |∂_y O|² + i |∂_x O|²
        shift_num = xp.empty((n_patterns, 2))
        shift_den = xp.empty((n_patterns, 2))
        residual_power = xp.empty(n_patterns)                  # Σ |χ_j|²: the shift's noise level
        d_patch = xp.empty((2, step, n, n), np.complex64)      # ∂_y O, ∂_x O windows of a sub-batch
        sq_patch = xp.empty((step, n, n), np.complex64)
        deform = WindowDeformation(n, xp, box_d) if window_sums else None

    # Pass 1.
    for batch in blocks:
        b = batch.stop - batch.start
        r = outer_ramps(ry[batch], rx[batch], out=ramp[:b])
        pft = probe_ft[None] if variable is None else variable.spectra(batch, out=variable.buffer[:b])
        sp = xp.multiply(r[:, None], pft, out=shifted[batch] if update_probe else shifted[:b])
        _fft_in_place(sp, inverse=True)                     # S_f P = F⁻¹(ramp · F P)
        o = index.extract(obj_box, batch, out=patches[:b])
        wave = chis[batch] if update_probe else work[:b]
        xp.multiply(sp, o[:, None], out=wave)               # ψ = S_f P · O
        _fft_in_place(wave)
        y = intensities[batch].astype(np.float32, copy=False)
        _, yhat, loss_b = kernels.far_field_update(options.noise, wave, y, valid, options.eps, overwrite=True,
                                                   background=None if variable is None else variable.background)
        loss += float(loss_b.sum())
        # Σ_j y_j and Σ_j ŷ_j per pixel: float32 over one block, float64 across blocks.
        measured += ones[:b] @ y.reshape(b, -1)
        model += ones[:b] @ yhat.reshape(b, -1)
        chi = _fft_in_place(wave, inverse=True)             # χ = F⁻¹(Ψ' − Ψ)
        if variable is not None:                            # brightness_first: χ then holds
            variable.brightness_step(batch, o, sp, chi)     # what the brightness step leaves
        # g = Σ_k conj(S_f P_k) χ_k and w = Σ_k |S_f P_k|² (one fused pass on the GPU)
        g, w = kernels.object_gradient(sp, chi, out=grad[:b] if update_probe else obj_grad[batch])
        if variable is not None:
            variable.pattern_terms(batch, o, g, w, intensity=not variable.steps_brightness_first)
        if position_terms:
            grads = [index.extract(box_d[axis], batch, out=d_patch[axis, :b]) for axis in range(2)]
            for axis, d in enumerate(grads):
                shift_num[batch, axis] = real_dots(d, g)
            squares = index.extract(box_squares, batch, out=sq_patch[:b])
            shift_den[batch] = channel_dots(w, squares)
            residual_power[batch] = real_dots(chi.reshape(b, -1), chi.reshape(b, -1))
            if deform is not None:
                deform.add_gram(batch, w, grads, squares)
        index.scatter_add(obj_num, g, batch)
        index.scatter_add(illum, w, batch)
        if update_probe:  # G_j = conj(ramp_j) · F(conj(O_j) χ_j), summed; χ stays for pass 2
            spec = kernels.conj_product(chi, o, out=work[:b])
            _fft_in_place(spec)
            kernels.conj_product(spec, r, out=spec)
            if variable is None:
                spectra_sum += ones_c[:b] @ spec.reshape(b, -1)
            else:  # Σ_j (∂P_jm/∂P_m) G_jm, and the eigen-probe and weight terms from G_j0
                variable.probe_terms(batch, spec, spectra_sum.reshape(n_modes, -1))
        else:
            illum_patches[batch] = w
    if position_terms and deform is not None:   # b on the box, from Σ_j g_j (obj_num, not yet scaled)
        deform.add_first(obj_num, index.corners, shift_num)
    inv_precond = _preconditioner(illum, options.object_delta)
    xp.divide(np.float32(1.0), inv_precond, out=inv_precond)
    obj_dir = obj_num * inv_precond  # ΔÔ = num / p, as num · (1/p): complex ÷ real is 5× slower

    # Pass 2: step-length system per pattern.
    a_chi = xp.empty(n_patterns)
    a_a = xp.empty(n_patterns)
    probe_sum = None
    if update_probe:
        spectra_sum = spectra_sum.reshape(n_modes, n, n)
        probe_sum = ifft2(spectra_sum)                      # Σ_j S_{-f_j}(conj(O_j) χ_j)
        probe_dir_ft = spectra_sum / np.float32(n_patterns)  # F ΔP̂
        b_chi = xp.empty(n_patterns)
        a_b = xp.empty(n_patterns)
        b_b = xp.empty(n_patterns)
        # a_j = ΔÔ_j S_f P_j: formed by the reference dots only (the fused ones never store it)
        a = None if kernels.uses_fused(obj_box) else xp.empty((step, n_modes, n, n), np.complex64)
    dirs = xp.empty((step, n, n), np.complex64)
    for batch in blocks:
        b = batch.stop - batch.start
        d = index.extract(obj_dir, batch, out=dirs[:b])    # ΔÔ_j
        if update_probe:
            r = outer_ramps(ry[batch], rx[batch], out=ramp[:b])
            bb = xp.multiply(r[:, None], probe_dir_ft[None], out=work[:b])
            _fft_in_place(bb, inverse=True)                # S_f ΔP̂
            bb *= index.extract(obj_box, batch, out=patches[:b])[:, None]
            if variable is not None:                       # pattern j's probe moves by (∂P_j/∂P) ΔP̂
                bb *= variable.mode_factors_xp(batch)[:, :, None, None]
            (a_chi[batch], b_chi[batch], a_a[batch], b_b[batch], a_b[batch]) = kernels.step_dots(
                d, shifted[batch], bb, chis[batch], work=None if a is None else a[:b])
        else:  # Re⟨a_j, χ_j⟩ = Re⟨ΔÔ_j, g_j⟩; Σ_k |ΔÔ_j S_f P_k|² = Σ |ΔÔ_j|² Σ_k |S_f P_k|²
            a_chi[batch], a_a[batch] = kernels.object_step_dots(d, obj_grad[batch], illum_patches[batch])

    if update_probe:
        a_a = a_a + options.tikhonov * a_a.mean() + 1e-30
        b_b = b_b + options.tikhonov * b_b.mean() + 1e-30
        det = a_a * b_b - a_b * a_b
        alpha_o = xp.clip((b_b * a_chi - a_b * b_chi) / det, 0.0, None)
        alpha_p = xp.clip((a_a * b_chi - a_b * a_chi) / det, 0.0, None)
        alpha_p = _trimmed_mean(alpha_p, xp)
    else:
        alpha_o = xp.clip(a_chi / (a_a * (1 + options.tikhonov) + 1e-30), 0.0, None)
        alpha_p = 0.0
    alpha_o = _trimmed_mean(alpha_o, xp)

    mask = None if valid is None else valid.reshape(-1).astype(np.float64)
    origin = (int(box0[0]), int(box0[1]))
    obj_num *= np.float32(alpha_o)
    parts = Partial(
        boxes={"object": BoxedArray(origin, obj_num), "illumination": BoxedArray(origin, illum)},
        scalars={"loss": loss, "n": float(n_patterns),
                 "alpha_object": alpha_o * n_patterns, "alpha_probe": alpha_p * n_patterns,
                 "sum_measured": float(measured.sum() if valid is None else measured @ mask),
                 "sum_model": float(model.sum() if valid is None else model @ mask)},
    )
    if probe_sum is not None:
        parts.arrays["probe"] = (np.float32(alpha_p) * probe_sum).astype(np.complex64, copy=False)
    if position_terms:
        parts.local["shift_terms"] = (to_numpy(shift_num), to_numpy(shift_den))
        parts.local["residual_power"] = to_numpy(residual_power)
        if deform is not None:
            parts.arrays.update(deform.sums(positions))
    if variable is not None:
        variable.finish(parts, measured, model)
    return parts if is_cupy(obj) else parts.to_numpy()  # partials stay where the state lives


def refining_chunk_step(obj, probe, intensities, nominal, local: dict, *, options: LSQMLOptions,
                        positions: PositionOptions, epoch: int, affine=None, update_probe: bool = True,
                        valid=None, variable=None, step=None, frame=None) -> Partial:
    """:func:`chunk_step` at the refined positions ``local["positions"]`` of these patterns,
    moving them (from epoch ``positions.start_epoch`` on).

    Before the step the refined positions are pulled towards ``affine`` (the map fitted after the
    last epoch, if any); after it each moves by the LSQML shift with momentum, limited to
    ``max_step`` per axis and kept inside the object. The partial gains the affine normal
    equations of the new positions (additive), ``position_update_sq`` / ``position_refined``
    (for the rms update) and, in ``local``, the patterns' new per-pattern state. ``step``: the
    chunk step of the sample's forward model (default :func:`chunk_step`, one slice in the far
    field; see :mod:`daskpty.engines.sample_model`). Chunks whose step carries the sums through
    slices keep the carried ones in ``local`` and reuse them between refreshes
    (:func:`~.multislice_positions.reused_sums`).
    """
    return refining_step(step or chunk_step, obj, probe, intensities, nominal, local, positions=positions,
                         epoch=epoch, affine=affine, frame=frame, options=options, update_probe=update_probe,
                         valid=valid, variable=variable)


def apply(state: LSQMLState, total: Partial, options: LSQMLOptions,
          illumination_max: float | None = None) -> LSQMLState:
    """Add a reduced partial to the state: O += β ΔO / √(W² + (δ max W)²), P += β ΔP / N.

    Runs where the state lives (NumPy, or CuPy on a GPU worker: see
    :mod:`daskpty.execution.device_state`); ``total`` must live there too. ``illumination_max``:
    max W over the whole object, when the state holds only a tile of it (:mod:`.lsqml_tiles`)."""
    accumulate_affine(state, total)
    accumulate_window(state, total)
    if "object" not in total.boxes:
        return state
    xp = get_xp(state.object)
    # New arrays, never writes into the state's (copies of a state share them).
    obj = state.object.copy()
    num = total.boxes["object"]
    illum = total.boxes["illumination"]
    scale = _preconditioner(illum.data, options.object_delta, illumination_max)
    xp.divide(np.float32(options.beta), scale, out=scale)  # β / p: complex ÷ real is 5× slower
    step = num.data * scale
    BoxedArray(num.offset, step).add_into(obj)
    probe = state.probe
    if "probe" in total.arrays:
        probe = (probe + options.beta * total.arrays["probe"] / np.float32(total.scalars["n"])).astype(np.complex64)
    # The epoch's illumination: the largest of its rounds', pixel by pixel (zero outside the boxes).
    full_illum = (xp.zeros(obj.shape, dtype=np.float32) if state.illumination is None
                  else state.illumination.copy())
    (y0, x0), (y1, x1) = illum.offset, illum.stop
    xp.maximum(full_illum[y0:y1, x0:x1], illum.data, out=full_illum[y0:y1, x0:x1])
    state.object, state.probe, state.illumination = obj, probe, full_illum
    return state


def forward_sums(obj, probe, intensities, positions, *, sample: ForwardModel = THIN, valid=None) -> Partial:
    """Σ measured and Σ model intensity of one chunk through ``sample`` (the first-epoch probe
    rescale)."""
    c = sample.chunk(obj, probe, intensities, positions, whole=True)
    yhat = model_intensity(c.forward(c.blocks[0]).detected)
    if valid is not None:
        valid = asarray_like(valid, intensities)
        yhat = yhat * valid
        intensities = intensities * valid
    return Partial(scalars={"sum_measured": float(intensities.sum(dtype=np.float64)),
                            "sum_model": float(yhat.sum(dtype=np.float64)),
                            "n": float(intensities.shape[0])})


def rescale_probe(state: LSQMLState, sums: Partial) -> LSQMLState:
    """Scale the probe so that Σ ŷ = Σ y over all patterns."""
    model = sums.scalars.get("sum_model", 0.0)
    if model > 0:
        state.probe = (state.probe * np.float32(np.sqrt(sums.scalars["sum_measured"] / model))).astype(np.complex64)
    return state


