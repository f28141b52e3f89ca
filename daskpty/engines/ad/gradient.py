"""AD per-chunk forward model and its adjoint: :func:`chunk_gradient`, :func:`chunk_loss`."""
from __future__ import annotations

import numpy as np

from ...physics import fft2, get_noise_model, get_xp, ifft2, model_intensity
from ...physics.backend import asarray_like, is_cupy, real_dots, real_dots_with, to_numpy
from ...physics.patches import PatchIndex
from ...physics.shifts import outer_ramps, shift_ramp_factors
from ..lsqml import _fft_in_place
from ...physics import kernels
from ..partials import BoxedArray, Partial
from ..tile_frame import step_positions, whole_shape
from ..positions import central_gradients, finish_step, positions_for_step, step_with_optimizer
from ..window_deformation import WindowDeformation, wants_window_sums
from ..multislice_positions import ReusedSums, refreshes
from .losses import _far_field_loss
from .state import ADOptions

# --------------------------------------------------------------------------------------------------
# Per-chunk forward model and its adjoint

#: Target size of one sub-batch (b, M, n, n) of waves on the CPU (as in the LSQML engine): small
#: enough that a block's temporaries stay in the L2/L3 caches between the FFTs and the element-wise
#: passes. On the GPU a chunk is one block.
CPU_BLOCK_BYTES = 1 << 20


def _split(positions, n: int):
    """Integer corners and float64 fractions (the convention of physics.split_positions, full precision)."""
    top_left = np.asarray(positions, dtype=np.float64) - n / 2.0
    corners = np.floor(top_left + 0.5).astype(np.int64)
    return corners, top_left - corners


def _working_dtypes(*arrays):
    wide = any(np.dtype(a.dtype) in (np.complex128, np.float64) for a in arrays)
    return (np.complex128, np.float64) if wide else (np.complex64, np.float32)


def _ramp_factors(fractions, n: int, rdtype, xp):
    """Separable shift ramps exp(−2πi k f) per axis, each (B, n), in the working precision."""
    return shift_ramp_factors(fractions, n, xp, np.complex64 if rdtype == np.float32 else np.complex128)


def _outer_ramps(ry, rx, out):
    """ry[:, :, None] · rx[:, None, :] into ``out`` (the physics helper's real matrix product for complex64)."""
    if ry.dtype == np.complex64:
        return outer_ramps(ry, rx, out=out)
    return get_xp(ry).multiply(ry[:, :, None], rx[:, None, :], out=out)


