"""Position refinement: per-pattern position updates and the global affine constraint.

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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..physics.backend import to_numpy
from .engine_defaults import with_engine_defaults

OPTIMIZERS = ("momentum", "adam")


class PositionsDiverged(ValueError):
    """Position refinement moved a pattern too far from its nominal position (or to NaN)."""


#: Each engine's defaults of the settings left None (:meth:`PositionOptions.for_engine`),
#: measured on the 576 × 64² scan of benchmarks/bench_positions.py (see ``affine_gain``).
ENGINE_DEFAULTS = {"lsqml": {"affine_gain": 6.0, "start_epoch": "auto", "window_every": 1},
                   "ad": {"affine_gain": 2.0, "start_epoch": 5, "window_every": 2}}

#: ``start_epoch="auto"``: refinement starts in the epoch after the first one in which the probe
#: changed by at most PROBE_SETTLED (‖P_e − P_e−1‖ / ‖P_e‖, all modes), but not before epoch
#: AUTO_EARLIEST and at the latest in epoch AUTO_LATEST. LSQML on 576 × 64² (1 px + 1.5 % +
#: 0.5° errors): from a calibration scan's probe the change falls to 0.009 after epoch 4 (start
#: 5), from the store's optics guess (10 % defocus error) to 0.007 after epoch 9 (start 10); a
#: fixed start of 4 was best from the first (three noise draws, 0.27–0.34 px after 50 epochs,
#: against 0.31–0.37 px from 10) and worst from the second (0.60 against 0.50 px).
AUTO_START = "auto"
PROBE_SETTLED = 0.01
AUTO_EARLIEST = 3
AUTO_LATEST = 10


@dataclass(frozen=True)
class PositionOptions:
    """Settings of position refinement (both engines).

    start_epoch: first epoch whose chunk steps move positions (epochs count from 0), or
        ``"auto"``: the epoch after the probe has settled (:data:`PROBE_SETTLED`, between epochs
        :data:`AUTO_EARLIEST` and :data:`AUTO_LATEST`). None: the engine's own
        (:data:`ENGINE_DEFAULTS`: LSQML ``"auto"``, AD 5). LSQML waits until the object and
        probe have roughly formed: its updates from a blurred object over-step
        (benchmarks/bench_positions.py, 576 × 64² with 1 px random errors, started from the
        store's probe guess, 50 epochs: 0.60 px left starting at 20 with 0.1 px steps, 0.54 px
        starting at 10 with 0.2 px steps), and from a probe still far off the windows' scale
        follows the probe's size; how soon that is depends on the start probe (see
        :data:`AUTO_START`). AD's Adam steps with the window correction gain from
        an earlier start (1 px + 1.5 % + 0.5° errors, 150 epochs, three noise draws, calibration
        probe: NRMSE 1.13 / 1.16 / 1.11× the true-position run from epoch 10, 1.12 / 1.14 / 1.11×
        from epoch 5, with ``affine_gain`` 2).
    max_step: largest move of one pattern per epoch, pixels per axis (default 0.3; LSQML's
        momentum-driven steps reach it in the first epochs of refinement:
        576 × 64², 50 epochs, 0.2 → 0.3 px took 1 px + 1.5 % + 0.5° errors 0.627 → 0.611 px,
        1 px random 0.280 → 0.267 px, 1 px + −1.5 % 0.484 → 0.480 px, NRMSE −1.5 … −2.2 %
        in each; 0.6 gains nothing more; AD's Adam steps of about ``lr`` are clipped to it).
    momentum: LSQML heavy-ball memory of the position update (0 disables; default 0.8: the
        one-step LSQML shift under-steps about 5× at 1 px errors, and momentum lets consistent
        shifts add up — 1 px random case, 50 epochs: 0.54 px left with 0, 0.41 with 0.5, 0.28
        with 0.8; 1 px + 1.5 % + 0.5°: 1.22, 1.07, 0.88 px).
    gain: LSQML fraction of the computed shift applied per epoch (0 < gain ≤ 2).
    regularization: LSQML Tikhonov term of the shift's denominator, relative to its chunk mean:
        patterns whose object patch has weak gradients (flat or still blurred) move less.
    optimizer / lr: AD only: ``"adam"`` (default; steps of about ``lr`` pixels whatever the
        gradient's scale, within ``max_step``; default lr 0.5 — same 576 × 64² scan, 150 epochs,
        from a calibration scan's probe, before AD had the window correction: 1 px + 1.5 % +
        0.5° errors 0.330 → 0.073 px and NRMSE 2.57 → 1.16× the true-position run with lr
        0.1 → 0.5 (0.3: 0.102 px, 0.8: 0.094 px); 1 px random 0.114 → 0.051 px; 1 px + −1.5 %
        0.251 → 0.050 px; lr 0.2 or a decaying lr are slower, a second moment pooled over the
        chunk or β₂ 0.9 / 0.99 gain nothing; see ``window_gain`` for what it then left) or
        ``"momentum"`` (gradient descent with momentum, ``lr`` in px² per
        unit gradient).
    affine: after every epoch fit the best affine map from nominal to refined positions; in the
        next epoch move every position by ``affine_gain − 1`` times the map's change over the
        epoch and pull it ``affine_blend`` of the way to the map.
    affine_gain: speed-up of the affine (global scale, rotation, shear, shift) part of the
        refinement. Per-pattern updates fix random errors within a few tens of epochs but move
        the global part only slowly (the object stretches to follow it). The extra move is one
        affine map for every pattern, so the random part is untouched. None: the engine's own
        (:data:`ENGINE_DEFAULTS`: LSQML 6, AD 2). On 576 × 64² with 1 px + 1.5 % + 0.5° errors,
        from the store's probe (docs/benchmarks.md): LSQML 3 / 6 / 10 leave 0.72 / 0.63 / 1.60 px
        after 50 epochs (0.40 / 0.32 px after 150; 1 px random errors only: 0.28 px either;
        −1.5 % scale: 0.59 / 0.48 px). AD with its window correction, 150 epochs from a
        calibration probe, starting at epoch 5: 2 and 3 tie on three noise draws of that case
        (NRMSE 1.12–1.14× against 1.11–1.13× the true-position run), but 3 leaves 1.24× on
        1 px random errors only (2: 1.11×) and 1.28× from the store's probe (2: 1.15×).
    affine_blend: fraction of the way to the affine map each epoch (0 … 1; the classical affine
        constraint). Default 0: it pulls the random part of the errors back towards the map of
        the nominal positions (same benchmark: 0.94 px left with 0.1, 0.60 px with 0). Raise it
        when the scan is known to be an affine map of the nominal one plus little noise.
    window_gain: fraction of the scan's global rotation, as seen inside the windows, corrected
        after each epoch (both engines; 0 disables). A global rotation (or scale) error of the
        positions makes the object turn (or stretch) with them, which the per-pattern shifts
        cannot see; inside every window the data still see it, as one linear deformation L of
        the window's content (:class:`~daskpty.engines.window_deformation.WindowDeformation`, tiny additive
        sums; AD forms them from its loss gradient). The positions then move by (I + g L)⁻¹
        about their centroid and the object is resampled with them (:func:`window_correction`).
        LSQML, 576 × 64², 1 px + 1.5 % + 0.5° errors, 50 epochs: 0.88 → 0.74 px (0.63 px with
        LSQML's affine_gain 6; rotation 0.22° → 0.04° left), NRMSE 1.97 → 1.34× (1.30×) the
        true-position run; 1 px-only scans unharmed. AD (with ``window_scale``, twelfth
        session), 150 epochs from a calibration probe: 0.073 → 0.057 px and NRMSE 1.16 →
        1.13×; on two other noise draws 0.52 / ~0.5 px → 0.06 px, where a global shear of
        ~0.008 and a patch of edge windows had stayed wrong without it. The intensity loss
        has no window correction (its gradient is not a constant multiple of the exit-wave
        update). Above 1 it runs away.
    window_every: take the windows' sums and correct in every this many epochs of refinement
        (its first, then every ``window_every``-th; 1 … 10), each correction ``window_every``
        times ``window_gain``, so the correction per epoch stays ``window_gain``. None: the
        engine's (:data:`ENGINE_DEFAULTS`: LSQML 1, AD 2). The sums are most of what refinement
        costs in a chunk step; AD, 576 × 64², 150 epochs (fourteenth session), every 1st / 2nd
        epoch: 1 px + 1.5 % + 0.5° errors from a calibration probe 1.12 / 1.12× the
        true-position NRMSE, 0.057 / 0.057 px (second noise draw 1.14 / 1.14×, 0.056 / 0.056 px),
        1 px random errors 1.11 / 1.11×, from the store's probe 1.13 / 1.12×, 0.061 / 0.059 px;
        extra time per epoch +29 % / +15 … +19 %. Every 2nd epoch at the gain of every epoch
        instead left 1.27× / 0.100 px from the store's probe.
    window_scale: also correct the symmetric part of L (scale and shear; both engines). The probe's size
        decides what scale the windows ask for, so only with a probe of the right size (from
        the optics or the store, not guessed from the mean pattern, which made it rescale a
        scan by 2 % the wrong way): same case 0.88 → 0.51 px, NRMSE 1.24×; −1.5 % scale
        error: 0.59 → 0.30 px. None (default): on when the run starts from a given probe (the
        ``probe`` argument or the store's), off when it is guessed from the data
        (:meth:`for_start_probe`). From a calibration scan's probe (eleventh session, 50
        epochs): 1 px + 1.5 % + 0.5° errors 0.470 → 0.322 px, NRMSE 1.23 → 1.15× the
        true-position run; 1 px random errors 0.262 → 0.268 px. It costs nothing extra: the
        windows' sums are the same either way (first moments on every pattern, the normal
        matrix on every 4th). Unresolved (None), the chunk steps treat it as False.
    remove_drift: also remove the mean displacement (the fitted map keeps the nominal centroid).
    max_displacement: refinement stops with :class:`PositionsDiverged` when a pattern drifts
        farther than this from its nominal position, pixels (default: a quarter of the probe size).
    """

    start_epoch: int | None = None
    max_step: float = 0.3
    momentum: float = 0.8
    gain: float = 1.0
    regularization: float = 1e-3
    optimizer: str = "adam"
    lr: float = 0.5
    affine: bool = True
    affine_gain: float | None = None
    affine_blend: float = 0.0
    window_gain: float = 0.5
    window_every: int | None = None
    window_scale: bool | None = None
    remove_drift: bool = False
    max_displacement: float | None = None

    def __post_init__(self):
        def check(ok, message):
            if not ok:
                raise ValueError(f"refine_positions: {message}")

        check(self.start_epoch is None or self.start_epoch == AUTO_START
              or isinstance(self.start_epoch, (int, np.integer))
              and not isinstance(self.start_epoch, bool) and self.start_epoch >= 0,
              f"start_epoch must be an integer >= 0 or 'auto', got {self.start_epoch!r}")
        check(_number(self.max_step) and 0 < self.max_step <= 8,
              f"max_step must lie in (0, 8] pixels, got {self.max_step!r}")
        check(_number(self.momentum) and 0 <= self.momentum < 1,
              f"momentum must lie in [0, 1), got {self.momentum!r}")
        check(_number(self.gain) and 0 < self.gain <= 2, f"gain must lie in (0, 2], got {self.gain!r}")
        check(_number(self.regularization) and self.regularization >= 0,
              f"regularization must be >= 0, got {self.regularization!r}")
        check(self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check(_number(self.lr) and self.lr > 0, f"lr must be positive, got {self.lr!r}")
        check(self.affine_gain is None or _number(self.affine_gain) and 1 <= self.affine_gain <= 20,
              f"affine_gain must lie in [1, 20], got {self.affine_gain!r}")
        check(_number(self.affine_blend) and 0 <= self.affine_blend <= 1,
              f"affine_blend must lie in [0, 1], got {self.affine_blend!r}")
        check(_number(self.window_gain) and 0 <= self.window_gain <= 1,
              f"window_gain must lie in [0, 1], got {self.window_gain!r}")
        check(self.window_every is None or isinstance(self.window_every, (int, np.integer))
              and not isinstance(self.window_every, bool) and 1 <= self.window_every <= 10,
              f"window_every must be a whole number of epochs in [1, 10], got {self.window_every!r}")
        check(self.window_scale is None or isinstance(self.window_scale, (bool, np.bool_)),
              f"window_scale must be True, False or None, got {self.window_scale!r}")
        check(self.max_displacement is None or (_number(self.max_displacement) and self.max_displacement > 0),
              f"max_displacement must be positive or None, got {self.max_displacement!r}")

    @classmethod
    def from_argument(cls, value, engine: str | None = None) -> "PositionOptions | None":
        """``reconstruct(refine_positions=...)``: False/None (off), True (defaults), a dict of
        fields, or a PositionOptions; with ``engine``, settings left None take its defaults."""
        if value is None or value is False:
            return None
        if value is True:
            options = cls()
        elif isinstance(value, cls):
            options = value
        elif isinstance(value, dict):
            names = set(cls.__dataclass_fields__)
            unknown = sorted(set(value) - names)
            if unknown:
                raise TypeError(f"refine_positions: unknown option(s) {unknown}; valid: {sorted(names)}")
            options = cls(**value)
        else:
            raise TypeError(f"refine_positions must be True, False, a dict or a PositionOptions, got {value!r}")
        return options if engine is None else options.for_engine(engine)

    def for_engine(self, engine: str) -> "PositionOptions":
        """These options with every setting left None set to ``engine``'s default."""
        return with_engine_defaults(self, ENGINE_DEFAULTS, engine)

    def for_start_probe(self, guessed: bool) -> "PositionOptions":
        """These options with ``window_scale`` None resolved: off when the start probe is
        guessed from the data (its size may be wrong, and the scale would follow it), else on."""
        if self.window_scale is not None:
            return self
        return dataclasses.replace(self, window_scale=not guessed)

    def displacement_limit(self, n: int) -> float:
        return float(self.max_displacement) if self.max_displacement is not None else n / 4.0

    def start_bounds(self) -> tuple[int, int]:
        """(earliest, latest) epoch in which refinement can start: the start epoch twice, or
        (:data:`AUTO_EARLIEST`, :data:`AUTO_LATEST`) for ``"auto"``."""
        if self.start_epoch is None:
            raise ValueError("start_epoch is unset: resolve the options first (PositionOptions.for_engine)")
        if self.start_epoch == AUTO_START:
            return AUTO_EARLIEST, AUTO_LATEST
        return int(self.start_epoch), int(self.start_epoch)

    def for_state(self, state) -> "PositionOptions":
        """These options as the chunk steps of ``state``'s epoch use them: ``"auto"`` replaced by
        the start epoch decided so far (``state.positions_start``, :func:`settle_start`), or by the
        next epoch while undecided."""
        if self.start_epoch != AUTO_START:
            return self
        decided = state.positions_start
        return dataclasses.replace(self, start_epoch=int(decided) if decided is not None else state.epoch + 1)

    def active(self, epoch: int) -> bool:
        if self.start_epoch is None or self.start_epoch == AUTO_START:
            raise ValueError(f"start_epoch is {self.start_epoch!r}: resolve the options first "
                             "(PositionOptions.for_engine, then for_state)")
        return epoch >= self.start_epoch


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and np.isfinite(v)


