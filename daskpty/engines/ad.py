"""AD engine: exact reverse-mode gradients from the physics operators' hand-written adjoints.

Same forward model as LSQML (design.md), per pattern j and probe mode k::

    Q_jk = S_{f_j} P_k,   ψ_jk = Q_jk · O[r_j window],   Ψ_jk = F ψ_jk,   ŷ_j = Σ_k |Ψ_jk|²,

and a data loss L(Ψ) = Σ_j Σ_pixels h(ŷ_j, y_j). The gradient is propagated backwards through the
chain of adjoints (no autograd, no tape; NumPy and CuPy alike, the namespace of the input):

    g_Ψ = ∇_Ψ L  →  g_ψ = F⁻¹ g_Ψ  →  object: Σ_k conj(Q_jk) g_ψjk, scatter-added at r_j
                                     probe:  Σ_j S_{-f_j}(conj(O_j) g_ψj)
                                     positions: Re⟨F[conj(O_j) g_ψj], (−2πi k) F[P] ramp_j⟩.

**Complex gradient convention.** For a real function f of complex z we use
``g = ∂f/∂Re z + i ∂f/∂Im z`` (= 2 ∂f/∂z̄), so a first-order change is
``δf = Re⟨g, δz⟩ = Re Σ conj(g)·δz``. Gradient descent is ``z ← z − lr·g``. The finite-difference
tests check exactly this relation.

Layout of this module (no dask in here):

* losses with value and gradient w.r.t. Ψ: :func:`gaussian_loss_gradient`,
  :func:`poisson_loss_gradient`, :func:`intensity_loss_gradient` (:data:`LOSS_GRADIENTS`);
* :func:`chunk_gradient` / :func:`chunk_loss` — per-chunk additive :class:`Partial` results, one
  pass over cache-sized sub-batches of the chunk on the CPU (the whole chunk on the GPU);
* optimisers over dicts of host arrays: :class:`Adam`, :class:`SGD` (heavy-ball / Nesterov),
  :class:`ConjugateGradient` (Polak–Ribière+, Armijo backtracking with one quadratic interpolation
  that needs loss values only); their memory is an :class:`OptimizerState` of plain NumPy arrays
  and floats (checkpointable without pickle);
* :class:`ADOptions`, :class:`ADState`, :func:`apply`, :func:`begin_epoch`, :func:`end_epoch`.

Precision: the working precision is complex128 when the object or probe is complex128, complex64
otherwise; loss values are accumulated in float64 (the Poisson loss's pixel terms are also formed
in float64; the Gaussian and intensity losses' squared residuals in the working precision).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..physics import fft2, get_xp, ifft2, model_intensity
from ..physics.backend import asarray_like, real_dots, to_numpy
from ..physics.noise import _poisson_loss64
from ..physics.patches import PatchIndex
from ..physics.shifts import outer_ramps, shift_ramp_factors
from .lsqml import _fft_in_place, forward_sums, rescale_probe  # noqa: F401  (the last two re-exported)
from .partials import BoxedArray, Partial

DEFAULT_EPS = 1e-6
LOSS_NAMES = ("gaussian", "poisson", "intensity")
OPTIMIZERS = ("adam", "sgd", "cg")
SCHEDULES = ("constant", "exponential", "step")
PARAMETERS = ("object", "probe")

#: Per-optimiser default learning rates (object, probe); see :class:`ADOptions`.
DEFAULT_LR = {"adam": (0.05, 0.01), "sgd": (0.25, 0.05), "cg": (0.5, 0.1)}


# --------------------------------------------------------------------------------------------------
# Losses: value and gradient w.r.t. the far field Ψ (B, M, n, n)


def _far_field_loss(name: str, far, y, valid, eps: float, gradient: bool, overwrite: bool = False):
    """Loss per pattern, ∇_Ψ L and ŷ of far fields ``far`` (B, M, n, n), fused in a few passes.

    Returns ``(per_pattern, grad, yhat)``: per_pattern (B,) float64, grad = 2 h'(ŷ) Ψ (None unless
    ``gradient``; written into ``far`` when ``overwrite``), yhat = Σ_k |Ψ_k|² (B, n, n). The pixel
    terms are formed in the precision of ``far`` (``y`` is cast to it). Gaussian and intensity
    losses are Σ r² of their residuals r = √(ŷ+ε) − √y and ŷ − y, by BLAS dots (single precision:
    float32 over 1024 pixels, float64 across, see :func:`real_dots`); the Poisson loss, whose
    per-pixel terms are large next to their sum's changes, is evaluated in float64.
    """
    xp = get_xp(far)
    rdtype = np.float64 if far.dtype == np.complex128 else np.float32
    if valid is not None:
        valid = xp.asarray(valid)
    yhat = model_intensity(far)
    y = y.astype(rdtype, copy=False)
    factor = None
    if name == "gaussian":      # (√(ŷ+ε) − √y)² = (ŷ+ε) u²,  2h' = 2u,  u = 1 − √(y/(ŷ+ε))
        level = yhat + rdtype(eps)
        u = xp.divide(y, level)
        xp.sqrt(u, out=u)
        xp.subtract(rdtype(1), u, out=u)
        if valid is not None:
            u *= valid
        level *= u
        value = real_dots(level, u)
        if gradient:
            factor = u
            factor *= rdtype(2)
    elif name == "poisson":     # ŷ − y log(ŷ+ε),  2h' = 2 (1 − y/(ŷ+ε))
        value = _poisson_loss64(yhat.astype(np.float64, copy=False), y.astype(np.float64, copy=False),
                                valid, eps)
        if gradient:
            factor = yhat + rdtype(eps)
            xp.divide(y, factor, out=factor)
            factor *= rdtype(-2)
            factor += rdtype(2)
            if valid is not None:
                factor *= valid
    elif name == "intensity":   # (ŷ − y)²,  2h' = 4 (ŷ − y)
        residual = yhat - y
        if valid is not None:
            residual *= valid
        value = real_dots(residual, residual)
        if gradient:
            factor = residual
            factor *= rdtype(4)
    else:
        raise ValueError(f"loss must be one of {LOSS_NAMES}, got {name!r}")
    grad = None
    if gradient:
        grad = xp.multiply(far, factor[:, None], out=far if overwrite else None)
    return value, grad, yhat


def loss_and_gradient(far, y, *, loss: str = "gaussian", valid=None, eps: float = DEFAULT_EPS,
                      gradient: bool = True):
    """Loss of far fields ``far`` (B, M, n, n) against data ``y`` (B, n, n) (zero frequency at index 0).

    Returns ``(per_pattern_loss, grad)``: the loss per pattern (B,) float64 and ∇_Ψ L (same shape and
    dtype as ``far``; None when ``gradient`` is False). With ŷ = Σ_k |Ψ_k|², ∇_Ψ L = 2 h'(ŷ) Ψ.
    ``valid`` (n, n) bool: masked pixels contribute nothing.
    """
    per_pattern, grad, _ = _far_field_loss(loss, far, y, valid, eps, gradient)
    return per_pattern, grad


def gaussian_loss_gradient(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Amplitude least squares Σ (√(ŷ+ε) − √y)²: returns ``(loss, ∇_Ψ)``, loss a float (float64 sum)."""
    per, g = loss_and_gradient(far, y, loss="gaussian", valid=valid, eps=eps)
    return float(per.sum()), g