class _Chunk:
    """One chunk on the bounding box of its footprint, walked in sub-batches of patterns.

    On the CPU a sub-batch (b, M, n, n) holds about :data:`CPU_BLOCK_BYTES`, so that its
    temporaries stay in cache from one FFT to the next; on the GPU it is the whole chunk.
    :meth:`forward` runs the forward model of one block into buffers reused by every block; the
    callers take the block through the loss (and the adjoint) before moving to the next one.
    ``keep_shifted``: keep S_f P next to Ψ (the adjoint needs it); otherwise Ψ overwrites it.
    """

    def __init__(self, obj, probe, intensities, positions, valid, keep_shifted: bool = True, variable=None):
        xp = get_xp(intensities)
        self.xp = xp
        cdtype, rdtype = _working_dtypes(obj, probe)
        self.cdtype, self.rdtype = cdtype, rdtype
        probe = asarray_like(probe, intensities).astype(cdtype, copy=False)
        if probe.ndim == 2:
            probe = probe[None]
        n_modes, n = probe.shape[0], probe.shape[-1]
        self.n_modes, self.n = n_modes, n
        corners, fractions = _split(to_numpy(positions), n)
        self.box0 = corners.min(axis=0)
        box1 = corners.max(axis=0) + n
        if self.box0.min() < 0 or box1[0] > obj.shape[-2] or box1[1] > obj.shape[-1]:
            raise ValueError(f"probe windows span {self.box0.tolist()}..{box1.tolist()}, outside the object "
                             f"of shape {tuple(obj.shape[-2:])}")
        self.obj_box = asarray_like(obj[self.box0[0]:box1[0], self.box0[1]:box1[1]],
                                    intensities).astype(cdtype, copy=False)
        self.index = PatchIndex(corners - self.box0, n, self.obj_box.shape, xp)  # every gather/scatter
        self.ry, self.rx = _ramp_factors(fractions, n, rdtype, xp)
        self.probe_ft = fft2(probe)                                             # (M, n, n)
        self.valid = None if valid is None else asarray_like(valid, intensities)
        self.intensities = xp.asarray(intensities)
        n_patterns = intensities.shape[0]
        block = CPU_BLOCK_BYTES // (np.dtype(cdtype).itemsize * n_modes * n * n)
        self.step = step = n_patterns if xp is not np else max(1, min(n_patterns, block))
        self.blocks = [slice(s, min(s + step, n_patterns)) for s in range(0, n_patterns, step)]
        self._ramps = xp.empty((step, n, n), cdtype)
        self._patches = xp.empty((step, n, n), cdtype)
        self._shifted = xp.empty((step, n_modes, n, n), cdtype)
        self._waves = xp.empty((step, n_modes, n, n), cdtype) if keep_shifted else self._shifted
        self.variable = variable  # a varying probe (engines.pattern_probes.PatternProbes), or None
        self._spectra = None if variable is None else xp.empty((step, n_modes, n, n), cdtype)

    @property
    def origin(self):
        return (int(self.box0[0]), int(self.box0[1]))

    def data(self, batch: slice):
        """Measured intensities of a block in the working precision."""
        return self.intensities[batch].astype(self.rdtype, copy=False)

    def forward(self, batch: slice):
        """Forward model of one block: ``(ramp_j, Q_j = S_{f_j} P, O_j, Ψ_j)``, views of the buffers."""
        xp = self.xp
        b = batch.stop - batch.start
        r = _outer_ramps(self.ry[batch], self.rx[batch], out=self._ramps[:b])
        pft = self.probe_ft[None] if self.variable is None else self.variable.spectra(batch, self._spectra[:b])
        q = xp.multiply(r[:, None], pft, out=self._shifted[:b])
        _fft_in_place(q, inverse=True)                                          # Q = F⁻¹(ramp · F P)
        o = self.index.extract(self.obj_box, batch, out=self._patches[:b])
        wave = xp.multiply(q, o[:, None], out=self._waves[:b])                  # ψ = Q · O_j
        _fft_in_place(wave)                                                     # Ψ = F ψ
        return r, q, o, wave


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