def initial_local(nominal, options: PositionOptions, engine: str = "lsqml") -> dict:
    """The per-pattern state of one chunk before its first refinement step."""
    nominal = np.asarray(nominal, dtype=np.float64)
    local = {"positions": nominal.copy(), "velocity": np.zeros_like(nominal)}
    if engine == "ad" and options.optimizer == "adam":
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


def step_with_momentum(local: dict, shift, options: PositionOptions) -> tuple[dict, np.ndarray]:
    """LSQML: velocity ← momentum · velocity + shift; position += velocity, each axis limited to
    ``max_step``. Returns the new arrays and the applied step."""
    velocity = options.momentum * local["velocity"] + np.asarray(shift, dtype=np.float64)
    step = np.clip(velocity, -options.max_step, options.max_step)
    return {"positions": local["positions"] + step, "velocity": step}, step


def step_with_optimizer(local: dict, grad, options: PositionOptions, t: int) -> tuple[dict, np.ndarray]:
    """AD: one optimiser step against the loss gradient ``grad`` (B, 2); ``t`` (≥ 1) counts the
    steps so far (the same for every pattern: each is visited once per epoch)."""
    grad = np.asarray(grad, dtype=np.float64)
    new = dict(local)
    if options.optimizer == "adam":
        b1, b2 = 0.9, 0.999
        m = b1 * local["velocity"] + (1 - b1) * grad
        v = b2 * local["moment2"] + (1 - b2) * grad * grad
        step = -options.lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + 1e-12)
        new["velocity"], new["moment2"] = m, v
    else:
        velocity = options.momentum * local["velocity"] - options.lr * grad
        step = velocity
        new["velocity"] = velocity
    step = np.clip(step, -options.max_step, options.max_step)
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