def poisson_loss_gradient(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Poisson negative log-likelihood Σ ŷ − y log(ŷ+ε): returns ``(loss, ∇_Ψ)``."""
    per, g = loss_and_gradient(far, y, loss="poisson", valid=valid, eps=eps)
    return float(per.sum()), g


def intensity_loss_gradient(far, y, valid=None, eps: float = DEFAULT_EPS):
    """Intensity least squares Σ (ŷ − y)²: returns ``(loss, ∇_Ψ)``."""
    per, g = loss_and_gradient(far, y, loss="intensity", valid=valid, eps=eps)
    return float(per.sum()), g


LOSS_GRADIENTS = {"gaussian": gaussian_loss_gradient, "poisson": poisson_loss_gradient,
                  "intensity": intensity_loss_gradient}


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

    def __init__(self, obj, probe, intensities, positions, valid, keep_shifted: bool = True):
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
        q = xp.multiply(r[:, None], self.probe_ft[None], out=self._shifted[:b])
        _fft_in_place(q, inverse=True)                                          # Q = F⁻¹(ramp · F P)
        o = self.index.extract(self.obj_box, batch, out=self._patches[:b])
        wave = xp.multiply(q, o[:, None], out=self._waves[:b])                  # ψ = Q · O_j
        _fft_in_place(wave)                                                     # Ψ = F ψ
        return r, q, o, wave


def _check_chunk_inputs(intensities, positions):
    if intensities.ndim != 3:
        raise ValueError(f"intensities must be (B, n, n), got shape {intensities.shape}")
    if np.shape(positions) != (intensities.shape[0], 2):
        raise ValueError(f"positions must be ({intensities.shape[0]}, 2), got shape {np.shape(positions)}")


def chunk_gradient(obj, probe, intensities, positions, *, options: "ADOptions | None" = None, valid=None,
                   want_object: bool = True, want_probe: bool = True,
                   want_positions: bool = False) -> Partial:
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
    * ``scalars``: ``loss`` (float64 sum), ``n``, ``sum_measured``, ``sum_model``.

    One pass over sub-batches (see :class:`_Chunk`): forward model, g_Ψ (in place), g_ψ = F⁻¹ g_Ψ,
    illumination and object gradient scattered into the box, and G_j = conj(ramp_j) F[conj(O_j) g_ψj]
    (F of the adjoint shift of g_Q): the probe gradient is F⁻¹ Σ_j G_j, summed block by block, and
    ∂L/∂f_j = Re⟨G_j, F[P] (−2πi k)⟩ are BLAS dots.
    """
    _check_chunk_inputs(intensities, positions)
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    opts = options or ADOptions()
    c = _Chunk(obj, probe, intensities, positions, valid)
    xp, cdtype, rdtype = c.xp, c.cdtype, c.rdtype
    n, n_modes = c.n, c.n_modes
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

    for batch in c.blocks:
        b = batch.stop - batch.start
        r, q, o, wave = c.forward(batch)
        y = c.data(batch)
        per, g_far, yhat = _far_field_loss(opts.loss, wave, y, c.valid, opts.eps, gradient=True,
                                           overwrite=True)                  # g_Ψ into Ψ's buffer
        loss += float(per.sum())
        # Σ_j y_j and Σ_j ŷ_j per pixel: working precision over one block, float64 across blocks
        measured += ones[:b] @ y.reshape(b, -1)
        model += ones[:b] @ yhat.reshape(b, -1)
        g_psi = _fft_in_place(g_far, inverse=True)                          # g_ψ = F⁻¹ g_Ψ
        c.index.scatter_add(illum, model_intensity(q), batch)              # Σ_k |Q_jk|²
        if want_object:                                 # Σ_k conj(Q_jk) g_ψjk, in Q's buffer
            g = xp.conj(q[:, 0], out=q[:, 0])
            g *= g_psi[:, 0]
            for m in range(1, n_modes):
                g += xp.conj(q[:, m]) * g_psi[:, m]
            c.index.scatter_add(obj_grad, g, batch)
        if want_spectra:
            if want_probe:                              # Σ_j |O_j|², windows of |O|² on the box
                probe_illum += ones[:b] @ c.index.extract(obj_power, batch, out=powers[:b]).reshape(b, -1)
            g_psi *= xp.conj(o, out=o)[:, None]                            # g_Q = conj(O_j) g_ψ
            spectra = _fft_in_place(g_psi)
            spectra *= xp.conj(r, out=r)[:, None]                           # G_j
            if want_probe:
                spectra_sum += ones_c[:b] @ spectra.reshape(b, -1)
            if want_positions:
                position_grad[batch, 0] = real_dots(spectra, xp.broadcast_to(dq_y, spectra.shape))
                position_grad[batch, 1] = real_dots(spectra, xp.broadcast_to(dq_x, spectra.shape))

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
    return part.to_numpy()


def chunk_loss(obj, probe, intensities, positions, *, options: "ADOptions | None" = None,
               valid=None) -> Partial:
    """Loss only (forward model, no adjoint) for one chunk: ``scalars`` loss (float64 sum) and n."""
    _check_chunk_inputs(intensities, positions)
    if intensities.shape[0] == 0:
        return Partial()
    opts = options or ADOptions()
    c = _Chunk(obj, probe, intensities, positions, valid, keep_shifted=False)
    loss = 0.0
    for batch in c.blocks:
        wave = c.forward(batch)[3]
        per, _, _ = _far_field_loss(opts.loss, wave, c.data(batch), c.valid, opts.eps, gradient=False)
        loss += float(per.sum())
    return Partial(scalars={"loss": loss, "n": float(intensities.shape[0])})


# --------------------------------------------------------------------------------------------------
# Optimisers: pure functions of (parameters, gradients, state) over dicts of host arrays


def inner(a: dict, b: dict) -> float:
    """Real inner product Re Σ conj(a)·b over every shared key, accumulated in float64."""
    total = 0.0
    for k in a:
        if k in b:
            x, y = a[k], b[k]
            if np.iscomplexobj(x) or np.iscomplexobj(y):
                x, y = np.asarray(x), np.asarray(y)
                total += float(np.sum(x.real * y.real, dtype=np.float64)
                               + np.sum(np.imag(x) * np.imag(y), dtype=np.float64))
            else:
                total += float(np.sum(x * y, dtype=np.float64))
    return total


@dataclass
class OptimizerState:
    """An optimiser's memory: plain NumPy arrays and floats, keyed ``"<slot>/<parameter>"``."""

    arrays: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)

    def get(self, slot: str, name: str):
        return self.arrays.get(f"{slot}/{name}")

    def set(self, slot: str, name: str, value) -> None:
        self.arrays[f"{slot}/{name}"] = value

    def drop(self, slot: str) -> None:
        for k in [k for k in self.arrays if k.startswith(slot + "/")]:
            del self.arrays[k]


