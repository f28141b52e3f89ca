"""AD per-chunk loss and its exact gradient against the sample's forward model
(:mod:`daskpty.engines.forward_model`): :func:`chunk_gradient`, :func:`chunk_loss`."""
from __future__ import annotations

import numpy as np

from ...physics import get_noise_model, ifft2, model_intensity
from ...physics.backend import asarray_like, is_cupy, to_numpy
from ..forward_model import CPU_BLOCK_BYTES, THIN, ForwardModel, split, working_dtypes
from ..partials import BoxedArray, Partial
from ..position_sums import PositionSums
from ..tile_frame import step_positions, whole_shape
from ..positions import finish_step, positions_for_step, step_with_optimizer
from ..window_deformation import wants_window_sums
from ..multislice_positions import ReusedSums, refreshes
from .losses import _far_field_loss
from .state import ADOptions

_split = split   # (the name the tests use)
__all__ = ["CPU_BLOCK_BYTES", "chunk_gradient", "chunk_loss", "refining_chunk_gradient", "window_chi_factor"]


def window_chi_factor(loss: str) -> float | None:
    """χ ≈ factor · ∂L/∂ψ* of the loss near a fit (orthonormal FFTs), from the noise model's
    registry entry: the Gaussian loss's gradient is 2(ψ − ψ'), ψ' the modulus-projected wave, so
    χ = ψ' − ψ is −1/2 of it; the Poisson loss's 2(1 − y/ŷ)Ψ is about twice that. None when no
    constant does it (the intensity loss's weight grows with ŷ): such runs do not correct windows."""
    return get_noise_model(loss, what="loss").window_chi_factor


def _check_chunk_inputs(intensities, positions):
    if intensities.ndim != 3:
        raise ValueError(f"intensities must be (B, n, n), got shape {intensities.shape}")
    if np.shape(positions) != (intensities.shape[0], 2):
        raise ValueError(f"positions must be ({intensities.shape[0]}, 2), got shape {np.shape(positions)}")


