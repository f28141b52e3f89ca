"""Position refinement's global fits, both engines: the affine map of the nominal positions the
refined ones are pulled towards (its normal equations are additive sums over patterns,
:func:`affine_sums`, that ride the tree reduce; the state solves them once per epoch,
:func:`solve_affine` / :func:`fit_affine`), and the scan's global deformation as seen inside the
windows (:func:`fit_window`, from the sums of
:class:`~daskpty.engines.window_deformation.WindowDeformation`). Pure NumPy on the host."""
from __future__ import annotations

import numpy as np

from .position_options import PositionOptions


# --- the affine constraint -------------------------------------------------------------------

def _design(nominal):
    nominal = np.asarray(nominal, dtype=np.float64)
    return np.concatenate([nominal, np.ones((len(nominal), 1))], axis=1)  # rows (y, x, 1)


def mapped(points, matrix) -> np.ndarray:
    """[points, 1] · ``matrix`` (3, 2) for (B, 2) points, float64, element by element: the same
    bits wherever the points' memory lies (a BLAS product's may change with its alignment, and a
    resumed run's positions are read into other memory than the run's own)."""
    p, m = np.asarray(points, np.float64), np.asarray(matrix, np.float64)
    return p[:, :1] * m[0] + p[:, 1:2] * m[1] + m[2]


def affine_sums(nominal, refined) -> dict:
    """Normal equations of refined ≈ [nominal, 1] · A for these patterns: ``{"affine_xtx":
    (3, 3), "affine_xty": (3, 2)}`` float64 sums, additive over chunks; plus the sums of the
    nominal and refined positions (for drift removal) inside ``affine_xty``'s design column."""
    x = _design(nominal)
    return {"affine_xtx": x.T @ x, "affine_xty": x.T @ np.asarray(refined, dtype=np.float64)}


def solve_affine(xtx, xty, remove_drift: bool = False) -> np.ndarray | None:
    """The affine map A (3, 2) with refined ≈ [y, x, 1] · A, least squares over all patterns, or
    None when the system is singular (fewer than three non-collinear positions). With
    ``remove_drift`` its translation makes the mapped nominal centroid stay where it was."""
    xtx = np.asarray(xtx, dtype=np.float64)
    if xtx[2, 2] < 3 or np.linalg.cond(xtx) > 1e12:
        return None
    a = np.linalg.solve(xtx, np.asarray(xty, dtype=np.float64))
    if remove_drift:
        centroid = xtx[2, :2] / xtx[2, 2]           # mean nominal position
        mapped = centroid @ a[:2] + a[2]
        a = a.copy()
        a[2] += centroid - mapped
    return a


def affine_boost(previous, previous_boost, fitted, gain: float, window=None) -> np.ndarray | None:
    """The extra affine move of the next epoch: ``gain − 1`` times the change of the fitted map
    over the last epoch that the refinement made by itself: without the previous boost, and
    without the epoch's window correction ``window`` (3, 2) (both moved the positions by design;
    boosted again they would feed back on themselves, and a boosted window correction moves the
    positions without the object, which the windows then see as a new deformation)."""
    if gain is None:
        raise ValueError("affine_gain is unset: resolve the options first (PositionOptions.for_engine)")
    if previous is None or gain == 1:
        return None
    expected = previous if window is None else mapped_affine(previous, window)
    natural = fitted - expected - (0 if previous_boost is None else previous_boost)
    return (gain - 1) * natural


def mapped_affine(affine, window) -> np.ndarray:
    """The affine map of positions [r, 1] · A after they move by [r, 1] · W: A W[:2], plus W[2]
    on the translation row."""
    affine, window = np.asarray(affine, np.float64), np.asarray(window, np.float64)
    out = affine @ window[:2]
    out[2] += window[2]
    return out


def move_to_affine(refined, nominal, affine, boost, blend: float) -> np.ndarray:
    """Positions moved by the affine ``boost`` (the same map for every pattern), then ``blend``
    of the way to the (boosted) affine map of the nominal ones."""
    if boost is not None:
        refined = refined + mapped(nominal, boost)
        affine = affine + boost
    if blend:
        refined = refined + blend * (mapped(nominal, affine) - refined)
    return refined