def _cast(new, like):
    return new.astype(like.dtype, copy=False)


class Adam:
    """Adam (Kingma & Ba) on complex arrays: first moment complex, second moment |g|² (rotation invariant)."""

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def step(self, params: dict, grads: dict, lrs: dict, state: OptimizerState):
        out = dict(params)
        for name, g in grads.items():
            m, v = state.get("m", name), state.get("v", name)
            t = int(state.scalars.get(f"t/{name}", 0)) + 1
            m = (1 - self.beta1) * g if m is None else self.beta1 * m + (1 - self.beta1) * g
            g2 = (g.real**2 + np.imag(g) ** 2)
            v = (1 - self.beta2) * g2 if v is None else self.beta2 * v + (1 - self.beta2) * g2
            m, v = _cast(m, g), _cast(v, g2)
            state.set("m", name, m)
            state.set("v", name, v)
            state.scalars[f"t/{name}"] = float(t)
            m_hat = m / (1 - self.beta1**t)
            v_hat = v / (1 - self.beta2**t)
            out[name] = _cast(params[name] - lrs[name] * m_hat / (np.sqrt(v_hat) + self.eps), params[name])
        return out, state


class SGD:
    """Gradient descent with heavy-ball or Nesterov momentum: b ← μ b + g; p ← p − lr (g + μ b | b)."""

    def __init__(self, momentum: float = 0.0, nesterov: bool = False):
        self.momentum, self.nesterov = momentum, nesterov

    def step(self, params: dict, grads: dict, lrs: dict, state: OptimizerState):
        out = dict(params)
        for name, g in grads.items():
            update = g
            if self.momentum > 0:
                b = state.get("b", name)
                b = g if b is None else _cast(self.momentum * b + g, g)
                state.set("b", name, b)
                update = g + self.momentum * b if self.nesterov else b
            out[name] = _cast(params[name] - lrs[name] * update, params[name])
        return out, state


