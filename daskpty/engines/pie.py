"""The PIE family in minibatch rounds: rPIE (Maiden, Johnson & Li, Optica 4, 736, 2017), ePIE as α = 1.

Per pattern j and probe mode k, with exit wave ψ_jk = S_f P_k · O_j and the noise model's
far-field correction Ψ' (the same projection LSQML uses, from :mod:`daskpty.physics.noise_models`),
χ_jk = F⁻¹Ψ'_jk − ψ_jk. rPIE updates the object and the probe by

    O ← O + β_O · Σ_jk conj(S_f P_k) χ_jk / ((1 − α) Σ_jk |S_f P_k|² + α max Σ_jk |S_f P_k|²)
    P_k ← P_k + β_P · mean_j S_−f(conj(O_j) χ_jk / ((1 − α_P) |O_j|² + α_P max |O_j|²))

with the sums over the patterns of one round (one slice of every chunk, as AD's minibatches).
With one pattern per round these are Maiden's rPIE equations. With many, the object's numerators
and denominators are summed over the round's patterns before the division (the batched form of
Tike's rPIE), so that a large round takes an averaged step instead of the sum of its patterns'
steps and no step size needs tuning to the batch; the probe takes the mean of its patterns' rPIE
updates (as Pty-Chi's batched rPIE). All of these are sums, so a chunk returns them in a
:class:`~.partials.Partial` and any number of workers give the same result. α = 1 is ePIE (the
denominator becomes the illumination's maximum); α ∈ (0, 1) mixes in the local illumination.

Position refinement (:func:`refining_chunk_step`) takes LSQML's position shift: with
g_j = Σ_k conj(S_f P_k) χ_jk, already formed for the object, each pattern moves by
Re⟨∂_a O_j, g_j⟩ / ⟨|∂_a O_j|², Σ_k |S_f P_k|²⟩ along a = y, x, then through the machinery of
:mod:`.positions` that LSQML and AD share (momentum, step limit, affine fit, the windows'
deformation).

K slices and the near-field detector: 3PIE (Maiden, Humphry & Rodenburg, JOSA A 29, 1606,
2012) with rPIE's regularised denominators, one chunk step against the sample's forward model
(:mod:`.forward_model`). The exit wave's change Δψ_K = χ is carried back slice by slice,
k = K … 1: slice k's numerator Σ_m conj(φ_k) Δψ_k and denominator Σ_m |φ_k|², then
Δφ_k = conj(O_k) Δψ_k / ((1 − α_P)|O_k|² + α_P max|O_k|²) (rPIE's probe rule) and
Δψ_{k−1} = 𝒫ᴴ Δφ_k; Δφ_1, shifted back by −f, is the pattern's probe update. With K = 1 in the
far field this is rPIE above. The slices share the exit wave's correction: each slice's object
numerator is divided by K. Every slice's full step explains nearly the same χ (its low
frequencies above all), so together they overshoot K-fold: on a 2-slice electron scan
(tests/test_compose_runs.py's, 49 patterns, 4 rounds) rPIE with full steps diverged in epoch 4
(loss 2.7e3 → 6.7e6), with 1/K it fell monotonically (1982 after 12 epochs, one slice 2541).
Position refinement through the slices takes the exit wave's exact change per unit position
(:func:`daskpty.engines.multislice_positions.position_sums`).

The state is :class:`~.state.EngineState` (object, probe, epoch, illumination; the position
refinement's affine map and window sums; the extras LSQML adds for momentum stay None), so
checkpoints and results read it as they read LSQML's. No dask here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..physics import get_noise_model, get_xp, ifft2
from ..physics.backend import asarray_like
from ..physics.kernels import far_field_update
from .forward_model import THIN, ForwardModel
from .lsqml_epoch import close_epoch
from .partials import BoxedArray, Partial
from .position_sums import PositionSums, refining_step
from .positions import PositionOptions, accumulate_position_sums
from .state import EngineState

#: target bytes of one sub-batch's (b, M, n, n) complex64 exit waves
BLOCK_BYTES = 8 << 20


@dataclass(frozen=True)
class PIEOptions:
    """Settings of the PIE engines.

    alpha: rPIE's object regularisation α ∈ (0, 1] (Maiden et al. 2017 suggest 0.05–0.25);
        1 is ePIE. probe_alpha: the same for the probe.
    object_step, probe_step: β_O, β_P ∈ (0, 2), the step along each update (1: the full step).
    probe_start_epoch: first epoch whose rounds update the probe (None: never).
    noise: a noise model with a far-field correction (``gaussian``: the modulus projection of
        the PIE papers; ``poisson``).
    orthogonalize: SVD-orthogonalise the probe modes after each epoch.
    normalize_every: remove the object/probe scale ambiguity every this many epochs (0: never).
    eps: added where intensities are divided.
    """

    alpha: float = 0.1
    probe_alpha: float = 0.1
    object_step: float = 1.0
    probe_step: float = 1.0
    probe_start_epoch: int | None = 1
    noise: str = "gaussian"
    orthogonalize: bool = True
    normalize_every: int = 1
    eps: float = 1e-6

    def __post_init__(self):
        get_noise_model(self.noise, lsqml=True)
        for name in ("alpha", "probe_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in (0, 1] (1 is ePIE), got {getattr(self, name)}")
        for name in ("object_step", "probe_step"):
            if not 0 < getattr(self, name) < 2:
                raise ValueError(f"{name} must lie in (0, 2), got {getattr(self, name)}")
        if self.probe_start_epoch is not None and self.probe_start_epoch < 0:
            raise ValueError(f"probe_start_epoch must be >= 0 or None, got {self.probe_start_epoch}")
        if self.normalize_every < 0:
            raise ValueError(f"normalize_every must be >= 0, got {self.normalize_every}")


def updates_probe(state: EngineState, options: PIEOptions) -> bool:
    return options.probe_start_epoch is not None and state.epoch >= options.probe_start_epoch


def chunk_step(obj, probe, intensities, positions, *, options: PIEOptions, sample: ForwardModel = THIN,
               update_probe: bool = True, valid=None, position_terms: bool = False, window_sums: bool = False,
               reuse=None) -> Partial:
    """The rPIE / 3PIE sums of one chunk (or one round's slice of it) as an additive partial.

    obj (H, W) complex64 for one slice in the far field, else (K, H, W) (only the chunk's bounding
    box is read); probe (M, n, n) complex64; intensities (B, n, n) (far field: zero frequency at
    index 0; near field: as recorded); positions (B, 2) (y, x) in object pixels; ``sample`` the
    sample's :class:`~.forward_model.ForwardModel`; valid (n, n) bool or None. Boxes (h, w) or
    (K, h, w): ``object_num`` Σ conj(φ_k) Δψ_k, ``illumination`` Σ |φ_k|²; arrays (when
    ``update_probe``): ``probe_num`` (M, n, n), the sum of the patterns' probe updates
    S_−f Δφ_1; scalars: ``loss``, ``n``, ``sum_model``.

    ``position_terms``: also LSQML's position-shift sums of every pattern in
    ``local["shift_terms"]``, and with ``window_sums`` the windows' deformation sums in
    ``arrays`` (:class:`~.position_sums.PositionSums`; ``reuse``: an earlier epoch's carried sums
    through slices, :class:`~.multislice_positions.ReusedSums`).
    """
    n_patterns = intensities.shape[0]
    if n_patterns == 0:
        return Partial()
    c = sample.chunk(obj, probe, intensities, positions, block_bytes=BLOCK_BYTES)
    xp, n_slices = c.xp, c.n_slices
    valid = None if valid is None else asarray_like(valid, intensities)
    obj_num, illum = c.box(np.complex64), c.box(np.float32)
    spectra_sum = xp.zeros((c.n_modes, c.n, c.n), np.complex64) if update_probe else None
    loss = sum_model = 0.0
    sums = PositionSums(c, shifts=True, window=window_sums, reuse=reuse) if position_terms else None
    for batch in c.blocks:
        blk = c.forward(batch)
        y = xp.asarray(intensities[batch])
        delta, yhat, per_pattern = far_field_update(options.noise, blk.detected, y, valid, options.eps, overwrite=True)
        change = c.to_exit(blk, delta)                                     # Δψ_K = χ
        loss += float(per_pattern.sum())
        sum_model += float((yhat if valid is None else yhat * valid).sum(dtype=np.float64))
        if sums is not None and n_slices > 1:   # the shift sums take the exact gradients
            grads, lit, _ = c.vjp(blk, change)
            sums.add(blk, grads, lit)
        for k in range(n_slices - 1, -1, -1):
            g, power = c.slice_terms(blk, k, change)
            if sums is not None and n_slices == 1:
                sums.add(blk, [g], [power])
            c.index.scatter_add(c.slice_of(obj_num, k), g, batch)
            c.index.scatter_add(c.slice_of(illum, k), power, batch)
            if k == 0 and not update_probe:
                break
            change = c.back(blk, k, change, weight=_probe_weight(blk.patches[k], options.probe_alpha, xp))
        if update_probe:                    # Σ_j S_−f Δφ_1j: each pattern's update shifted back
            spectra_sum += c.entrance_spectra(blk, change).sum(axis=0)
    part = Partial(boxes={"object_num": BoxedArray(c.origin, obj_num), "illumination": BoxedArray(c.origin, illum)},
                   scalars={"loss": loss, "n": float(n_patterns), "sum_model": sum_model})
    if update_probe:
        part.arrays["probe_num"] = ifft2(spectra_sum).astype(np.complex64, copy=False)
    if sums is not None:
        part.local["shift_terms"], window = sums.finish(positions, obj_num if n_slices == 1 else None)
        if window is not None:
            part.arrays.update(window)
    if n_slices > 1:   # the slices share the exit wave's correction (module docstring)
        obj_num *= np.float32(1.0 / n_slices)
    return part


def _probe_weight(o, alpha: float, xp):
    """rPIE's probe weight conj(O_j) / ((1 − α)|O_j|² + α max|O_j|²) per pattern (b, n, n)."""
    power = o.real ** 2 + o.imag ** 2
    top = power.reshape(power.shape[0], -1).max(axis=1)[:, None, None]
    return xp.conj(o) / xp.maximum((1 - alpha) * power + alpha * top, np.float32(1e-30))


def refining_chunk_step(obj, probe, intensities, nominal, local: dict, *, options: PIEOptions,
                        positions: PositionOptions, epoch: int, affine=None, update_probe: bool = True,
                        valid=None, step=None, frame=None) -> Partial:
    """:func:`chunk_step` (or ``step``, bound to the sample's forward model) at the refined
    positions ``local["positions"]`` of these patterns, moving them by LSQML's shift with
    momentum from epoch ``positions.start_epoch`` on, exactly as
    :func:`daskpty.engines.lsqml.refining_chunk_step` does (:mod:`.positions`: the pull towards
    the last epoch's affine map and window correction, ``max_step``, kept inside the object,
    divergence check, the affine normal equations in the partial, ``local`` the new state)."""
    return refining_step(step or chunk_step, obj, probe, intensities, nominal, local, positions=positions,
                         epoch=epoch, affine=affine, frame=frame, options=options, update_probe=update_probe,
                         valid=valid)


def _regularised(den, alpha: float, top=None):
    """(1 − α) D + α max D, the rPIE denominator (floored so that an unlit pixel divides by > 0);
    for K slices (K, h, w) the maximum of each slice. ``top``: max D over the whole object when
    ``den`` covers a tile of it (:mod:`daskpty.execution.tile_numbers`)."""
    if den.ndim == 3:
        top = (den.reshape(den.shape[0], -1).max(axis=1) if top is None
               else get_xp(den).asarray(top, dtype=np.float32))[:, None, None]
        out = (1.0 - alpha) * den + alpha * top
        return get_xp(den).maximum(out, np.float32(1e-12) * get_xp(den).maximum(top, np.float32(1e-30)))
    top = float(den.max()) if top is None else float(top)
    out = (1.0 - alpha) * den + alpha * top
    return get_xp(den).maximum(out, 1e-12 * max(top, 1e-30))


def apply(state: EngineState, total: Partial, options: PIEOptions, illumination_max=None) -> EngineState:
    """Add a round's reduced sums to the state (new arrays; the old state's stay untouched), and
    the positions' affine and window sums to the epoch's. The object is (H, W) or (K, H, W)
    with (K, h, w) boxes (each slice its own denominator).
    ``illumination_max``: the round's largest illumination over the whole object (per slice),
    when the state holds a tile of it."""
    accumulate_position_sums(state, total)
    if "object_num" not in total.boxes:
        return state
    xp = get_xp(state.object)
    num, illum = total.boxes["object_num"], total.boxes["illumination"]
    obj = state.object.copy()
    step = num.data * (np.float32(options.object_step)
                       / _regularised(illum.data, options.alpha, illumination_max)).astype(np.float32)
    BoxedArray(num.offset, step).add_into(obj)
    probe = state.probe
    if "probe_num" in total.arrays:
        step = np.float32(options.probe_step / total.scalars["n"])
        probe = (probe + step * total.arrays["probe_num"]).astype(np.complex64)
    full = xp.zeros(obj.shape, np.float32) if state.illumination is None else state.illumination.copy()
    (y0, x0), (y1, x1) = illum.offset, illum.stop
    xp.maximum(full[..., y0:y1, x0:x1], illum.data, out=full[..., y0:y1, x0:x1])
    state.object, state.probe, state.illumination = obj, probe, full
    return state


def begin_epoch(state: EngineState, options: PIEOptions) -> EngineState:
    """A new epoch's illumination is the largest of its rounds' (reset here), as are the
    positions' affine sums."""
    state.illumination = None
    state.affine_sums = None
    return state


def end_epoch(state: EngineState, options: PIEOptions, scales=None) -> EngineState:
    """Probe-mode orthogonalisation and scale-ambiguity removal, as LSQML's epoch end (a
    (K, H, W) object's scale slice by slice; ``scales`` from outside on a tile)."""
    return close_epoch(state, options, scales)
