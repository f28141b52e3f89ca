"""LSQML engine (Odstrčil, Menzel & Guizar-Sicairos, Opt. Express 26, 3108, 2018).

Two pure functions around an additive :class:`~daskpty.engines.partials.Partial`:

* :func:`chunk_step` — for one chunk of patterns and the current object/probe, through the
  sample's forward model (:mod:`.forward_model`: one slice in the far field, K slices, the near
  field), compute the exit-wave residuals, the object (per slice) and probe update directions,
  the per-pattern optimal step lengths (a 2 × 2 least-squares system, the object's and the
  probe's; through K slices one step for all of them) and return a partial holding the
  step-scaled object numerator and illumination on the chunk's bounding box, the step-scaled
  probe sum, and loss / step statistics.
* :func:`apply` — add the reduced partial to the state with the illumination preconditioner.

Plus :func:`end_epoch` (momentum, probe-mode orthogonalisation, scale-ambiguity removal) and
:func:`forward_sums` (for the first-epoch probe intensity rescale). No dask in here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..physics import get_noise_model, get_xp, ifft2, kernels, model_intensity
from ..physics.backend import asarray_like, is_cupy, real_dots, to_numpy
from ..physics.multislice import slice_windows, transmit, transmit_sum
from .lsqml_epoch import (begin_epoch, begin_owned_epoch, close_epoch, end_epoch,  # noqa: F401 (re-exported)
                          normalize_scale, normalizes_now, owned_at_end)
from .partials import BoxedArray, Partial
from .dose_rule import low_dose_through_slices
from .forward_model import THIN, ForwardModel
from .position_sums import PositionSums, refining_step
from .state import EngineState, trimmed_mean
from .state import trimmed_mean as _trimmed_mean  # noqa: F401  (the tests' name)
from .window_deformation import warp_object
from .tile_frame import frame_of
from .positions import PositionOptions, accumulate_position_sums


#: the illumination preconditioner's δ for one slice, and for K > 1 slices (LSQMLOptions.delta)
DELTA, SLICES_DELTA = 0.1, 0.5
#: the object's heavy-ball momentum (LSQMLOptions.momentum)
MOMENTUM = 0.5
#: Gaussian epochs before a Poisson noise model through K > 1 slices (LSQMLOptions.noise_warmup).
#: The Poisson update alone forms the object slowly from slabs of ones (abTEM's `t2_s1`, 16
#: counts per pixel: mean per-slab NRMSE 0.0681 at 30 epochs, after 5 Gaussian epochs 0.0590;
#: a switch at 10 or 15 within 1.5 % of 5; daskpty's own 2- and 4-slice scans 4–13 % lower with it
#: than without): docs/benchmarks.md.
NOISE_WARMUP = 5
#: The step system's relative regularisation for one slice, and through K > 1 slices
#: (LSQMLOptions.tikhonov). Through slices the object's step (every slice's change carried to
#: the exit together) trades with the probe's, which the first slice can stand in for; a floor
#: of half the mean diagonal keeps the solutions from swinging pattern to pattern. Six abTEM
#: scans of 2–4 slabs, 30 epochs, against 0.01: mean per-slab NRMSE 0.7–3.4 % lower on six of
#: nine runs from a probe 10 % off in defocus or the true one, 0.1–1 % higher on three; with a
#: step per slice (a (K + 1)-unknown system) it was worth 5–16 % (docs/benchmarks.md).
TIKHONOV, SLICES_TIKHONOV = 1e-2, 0.5


@dataclass(frozen=True)
class LSQMLOptions:
    """Settings of the LSQML engine.

    noise: ``"gaussian"`` (amplitude) or ``"poisson"`` far-field correction (and reported loss).
    noise_warmup: epochs of the Gaussian model before a Poisson ``noise`` takes over
        (:meth:`at_epoch`): from a flat start the Poisson update forms the object slowly, the
        amplitude model fast. None: :data:`NOISE_WARMUP` for Poisson through K > 1 slices
        (:meth:`for_slices`), else 0. The reported loss changes model with it.
    beta: damping of the optimal step (0 < beta ≤ 1).
    delta: illumination-preconditioner regularisation, relative to max illumination. None:
        0.1 for one slice, 0.5 for K > 1 slices, 0.1 again through slices on low-dose counting
        data (:meth:`for_slices`; read as :attr:`object_delta`). Through slices the larger floor
        keeps the deeper slices, lit by a spread beam, from taking noisy steps where they are
        barely lit (per-slice NRMSE 15–20 % lower on four of five multislice sets:
        docs/benchmarks.md).
    tikhonov: relative regularisation of the step-length system (2 × 2 in one slice). None:
        0.01 for one slice, 0.5 through K > 1 slices (:meth:`for_slices`; read as
        :attr:`step_tikhonov`).
    probe_start_epoch: first epoch in which the probe is updated (None: never).
    momentum: heavy-ball momentum on the object's per-epoch change (0 disables). None:
        :data:`MOMENTUM`, or 0 through K > 1 slices on low-dose counting data
        (:mod:`~daskpty.engines.dose_rule`; :meth:`for_slices`; read as :attr:`object_momentum`).
    orthogonalize: SVD-orthogonalise probe modes after each epoch.
    normalize_every: remove the object/probe scale ambiguity every this many epochs (0: never).
    eps: small number added where intensities are divided.
    """

    noise: str = "gaussian"
    noise_warmup: int | None = None
    beta: float = 0.9
    delta: float | None = None
    tikhonov: float | None = None
    probe_start_epoch: int | None = 0
    momentum: float | None = None
    orthogonalize: bool = True
    normalize_every: int = 1
    eps: float = 1e-6

    def __post_init__(self):
        get_noise_model(self.noise, lsqml=True)
        if not (self.noise_warmup is None or isinstance(self.noise_warmup, (int, np.integer))
                and not isinstance(self.noise_warmup, bool) and self.noise_warmup >= 0):
            raise ValueError(f"noise_warmup must be a whole number of epochs >= 0 or None, got {self.noise_warmup!r}")
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must lie in (0, 1], got {self.beta}")
        if not (self.delta is None or self.delta > 0):
            raise ValueError(f"delta must be positive or None, got {self.delta}")
        if not (self.tikhonov is None or self.tikhonov >= 0):
            raise ValueError(f"tikhonov must be >= 0 or None, got {self.tikhonov}")
        if not (self.momentum is None or 0 <= self.momentum < 1):
            raise ValueError(f"momentum must lie in [0, 1) or be None, got {self.momentum}")

    @property
    def object_delta(self) -> float:
        """The preconditioner's δ (``delta``, or one slice's default when unresolved)."""
        return DELTA if self.delta is None else float(self.delta)

    @property
    def step_tikhonov(self) -> float:
        """The step system's regularisation (``tikhonov``, or one slice's default when unresolved)."""
        return TIKHONOV if self.tikhonov is None else float(self.tikhonov)

    @property
    def object_momentum(self) -> float:
        """The object's momentum (``momentum``, or :data:`MOMENTUM` when unresolved)."""
        return MOMENTUM if self.momentum is None else float(self.momentum)

    def at_epoch(self, epoch: int) -> "LSQMLOptions":
        """The options epoch ``epoch``'s chunk steps run with: the Gaussian model during the
        warm-up (``noise_warmup``, 0 when unresolved)."""
        if self.noise == "gaussian" or epoch >= (self.noise_warmup or 0):
            return self
        return dataclasses.replace(self, noise="gaussian")

    def for_slices(self, n_slices: int, counts_per_pixel: float | None = None) -> "LSQMLOptions":
        """These options with ``delta``, ``tikhonov``, ``momentum`` and ``noise_warmup`` None resolved for an
        object of ``n_slices`` slices and data of ``counts_per_pixel`` mean counts per detector
        pixel (None: not counting data, e.g. float intensities): :mod:`~daskpty.engines.dose_rule`."""
        low_dose = low_dose_through_slices(n_slices, counts_per_pixel)
        delta = self.delta if self.delta is not None else DELTA if n_slices <= 1 or low_dose else SLICES_DELTA
        momentum = self.momentum if self.momentum is not None else 0.0 if low_dose else MOMENTUM
        warmup = self.noise_warmup if self.noise_warmup is not None else \
            NOISE_WARMUP if self.noise == "poisson" and n_slices > 1 else 0
        tikhonov = self.tikhonov if self.tikhonov is not None else TIKHONOV if n_slices <= 1 else SLICES_TIKHONOV
        if (delta, tikhonov, momentum, warmup) == (self.delta, self.tikhonov, self.momentum, self.noise_warmup):
            return self
        return dataclasses.replace(self, delta=delta, tikhonov=tikhonov, momentum=momentum, noise_warmup=warmup)


