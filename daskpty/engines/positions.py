"""Position refinement: per-pattern position updates and the epoch's hooks.

Pure functions on NumPy arrays (positions are a few numbers per pattern: they stay on the host
even on GPU workers). Per pattern the chunk step of an engine proposes a shift; this module
limits it, applies momentum (LSQML) or an optimiser (AD), keeps every window inside the object,
and detects divergence. Globally, the refined positions are pulled towards the best affine map
of the nominal ones (scale, rotation, shear, translation): its normal equations are additive
sums over patterns (:func:`affine_sums`), so they ride the tree reduce with the other partial
sums; the state solves them once per epoch (:func:`solve_affine`).

Conventions (design.md): positions (y, x) in object pixels; a position moving by +d moves its
window by +d over the object. The per-pattern state of one chunk (:func:`initial_local`) is a
dict of (B, 2) float64 arrays: ``positions`` (refined), ``velocity`` (momentum memory) and, for
Adam, ``moment2``.

The options live in :mod:`daskpty.engines.position_options`, the affine and window fits in
:mod:`daskpty.engines.position_fits`; both are re-exported here, the engines' one entry point.
"""
from __future__ import annotations

import numpy as np

from ..physics.backend import to_numpy
from .position_fits import (  # noqa: F401  (re-exported)
    WINDOW_KEYS,
    accumulate_affine,
    accumulate_position_sums,
    accumulate_window,
    affine_boost,
    affine_parameters,
    affine_sums,
    epoch_rms_move,
    fit_affine,
    fit_window,
    mapped,
    mapped_affine,
    misfit_rose,
    move_to_affine,
    solve_affine,
    solve_window_deformation,
    window_correction,
    window_parameters,
)
from .position_options import (  # noqa: F401  (re-exported)
    AUTO_EARLIEST,
    AUTO_LATEST,
    AUTO_START,
    LOSS_SETTLED,
    LOSS_SETTLED_HELD_SCALE,
    OPTIMIZERS,
    PROBE_SETTLED,
    PositionOptions,
    PositionsDiverged,
)


def initial_local(nominal, options: PositionOptions, gradient_based: bool = False) -> dict:
    """The per-pattern state of one chunk before its first refinement step; a gradient-based
    engine (``EngineSpec.gradient_based``) steps positions with ``options.optimizer``, and Adam
    keeps a second moment."""
    nominal = np.asarray(nominal, dtype=np.float64)
    local = {"positions": nominal.copy(), "velocity": np.zeros_like(nominal)}
    if gradient_based and options.optimizer == "adam":
        local["moment2"] = np.zeros_like(nominal)
    return local


def central_gradients(box, xp):
    """(∂_y O, ∂_x O) of an object box by central differences (one-sided at the edges)."""
    dy = xp.empty_like(box)
    dx = xp.empty_like(box)
    half = np.float32(0.5)
    xp.subtract(box[2:], box[:-2], out=dy[1:-1])
    dy[1:-1] *= half
    dy[0] = box[1] - box[0]
    dy[-1] = box[-1] - box[-2]
    xp.subtract(box[:, 2:], box[:, :-2], out=dx[:, 1:-1])
    dx[:, 1:-1] *= half
    dx[:, 0] = box[:, 1] - box[:, 0]
    dx[:, -1] = box[:, -1] - box[:, -2]
    return dy, dx


def lsqml_shift(numerator, denominator, tikhonov: float = 1e-3):
    """Δr_a = Re Σ conj(P ∂_a O) χ / Σ |P ∂_a O|² per pattern and axis, (B, 2) float64; the
    denominator is regularised by ``tikhonov`` times its chunk mean (flat patches do not move)."""
    numerator = np.asarray(numerator, dtype=np.float64)
    denominator = np.asarray(denominator, dtype=np.float64)
    floor = tikhonov * denominator.mean(axis=0, keepdims=True) + 1e-30
    return numerator / (denominator + floor)


def noise_limited(shift, denominator, residual_power, n_pixels: int, threshold: float) -> np.ndarray:
    """The LSQML ``shift`` (B, 2) shrunk towards zero by ``threshold`` times its own noise level:
    were pattern j's exit-wave update χ_j white noise of its power ``residual_power[j]``
    (Σ |χ_j|² over its ``n_pixels`` pixels and modes), the shift's numerator would scatter by
    about √(den · Σ|χ_j|² / n_pixels), the shift by that over ``denominator``. A shift within
    its scatter is not taken (on exact positions every shift is noise, and momentum adds it up);
    a larger one loses the scatter (a soft threshold) and keeps its direction."""
    shift = np.asarray(shift, np.float64)
    if not threshold or residual_power is None:
        return shift
    den = np.asarray(denominator, np.float64)
    power = np.asarray(residual_power, np.float64).reshape(-1, 1) / max(int(n_pixels), 1)
    scatter = threshold * np.sqrt(den * power) / (den + 1e-30)
    return np.sign(shift) * np.maximum(np.abs(shift) - scatter, 0.0)