def affine_parameters(affine) -> dict:
    """Readable parameters of A: scale and rotation per axis, shear, translation (for history).

    The linear part M = A[:2].T maps nominal (y, x) to refined; scale_y/scale_x are the norms of
    its columns, rotation the angle of the x column (degrees), shear the cosine of the angle
    between the columns' directions minus a right angle (0 for a similarity)."""
    m = np.asarray(affine[:2]).T
    col_y, col_x = m[:, 0], m[:, 1]
    sy, sx = float(np.linalg.norm(col_y)), float(np.linalg.norm(col_x))
    rotation = float(np.degrees(np.arctan2(col_x[0], col_x[1])))
    shear = float(col_y @ col_x / (sy * sx)) if sy > 0 and sx > 0 else 0.0
    return {"affine_scale_y": sy, "affine_scale_x": sx, "affine_rotation_deg": rotation,
            "affine_shear": shear, "affine_shift_y": float(affine[2, 0]), "affine_shift_x": float(affine[2, 1])}


def accumulate_position_sums(state, total) -> None:
    """Every engine's ``apply``: a round's loss, position moves, affine normal equations and
    window-deformation sums added to the epoch's (:func:`accumulate_affine`, :func:`accumulate_window`)."""
    accumulate_affine(state, total)
    accumulate_window(state, total)


def accumulate_affine(state, total) -> None:
    """``apply``: add a round's affine normal equations to the state's sums of the epoch (a new
    dict: copies of a state share the old one), and its loss and position moves to the epoch's
    (``epoch_loss``, ``epoch_moves``, once :func:`~.positions.note_epoch_start` has started them)."""
    if getattr(state, "epoch_loss", None) is not None:     # the epoch's misfit (start and boost rules)
        state.epoch_loss += float(total.scalars.get("loss", 0.0))
        moves = getattr(state, "epoch_moves", None)      # Σ |move|², count of the epoch (scale_waits)
        state.epoch_moves = (np.zeros(2) if moves is None else moves) + np.array(
            [total.scalars.get("position_update_sq", 0.0), total.scalars.get("position_refined", 0.0)])
    if "affine_xtx" in total.arrays:
        sums = state.affine_sums or {}
        state.affine_sums = {k: sums.get(k, 0.0) + total.arrays[k] for k in ("affine_xtx", "affine_xty")}


#: A rise of the epoch's misfit by more than this fraction rejects the global moves
#: (:func:`misfit_rose`): the loss of a settled run wanders by less (ideal 576 × 64² scan, up to
#: 0.02 % between epochs once refining), a scale the data do not pin raised it 0.3–0.5 % per epoch
#: (the electron preset, LSQML, 3 slices).
MISFIT_RISE = 1e-3


def misfit_rose(state) -> bool:
    """Whether the data misfit of the epoch that ended (the loss summed over its rounds,
    :func:`accumulate_affine`) rose by more than :data:`MISFIT_RISE` over the epoch before's."""
    loss, previous = getattr(state, "epoch_loss", None), getattr(state, "previous_loss", None)
    return bool(previous) and loss is not None and loss > previous * (1 + MISFIT_RISE)


def fit_affine(state, options: PositionOptions, window=None) -> None:
    """End of an epoch: solve the epoch's affine normal equations into ``state.affine`` and the
    next epoch's ``state.affine_boost``. The state has ``affine``, ``affine_boost``, ``affine_sums``;
    ``window``: the window correction the epoch applied (LSQML), not boosted.

    The boost is a proposal the data must accept: once ``state.affine_held`` (a refining
    epoch's misfit rose, :func:`~.positions.finish_epoch`) no further boost is made."""
    if state.affine_sums is not None and options.affine:
        fitted = solve_affine(state.affine_sums["affine_xtx"], state.affine_sums["affine_xty"],
                              options.remove_drift)
        if fitted is not None:
            held = getattr(state, "affine_held", False)
            boost = None if held else affine_boost(state.affine, state.affine_boost, fitted,
                                                   options.affine_gain, window)
            if options.scan_scale is False:
                xtx = state.affine_sums["affine_xtx"]
                boost = hold_scale(fitted, boost, np.asarray(xtx)[2, :2] / xtx[2, 2])
            state.affine_boost, state.affine = boost, fitted
    state.affine_sums = None