class ConjugateGradient:
    """Nonlinear CG, Polak–Ribière+ with restarts, and a line search that needs only loss values.

    ``grads`` are the exact gradients g, ``precond`` the preconditioned ones s = M⁻¹g (pass
    ``precond=grads`` for none); per-parameter ``lrs`` scale s as part of the preconditioner, so a
    line-search step α = 1 is one SGD step. Direction ``d = −s + β d_prev`` with
    ``β = max(0, ⟨g, s − s_prev⟩ / ⟨g_prev, s_prev⟩)``; restart (β = 0) when d is not a descent
    direction or the parameter set changed.

    Line search along d from the last accepted α: evaluate L(α₀); fit the parabola through L(0),
    L'(0) = ⟨g, d⟩ and L(α₀), evaluate its minimiser α₁; accept the lower of the two if it meets
    Armijo's condition L(α) ≤ L(0) + c₁ α L'(0), else backtrack (α ← ρ·α). On a quadratic the
    interpolated step is the exact minimiser, so CG terminates in ≤ dim steps (up to rounding).
    """

    def __init__(self, c1: float = 1e-4, backtrack: float = 0.5, max_evaluations: int = 6,
                 interpolate: bool = True, grow: float = 1.5):
        self.c1, self.backtrack, self.max_evaluations = c1, backtrack, max_evaluations
        self.interpolate, self.grow = interpolate, grow

    def direction(self, grads: dict, precond: dict, lrs: dict, state: OptimizerState) -> tuple[dict, float]:
        s = {k: lrs[k] * precond[k] for k in grads}
        names = sorted(grads)
        same = state.scalars.get("cg_names") == float(_names_code(names))
        beta = 0.0
        d_prev = {k: state.get("cg_d", k) for k in names}
        s_prev = {k: state.get("cg_s", k) for k in names}
        g_prev = {k: state.get("cg_g", k) for k in names}
        if same and all(v is not None for v in (*d_prev.values(), *s_prev.values(), *g_prev.values())):
            denom = inner(g_prev, s_prev)
            if denom > 0:
                beta = max(0.0, (inner(grads, s) - inner(grads, s_prev)) / denom)
        d = {k: -s[k] + beta * d_prev[k] if beta > 0 else -s[k] for k in names}
        slope = inner(grads, d)
        if slope >= 0 and beta > 0:     # not a descent direction: restart along −s
            d = {k: -s[k] for k in names}
            slope = inner(grads, d)
        state.drop("cg_d"), state.drop("cg_s"), state.drop("cg_g")
        for k in names:
            state.set("cg_d", k, d[k])
            state.set("cg_s", k, s[k])
            state.set("cg_g", k, grads[k])
        state.scalars["cg_names"] = float(_names_code(names))
        state.scalars["cg_beta"] = beta
        return d, slope

    def step(self, params: dict, grads: dict, precond: dict, lrs: dict, loss0: float, evaluate,
             state: OptimizerState):
        """One CG iteration. ``evaluate(params) -> loss`` (same data as ``loss0``). Returns (params, state)."""
        d, slope = self.direction(grads, precond, lrs, state)
        alpha0 = state.scalars.get("cg_alpha", 1.0)
        evaluations = 0
        if not slope < 0 or not math.isfinite(slope):
            state.scalars["cg_evaluations"] = 0.0
            return dict(params), state

        def trial(a):
            nonlocal evaluations
            evaluations += 1
            p = {k: _cast(params[k] + a * d[k], params[k]) if k in d else params[k] for k in params}
            return p, float(evaluate(p))

        def armijo(a, value):
            return math.isfinite(value) and value <= loss0 + self.c1 * a * slope

        best = None
        alpha = alpha0
        while evaluations < self.max_evaluations:
            p, value = trial(alpha)
            candidates = [(value, alpha, p)]
            if self.interpolate and evaluations < self.max_evaluations and math.isfinite(value):
                curvature = (value - loss0 - slope * alpha) / (alpha * alpha)
                if curvature > 0:
                    a1 = min(max(-slope / (2 * curvature), 1e-3 * alpha), 1e3 * alpha)
                    p1, v1 = trial(a1)
                    candidates.append((v1, a1, p1))
            ok = [c for c in candidates if armijo(c[1], c[0])]
            if ok:
                best = min(ok, key=lambda c: c[0])
                break
            finite = [c[1] for c in candidates if math.isfinite(c[0])]
            alpha = self.backtrack * (min(finite) if finite else alpha)
        state.scalars["cg_evaluations"] = float(evaluations)
        if best is None:                 # no acceptable step: stay, restart, try shorter next time
            state.drop("cg_d")
            state.scalars["cg_alpha"] = alpha
            return dict(params), state
        state.scalars["cg_alpha"] = best[1] * self.grow if best[1] >= alpha0 else best[1]
        state.scalars["cg_last_alpha"] = best[1]
        return best[2], state


