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

from dataclasses import dataclass, field

import numpy as np

from ..physics import (
    CORRECTIONS,
    exit_waves,
    fft2,
    get_xp,
    ifft2,
    model_intensity,
    orthogonalize_modes,
    shift_probe,
    shift_probe_adjoint,
    shift_ramps,
    split_positions,
)
from ..physics.backend import asarray_like, to_numpy
from ..physics.patches import PatchIndex
from ..physics.noise import far_field_update
from .partials import BoxedArray, Partial


@dataclass(frozen=True)
class LSQMLOptions:
    """Settings of the LSQML engine.

    noise: ``"gaussian"`` (amplitude) or ``"poisson"`` far-field correction.
    beta: damping of the optimal step (0 < beta ≤ 1).
    delta: illumination-preconditioner regularisation, relative to max illumination.
    tikhonov: relative regularisation of the 2 × 2 step system.
    probe_start_epoch: first epoch in which the probe is updated (None: never).
    momentum: heavy-ball momentum on the object's per-epoch change (0 disables).
    orthogonalize: SVD-orthogonalise probe modes after each epoch.
    normalize_every: remove the object/probe scale ambiguity every this many epochs (0: never).
    eps: small number added where intensities are divided.
    """

    noise: str = "gaussian"
    beta: float = 0.9
    delta: float = 0.1
    tikhonov: float = 1e-2
    probe_start_epoch: int | None = 0
    momentum: float = 0.5
    orthogonalize: bool = True
    normalize_every: int = 1
    eps: float = 1e-6

    def __post_init__(self):
        if self.noise not in CORRECTIONS:
            raise ValueError(f"noise must be one of {sorted(CORRECTIONS)}, got {self.noise!r}")
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must lie in (0, 1], got {self.beta}")
        if not self.delta > 0:
            raise ValueError(f"delta must be positive, got {self.delta}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum}")


@dataclass
class LSQMLState:
    """Object (H, W) and probe (M, n, n), complex64 on the host, plus the engine's memory."""

    object: np.ndarray
    probe: np.ndarray
    epoch: int = 0
    velocity: np.ndarray | None = None      # momentum buffer (object frame)
    epoch_start_object: np.ndarray | None = None
    illumination: np.ndarray | None = None  # last epoch's Σ|S_f P|² (object frame, float32)
    extra: dict = field(default_factory=dict)

    def update_probe(self, options: LSQMLOptions) -> bool:
        return options.probe_start_epoch is not None and self.epoch >= options.probe_start_epoch


def _trimmed_mean(x, xp, trim: float = 0.1) -> float:
    n = x.shape[0]
    k = int(n * trim)
    if n - 2 * k <= 0:
        return float(x.mean())
    return float(xp.sort(x)[k:n - k].mean())


def _preconditioner(illum, delta: float):
    xp = get_xp(illum)
    floor = (delta * illum.max()) ** 2
    return xp.sqrt(illum * illum + floor).astype(np.float32)