# --- the affine constraint -------------------------------------------------------------------

def _design(nominal):
    nominal = np.asarray(nominal, dtype=np.float64)
    return np.concatenate([nominal, np.ones((len(nominal), 1))], axis=1)  # rows (y, x, 1)


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
    design = _design(nominal)
    if boost is not None:
        refined = refined + design @ boost
        affine = affine + boost
    if blend:
        refined = refined + blend * (design @ affine - refined)
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
        refined = _design(refined) @ window
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


def accumulate_affine(state, total) -> None:
    """``apply``: add a round's affine normal equations to the state's sums of the epoch (a new
    dict: copies of a state share the old one)."""
    if "affine_xtx" in total.arrays:
        sums = state.affine_sums or {}
        state.affine_sums = {k: sums.get(k, 0.0) + total.arrays[k] for k in ("affine_xtx", "affine_xty")}


def fit_affine(state, options: PositionOptions, window=None) -> None:
    """End of an epoch: solve the epoch's affine normal equations into ``state.affine`` and the
    next epoch's ``state.affine_boost``. The state has ``affine``, ``affine_boost``, ``affine_sums``;
    ``window``: the window correction the epoch applied (LSQML), not boosted."""
    if state.affine_sums is not None and options.affine:
        fitted = solve_affine(state.affine_sums["affine_xtx"], state.affine_sums["affine_xty"],
                              options.remove_drift)
        if fitted is not None:
            state.affine_boost = affine_boost(state.affine, state.affine_boost, fitted, options.affine_gain,
                                              window)
            state.affine = fitted
    state.affine_sums = None