def chunk_gradient(obj, probe, intensities, positions, *, options: "ADOptions | None" = None,
                   sample: ForwardModel = THIN, valid=None, want_object: bool = True, want_probe: bool = True,
                   want_positions: bool = False, position_noise: bool = False, variable=None,
                   window_sums: bool = False, reuse=None) -> Partial:
    """Loss and its gradients for one chunk of patterns, as an additive partial.

    obj (H, W) complex for one slice in the far field, else (K, H, W) (only the chunk's bounding
    box is read); probe (M, n, n) complex; intensities (B, n, n) real (far field: zero frequency
    at index 0; near field: as recorded); positions (B, 2) (y, x) object pixels; ``sample`` the
    sample's :class:`~daskpty.engines.forward_model.ForwardModel`; valid optional (n, n) bool;
    complex128 object or probe works in complex128. Returns a :class:`Partial` with

    * ``boxes["object_grad"]``: ∇_O L on the chunk's bounding box ((h, w) or (K, h, w));
    * ``boxes["illumination"]``: Σ_j Σ_m |φ_kjm|² per slice on the same box (object
      preconditioner, masks; always present);
    * ``arrays["probe_grad"]`` (M, n, n) ∇_P L and ``arrays["probe_illumination"]`` (n, n) Σ_j |O_1j|²
      (probe preconditioner), when ``want_probe``;
    * ``arrays["position_grad"]`` (B, 2) float64 ∂L/∂(y, x) per pattern of *this* chunk, when
      ``want_positions`` (not additive across chunks: for single-chunk use); with
      ``position_noise`` also ``arrays["position_noise"]`` (B, 2), each one's scatter were the
      residual noise (one slice in the far field; the steps' noise gate);
    * ``arrays["window_num"]``, ``["window_gram"]``, ``["window_positions"]``: the windows'
      deformation sums (:class:`~daskpty.engines.position_sums.PositionSums`, with
      ``window_sums``; ``reuse``: through slices, without the normal matrix) with the exit-wave
      update χ of LSQML taken as −∂L/∂ψ* over the loss's Gauss–Newton curvature
      (:func:`window_chi_factor`), when the object gradient is formed;
    * ``scalars``: ``loss`` (float64 sum), ``n``, ``sum_measured``, ``sum_model``.

    One pass over the operator's blocks: forward model, g_Ψ (in place), the detector's adjoint,
    the backward chain through the slices (object gradient and illumination scattered into the
    box), and at the entrance G_j = conj(ramp_j) F[g_Qj] (F of the adjoint shift of g_Q): the
    probe gradient is F⁻¹ Σ_j G_j, summed block by block, and ∂L/∂f_j are BLAS dots of G_j.

    ``variable``: a :class:`~daskpty.engines.pattern_probes.PatternProbes` (a probe varying over the
    scan): every pattern's own probe spectra in the forward model, the probe gradient weighted by
    ∂P_jm/∂P_m, and the gradients of the eigen-probes, weights, intensity factors and background
    gathered on ``variable`` and in ``arrays`` (see :mod:`daskpty.engines.ad.opr`).
    """
    _check_chunk_inputs(intensities, positions)
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    opts = options or ADOptions()
    cdtype, rdtype = working_dtypes(obj, probe)
    c = sample.chunk(obj, probe, intensities, positions, cdtype=cdtype, variable=variable)
    xp, n, n_modes = c.xp, c.n, c.n_modes
    valid = None if valid is None else asarray_like(valid, intensities)
    background = None
    if variable is not None:
        variable.begin(c.step, n_patterns, want_probe)
        background = variable.background
    # the intensity factors' terms come from the slice gradient in one slice, else from the exit wave
    want_grads = want_object or (variable is not None and variable.want_intensity and c.thin)
    illum = c.box(rdtype)
    obj_grad = c.box(cdtype) if want_object else None
    ones = xp.ones(c.step, rdtype)
    if want_probe:
        ones_c = ones.astype(cdtype)
        spectra_sum = xp.zeros(n_modes * n * n, np.complex128)     # Σ_j G_j
        probe_illum = xp.zeros(n * n)                                # Σ_j |O_1j|²
        obj_power = model_intensity(c.obj_box[:1, None])[0]         # |O_1|² on the box
        powers = xp.empty((c.step, n, n), rdtype)
    # the gradients' scatter, for the steps' noise gate: one slice in the far field, where the
    # residual is mostly noise once the object has formed (through slices it is mostly the
    # model's: a 2-slice scan 0.97 px off ended 0.88 px off with the gate, 0.04 px without)
    gate = want_positions and position_noise and c.n_slices == 1 and c.detector is None
    if want_positions:
        position_grad = xp.empty((n_patterns, 2))
    position_noise = xp.empty((n_patterns, 2)) if gate else None
    measured = xp.zeros(n * n)  # the mask is applied at the end
    model = xp.zeros(n * n)
    loss = 0.0
    sums = scattered = None
    if window_sums and want_grads and window_chi_factor(opts.loss) is not None:
        sums = PositionSums(c, shifts=False, window=True, reuse=reuse)
        scattered = obj_grad if want_object else c.box(cdtype)            # Σ_j g_j

    for batch in c.blocks:
        b = batch.stop - batch.start
        blk = c.forward(batch)
        y = xp.asarray(intensities[batch]).astype(rdtype, copy=False)
        per, g_far, yhat = _far_field_loss(opts.loss, blk.detected, y, valid, opts.eps, gradient=True,
                                           overwrite=blk.detector is None, background=background)
        if variable is not None and variable.want_background:
            variable.background_terms(opts.loss, yhat, y, valid, opts.eps)
        loss += float(per.sum())
        # Σ_j y_j and Σ_j ŷ_j per pixel: working precision over one block, float64 across blocks
        measured += ones[:b] @ y.reshape(b, -1)
        model += ones[:b] @ yhat.reshape(b, -1)
        g = c.to_exit(blk, g_far)                                             # g_ψ at the exit
        if variable is not None and not c.thin:     # Re⟨ψ_j, g_ψj⟩ = s_j ∂L/∂s_j, ‖ψ_j‖²
            variable.pattern_terms(batch, blk.patches[0], None, None, intensity=False)
            variable.exit_terms(batch, blk.exit, g)
        grads, lit = [None] * c.n_slices, [None] * c.n_slices
        for k in range(c.n_slices - 1, -1, -1):
            if want_grads:                          # Σ_m conj(φ_k) g_k, Σ_m |φ_k|²
                grads[k], lit[k] = c.slice_terms(blk, k, g)
                if want_object:
                    c.index.scatter_add(c.slice_of(obj_grad, k), grads[k], batch)
            else:
                lit[k] = model_intensity(blk.incident[k])
            c.index.scatter_add(c.slice_of(illum, k), lit[k], batch)
            if k == 0 and variable is not None and c.thin:   # Re⟨O_j, g_j⟩ = s_j ∂L/∂s_j, |O_j|²
                variable.pattern_terms(batch, blk.patches[0], grads[0], lit[0])
            if k or want_probe or want_positions:
                g = c.back(blk, k, g)                                         # g at slice k − 1 / g_Q
        if sums is not None:
            sums.add(blk, grads, lit)
            if not want_object:
                c.index.scatter_add(scattered, grads[0], batch)
        if want_probe or want_positions:
            if want_probe:                              # Σ_j |O_1j|², windows of |O_1|² on the box
                probe_illum += ones[:b] @ c.index.extract(obj_power, batch, out=powers[:b]).reshape(b, -1)
            spectra = c.entrance_spectra(blk, g)                              # G_j
            if want_probe and variable is not None:     # Σ_j (∂P_jm/∂P_m) G_jm, eigen and weight terms
                variable.probe_terms(batch, spectra, spectra_sum.reshape(n_modes, -1))
            elif want_probe:
                spectra_sum += ones_c[:b] @ spectra.reshape(b, -1)
            if want_positions:
                if gate:
                    position_grad[batch], position_noise[batch] = c.position_gradient(blk, spectra, g_far, noise=True)
                else:
                    position_grad[batch] = c.position_gradient(blk, spectra, g_far)

    if valid is None:
        sum_measured, sum_model = float(measured.sum()), float(model.sum())
    else:
        mask = valid.reshape(-1).astype(np.float64)
        sum_measured, sum_model = float(measured @ mask), float(model @ mask)
    part = Partial(scalars={"loss": loss, "n": float(n_patterns), "sum_measured": sum_measured,
                            "sum_model": sum_model})
    part.boxes["illumination"] = BoxedArray(c.origin, illum)
    if want_object:
        part.boxes["object_grad"] = BoxedArray(c.origin, obj_grad)
    if want_probe:
        part.arrays["probe_grad"] = ifft2(spectra_sum.reshape(n_modes, n, n).astype(cdtype))
        part.arrays["probe_illumination"] = probe_illum.reshape(n, n).astype(rdtype)
    if want_positions:
        part.arrays["position_grad"] = position_grad
        if position_noise is not None:
            part.arrays["position_noise"] = position_noise
    if sums is not None:
        _, window = sums.finish(positions, scattered)
        part.arrays.update(window, window_num=window["window_num"] * window_chi_factor(opts.loss))
    if variable is not None:
        variable.finish(part, measured, model)
    if is_cupy(obj):  # partials stay where the state lives; the positions' optimiser is on the host
        if want_positions:
            part.arrays.update({k: to_numpy(part.arrays[k]) for k in ("position_grad", "position_noise")
                                if k in part.arrays})
        return part
    return part.to_numpy()