def _names_code(names) -> int:
    return sum(1 << PARAMETERS.index(n) for n in names if n in PARAMETERS)


# --------------------------------------------------------------------------------------------------
# Options and state


@dataclass(frozen=True)
class ADOptions:
    """Settings of the AD engine.

    Defaults (amplitude loss; SGD with Nesterov momentum 0.9 at lr 0.25 / 0.05 on the
    illumination-preconditioned gradients — Adam for the intensity loss, whose gradient scale
    follows the photon count; probe updates from epoch 1) reach LSQML's object error within about
    three times its epochs without tuning (tests/test_ad.py; on the simulator's small preset SGD
    reached NRMSE 0.098 / 0.020 after 30 / 100 epochs where Adam at its defaults reached
    0.41 / 0.34).

    loss: ``"gaussian"`` (amplitude least squares), ``"poisson"`` (negative log-likelihood) or
        ``"intensity"`` (intensity least squares).
    optimizer: None (default: ``"sgd"``, or ``"adam"`` for the intensity loss), ``"adam"``, ``"sgd"`` (``momentum``, ``nesterov``) or ``"cg"`` (nonlinear conjugate
        gradient with a loss-only line search; needs loss evaluations from the driver, see
        :func:`apply`; meant for ``rounds_per_epoch = 1``).
    lr, probe_lr: step sizes of object and probe (None: the optimiser's default, :data:`DEFAULT_LR`:
        Adam 0.05 / 0.01, SGD 0.25 / 0.05, CG 0.5 / 0.1).
        Adam: the per-element step relative to the parameter's scale (mean |O| over the well-lit
        region, rms |P|), so it needs no knowledge of the photon count or loss scale.
        SGD: multiplies the (preconditioned) gradient; for the amplitude loss, g_O = −2 ΔO_LSQML,
        so lr = 0.5 with preconditioning is one unscaled LSQML/ePIE step (Poisson: about twice
        that). The intensity loss's gradient is ~4ŷ times larger: scale SGD/CG rates down by about
        1/(4·typical ŷ) or use Adam. CG: a diagonal preconditioner (the first trial step is one SGD step).
    schedule: ``"constant"``, ``"exponential"`` (lr · decay^epoch) or ``"step"``
        (lr · decay^(epoch // decay_every)); epochs count from each parameter's start epoch.
    object_start_epoch, probe_start_epoch: first epoch updating each (None: never);
    object_stop_epoch, probe_stop_epoch: first epoch no longer updating it (None: never stop).
    precondition: divide the object gradient by Σ|S_f P|² + δ·max and the probe gradient by
        Σ_j|O_j|² + δ·max (same round's patterns); delta: that δ.
    beta1, beta2, adam_eps: Adam's moment decays and denominator floor.
    momentum, nesterov: SGD momentum.
    cg_c1, cg_backtrack, cg_max_evaluations: Armijo constant, backtracking factor, loss evaluations
        (map-reduces) allowed per CG iteration.
    orthogonalize: SVD-orthogonalise probe modes after each epoch (optimiser memory is rotated too).
    normalize_every: remove the object/probe scale ambiguity every this many epochs (0: never).
    eps: small number added where intensities are divided (part of the loss definitions).
    """

    loss: str = "gaussian"
    optimizer: str | None = None
    lr: float | None = None
    probe_lr: float | None = None
    schedule: str = "constant"
    decay: float = 1.0
    decay_every: int = 10
    object_start_epoch: int | None = 0
    object_stop_epoch: int | None = None
    probe_start_epoch: int | None = 1
    probe_stop_epoch: int | None = None
    precondition: bool = True
    delta: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = True
    cg_c1: float = 1e-4
    cg_backtrack: float = 0.5
    cg_max_evaluations: int = 6
    orthogonalize: bool = True
    normalize_every: int = 1
    eps: float = DEFAULT_EPS

    def __post_init__(self):
        def check(cond, msg):
            if not cond:
                raise ValueError(msg)

        check(self.loss in LOSS_NAMES, f"loss must be one of {LOSS_NAMES}, got {self.loss!r}")
        if self.optimizer is None:  # SGD+Nesterov converges fastest on counting data; Adam is the
            # robust choice for the intensity loss, whose gradient scale follows the photon count
            object.__setattr__(self, "optimizer", "adam" if self.loss == "intensity" else "sgd")
        check(self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("lr", "probe_lr"):
            v = getattr(self, name)
            check(v is None or (_is_number(v) and v > 0 and math.isfinite(v)),
                  f"{name} must be a positive number or None, got {v!r}")
        check(_is_number(self.decay) and 0 < self.decay <= 1, f"decay must lie in (0, 1], got {self.decay!r}")
        check(isinstance(self.decay_every, (int, np.integer)) and self.decay_every >= 1,
              f"decay_every must be a positive integer, got {self.decay_every!r}")
        for name in ("object_start_epoch", "object_stop_epoch", "probe_start_epoch", "probe_stop_epoch"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, (int, np.integer)) and v >= 0),
                  f"{name} must be a non-negative integer or None, got {v!r}")
        for p in ("object", "probe"):
            a, b = getattr(self, f"{p}_start_epoch"), getattr(self, f"{p}_stop_epoch")
            check(a is None or b is None or b > a, f"{p}_stop_epoch ({b}) must be after {p}_start_epoch ({a})")
        check(_is_number(self.delta) and self.delta > 0, f"delta must be positive, got {self.delta!r}")
        check(0 <= self.beta1 < 1, f"beta1 must lie in [0, 1), got {self.beta1!r}")
        check(0 <= self.beta2 < 1, f"beta2 must lie in [0, 1), got {self.beta2!r}")
        check(self.adam_eps > 0, f"adam_eps must be positive, got {self.adam_eps!r}")
        check(0 <= self.momentum < 1, f"momentum must lie in [0, 1), got {self.momentum!r}")
        check(0 < self.cg_c1 < 0.5, f"cg_c1 must lie in (0, 0.5), got {self.cg_c1!r}")
        check(0 < self.cg_backtrack < 1, f"cg_backtrack must lie in (0, 1), got {self.cg_backtrack!r}")
        check(isinstance(self.cg_max_evaluations, (int, np.integer)) and self.cg_max_evaluations >= 1,
              f"cg_max_evaluations must be a positive integer, got {self.cg_max_evaluations!r}")
        check(isinstance(self.normalize_every, (int, np.integer)) and self.normalize_every >= 0,
              f"normalize_every must be a non-negative integer, got {self.normalize_every!r}")
        check(_is_number(self.eps) and self.eps >= 0, f"eps must be non-negative, got {self.eps!r}")

    @property
    def object_lr(self) -> float:
        return float(self.lr if self.lr is not None else DEFAULT_LR[self.optimizer][0])

    @property
    def probe_lr_value(self) -> float:
        return float(self.probe_lr if self.probe_lr is not None else DEFAULT_LR[self.optimizer][1])

    def active(self, name: str, epoch: int) -> bool:
        start, stop = getattr(self, f"{name}_start_epoch"), getattr(self, f"{name}_stop_epoch")
        return start is not None and epoch >= start and (stop is None or epoch < stop)

    def learning_rate(self, name: str, epoch: int) -> float:
        base = self.object_lr if name == "object" else self.probe_lr_value
        e = max(0, epoch - (getattr(self, f"{name}_start_epoch") or 0))
        if self.schedule == "exponential":
            return base * self.decay**e
        if self.schedule == "step":
            return base * self.decay ** (e // self.decay_every)
        return base

    def make_optimizer(self):
        if self.optimizer == "adam":
            return Adam(self.beta1, self.beta2, self.adam_eps)
        if self.optimizer == "sgd":
            return SGD(self.momentum, self.nesterov)
        return ConjugateGradient(self.cg_c1, self.cg_backtrack, self.cg_max_evaluations)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass
class ADState:
    """Object (H, W) and probe (M, n, n) on the host, the epoch, and the optimiser's memory.

    illumination: this epoch's Σ|S_f P|² (object frame, max over rounds) for masks and scale removal.
    iteration: optimiser steps taken. last_loss: loss of the last round (sum over its patterns).
    """

    object: np.ndarray
    probe: np.ndarray
    epoch: int = 0
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    illumination: np.ndarray | None = None
    iteration: int = 0
    last_loss: float = float("nan")
    extra: dict = field(default_factory=dict)

    def active(self, name: str, options: ADOptions) -> bool:
        return options.active(name, self.epoch)

    def to_arrays(self) -> dict:
        """Everything beyond object, probe and epoch, as flat ``name -> ndarray`` (checkpoints; no
        pickle). Names contain no ``/``: ``optimizer.<slot>.<parameter>`` for arrays,
        ``optimizer_scalar.<key>`` for 0-d floats, ``iteration``."""
        out = {"optimizer." + k.replace("/", "."): np.asarray(v) for k, v in self.optimizer.arrays.items()}
        out.update({"optimizer_scalar." + k.replace("/", "."): np.asarray(float(v), dtype=np.float64)
                    for k, v in self.optimizer.scalars.items()})
        out["iteration"] = np.asarray(self.iteration, dtype=np.int64)
        return out

    @classmethod
    def from_arrays(cls, obj, probe, epoch: int = 0, arrays: dict | None = None) -> "ADState":
        """Inverse of :meth:`to_arrays` (``arrays`` None or empty: a fresh optimiser)."""
        opt = OptimizerState()
        iteration = 0
        for name, value in (arrays or {}).items():
            if name.startswith("optimizer_scalar."):
                opt.scalars[name[len("optimizer_scalar."):].replace(".", "/")] = float(np.asarray(value))
            elif name.startswith("optimizer."):
                opt.arrays[name[len("optimizer."):].replace(".", "/", 1)] = np.asarray(value)
            elif name == "iteration":
                iteration = int(np.asarray(value))
        return cls(object=obj, probe=probe, epoch=int(epoch), optimizer=opt, iteration=iteration)


# --------------------------------------------------------------------------------------------------
# apply / epochs


def _preconditioned(g, illum, delta: float):
    return g / (illum + delta * float(illum.max())).astype(illum.dtype, copy=False)


def _lit_mean_abs(obj, illum) -> float:
    lit = illum > 0.5 * illum.max()
    return float(np.abs(obj[lit]).mean()) if lit.any() else 1.0


def apply(state: ADState, total: Partial, options: ADOptions, evaluate=None) -> ADState:
    """One optimiser step from a reduced gradient partial.

    ``evaluate(params) -> float``, with ``params`` a dict holding trial ``"object"`` and/or
    ``"probe"`` arrays, returns the loss (sum over the same patterns as ``total``); only the CG
    optimiser calls it (its line search) and it is required there.
    """
    if total is None:
        return state
    params, grads, pre, lrs = {}, {}, {}, {}
    epoch = state.epoch
    illum_box = total.boxes.get("illumination")
    full_illum = None
    if illum_box is not None:
        full_illum = np.zeros(state.object.shape, dtype=illum_box.data.dtype)
        illum_box.add_into(full_illum)
    if "object_grad" in total.boxes:
        box = total.boxes["object_grad"]
        g = np.zeros(state.object.shape, dtype=np.result_type(state.object.dtype, box.data.dtype))
        box.add_into(g)
        params["object"], grads["object"] = state.object, g
        pre["object"] = _preconditioned(g, full_illum, options.delta) if options.precondition else g
        lrs["object"] = options.learning_rate("object", epoch)
        if options.optimizer == "adam":
            lrs["object"] *= _lit_mean_abs(state.object, full_illum)
    if "probe_grad" in total.arrays:
        g = total.arrays["probe_grad"].astype(np.result_type(state.probe.dtype, total.arrays["probe_grad"].dtype))
        params["probe"], grads["probe"] = state.probe, g
        pre["probe"] = (_preconditioned(g, total.arrays["probe_illumination"][None], options.delta)
                        if options.precondition else g)
        lrs["probe"] = options.learning_rate("probe", epoch)
        if options.optimizer == "adam":
            lrs["probe"] *= float(np.sqrt(np.mean(np.abs(state.probe) ** 2)))

    if full_illum is not None:
        state.illumination = full_illum if state.illumination is None else np.maximum(state.illumination,
                                                                                      full_illum)
    if not grads:
        return state
    optimizer = options.make_optimizer()
    loss0 = float(total.scalars.get("loss", float("nan")))
    if options.optimizer == "cg":
        if evaluate is None:
            raise RuntimeError("the CG optimiser needs loss evaluations for its line search: call "
                               "apply(..., evaluate=...) (ADAdapter.run_round does this)")
        new, state.optimizer = optimizer.step(params, grads, pre, lrs, loss0, evaluate, state.optimizer)
    else:
        new, state.optimizer = optimizer.step(params, pre, lrs, state.optimizer)
    state.object = new.get("object", state.object)
    state.probe = new.get("probe", state.probe)
    state.iteration += 1
    state.last_loss = loss0
    return state


def begin_epoch(state: ADState, options: ADOptions) -> ADState:
    """Reset the epoch's illumination (it is rebuilt from the rounds' partials)."""
    state.illumination = None
    return state


def end_epoch(state: ADState, options: ADOptions) -> ADState:
    """Probe-mode orthogonalisation, scale-ambiguity removal (optimiser memory follows), epoch += 1."""
    if options.orthogonalize and state.probe.shape[0] > 1 and state.active("probe", options):
        orthogonalize_probe(state)
    if options.normalize_every and (state.epoch + 1) % options.normalize_every == 0:
        normalize_scale(state, options)
    state.epoch += 1
    return state


def orthogonalize_probe(state: ADState) -> None:
    """P ← Uᴴ P (SVD, strongest mode first); linear optimiser memory is rotated the same way
    (Adam's second moment by |Uᴴ|², an approximation)."""
    m = state.probe.shape[0]
    a = state.probe.reshape(m, -1).astype(np.complex128)
    u, s, vh = np.linalg.svd(a, full_matrices=False)
    state.probe = (s[:, None] * vh).reshape(state.probe.shape).astype(state.probe.dtype)
    uh = u.conj().T
    for key, arr in list(state.optimizer.arrays.items()):
        slot, name = key.split("/", 1)
        if name != "probe" or arr.shape[0] != m:
            continue
        flat = arr.reshape(m, -1)
        if slot == "v":
            new = (np.abs(uh) ** 2) @ flat
        else:
            new = uh @ flat
        state.optimizer.arrays[key] = new.reshape(arr.shape).astype(arr.dtype)


def normalize_scale(state: ADState, options: ADOptions) -> None:
    """Remove the O·c, P/c ambiguity: mean |O| = 1 over the well-illuminated region.

    The optimiser memory is rescaled consistently: with O' = O/c and P' = cP, raw gradients scale as
    c (object) and 1/c (probe), preconditioned ones like the parameters.
    """
    if state.illumination is None:
        return
    c = _lit_mean_abs(state.object, state.illumination)
    if not (c > 0 and math.isfinite(c)) or c == 1.0:
        return
    state.object = (state.object / c).astype(state.object.dtype)
    state.probe = (state.probe * c).astype(state.probe.dtype)
    param = {"object": 1.0 / c, "probe": c}
    raw = {"object": c, "probe": 1.0 / c}
    fed = param if options.precondition else raw   # what the optimiser was fed (s or g)
    for key, arr in list(state.optimizer.arrays.items()):
        slot, name = key.split("/", 1)
        if name not in param:
            continue
        if slot == "v":
            f = fed[name] ** 2
        elif slot == "cg_g":
            f = raw[name]
        else:   # m, b, cg_d, cg_s
            f = fed[name]
        state.optimizer.arrays[key] = (arr * f).astype(arr.dtype)