#: the state of LSQML (and of the PIE engines): :class:`~.state.EngineState`
LSQMLState = EngineState


def resample_object_state(state, matrix, offset) -> None:
    """O(x) ← O(matrix · x + offset) for the object and its momentum buffer, where the state
    lives (NumPy or CuPy): the window correction's move of the object (:func:`warp_object`)."""
    frame = frame_of(state)  # (on a tile: rows placed in the whole object)
    state.object, state.velocity = (warp_object(a, matrix, offset, frame) for a in (state.object, state.velocity))


def _preconditioner(illum, delta: float, peak=None):
    """√(W² + (δ max W)²), per slice of a (K, h, w) W; ``peak``: max W (the (K,) maxima) when
    ``illum`` is only a tile of the object's."""
    xp = get_xp(illum)
    if illum.ndim == 3:
        peak = illum.reshape(illum.shape[0], -1).max(axis=1) if peak is None else xp.asarray(peak, np.float32)
        floor = ((np.float32(delta) * peak) ** 2).astype(np.float32)[:, None, None]
        return xp.sqrt(illum * illum + floor).astype(np.float32, copy=False)
    floor = np.float32((delta * (float(illum.max()) if peak is None else peak)) ** 2)
    out = illum * illum
    out += floor
    return xp.sqrt(out, out=out).astype(np.float32, copy=False)