def chunk_step(obj, probe, intensities, positions, *, options: LSQMLOptions, update_probe: bool = True,
               valid=None) -> Partial:
    """One LSQML step for one chunk of patterns, returned as an additive partial.

    obj: (H, W) complex64 (whole object; only the chunk's bounding box is read).
    probe: (M, n, n) complex64. intensities: (B, n, n), zero frequency at index 0, any real dtype
    (counts stay integer until here). positions: (B, 2) float (y, x) in object pixels.
    valid: optional (n, n) bool detector mask (zero frequency at index 0).
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
    probe = asarray_like(probe, intensities)
    if valid is not None:
        valid = asarray_like(valid, intensities)
    index = PatchIndex(corners - box0, n, obj_box.shape, xp)  # reused by every gather/scatter
    ramps = shift_ramps(fractions, n, xp)

    obj_patches = index.extract(obj_box)
    shifted_probe = shift_probe(probe, ramps)
    far = fft2(shifted_probe * obj_patches[:, None], overwrite=True)
    far_delta, yhat, loss = far_field_update(options.noise, far, intensities, valid, options.eps)
    loss = loss.sum()
    del far
    chi = ifft2(far_delta, overwrite=True)  # exit-wave residual χ = F⁻¹(Ψ' − Ψ) (B, M, n, n)
    del far_delta

    # Object direction and illumination on the chunk's bounding box.
    conj_probe = xp.conj(shifted_probe)
    obj_grad = (conj_probe * chi).sum(axis=1)
    illum_patches = (shifted_probe.real**2 + shifted_probe.imag**2).sum(axis=1)
    obj_num = xp.zeros(obj_box.shape, dtype=np.complex64)
    index.scatter_add(obj_num, obj_grad)
    illum = xp.zeros(obj_box.shape, dtype=np.float32)
    index.scatter_add(illum, illum_patches)
    obj_dir = obj_num / _preconditioner(illum, options.delta)

    # Step-length system per pattern: a = ΔÔ_j · S_f P_k, b = S_f ΔP̂_k · O_j.
    a = index.extract(obj_dir)[:, None] * shifted_probe
    a_chi = (xp.conj(a) * chi).real.sum(axis=(1, 2, 3), dtype=np.float64)
    a_a = (a.real**2 + a.imag**2).sum(axis=(1, 2, 3), dtype=np.float64)
    probe_sum = None
    if update_probe:
        probe_sum = shift_probe_adjoint(xp.conj(obj_patches)[:, None] * chi, ramps, overwrite=True)
        b = shift_probe(probe_sum / np.float32(n_patterns), ramps) * obj_patches[:, None]
        b_chi = (xp.conj(b) * chi).real.sum(axis=(1, 2, 3), dtype=np.float64)
        b_b = (b.real**2 + b.imag**2).sum(axis=(1, 2, 3), dtype=np.float64)
        a_b = (xp.conj(a) * b).real.sum(axis=(1, 2, 3), dtype=np.float64)
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

    origin = (int(box0[0]), int(box0[1]))
    parts = Partial(
        boxes={"object": BoxedArray(origin, (np.float32(alpha_o) * obj_num).astype(np.complex64)),
               "illumination": BoxedArray(origin, illum)},
        scalars={"loss": float(loss), "n": float(n_patterns),
                 "alpha_object": alpha_o * n_patterns, "alpha_probe": alpha_p * n_patterns,
                 "sum_measured": float(intensities.sum(dtype=np.float64) if valid is None
                                       else (intensities * valid).sum(dtype=np.float64)),
                 "sum_model": float(yhat.sum(dtype=np.float64) if valid is None
                                    else (yhat * valid).sum(dtype=np.float64))},
    )
    if probe_sum is not None:
        parts.arrays["probe"] = (np.float32(alpha_p) * probe_sum).astype(np.complex64)
    return parts.to_numpy()


def apply(state: LSQMLState, total: Partial, options: LSQMLOptions) -> LSQMLState:
    """Add a reduced partial to the state: O += β ΔO / √(W² + (δ max W)²), P += β ΔP / N."""
    if "object" not in total.boxes:
        return state
    obj = state.object.copy()
    num = total.boxes["object"]
    illum = total.boxes["illumination"]
    step = (options.beta * num.data / _preconditioner(illum.data, options.delta)).astype(np.complex64)
    BoxedArray(num.offset, step).add_into(obj)
    probe = state.probe
    if "probe" in total.arrays:
        probe = (probe + options.beta * total.arrays["probe"] / np.float32(total.scalars["n"])).astype(np.complex64)
    full_illum = np.zeros(obj.shape, dtype=np.float32)
    illum.add_into(full_illum)
    state.object, state.probe = obj, probe
    state.illumination = full_illum if state.illumination is None else np.maximum(state.illumination, full_illum)
    return state


def forward_sums(obj, probe, intensities, positions, *, valid=None) -> Partial:
    """Σ measured and Σ model intensity of one chunk (for the first-epoch probe rescale)."""
    xp = get_xp(intensities)
    obj = asarray_like(obj, intensities)
    probe = asarray_like(probe, intensities)
    n = probe.shape[-1]
    corners, fractions = split_positions(to_numpy(positions), n)
    ramps = shift_ramps(fractions, n, xp)
    psi, _, _ = exit_waves(obj, probe, xp.asarray(corners), ramps)
    yhat = model_intensity(fft2(psi))
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


def begin_epoch(state: LSQMLState, options: LSQMLOptions) -> LSQMLState:
    """Remember the object at the start of the epoch (for momentum) and reset illumination."""
    if options.momentum > 0:
        state.epoch_start_object = state.object.copy()
    state.illumination = None
    return state


def end_epoch(state: LSQMLState, options: LSQMLOptions) -> LSQMLState:
    """Momentum on the object's change, probe-mode orthogonalisation, scale-ambiguity removal."""
    if options.momentum > 0 and state.epoch_start_object is not None:
        change = state.object - state.epoch_start_object
        if state.velocity is not None:
            agree = np.vdot(state.velocity, change).real > 0
            if agree:
                state.object = (state.object + options.momentum * state.velocity).astype(np.complex64)
                state.velocity = (change + options.momentum * state.velocity).astype(np.complex64)
            else:
                state.velocity = change.astype(np.complex64)
        else:
            state.velocity = change.astype(np.complex64)
    if options.orthogonalize and state.probe.shape[0] > 1:
        state.probe = orthogonalize_modes(state.probe)
    if options.normalize_every and (state.epoch + 1) % options.normalize_every == 0:
        normalize_scale(state)
    state.epoch += 1
    return state


def normalize_scale(state: LSQMLState) -> None:
    """Remove the O·c, P/c ambiguity: mean |O| = 1 over the well-illuminated region."""
    if state.illumination is None:
        return
    lit = state.illumination > 0.5 * state.illumination.max()
    if not lit.any():
        return
    c = float(np.abs(state.object[lit]).mean())
    if c > 0 and np.isfinite(c):
        state.object = (state.object / np.float32(c)).astype(np.complex64)
        state.probe = (state.probe * np.float32(c)).astype(np.complex64)
        if state.velocity is not None:
            state.velocity = (state.velocity / np.float32(c)).astype(np.complex64)