def hold_scale(fitted, boost, centre) -> np.ndarray:
    """``boost`` (3, 2, or None) plus the affine move that brings the isotropic scale of the map
    ``fitted + boost`` (nominal → refined, its linear part's √|det|) back to 1 about the nominal
    ``centre``: what the positions take next epoch then stretches the scan no more than the
    nominal one (``PositionOptions.scan_scale`` off). The move is one map for every pattern,
    so the random part of the refinement, its rotation and its shear stay."""
    total = np.asarray(fitted, np.float64) + (0.0 if boost is None else np.asarray(boost, np.float64))
    scale = float(np.sqrt(abs(np.linalg.det(total[:2]))))
    if not np.isfinite(scale) or scale <= 0:
        return boost
    held = total.copy()
    held[:2] = total[:2] / scale
    held[2] = total[2] + np.asarray(centre, np.float64) @ (total[:2] - held[:2])
    return held - total + (0.0 if boost is None else np.asarray(boost, np.float64))


# --- the scan's global deformation, seen inside the windows (both engines) -------------------

WINDOW_KEYS = ("window_num", "window_gram", "window_positions")

#: The windows' isotropic deformation (tr L / 2) below which they ask for no change of the scan's
#: scale; above it they get what exceeds it (a soft threshold). On exact positions the windows
#: keep asking for a small stretch, −1 … −2·10⁻⁵ an epoch once the object has formed (small
#: preset, LSQML), enough to stretch the scan by 0.1–0.2 % over 60 epochs where the data hardly
#: pin it; a scan whose scale is off asks for 1–4·10⁻⁴ (1 % … 1.5 % left). With it, ratio to the
#: plain run's NRMSE at 30 / 60 epochs on exact scans (with LOSS_SETTLED's start): medium
#: preset seed 0 1.02 / 1.10 → 1.01 / 1.03, seed 1 1.01 / 1.02, small seed 2 1.005 / 1.036 →
#: 1.003 / 1.013; a pure 1 % scale error loses 1–3 % at 60 (small seeds 0–2: 0.81 / 0.74 / 0.64
#: → 0.82 / 0.76 / 0.67× the nominal run), scans with random errors the same or better.
WINDOW_SCALE_DEADBAND = 6e-5


#: The epoch's rms per-pattern move (px) below which the patterns stand still
#: (:func:`scale_waits`): AD on the small preset's exact scan 0.001–0.01 px an epoch over the
#: first 10 epochs of refinement, on a scan 1.4 px + 1.5 % + 0.5° off 0.13–0.33 px.
PATTERNS_STILL = 0.05


def scale_waits(state, options: PositionOptions) -> bool:
    """Whether the windows' isotropic deformation is left out this epoch: within the first
    ``window_scale_wait`` epochs of refinement while the patterns stand still (the epoch's rms
    move below :data:`PATTERNS_STILL`, ``state.epoch_moves``). Then the windows' scale follows
    the object's own settling, not the scan's: AD on the small preset's exact scan read
    +1.4·10⁻³ in its first window, and the scan shrank 0.13 %, which the noise-gated pattern
    steps could not undo (1.06–1.11× the plain run's NRMSE at 30 epochs). Patterns that move
    are fixing errors the windows' scale belongs to, so it is taken from the start."""
    wait = options.window_scale_wait or 0
    if not wait or state.epoch - options.start_epoch >= wait:
        return False
    return epoch_rms_move(state) < PATTERNS_STILL


def epoch_rms_move(state) -> float:
    """The rms per-pattern move (px) of the epoch's refined positions (``state.epoch_moves``:
    Σ |move|² and the count, summed over its rounds); 0 before any."""
    moves = getattr(state, "epoch_moves", None)
    return float(np.sqrt(moves[0] / moves[1])) if moves is not None and moves[1] else 0.0