def probe_change(before, after) -> float:
    """‖after − before‖ / ‖after‖ over all probe modes (host float)."""
    after = np.asarray(to_numpy(after))
    scale = float(np.linalg.norm(after))
    return float(np.linalg.norm(after - np.asarray(to_numpy(before)))) / scale if scale > 0 else float("inf")


def decide_start(epoch: int, change: float) -> int | None:
    """After epoch ``epoch`` ended with the probe's relative change ``change``: the start epoch of
    an ``"auto"`` refinement (the next epoch, once the probe has settled or by
    :data:`AUTO_LATEST`), or None (not yet)."""
    if epoch + 1 >= AUTO_LATEST or (change <= PROBE_SETTLED and epoch + 1 >= AUTO_EARLIEST):
        return epoch + 1
    return None


def options_for(options: PositionOptions | None, state) -> PositionOptions | None:
    """The refinement's options for the chunk steps of ``state``'s epoch (None: no refinement)."""
    return None if options is None else options.for_state(state)


def note_epoch_start(state, options: PositionOptions) -> None:
    """Start of an epoch, both engines: keep the probe for ``"auto"``'s start rule while undecided."""
    if options.start_epoch == AUTO_START and state.positions_start is None:
        state.epoch_start_probe = np.array(to_numpy(state.probe), copy=True)