def step_with_momentum(local: dict, shift, options: PositionOptions) -> tuple[dict, np.ndarray]:
    """LSQML: velocity ← momentum · velocity + shift; position += velocity, each axis limited to
    ``max_step``. Returns the new arrays and the applied step."""
    velocity = options.momentum * local["velocity"] + np.asarray(shift, dtype=np.float64)
    step = np.clip(velocity, -options.max_step, options.max_step)
    return {"positions": local["positions"] + step, "velocity": step}, step


def noise_gate(grad, noise, threshold: float) -> np.ndarray:
    """AD: the fraction (B, 2) of each pattern's optimiser step to take, from its (mean) loss
    gradient ``grad`` and that gradient's scatter ``noise`` (both (B, 2)):
    max(|g| − threshold·σ, 0) / |g|. A gradient within its scatter moves nothing; a strong one
    is taken nearly whole. Adam's steps are about ``lr`` whatever the gradient's size, so
    without it every pattern of an exact scan jumps ~``max_step`` when refinement starts (the
    loss rose 3.2× in that epoch, small preset) and keeps jittering by the noise's direction."""
    grad = np.abs(np.asarray(grad, np.float64))
    if noise is None or not threshold:
        return np.ones_like(grad)
    kept = np.maximum(grad - threshold * np.asarray(noise, np.float64), 0.0)
    return np.divide(kept, grad, out=np.zeros_like(grad), where=grad > 0)


def typical_scatter(noise) -> np.ndarray:
    """Each pattern's gradient scatter (B, 2), at most the median of the B patterns': the scatter
    is estimated from the pattern's own residual as if it were noise, and a pattern far off its
    position has a large residual that is signal (small preset, 1.4 px random errors: the own
    scatter left a few patterns 1.7–2.2 px off)."""
    noise = np.asarray(noise, np.float64)
    return np.minimum(noise, np.median(noise, axis=0)) if len(noise) else noise


def mean_scatter(noise, beta: float, t: int) -> np.ndarray:
    """The scatter of Adam's bias-corrected mean m̂_t = (1 − β) Σ_i β^(t−i) g_i / (1 − β^t) of t
    independent draws of scatter ``noise``: σ √((1 − β)(1 − β^2t) / ((1 + β)(1 − β^t)²)) — σ at
    the first step, 0.23 σ after many (β = 0.9)."""
    factor = (1 - beta) * (1 - beta ** (2 * t)) / ((1 + beta) * (1 - beta ** t) ** 2)
    return np.asarray(noise, np.float64) * np.sqrt(factor)


def step_with_optimizer(local: dict, grad, options: PositionOptions, t: int, noise=None) -> tuple[dict, np.ndarray]:
    """AD: one optimiser step against the loss gradient ``grad`` (B, 2); ``t`` (≥ 1) counts the
    steps so far (the same for every pattern: each is visited once per epoch). ``noise``: the
    gradient's scatter σ (B, 2) were the pattern's residual noise, which shrinks the step by
    ``noise_threshold`` (:func:`noise_gate`): Adam's by its mean gradient m̂ against m̂'s own
    scatter (:func:`mean_scatter`), so a pull that persists over the epochs passes once it stands
    out of the averaged noise and a noise draw does not; momentum's by the gradient."""
    grad = np.asarray(grad, dtype=np.float64)
    noise = None if noise is None else typical_scatter(noise)
    new = dict(local)
    if options.optimizer == "adam":
        b1, b2 = 0.9, 0.999
        m = b1 * local["velocity"] + (1 - b1) * grad
        v = b2 * local["moment2"] + (1 - b2) * grad * grad
        m_hat = m / (1 - b1 ** t)
        step = -options.lr * m_hat / (np.sqrt(v / (1 - b2 ** t)) + 1e-12)
        gate = noise_gate(m_hat, None if noise is None else mean_scatter(noise, b1, t), options.noise_threshold)
        new["velocity"], new["moment2"] = m, v
    else:
        velocity = options.momentum * local["velocity"] - options.lr * grad
        step = velocity
        gate = noise_gate(grad, noise, options.noise_threshold)
        new["velocity"] = velocity
    step = np.clip(step * gate, -options.max_step, options.max_step)
    new["positions"] = local["positions"] + step
    return new, step