def without_small_scale(deformation, deadband: float = WINDOW_SCALE_DEADBAND) -> np.ndarray:
    """The windows' deformation L (2, 2) with its isotropic part tr L / 2 shrunk towards 0 by
    ``deadband`` (rotation and shear untouched)."""
    L = np.asarray(deformation, np.float64)
    iso = float(np.trace(L)) / 2
    kept = np.sign(iso) * max(abs(iso) - deadband, 0.0)
    return L + (kept - iso) * np.eye(2)


def window_correction(deformation, centre, gain: float):
    """From the windows' deformation L (2, 2): the map of the positions W (3, 2),
    r ← c + (I + g L)⁻¹ (r − c) as [r, 1] · W, and the object's resampling (matrix, offset),
    O(x) ← O(c + (I + g L)(x − c)). Together they leave every window where it was on the object
    and give its content the deformation the data asked for: O_new(r_new + u) = O(r + (I + g L) u)."""
    m = np.eye(2) + gain * np.asarray(deformation, np.float64)
    inv = np.linalg.inv(m)
    c = np.asarray(centre, np.float64)
    window = np.vstack([inv.T, c - c @ inv.T])
    return window, m, c - m @ c


def solve_window_deformation(num, gram, tikhonov: float = 1e-6) -> np.ndarray | None:
    """L (2, 2), rows the object axis (y, x) and columns the window offset's, from the summed
    normal equations of :class:`~daskpty.engines.window_deformation.WindowDeformation`; None if singular."""
    gram = np.asarray(gram, np.float64)
    trace = float(np.trace(gram))
    if not np.isfinite(trace) or trace <= 0:
        return None
    return np.linalg.solve(gram + tikhonov * trace / 4 * np.eye(4), np.asarray(num, np.float64)).reshape(2, 2)


def window_parameters(deformation) -> dict:
    """History entries of the windows' deformation L: ``affine_window_scale`` (tr L / 2, the
    isotropic stretch the data asked for) and ``affine_window_rotation_deg`` ((L_xy − L_yx)/2)."""
    if deformation is None:
        return {}
    L = np.asarray(deformation, np.float64)
    return {"affine_window_scale": float(np.trace(L) / 2),
            "affine_window_rotation_deg": float(np.degrees((L[1, 0] - L[0, 1]) / 2))}


def accumulate_window(state, total) -> None:
    """``apply``: add a round's window-deformation sums to the epoch's (a new dict; without
    ``window_gram`` when the steps kept an earlier epoch's normal matrix)."""
    if "window_num" in total.arrays:
        sums = state.window_sums or {}
        state.window_sums = {k: sums.get(k, 0.0) + np.asarray(total.arrays[k], np.float64)
                             for k in WINDOW_KEYS if k in total.arrays}


def fit_window(state, options: PositionOptions):
    """End of an epoch: the windows' deformation L of the epoch (``state.window_deformation``,
    for the history) and, with ``window_gain``, the next epoch's map of the positions
    (``state.window_map``); returns the object's resampling ``(matrix, offset)`` or None."""
    sums, state.window_sums, state.window_map = state.window_sums, None, None
    if sums is None:                      # an epoch without the sums (window_every): no L to report
        state.window_deformation = None
        return None
    if "window_gram" in sums:             # formed this epoch: kept for the epochs that reuse it
        state.window_gram = sums["window_gram"]
    gram = state.window_gram              # (None: reused but never formed, e.g. an old store)
    state.window_deformation = None if gram is None else solve_window_deformation(sums["window_num"], gram)
    count = sums["window_positions"][2]
    if state.window_deformation is None or not options.window_gain or count < 3:
        return None
    centre = sums["window_positions"][:2] / count
    L = state.window_deformation
    waiting = scale_waits(state, options)
    if not options.window_scale or getattr(state, "affine_held", False) or waiting:   # the rotation only:
        # the antisymmetric part of L (the scale follows the probe's size, which the data may not
        # pin: once a refining epoch's misfit rose it is no longer taken; nor while it may still
        # follow the object's own settling, scale_waits)
        L = (L - L.T) / 2
    else:
        L = without_small_scale(L)
    gain = options.window_gain * (options.window_every or 1)   # the per-epoch gain, taken every window_every
    state.window_map, matrix, offset = window_correction(L, centre, gain)
    return matrix, offset