#: Target size of one sub-batch (b, M, n, n) complex64 block on the CPU: small enough that a
#: block's temporaries stay in the L2/L3 caches between the FFTs and the element-wise passes.
CPU_BLOCK_BYTES = 1 << 20
#: With K > 1 slices :func:`chunk_step` solves the per-pattern step system on a sample of the
#: chunk's patterns, every s-th (see :func:`step_sample_stride`): only the trimmed mean of the
#: per-pattern step lengths is used, and carrying the object's and the probe's directions to the
#: exit costs 2(K − 1) propagations per sampled pattern (4 for K = 3).
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


def chunk_step(obj, probe, intensities, positions, *, options: LSQMLOptions, sample: ForwardModel = THIN,
               update_probe: bool = True, valid=None, position_terms: bool = False, variable=None,
               window_sums: bool = True, step_stride: int | None = None, reuse=None) -> Partial:
    """One LSQML step for one chunk of patterns through ``sample``, as an additive partial.

    obj (H, W) complex64 for one slice in the far field, else (K, H, W) (only the chunk's bounding
    box is read); probe (M, n, n) complex64; intensities (B, n, n), any real dtype (far field: zero
    frequency at index 0; near field: as recorded); positions (B, 2) (y, x) in object pixels;
    ``sample`` the :class:`~.forward_model.ForwardModel`; valid optional (n, n) bool mask.

    Two passes over the operator's blocks. Pass 1: exit waves, far-field update, residual χ
    carried back through the slices: per slice the numerator g_k = Σ_m conj(φ_km) χ_km and
    illumination Σ_m |φ_km|² scattered into the box, and the sum of the probe-gradient spectra
    G_j = conj(ramp_j) F(g_Qj) (F of the probe update). Pass 2: per pattern the least-squares
    step system of the object's direction a = Σ_k T_k(ΔÔ_k φ_k) (every slice's change carried to
    the exit together) and the probe's b = T_1(S_f ΔP̂ · O_1), Re⟨a_i, a_l⟩ α = Re⟨a_i, χ⟩ (2 × 2
    with the probe), regularised and clipped ≥ 0, then trimmed means over the chunk. All K slices
    take the one step length α_O (:func:`_carried_steps`). One slice in the far field keeps S_f P
    and χ between the passes when the probe is updated and forms the 2 × 2 system with the fused
    dots (else g and Σ|S_f P|², Re⟨a, χ⟩ = Re⟨ΔÔ, g⟩); K slices solve it on every
    ``step_stride``-th pattern (default :func:`step_sample_stride`).

    Returns ``boxes["object"]`` α_k Σ g_k, ``boxes["illumination"]``, ``arrays["probe"]``
    α_P Σ_j S_{−f}(conj(O_1) χ_1) with the probe, ``arrays["alpha_slices"]`` (K,) α_k B for a
    (K, H, W) object, scalars loss, n, alpha_object (mean α_k, times B), alpha_probe,
    sum_measured, sum_model.

    ``position_terms``: the LSQML position shift's sums in ``local["shift_terms"]`` and with
    ``window_sums`` the windows' deformation sums in ``arrays``
    (:class:`~.position_sums.PositionSums`; ``reuse``: through slices, an earlier epoch's carried
    sums). ``variable``: a :class:`~daskpty.engines.pattern_probes.PatternProbes` when the probe
    varies from pattern to pattern (OPR weights, intensity factors, background): each pattern's
    own probe spectra, the probe sums weighted by how each pattern's probe depends on the shared
    modes, the variable model's least-squares terms left on ``variable`` (see :mod:`.lsqml_opr`).
    """
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    c = sample.chunk(obj, probe, intensities, positions, variable=variable, block_bytes=CPU_BLOCK_BYTES)
    xp, n, n_modes, n_slices = c.xp, c.n, c.n_modes, c.n_slices
    if variable is not None:
        variable.begin(c.step, n_patterns, update_probe)
    valid = None if valid is None else asarray_like(valid, intensities)
    intensities = xp.asarray(intensities)
    keep_waves = c.thin and update_probe                    # S_f P and χ, kept for pass 2
    if keep_waves:
        shifted, chis = (xp.empty((n_patterns, n_modes, n, n), np.complex64) for _ in range(2))
        grad = xp.empty((c.step, n, n), np.complex64)       # g_j of one sub-batch
    elif c.thin:
        obj_grad = xp.empty((n_patterns, n, n), np.complex64)   # g_j and Σ_m |S_f P_m|², kept for pass 2
        illum_patches = xp.empty((n_patterns, n, n), np.float32)
    work = xp.empty((c.step, n_modes, n, n), np.complex64) if c.thin and update_probe else None
    obj_num, illum = c.box(np.complex64), c.box(np.float32)
    spectra_sum = xp.zeros(n_modes * n * n, np.complex64) if update_probe else None
    ones = xp.ones(c.step, np.float32)
    ones_c = ones.astype(np.complex64)
    measured, model = xp.zeros(n * n), xp.zeros(n * n)  # Σ_j y_j and Σ_j ŷ_j per pixel (masked at the end)
    loss = 0.0
    sums = PositionSums(c, shifts=True, window=window_sums, reuse=reuse) if position_terms else None
    background = None if variable is None else variable.background
    kept = None

    # Pass 1.
    for batch in c.blocks:
        b = batch.stop - batch.start
        blk = c.forward(batch, *((shifted[batch], chis[batch]) if keep_waves else ()))
        y = intensities[batch].astype(np.float32, copy=False)
        _, yhat, loss_b = kernels.far_field_update(options.noise, blk.detected, y, valid, options.eps,
                                                   overwrite=True, background=background)
        loss += float(loss_b.sum())
        # Σ_j y_j and Σ_j ŷ_j per pixel: float32 over one block, float64 across blocks.
        measured += ones[:b] @ y.reshape(b, -1)
        model += ones[:b] @ yhat.reshape(b, -1)
        chi = c.to_exit(blk, blk.detected)                  # χ = Dᴴ(Ψ' − Ψ)
        o = blk.patches[0]
        if variable is not None:                            # brightness_first: χ then holds
            variable.brightness_step(batch, o, blk.probe_waves, chi, psi=blk.exit)  # what it leaves
            if not c.thin:
                variable.pattern_terms(batch, o, None, None, intensity=False)
                if variable.want_intensity and not variable.steps_brightness_first:
                    variable.exit_terms(batch, blk.exit, chi)
        grads, lit, g = [None] * n_slices, [None] * n_slices, chi
        for k in range(n_slices - 1, -1, -1):     # g_k = Σ_m conj(φ_km) χ_km (one fused pass in one slice)
            out = None if not c.thin else grad[:b] if keep_waves else obj_grad[batch]
            grads[k], lit[k] = c.slice_terms(blk, k, g, out=out)
            if k == 0 and variable is not None and c.thin:
                variable.pattern_terms(batch, o, grads[0], lit[0], intensity=not variable.steps_brightness_first)
            c.index.scatter_add(c.slice_of(obj_num, k), grads[k], batch)
            c.index.scatter_add(c.slice_of(illum, k), lit[k], batch)
            if k or update_probe:
                g = c.back(blk, k, g, out=None if work is None else work[:b])
        if sums is not None:
            sums.add(blk, grads, lit, residual=chi)
        if update_probe:      # G_j = conj(ramp_j) F(g_Qj), summed; χ stays for pass 2
            spec = c.entrance_spectra(blk, g)
            if variable is None:
                spectra_sum += ones_c[:b] @ spec.reshape(b, -1)
            else:  # Σ_j (∂P_jm/∂P_m) G_jm, and the eigen-probe and weight terms from G_j0
                variable.probe_terms(batch, spec, spectra_sum.reshape(n_modes, -1))
        elif c.thin:
            illum_patches[batch] = lit[0]
        if not c.thin:
            kept = (blk, chi)
    if sums is not None:      # (the windows' b from Σ_j g_j: obj_num, not yet scaled)
        shift_terms, window = sums.finish(positions, obj_num if window_sums else None)
    obj_dir = obj_num * (np.float32(1.0) / _preconditioner(illum, options.object_delta))   # ΔÔ_k

    # Pass 2: the step-length system per pattern.
    probe_sum = probe_dir_ft = None
    if update_probe:
        spectra_sum = spectra_sum.reshape(n_modes, n, n)
        probe_sum = ifft2(spectra_sum)                      # Σ_j S_{-f_j}(conj(O_j) χ_j)
        probe_dir_ft = spectra_sum / np.float32(n_patterns)  # F ΔP̂
    if c.thin:
        steps = _fused_steps(c, obj_dir, probe_dir_ft, options, variable, *(
            (shifted, chis, work) if keep_waves else (obj_grad, illum_patches)))
    else:
        if step_stride is None:
            step_stride = step_sample_stride(n_patterns, n_slices)
        steps = _carried_steps(c, kept, obj_dir, probe_dir_ft, options, variable, max(1, int(step_stride)))
    alpha_slices = np.asarray(steps[:n_slices])
    alpha_p = steps[n_slices] if update_probe else 0.0

    mask = None if valid is None else valid.reshape(-1).astype(np.float64)
    if c.flat:
        obj_num *= np.float32(alpha_slices[0])
    else:
        obj_num *= xp.asarray(alpha_slices.astype(np.float32))[:, None, None]
    parts = Partial(
        boxes={"object": BoxedArray(c.origin, obj_num), "illumination": BoxedArray(c.origin, illum)},
        scalars={"loss": loss, "n": float(n_patterns),
                 "alpha_object": float(alpha_slices.mean()) * n_patterns, "alpha_probe": alpha_p * n_patterns,
                 "sum_measured": float(measured.sum() if valid is None else measured @ mask),
                 "sum_model": float(model.sum() if valid is None else model @ mask)},
    )
    if not c.flat:
        parts.arrays["alpha_slices"] = alpha_slices * n_patterns
    if probe_sum is not None:
        parts.arrays["probe"] = (np.float32(alpha_p) * probe_sum).astype(np.complex64, copy=False)
    if sums is not None:
        parts.local["shift_terms"] = shift_terms
        if sums.residual_power is not None:
            parts.local["residual_power"] = to_numpy(sums.residual_power)
        if window is not None:
            parts.arrays.update(window)
    if variable is not None:
        variable.finish(parts, measured, model)
    return parts if is_cupy(obj) else parts.to_numpy()  # partials stay where the state lives