def keep_inside(positions, n: int, object_shape) -> np.ndarray:
    """Clip positions so that every window stays inside the object (corner ≥ 0, end ≤ shape)."""
    lo = n / 2.0
    hi = np.array(object_shape[-2:], dtype=np.float64) - n / 2.0
    return np.clip(positions, lo, hi)


def check_displacement(refined, nominal, limit: float, epoch: int) -> None:
    """Raise :class:`PositionsDiverged` when positions are non-finite or drift beyond ``limit``."""
    refined = np.asarray(refined)
    bad = ~np.isfinite(refined).all(axis=1)
    distance = np.hypot(*(refined - nominal).T)
    far = distance > limit
    if bad.any() or far.any():
        count = int((bad | far).sum())
        worst = float(np.nanmax(np.where(bad, np.inf, distance)))
        raise PositionsDiverged(
            f"position refinement diverged in epoch {epoch + 1}: {count} pattern(s) moved "
            f"{'to NaN/inf' if bad.any() else f'up to {worst:.1f} px'} from their nominal positions "
            f"(limit {limit:g} px); start refinement later (start_epoch), lower max_step or lr, "
            f"or raise max_displacement if the scan really is that far off")


# --- the parts every engine's refining chunk step shares -------------------------------------

def positions_for_step(local: dict, nominal, affine, options: PositionOptions, epoch: int, n: int,
                       object_shape) -> np.ndarray:
    """The positions a chunk step uses: the refined ones, moved by the last epoch's window
    correction and affine map (``affine``: ``(fit, boost[, window])`` or None, any of them
    None) once refinement is active."""
    refined = local["positions"]
    if not options.active(epoch) or affine is None:
        return refined
    fit, boost, window = (tuple(affine) + (None,))[:3]
    if window is not None:                 # the scan's correction from the window deformation
        refined = mapped(refined, window)
    if fit is not None and options.affine:
        refined = move_to_affine(refined, nominal, fit, boost, options.affine_blend)
    return keep_inside(refined, n, object_shape)


def finish_step(part, new: dict, used, nominal, options: PositionOptions, epoch: int, n: int, object_shape):
    """Complete a refining chunk step's partial from the patterns' new per-pattern state ``new``:
    positions kept inside the object and checked for divergence, the affine normal equations
    (additive), ``position_update_sq`` / ``position_refined`` and ``part.local = new``."""
    new["positions"] = keep_inside(new["positions"], n, object_shape)
    check_displacement(new["positions"], nominal, options.displacement_limit(n), epoch)
    part.arrays.update(affine_sums(nominal, new["positions"]))
    part.scalars["position_update_sq"] = float(np.square(new["positions"] - used).sum())
    part.scalars["position_refined"] = float(len(used))
    part.local = new
    return part


def probe_change(before, after) -> float:
    """‖after − before‖ / ‖after‖ over all probe modes (host float)."""
    after = np.asarray(to_numpy(after))
    scale = float(np.linalg.norm(after))
    return float(np.linalg.norm(after - np.asarray(to_numpy(before)))) / scale if scale > 0 else float("inf")


def decide_start(epoch: int, change: float, fall: float = 0.0, loss_settled: float = LOSS_SETTLED,
                 probe_settled: float = PROBE_SETTLED) -> int | None:
    """After epoch ``epoch`` ended with the probe's relative change ``change`` and the loss's
    relative fall ``fall`` over the epoch before: the start epoch of an ``"auto"`` refinement
    (the next epoch, once the probe changes by at most ``probe_settled`` and the loss by at most
    ``loss_settled`` (:meth:`PositionOptions.probe_settled`, :meth:`PositionOptions.loss_settled`),
    or by :data:`AUTO_LATEST`), or None (not yet)."""
    settled = change <= probe_settled and abs(fall) <= loss_settled
    if epoch + 1 >= AUTO_LATEST or (settled and epoch + 1 >= AUTO_EARLIEST):
        return epoch + 1
    return None


def note_epoch_start(state, options: PositionOptions) -> None:
    """Start of an epoch, both engines: keep the probe for ``"auto"``'s start rule while
    undecided, and the last epoch's loss (``previous_loss``; the new one's sums from zero) for
    that rule and the affine boost's (:func:`~.position_fits.fit_affine`)."""
    state.previous_loss, state.epoch_loss = getattr(state, "epoch_loss", None), 0.0
    state.epoch_moves = np.zeros(2)
    if options.start_epoch == AUTO_START and state.positions_start is None:
        state.epoch_start_probe = np.array(to_numpy(state.probe), copy=True)