def start_parameters(state) -> dict:
    """The start epoch ``"auto"`` decided, for the epoch's history entry (empty while undecided)."""
    return {} if state.positions_start is None else {"position_start_epoch": int(state.positions_start)}


def start_arrays(state) -> dict:
    """The decided start epoch for a checkpoint (``positions_start``, 0-d int64), if any."""
    return {} if state.positions_start is None else {"positions_start": np.asarray(state.positions_start, np.int64)}


def start_from_arrays(arrays: dict | None) -> int | None:
    """Inverse of :func:`start_arrays`."""
    value = (arrays or {}).get("positions_start")
    return None if value is None else int(np.asarray(value))


def finish_epoch(state, options: PositionOptions, move_object) -> None:
    """End of a refining epoch, both engines: the windows' correction of the next epoch
    (:func:`fit_window`; ``move_object(state, matrix, offset)`` resamples the engine's object
    and its memory with it), then the affine fit (:func:`fit_affine`), which leaves out the
    window correction this epoch applied."""
    options = options.for_state(state)
    applied = state.window_map if options.active(state.epoch) else None
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
    state.positions_start = decide_start(state.epoch - 1, probe_change(state.epoch_start_probe, state.probe))
    state.epoch_start_probe = None


# --- the scan's global deformation, seen inside the windows (both engines) -------------------

WINDOW_KEYS = ("window_num", "window_gram", "window_positions")


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
    """``apply``: add a round's window-deformation sums to the epoch's (a new dict)."""
    if "window_num" in total.arrays:
        sums = state.window_sums or {}
        state.window_sums = {k: sums.get(k, 0.0) + np.asarray(total.arrays[k], np.float64) for k in WINDOW_KEYS}


def fit_window(state, options: PositionOptions):
    """End of an epoch: the windows' deformation L of the epoch (``state.window_deformation``,
    for the history) and, with ``window_gain``, the next epoch's map of the positions
    (``state.window_map``); returns the object's resampling ``(matrix, offset)`` or None."""
    sums, state.window_sums, state.window_map = state.window_sums, None, None
    if sums is None:                      # an epoch without the sums (window_every): no L to report
        state.window_deformation = None
        return None
    state.window_deformation = solve_window_deformation(sums["window_num"], sums["window_gram"])
    count = sums["window_positions"][2]
    if state.window_deformation is None or not options.window_gain or count < 3:
        return None
    centre = sums["window_positions"][:2] / count
    L = state.window_deformation
    if not options.window_scale:          # the rotation only: the antisymmetric part of L
        L = (L - L.T) / 2
    gain = options.window_gain * (options.window_every or 1)   # the per-epoch gain, taken every window_every
    state.window_map, matrix, offset = window_correction(L, centre, gain)
    return matrix, offset