def _fused_steps(c, obj_dir, probe_dir_ft, options, variable, kept, kept2, work=None) -> list:
    """One slice in the far field: the trimmed means of the per-pattern 2 × 2 (or 1 × 1) steps
    from the fused dots, with a_j = ΔÔ_j S_f P and b_j = S_f ΔP̂ · O_j (``kept``, ``kept2``:
    S_f P and χ with the probe, else g_j and Σ_m |S_f P_m|²)."""
    xp, n_patterns = c.xp, c.n_patterns
    a_chi, a_a = xp.empty(n_patterns), xp.empty(n_patterns)
    if probe_dir_ft is not None:
        b_chi, a_b, b_b = xp.empty(n_patterns), xp.empty(n_patterns), xp.empty(n_patterns)
        # a_j = ΔÔ_j S_f P_j: formed by the reference dots only (the fused ones never store it)
        a = None if kernels.uses_fused(c.obj_box) else xp.empty(work.shape, np.complex64)
    dirs = xp.empty((c.step, c.n, c.n), np.complex64)
    for batch in c.blocks:
        b = batch.stop - batch.start
        d = c.index.extract(c.slice_of(obj_dir, 0), batch, out=dirs[:b])    # ΔÔ_j
        if probe_dir_ft is None:  # Re⟨a_j, χ_j⟩ = Re⟨ΔÔ_j, g_j⟩; Σ_k |ΔÔ_j S_f P_k|² = Σ |ΔÔ_j|² Σ_k |S_f P_k|²
            a_chi[batch], a_a[batch] = kernels.object_step_dots(d, kept[batch], kept2[batch])
            continue
        bb = c.shifted(batch, c.ramps(batch), probe_dir_ft[None], out=work[:b])   # S_f ΔP̂
        bb *= c.index.extract(c.obj_box[0], batch, out=c._patches[:b])[:, None]
        if variable is not None:                       # pattern j's probe moves by (∂P_j/∂P) ΔP̂
            bb *= variable.mode_factors_xp(batch)[:, :, None, None]
        (a_chi[batch], b_chi[batch], a_a[batch], b_b[batch], a_b[batch]) = kernels.step_dots(
            d, kept[batch], bb, kept2[batch], work=None if a is None else a[:b])
    if probe_dir_ft is None:
        return _solved_steps(xp, options.step_tikhonov, a_chi, a_a)
    return _solved_steps(xp, options.step_tikhonov, a_chi, a_a, b_chi, b_b, a_b)