def start_parameters(state) -> dict:
    """The start epoch ``"auto"`` decided, for the epoch's history entry (empty while undecided)."""
    return {} if state.positions_start is None else {"position_start_epoch": int(state.positions_start)}


def start_arrays(state) -> dict:
    """For a checkpoint: the decided start epoch (``positions_start``, 0-d int64), the last
    epoch's loss (``positions_loss``, 0-d float64), whether the affine boost is held
    (``affine_held``, 0-d int8) and whether the noise gate has opened (``gate_open``, 0-d int8),
    those that are set."""
    out = {} if state.positions_start is None else {"positions_start": np.asarray(state.positions_start, np.int64)}
    if getattr(state, "epoch_loss", None) is not None:
        out["positions_loss"] = np.asarray(state.epoch_loss, np.float64)
    if getattr(state, "affine_held", False):
        out["affine_held"] = np.asarray(1, np.int8)
    if getattr(state, "gate_open", False):
        out["gate_open"] = np.asarray(1, np.int8)
    return out


def start_from_arrays(arrays: dict | None) -> int | None:
    """Inverse of :func:`start_arrays` for the start epoch (the rest: :func:`restore_rules`)."""
    value = (arrays or {}).get("positions_start")
    return None if value is None else int(np.asarray(value))


def restore_rules(state, arrays: dict | None):
    """Into a resumed ``state``: the last epoch's loss, the affine boost's hold and the noise
    gate's opening of :func:`start_arrays`. Returns the state."""
    arrays = arrays or {}
    if "positions_loss" in arrays:
        state.epoch_loss = float(np.asarray(arrays["positions_loss"]))
    if "affine_held" in arrays:
        state.affine_held = bool(np.asarray(arrays["affine_held"]))
    if "gate_open" in arrays:
        state.gate_open = bool(np.asarray(arrays["gate_open"]))
    return state


def finish_epoch(state, options: PositionOptions, move_object) -> None:
    """End of a refining epoch, both engines: the windows' correction of the next epoch
    (:func:`fit_window`; ``move_object(state, matrix, offset)`` resamples the engine's object
    and its memory with it), then the affine fit (:func:`fit_affine`), which leaves out the
    window correction this epoch applied. The global moves are proposals the data must accept:
    once an epoch that took one (a window correction or an affine boost) ends with a higher
    misfit than the epoch before, ``state.affine_held`` stops the affine boost and the
    correction's scale and shear for the rest of the run. An epoch whose patterns moved by more
    than ``gate_release`` rms opens the noise gate for the rest of the run (``state.gate_open``)."""
    options = options.for_state(state)
    if options.gate_release and epoch_rms_move(state) > options.gate_release:
        state.gate_open = True        # the scan has errors: the noise gate opens for the rest of the run
    applied = state.window_map if options.active(state.epoch) else None
    if applied is not None or state.affine_boost is not None:
        state.affine_held = getattr(state, "affine_held", False) or misfit_rose(state)
    warp = fit_window(state, options)
    if warp is not None:
        move_object(state, *warp)
    fit_affine(state, options, window=applied)


def settle_start(state, options: PositionOptions) -> None:
    """After the engine's end of an epoch (``state.epoch`` already the next one's index, its probe
    orthonormalised and rescaled as every epoch's is), ``"auto"`` only: start refinement in the
    next epoch when the probe has settled over the one that ended (:func:`decide_start`)."""
    if options.start_epoch != AUTO_START or state.positions_start is not None or state.epoch_start_probe is None:
        return
    loss, previous = getattr(state, "epoch_loss", None), getattr(state, "previous_loss", None)
    fall = 0.0 if loss is None else np.inf if not previous else (previous - loss) / previous
    obj = state.object
    slices = int(obj.shape[0]) if getattr(obj, "ndim", 2) == 3 else 1
    state.positions_start = decide_start(state.epoch - 1, probe_change(state.epoch_start_probe, state.probe), fall,
                                         options.loss_settled(slices), options.probe_settled(slices))
    state.epoch_start_probe = None


def step_maps(state) -> tuple | None:
    """What a refining chunk step needs of the last epoch's fits, for every engine's payload:
    ``(affine, affine_boost, window_map)``, or None before any."""
    if state.affine is None and state.window_map is None:
        return None
    return (state.affine, state.affine_boost, state.window_map)


def epoch_parameters(state) -> dict:
    """The fitted affine map's, the windows' deformation and the decided start epoch, for every
    engine's history entry."""
    out = {} if state.affine is None else affine_parameters(state.affine)
    return {**out, **window_parameters(state.window_deformation), **start_parameters(state)}

