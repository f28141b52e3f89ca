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
deformation). K slices and the near-field detector: :mod:`.pie_multislice` (3PIE).

The state is :class:`~.lsqml.LSQMLState` (object, probe, epoch, illumination; the position
refinement's affine map and window sums; the extras LSQML adds for momentum stay None), so
checkpoints and results read it as they read LSQML's. No dask here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..physics import fft2, get_noise_model, get_xp, ifft2
from ..physics.backend import asarray_like, channel_dots, real_dots, to_numpy
from ..physics.kernels import far_field_update
from ..physics.patches import PatchIndex
from ..physics.shifts import shift_ramps, split_positions
from .lsqml import LSQMLState, close_epoch
from .partials import BoxedArray, Partial
from .tile_frame import step_positions, whole_shape
from .positions import (PositionOptions, accumulate_affine, accumulate_window, central_gradients, finish_step,
                        lsqml_shift, positions_for_step, step_with_momentum)
from .window_deformation import WindowDeformation, squared_gradients, wants_window_sums
from .multislice_positions import keep_ratios, reused_sums

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


def updates_probe(state: LSQMLState, options: PIEOptions) -> bool:
    return options.probe_start_epoch is not None and state.epoch >= options.probe_start_epoch


def chunk_step(obj, probe, intensities, positions, *, options: PIEOptions, update_probe: bool = True,
               valid=None, position_terms: bool = False, window_sums: bool = False) -> Partial:
    """The rPIE sums of one chunk (or one round's slice of it) as an additive partial.

    obj (H, W) complex64 (only the chunk's bounding box is read), probe (M, n, n) complex64,
    intensities (B, n, n) with the zero frequency at index 0, positions (B, 2) (y, x) in object
    pixels, valid (n, n) bool or None. Boxes: ``object_num`` Σ conj(S_f P) χ, ``illumination``
    Σ |S_f P|²; arrays (when ``update_probe``): ``probe_num`` (M, n, n), the sum of the patterns'
    rPIE probe updates S_−f(conj(O_j) χ_j / ((1 − α_P)|O_j|² + α_P max|O_j|²)); scalars: ``loss``,
    ``n``, ``sum_model``.

    ``position_terms``: also LSQML's position-shift sums of every pattern in
    ``local["shift_terms"]`` ((B, 2) each: Re⟨∂_a O_j, g_j⟩ and ⟨|∂_a O_j|², Σ_k |S_f P_k|²⟩, ∂_a O
    by central differences on the box), and with ``window_sums`` the windows' deformation sums
    (:class:`~.window_deformation.WindowDeformation`) in ``arrays``, as
    :func:`daskpty.engines.lsqml.chunk_step` forms them.
    """
    xp = get_xp(intensities)
    n_patterns, n = intensities.shape[0], probe.shape[-1]
    if n_patterns == 0:
        return Partial()
    corners, fractions = split_positions(to_numpy(positions), n)
    box0, box1 = corners.min(axis=0), corners.max(axis=0) + n
    obj_box = xp.ascontiguousarray(asarray_like(obj[box0[0]:box1[0], box0[1]:box1[1]], intensities),
                                   dtype=np.complex64)
    probe = asarray_like(probe, intensities).astype(np.complex64, copy=False)
    n_modes = probe.shape[0]
    valid = None if valid is None else asarray_like(valid, intensities)
    index = PatchIndex(corners - box0, n, obj_box.shape, xp)
    probe_ft = fft2(probe)
    step = max(1, min(n_patterns, BLOCK_BYTES // (8 * n_modes * n * n)))
    obj_num = xp.zeros(obj_box.shape, np.complex64)
    illum = xp.zeros(obj_box.shape, np.float32)
    probe_num = xp.zeros((n_modes, n, n), np.complex64) if update_probe else None
    loss = sum_model = 0.0
    if position_terms:
        box_d = central_gradients(obj_box, xp)
        box_squares = squared_gradients(box_d, xp)               # |∂_y O|² + i |∂_x O|²
        shift_num, shift_den = np.empty((n_patterns, 2)), np.empty((n_patterns, 2))
        deform = WindowDeformation(n, xp, box_d) if window_sums else None
    for s in range(0, n_patterns, step):
        batch = slice(s, min(s + step, n_patterns))
        ramps = shift_ramps(fractions[batch], n, xp)                       # (b, n, n)
        shifted = ifft2(ramps[:, None] * probe_ft[None], overwrite=True).astype(np.complex64, copy=False)
        o = index.extract(obj_box, batch)                                  # (b, n, n)
        far = fft2(shifted * o[:, None], overwrite=True)                   # Ψ = F(S_f P · O_j)
        y = xp.asarray(intensities[batch])
        delta, yhat, per_pattern = far_field_update(options.noise, far, y, valid, options.eps, overwrite=True)
        chi = ifft2(delta, overwrite=True)                                 # χ = F⁻¹(Ψ' − Ψ)
        loss += float(per_pattern.sum())
        sum_model += float((yhat if valid is None else yhat * valid).sum(dtype=np.float64))
        g = (xp.conj(shifted) * chi).sum(axis=1)                          # g_j = Σ_k conj(S_f P_k) χ_jk
        power = (shifted.real ** 2 + shifted.imag ** 2).sum(axis=1).astype(np.float32, copy=False)
        if position_terms:
            grads = [xp.ascontiguousarray(index.extract(box_d[a], batch)) for a in range(2)]
            for a, d in enumerate(grads):
                shift_num[batch, a] = to_numpy(real_dots(d, g))
            squares = xp.ascontiguousarray(index.extract(box_squares, batch))
            shift_den[batch] = to_numpy(channel_dots(power, squares))
            if deform is not None:
                deform.add_gram(batch, power, grads, squares)
        index.scatter_add(obj_num, g, batch)
        index.scatter_add(illum, power, batch)
        if update_probe:
            o_power = o.real ** 2 + o.imag ** 2
            top = o_power.reshape(o_power.shape[0], -1).max(axis=1)[:, None, None]
            weight = xp.conj(o) / xp.maximum((1 - options.probe_alpha) * o_power + options.probe_alpha * top,
                                             np.float32(1e-30))
            spectra = fft2(weight[:, None] * chi, overwrite=True)          # undo each pattern's shift
            spectra *= xp.conj(ramps)[:, None]
            probe_num += ifft2(spectra.sum(axis=0)).astype(np.complex64, copy=False)
    offset = (int(box0[0]), int(box0[1]))
    part = Partial(boxes={"object_num": BoxedArray(offset, obj_num), "illumination": BoxedArray(offset, illum)},
                   scalars={"loss": loss, "n": float(n_patterns), "sum_model": sum_model})
    if update_probe:
        part.arrays["probe_num"] = probe_num
    if position_terms:
        part.local["shift_terms"] = (shift_num, shift_den)
        if deform is not None:              # b from Σ_j g_j on the box (obj_num, not yet divided)
            deform.add_first(obj_num, index.corners, shift_num)
            part.arrays.update(deform.sums(positions))
    return part


def refining_chunk_step(obj, probe, intensities, nominal, local: dict, *, options: PIEOptions,
                        positions: PositionOptions, epoch: int, affine=None, update_probe: bool = True,
                        valid=None, step=None, frame=None) -> Partial:
    """:func:`chunk_step` (or ``step``, the sample's: :mod:`.pie_multislice`) at the refined
    positions ``local["positions"]`` of these patterns, moving them by LSQML's shift with
    momentum from epoch ``positions.start_epoch`` on, exactly as
    :func:`daskpty.engines.lsqml.refining_chunk_step` does (:mod:`.positions`: the pull towards
    the last epoch's affine map and window correction, ``max_step``, kept inside the object,
    divergence check, the affine normal equations in the partial, ``local`` the new state)."""
    n = probe.shape[-1]
    shape = whole_shape(obj, frame)       # (a tile's frame: the whole object's)
    refined = positions_for_step(local, nominal, affine, positions, epoch, n, shape)
    active = positions.active(epoch)
    reuse = reused_sums(local, positions, epoch) if active else None
    part = (step or chunk_step)(obj, probe, intensities, step_positions(refined, frame, n, obj), options=options, update_probe=update_probe,
                                valid=valid, position_terms=active, window_sums=wants_window_sums(positions, epoch),
                                **({} if reuse is None else {"reuse": reuse}))
    if frame is not None:
        frame.sums_to_object(part)
    if not active or not part.scalars:
        part.local = {}
        return part
    terms = part.local.pop("shift_terms")
    shift = positions.gain * lsqml_shift(terms[0], terms[1], positions.regularization)
    new, _ = step_with_momentum({**local, "positions": refined}, shift, positions)
    keep_ratios(terms, new, local)
    return finish_step(part, new, refined, nominal, positions, epoch, n, shape)


def _regularised(den, alpha: float, top=None):
    """(1 − α) D + α max D, the rPIE denominator (floored so that an unlit pixel divides by > 0);
    for K slices (K, h, w) the maximum of each slice. ``top``: max D over the whole object when
    ``den`` covers a tile of it (:mod:`.pie_tiles`)."""
    if den.ndim == 3:
        top = (den.reshape(den.shape[0], -1).max(axis=1) if top is None
               else get_xp(den).asarray(top, dtype=np.float32))[:, None, None]
        out = (1.0 - alpha) * den + alpha * top
        return get_xp(den).maximum(out, np.float32(1e-12) * get_xp(den).maximum(top, np.float32(1e-30)))
    top = float(den.max()) if top is None else float(top)
    out = (1.0 - alpha) * den + alpha * top
    return get_xp(den).maximum(out, 1e-12 * max(top, 1e-30))


def apply(state: LSQMLState, total: Partial, options: PIEOptions, illumination_max=None) -> LSQMLState:
    """Add a round's reduced sums to the state (new arrays; the old state's stay untouched), and
    the positions' affine and window sums to the epoch's. The object is (H, W) or, from
    :mod:`.pie_multislice`, (K, H, W) with (K, h, w) boxes (each slice its own denominator).
    ``illumination_max``: the round's largest illumination over the whole object (per slice),
    when the state holds a tile of it."""
    accumulate_affine(state, total)
    accumulate_window(state, total)
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


def begin_epoch(state: LSQMLState, options: PIEOptions) -> LSQMLState:
    """A new epoch's illumination is the largest of its rounds' (reset here), as are the
    positions' affine sums."""
    state.illumination = None
    state.affine_sums = None
    return state


def end_epoch(state: LSQMLState, options: PIEOptions) -> LSQMLState:
    """Probe-mode orthogonalisation and scale-ambiguity removal, as LSQML's epoch end."""
    return close_epoch(state, options)