def _solved_steps(xp, tikhonov: float, a_chi, a_a, b_chi=None, b_b=None, a_b=None) -> list:
    """Trimmed means of the per-pattern steps from the dots Re⟨a, χ⟩, ‖a‖² (and with the probe
    Re⟨b, χ⟩, ‖b‖², Re⟨a, b⟩): the 1 × 1 system regularised by ``tikhonov`` times its own
    diagonal, the 2 × 2 by ``tikhonov`` times the chunk's mean diagonal; clipped ≥ 0."""
    if b_chi is None:
        return [trimmed_mean(xp.clip(a_chi / (a_a * (1 + tikhonov) + 1e-30), 0.0, None), xp)]
    a_a = a_a + tikhonov * a_a.mean() + 1e-30
    b_b = b_b + tikhonov * b_b.mean() + 1e-30
    det = a_a * b_b - a_b * a_b
    alpha_o = xp.clip((b_b * a_chi - a_b * b_chi) / det, 0.0, None)
    alpha_p = xp.clip((a_a * b_chi - a_b * a_chi) / det, 0.0, None)
    return [trimmed_mean(alpha_o, xp), trimmed_mean(alpha_p, xp)]


def _carried_steps(c, kept, obj_dir, probe_dir_ft, options, variable, stride: int) -> list:
    """K slices or the near field: the object's and the probe's directions carried to the exit
    on every ``stride``-th pattern of the chunk's one block (``kept``: it and χ), the 2 × 2 (1 × 1
    without the probe) system solved per pattern, trimmed means; [α_O] × K + [α_P].

    The K slices take one step length, that of their changes carried to the exit together. Each
    slice's own (a (K + 1)-unknown system) swings from pattern to pattern and epoch to epoch:
    the slices explain the same part of χ (its low frequencies above all) and trade it among
    themselves, and the probe trades with the first slice. Seven abTEM scans of 2–4 slabs, 30
    epochs: mean per-slab NRMSE 2–11 % lower from a probe 10 % off in defocus, −14 … +0.8 % from
    the true probe; daskpty's own weak-phase sets −7 … +1 % per slice (docs/benchmarks.md)."""
    blk, chi = kept
    xp, pick = c.xp, slice(0, None, stride)
    sample = blk.patches[:, pick]
    dir_patches = slice_windows(c.index, obj_dir, pick)
    a = transmit_sum((dir_patches[k][:, None] * blk.incident[k][pick] for k in range(c.n_slices)), sample, c.kernel)
    chi = chi[pick]
    dots = [real_dots(a, chi), real_dots(a, a)]
    if probe_dir_ft is not None:
        r = c.ramps(blk.batch)[pick]
        b = ifft2(r[:, None] * probe_dir_ft[None], overwrite=True)
        if variable is not None:                # pattern j's probe moves by (∂P_j/∂P) ΔP̂
            b *= variable.mode_factors_xp(blk.batch)[pick][:, :, None, None]
        b = transmit(b * sample[0][:, None], sample, c.kernel, 0)
        dots += [real_dots(b, chi), real_dots(b, b), real_dots(a, b)]
    steps = _solved_steps(xp, options.step_tikhonov, *dots)
    return steps[:1] * c.n_slices + steps[1:]


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
    """Add a reduced partial to the state: O += β ΔO / √(W² + (δ max W)²), P += β ΔP / N; a
    (K, H, W) object slice by slice (each slice's own max W_k).

    Runs where the state lives (NumPy, or CuPy on a GPU worker: see
    :mod:`daskpty.execution.device_state`); ``total`` must live there too. ``illumination_max``:
    max W (per slice) over the whole object, when the state holds only a tile of it
    (:mod:`daskpty.execution.tile_numbers`)."""
    accumulate_position_sums(state, total)
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
    xp.maximum(full_illum[..., y0:y1, x0:x1], illum.data, out=full_illum[..., y0:y1, x0:x1])
    state.object, state.probe, state.illumination = obj, probe, full_illum
    return state