def chunk_loss(obj, probe, intensities, positions, *, options: "ADOptions | None" = None,
               sample: ForwardModel = THIN, valid=None, variable=None) -> Partial:
    """Loss only (forward model, no adjoint) for one chunk: ``scalars`` loss (float64 sum) and n."""
    _check_chunk_inputs(intensities, positions)
    if intensities.shape[0] == 0:
        return Partial()
    opts = options or ADOptions()
    cdtype, rdtype = working_dtypes(obj, probe)
    c = sample.chunk(obj, probe, intensities, positions, cdtype=cdtype, variable=variable, keep_probe_waves=False)
    valid = None if valid is None else asarray_like(valid, intensities)
    if variable is not None:
        variable.begin(c.step, intensities.shape[0], False)
    background = None if variable is None else variable.background
    loss = 0.0
    for batch in c.blocks:
        y = c.xp.asarray(intensities[batch]).astype(rdtype, copy=False)
        per, _, _ = _far_field_loss(opts.loss, c.forward(batch).detected, y, valid, opts.eps, gradient=False,
                                    background=background)
        loss += float(per.sum())
    return Partial(scalars={"loss": loss, "n": float(intensities.shape[0])})


def refining_chunk_gradient(obj, probe, intensities, nominal, local: dict, *, options, positions,
                            epoch: int, affine=None, valid=None, want_object: bool = True,
                            want_probe: bool = True, variable=None, gradient=None, frame=None,
                            keep_gram: bool = False) -> Partial:
    """:func:`chunk_gradient` at the refined positions ``local["positions"]``, then (from epoch
    ``positions.start_epoch`` on) one step of the positions' own optimiser against ∂L/∂(y, x)
    (see :func:`daskpty.engines.positions.step_with_optimizer`); the partial carries the new
    per-pattern state in ``local`` and the affine normal equations, as in LSQML. ``gradient``: the
    chunk gradient of the sample's forward model (default :func:`chunk_gradient`; see
    :mod:`daskpty.engines.sample_model`). ``keep_gram``: the gradient carries the windows' normal
    matrix through slices, so it forms it only on the epochs that refresh it
    (:func:`~daskpty.engines.multislice_positions.refreshes`) and the window fit keeps it between."""
    n = probe.shape[-1]
    shape = whole_shape(obj, frame)       # (a tile's frame: the whole object's)
    used = positions_for_step(local, nominal, affine, positions, epoch, n, shape)
    active = positions.active(epoch)
    window = wants_window_sums(positions, epoch)
    reuse = {"reuse": ReusedSums()} if keep_gram and window and not refreshes(positions, epoch) else {}
    part = (gradient or chunk_gradient)(obj, probe, intensities, step_positions(used, frame, n, obj), options=options, valid=valid,
                                        want_object=want_object, want_probe=want_probe, want_positions=active,
                                        position_noise=bool(positions.noise_threshold),
                                        variable=variable, window_sums=window, **reuse)
    if frame is not None:
        frame.sums_to_object(part)
    if not active or not part.scalars:
        part.local = {}
        return part
    grad = part.arrays.pop("position_grad")
    noise = part.arrays.pop("position_noise", None)
    new, _ = step_with_optimizer({**local, "positions": used}, grad, positions,
                                 t=epoch - positions.start_epoch + 1, noise=noise)
    return finish_step(part, new, used, nominal, positions, epoch, n, shape)