def chunk_gradient(obj, probe, intensities, positions, *, options: "ADOptions | None" = None, valid=None,
                   want_object: bool = True, want_probe: bool = True,
                   want_positions: bool = False, variable=None, window_sums: bool = False) -> Partial:
    """Loss and its gradients for one chunk of patterns, as an additive partial.

    obj (H, W) complex (only the chunk's bounding box is read); probe (M, n, n) complex;
    intensities (B, n, n) real, zero frequency at index 0; positions (B, 2) (y, x) object pixels;
    valid optional (n, n) bool. Returns a :class:`Partial` with

    * ``boxes["object_grad"]``: ∇_O L on the chunk's bounding box (complex, working precision);
    * ``boxes["illumination"]``: Σ_j Σ_k |S_{f_j} P_k|² on the same box (object preconditioner,
      masks; always present);
    * ``arrays["probe_grad"]`` (M, n, n) ∇_P L and ``arrays["probe_illumination"]`` (n, n) Σ_j |O_j|²
      (probe preconditioner), when ``want_probe``;
    * ``arrays["position_grad"]`` (B, 2) float64 ∂L/∂(y, x) per pattern of *this* chunk, when
      ``want_positions`` (not additive across chunks: for single-chunk use);
    * ``arrays["window_num"]``, ``["window_gram"]``, ``["window_positions"]``: the windows'
      deformation sums (:class:`~daskpty.engines.window_deformation.WindowDeformation`, with
      ``window_sums``) with the exit-wave update χ of LSQML taken as
      −∂L/∂ψ* over the loss's Gauss–Newton curvature (:func:`window_chi_factor`), when the
      object gradient is formed;
    * ``scalars``: ``loss`` (float64 sum), ``n``, ``sum_measured``, ``sum_model``.

    One pass over sub-batches (see :class:`_Chunk`): forward model, g_Ψ (in place), g_ψ = F⁻¹ g_Ψ,
    illumination and object gradient scattered into the box, and G_j = conj(ramp_j) F[conj(O_j) g_ψj]
    (F of the adjoint shift of g_Q): the probe gradient is F⁻¹ Σ_j G_j, summed block by block, and
    ∂L/∂f_j = Re⟨G_j, F[P] (−2πi k)⟩ are BLAS dots.

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
    c = _Chunk(obj, probe, intensities, positions, valid, variable=variable)
    xp, cdtype, rdtype = c.xp, c.cdtype, c.rdtype
    n, n_modes = c.n, c.n_modes
    if variable is not None:
        variable.begin(c.step, n_patterns, want_probe)
        want_object_grad = want_object or variable.want_intensity
        background = variable.background
    else:
        want_object_grad, background = want_object, None
    want_spectra = want_probe or want_positions
    illum = xp.zeros(c.obj_box.shape, dtype=rdtype)
    if want_object:
        obj_grad = xp.zeros(c.obj_box.shape, dtype=cdtype)
    ones = xp.ones(c.step, rdtype)
    if want_probe:
        ones_c = ones.astype(cdtype)
        spectra_sum = xp.zeros(n_modes * n * n, np.complex128)     # Σ_j G_j
        probe_illum = xp.zeros(n * n)                                # Σ_j |O_j|²
        obj_power = model_intensity(c.obj_box[None, None])[0]        # |O|² on the box
        powers = xp.empty((c.step, n, n), rdtype)
    if want_positions:
        k = xp.asarray(np.fft.fftfreq(n), dtype=rdtype)
        w = rdtype(-2 * np.pi)
        dq_y = (c.probe_ft * (1j * w * k)[None, :, None]).astype(cdtype, copy=False)  # F[∂Q/∂f_y] / ramp
        dq_x = (c.probe_ft * (1j * w * k)[None, None, :]).astype(cdtype, copy=False)
        position_grad = xp.empty((n_patterns, 2))
    measured = xp.zeros(n * n)  # the mask is applied at the end
    model = xp.zeros(n * n)
    loss = 0.0
    deform = None
    if window_sums and want_object_grad and window_chi_factor(opts.loss) is not None:
        box_d = central_gradients(c.obj_box, xp)                           # ∂_y O, ∂_x O on the box
        deform = WindowDeformation(n, xp, box_d)
        d_patch = xp.empty((2, c.step, n, n), cdtype)
        shift_num = xp.empty((n_patterns, 2))                              # Re⟨∂_a O_j, g_j⟩
        scattered = obj_grad if want_object else xp.zeros(c.obj_box.shape, dtype=cdtype)  # Σ_j g_j

    for batch in c.blocks:
        b = batch.stop - batch.start
        r, q, o, wave = c.forward(batch)
        y = c.data(batch)
        per, g_far, yhat = _far_field_loss(opts.loss, wave, y, c.valid, opts.eps, gradient=True,
                                           overwrite=True, background=background)  # g_Ψ into Ψ's buffer
        if variable is not None and variable.want_background:
            variable.background_terms(opts.loss, yhat, y, c.valid, opts.eps)
        loss += float(per.sum())
        # Σ_j y_j and Σ_j ŷ_j per pixel: working precision over one block, float64 across blocks
        measured += ones[:b] @ y.reshape(b, -1)
        model += ones[:b] @ yhat.reshape(b, -1)
        g_psi = _fft_in_place(g_far, inverse=True)                          # g_ψ = F⁻¹ g_Ψ
        if want_object_grad:                            # Σ_k conj(Q_jk) g_ψjk (in Q's buffer), Σ_k |Q_jk|²
            g, q_power = kernels.object_gradient(q, g_psi, overwrite=True)
            if deform is not None:
                d = [c.index.extract(box_d[a], batch, out=d_patch[a, :b]) for a in range(2)]
                for a in range(2):
                    shift_num[batch, a] = real_dots(d[a], g)
                deform.add_gram(batch, q_power, d)
                if not want_object:
                    c.index.scatter_add(scattered, g, batch)
        else:
            q_power = model_intensity(q)
        c.index.scatter_add(illum, q_power, batch)
        if want_object_grad:
            if variable is not None:                    # Re⟨O_j, g_j⟩ = s_j ∂L/∂s_j, |O_j|²
                variable.pattern_terms(batch, o, g, q_power)
            if want_object:
                c.index.scatter_add(obj_grad, g, batch)
        elif variable is not None:
            variable.pattern_terms(batch, o, None, q_power)
        if want_spectra:
            if want_probe:                              # Σ_j |O_j|², windows of |O|² on the box
                probe_illum += ones[:b] @ c.index.extract(obj_power, batch, out=powers[:b]).reshape(b, -1)
            kernels.conj_product(g_psi, o, out=g_psi)                      # g_Q = conj(O_j) g_ψ
            spectra = _fft_in_place(g_psi)
            kernels.conj_product(spectra, r, out=spectra)                  # G_j
            if want_probe and variable is not None:     # Σ_j (∂P_jm/∂P_m) G_jm, eigen and weight terms
                variable.probe_terms(batch, spectra, spectra_sum.reshape(n_modes, -1))
            elif want_probe:
                spectra_sum += ones_c[:b] @ spectra.reshape(b, -1)
            if want_positions:
                position_grad[batch] = real_dots_with(spectra, (dq_y, dq_x))

    if c.valid is None:
        sum_measured, sum_model = float(measured.sum()), float(model.sum())
    else:
        mask = c.valid.reshape(-1).astype(np.float64)
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
    if deform is not None:
        deform.add_first(scattered, c.index.corners, shift_num)
        sums = deform.sums(positions)
        sums["window_num"] = sums["window_num"] * window_chi_factor(opts.loss)
        part.arrays.update(sums)
    if variable is not None:
        variable.finish(part, measured, model)
    if is_cupy(obj):  # partials stay where the state lives; the positions' optimiser is on the host
        if want_positions:
            part.arrays["position_grad"] = to_numpy(position_grad)
        return part
    return part.to_numpy()


def chunk_loss(obj, probe, intensities, positions, *, options: "ADOptions | None" = None,
               valid=None, variable=None) -> Partial:
    """Loss only (forward model, no adjoint) for one chunk: ``scalars`` loss (float64 sum) and n."""
    _check_chunk_inputs(intensities, positions)
    if intensities.shape[0] == 0:
        return Partial()
    opts = options or ADOptions()
    c = _Chunk(obj, probe, intensities, positions, valid, keep_shifted=False, variable=variable)
    background = None if variable is None else variable.background
    loss = 0.0
    for batch in c.blocks:
        wave = c.forward(batch)[3]
        per, _, _ = _far_field_loss(opts.loss, wave, c.data(batch), c.valid, opts.eps, gradient=False,
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
                                        variable=variable, window_sums=window, **reuse)
    if frame is not None:
        frame.sums_to_object(part)
    if not active or not part.scalars:
        part.local = {}
        return part
    grad = part.arrays.pop("position_grad")
    new, _ = step_with_optimizer({**local, "positions": used}, grad, positions,
                                 t=epoch - positions.start_epoch + 1)
    return finish_step(part, new, used, nominal, positions, epoch, n, shape)