#: Rows of the object updated at a time by :func:`apply_in_place`: the update's temporaries stay
#: a few MB however large the object or tile.
BLOCK_ROWS = 64


def apply_in_place(state: LSQMLState, total: Partial, options: LSQMLOptions, peak=None) -> LSQMLState:
    """:func:`apply` writing into the state's object and illumination (the epoch's own:
    :func:`~.lsqml_epoch.begin_owned_epoch`) block by block of rows, the same bits. ``peak``:
    max W (per slice) over the whole object when the state holds a tile; None: the round's own."""
    accumulate_position_sums(state, total)
    if "object" not in total.boxes:
        return state
    xp = get_xp(state.object)
    num, illum = total.boxes["object"], total.boxes["illumination"]
    if peak is None:  # as the preconditioner takes it, before the update goes by blocks
        peak = (float(illum.data.max()) if state.object.ndim == 2
                else illum.data.reshape(illum.data.shape[0], -1).max(axis=1))
    (y0, x0), (y1, x1) = num.offset, num.stop
    for a in range(0, num.data.shape[-2], BLOCK_ROWS):
        rows = slice(a, a + BLOCK_ROWS)
        scale = _preconditioner(illum.data[..., rows, :], options.object_delta, peak)
        xp.divide(np.float32(options.beta), scale, out=scale)
        step = num.data[..., rows, :] * scale
        state.object[..., y0 + a:y0 + a + step.shape[-2], x0:x1] += step
    if "probe" in total.arrays:
        state.probe = (state.probe + options.beta * total.arrays["probe"]
                       / np.float32(total.scalars["n"])).astype(np.complex64)
    if state.illumination is None:  # the epoch's first round: W of its own
        state.illumination = xp.zeros(state.object.shape, np.float32)
    (y0, x0), (y1, x1) = illum.offset, illum.stop
    frame = state.illumination[..., y0:y1, x0:x1]
    xp.maximum(frame, illum.data, out=frame)
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


