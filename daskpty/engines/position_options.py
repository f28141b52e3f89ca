"""Settings of position refinement (:class:`PositionOptions`, both engines), their validation
and each engine's defaults; the refinement itself is in :mod:`daskpty.engines.positions` (the
per-pattern step and the epoch's hooks) and :mod:`daskpty.engines.position_fits` (the affine and
window fits)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..faults import PositionsDiverged  # noqa: F401 (also named here)
from .dose_rule import held_scales
from .engine_defaults import with_engine_defaults

OPTIMIZERS = ("momentum", "adam")


#: ``start_epoch="auto"``: refinement starts in the epoch after the first one in which the probe
#: changed by at most PROBE_SETTLED (‖P_e − P_e−1‖ / ‖P_e‖, all modes), but not before epoch
#: AUTO_EARLIEST and at the latest in epoch AUTO_LATEST. LSQML on 576 × 64² (1 px + 1.5 % +
#: 0.5° errors): from a calibration scan's probe the change falls to 0.009 after epoch 4 (start
#: 5), from the store's optics guess (10 % defocus error) to 0.007 after epoch 9 (start 10); a
#: fixed start of 4 was best from the first (three noise draws, 0.27–0.34 px after 50 epochs,
#: against 0.31–0.37 px from 10) and worst from the second (0.60 against 0.50 px).
#: The loss must have settled too (changed by at most LOSS_SETTLED over the epoch): while the
#: object still forms, the shifts follow its errors and the positions keep what they take then,
#: a stretch of the scan above all. On exact positions the loss keeps falling as the object
#: forms; with position errors it levels out early, so the rule delays only the scans that need
#: refinement least. 0.5 % rather than 2 % (LSQML, 60 epochs, ratio to the plain run's NRMSE at
#: 30 / 60): exact `simulate` presets small seeds 0–2 1.00–1.02 / 1.00–1.06 → 1.00–1.01 /
#: 1.00–1.04, medium seed 0 1.07 / 1.18 → 1.02 / 1.10; with errors (1 px + 1.5 % + 0.5°, 0.3 px
#: + 0.5 % + 0.3°) the same or better (seed 1, 0.3 px: 0.48 → 0.40× the nominal run at 60); a
#: pure 1 % scale error 1–2 % worse at 30, the same at 60. AUTO_LATEST leaves room for a
#: late-forming object (one round per epoch, or a probe guessed from the mean pattern).
AUTO_START = "auto"
PROBE_SETTLED = 0.01
LOSS_SETTLED = 0.005
#: LOSS_SETTLED where the scan's scale is held through K > 1 slices (``scan_scale`` False, there by
#: default): the stricter rule keeps an early stretch out of the positions, which a held scale
#: cannot take; there it only delays refinement (abTEM's 3-slab sets, 30 epochs: 1–3 % higher
#: NRMSE with 0.5 %).
LOSS_SETTLED_HELD_SCALE = 0.02
#: PROBE_SETTLED where the scan's scale is held: through slices a probe can keep taking up what
#: the slab model leaves out (abTEM's finely sliced 2–3-slab sets, LSQML without momentum: still
#: 1.1–2.1 % an epoch at epoch 30), so 1 % started refinement only at AUTO_LATEST and the refined
#: run equalled the nominal one. With the scale and the windows held the probe cannot pull the
#: positions along, and the loss rule (LOSS_SETTLED_HELD_SCALE) binds: starts at 9–14 there,
#: and a fixed start anywhere in 5–20 refines within 1.5 % of it (docs/benchmarks.md); on
#: daskpty's own 2–4-slice scans the start is the same at 1, 2 and 5 %.
PROBE_SETTLED_HELD_SCALE = 0.05
AUTO_EARLIEST = 3
AUTO_LATEST = 30


@dataclass(frozen=True)
class PositionOptions:
    """Settings of position refinement (both engines).

    The defaults and the measurements behind them: docs/benchmarks.md, bench_positions.py.

    start_epoch: first epoch whose chunk steps move positions (epochs count from 0), or
        ``"auto"``: the epoch after the probe has settled (:data:`PROBE_SETTLED`, between epochs
        :data:`AUTO_EARLIEST` and :data:`AUTO_LATEST`). None: the engine's own
        (``EngineSpec.position_defaults``: ``"auto"`` for every engine). Refinement waits until
        the object and probe have roughly formed: shifts from a blurred object over-step, and
        from a probe still far off the windows' scale follows the probe's size; how soon that is
        depends on the start probe (:data:`AUTO_START`). AD's Adam steps are of about ``lr``
        whatever the gradient, so an early start walks exact positions away: small preset seed
        2, 60 epochs, from the store's probe, a fixed start at epoch 5 against "auto" (epoch 12),
        exact scan 1.24 / 1.11× → 1.11 / 1.09× the plain run at 30 / 60 epochs, 1 % scale error
        0.92 / 0.73× → 0.68 / 0.41× the nominal run; from a probe guessed from the mean pattern
        epoch 5 took a scan 1 px + 1.5 % + 0.5° off to 4.9 px rms (2.1× the nominal run at 60),
        "auto" (epoch 30) to 0.56×.
    max_step: largest move of one pattern per epoch, pixels per axis (default 0.3; LSQML's
        momentum-driven steps reach it in the first epochs of refinement; AD's Adam steps of
        about ``lr`` are clipped to it).
    momentum: LSQML heavy-ball memory of the position update (0 disables; default 0.8): the
        one-step LSQML shift under-steps about 5× at 1 px errors, and momentum lets consistent
        shifts add up.
    gain: LSQML fraction of the computed shift applied per epoch (0 < gain ≤ 2).
    regularization: LSQML Tikhonov term of the shift's denominator, relative to its chunk mean:
        patterns whose object patch has weak gradients (flat or still blurred) move less.
    noise_threshold: each pattern's step is shrunk by this many times its own noise level (0
        disables; None: the engine's, ``EngineSpec.position_defaults``: LSQML 1, AD 5; one slice
        in the far field). LSQML shrinks its shift
        (:func:`~daskpty.engines.positions.noise_limited`): small preset, exact positions, seed
        2, NRMSE vs the plain run at 60 epochs 1.08× without, 1.06× with 1; a scan 1.6 px off:
        0.0520 → 0.0533 (seed 2), 0.0694 → 0.0699 (seed 0). AD shrinks Adam's mean gradient by
        its scatter (:func:`~daskpty.engines.positions.noise_gate`) until ``gate_release``
        opens it: small preset seeds 0–2, exact scans 1.06–1.11 / 1.09–1.12× → 1.00–1.01 /
        0.98–1.04× the plain run at 30 / 60 epochs (threshold 3: 1.01 / 1.02–1.05×), the loss's
        3.2× rise when refinement starts gone.
    gate_release: the epoch's rms pattern move (px) above which the scan has errors to fix and
        the noise gate opens for the rest of the run (``state.gate_open``; 0 never; None: the
        engine's, AD 0.05, LSQML 0). A pattern 0.2–0.3 px off pulls below its noise in one epoch;
        ungated, Adam's normalised steps integrate that pull over many (bench_positions' scan:
        0.062 px at 150 epochs; kept gated, it stalled at 0.31 px, 2.1× the true-position NRMSE).
        On an exact scan the gated patterns move 0.001–0.01 px an epoch, one 1.4 px off
        0.13–0.33 px. The gate runs only from the ``"auto"`` start: it takes the residual for
        noise, which holds once the object has formed; from a fixed early start the model's
        error dominates it and the gate held AD's patterns near where they were
        (tests/test_positions.py's scan from epoch 3: 1.35 → 0.99 px in 60 epochs).
    optimizer / lr: AD only: ``"adam"`` (default; steps of about ``lr`` pixels whatever the
        gradient's scale, within ``max_step``; default lr 0.5) or ``"momentum"`` (gradient
        descent with momentum, ``lr`` in px² per unit gradient).
    affine: after every epoch fit the best affine map from nominal to refined positions; in the
        next epoch move every position by ``affine_gain − 1`` times the map's change over the
        epoch and pull it ``affine_blend`` of the way to the map.
    affine_gain: speed-up of the affine (global scale, rotation, shear, shift) part of the
        refinement. Per-pattern updates fix random errors within a few tens of epochs but move
        the global part only slowly (the object stretches to follow it). The extra move is one
        affine map for every pattern, so the random part is untouched. None: the engine's own
        (``EngineSpec.position_defaults``: LSQML 6, AD 2); much larger gains oscillate.
    affine_blend: fraction of the way to the affine map each epoch (0 … 1; the classical affine
        constraint). Default 0: it pulls the random part of the errors back towards the map of
        the nominal positions. Raise it when the scan is known to be an affine map of the
        nominal one plus little noise.
    window_gain: fraction of the scan's global rotation, as seen inside the windows, corrected
        after each epoch (both engines; 0 disables). A global rotation (or scale) error of the
        positions makes the object turn (or stretch) with them, which the per-pattern shifts
        cannot see; inside every window the data still see it, as one linear deformation L of
        the window's content (:class:`~daskpty.engines.window_deformation.WindowDeformation`, tiny additive
        sums; AD forms them from its loss gradient). The positions then move by (I + g L)⁻¹
        about their centroid and the object is resampled with them (:func:`window_correction`).
        The intensity loss has no window correction (its gradient is not a constant multiple
        of the exit-wave update). Above 1 it runs away.
    window_every: take the windows' sums and correct in every this many epochs of refinement
        (its first, then every ``window_every``-th; 1 … 10), each correction ``window_every``
        times ``window_gain``, so the correction per epoch stays ``window_gain``. None: the
        engine's (``EngineSpec.position_defaults``: LSQML 1, AD 2). The sums are most of what refinement
        costs in a chunk step; AD loses no accuracy taking them every 2nd epoch, LSQML's noise
        draws do.
    window_scale: also correct the symmetric part of L (scale and shear; both engines). The probe's size
        decides what scale the windows ask for, so only with a probe of the right size (from
        the optics or the store, not guessed from the mean pattern, which makes it rescale a
        scan the wrong way). None (default): on when the run starts from a given probe (the
        ``probe`` argument or the store's), off when it is guessed from the data
        (:meth:`for_start_probe`). It costs nothing extra: the windows' sums are the same
        either way (first moments on every pattern, the normal matrix on every 4th).
        Off through K > 1 slices, like ``scan_scale``, and on counting data of few counts per
        lit pixel (:meth:`for_start_probe`, :mod:`~daskpty.engines.dose_rule`: the amplitude
        model's bias reads as a stretch there).
        Unresolved (None), the chunk steps treat it as False.
    window_scale_wait: epochs after refinement starts during which the windows' scale is left
        out while the patterns stand still (:func:`~daskpty.engines.position_fits.scale_waits`;
        0 never). None: the engine's (LSQML 0, AD 8): AD's object still settles after its
        start, and the windows read that as a scale.
    scan_scale: let the refinement change the scan's isotropic scale (the mean stretch of the
        refined positions against the nominal ones). Off, the fitted affine map's isotropic
        scale is brought back to the nominal one after every epoch (:func:`~.position_fits.hold_scale`;
        rotation, shear and the random errors still refine). None (default): on for one slice,
        off on counting data of fewer counts per lit pixel still than ``window_scale``
        (:mod:`~daskpty.engines.dose_rule`) and through K > 1 slices
        (:meth:`for_start_probe`): there the scan's scale trades with the
        probe's defocus and with the slabs' depth, which the data do not tell apart. A
        daskpty-simulated 3-slice scan started from a probe 10 % off in defocus (1 % scale
        error): LSQML stretched the scan to +3.9 % and ended worse than not refining; abTEM's
        3-slab crystal: the data misfit falls with the scale up to +2 % at the true positions,
        so refinement stretched the scan (docs/benchmarks.md, bench_electron.py).
    remove_drift: also remove the mean displacement (the fitted map keeps the nominal centroid).
    max_displacement: refinement stops with :class:`PositionsDiverged` when a pattern drifts
        farther than this from its nominal position, pixels (default: a quarter of the probe size).
    """

    start_epoch: int | None = None
    max_step: float = 0.3
    momentum: float = 0.8
    gain: float = 1.0
    regularization: float = 1e-3
    noise_threshold: float | None = None
    gate_release: float | None = None
    optimizer: str = "adam"
    lr: float = 0.5
    affine: bool = True
    affine_gain: float | None = None
    affine_blend: float = 0.0
    window_gain: float = 0.5
    window_every: int | None = None
    window_scale: bool | None = None
    window_scale_wait: int | None = None
    scan_scale: bool | None = None
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
        check(self.noise_threshold is None or _number(self.noise_threshold) and self.noise_threshold >= 0,
              f"noise_threshold must be >= 0, got {self.noise_threshold!r}")
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
        check(self.gate_release is None or _number(self.gate_release) and self.gate_release >= 0,
              f"gate_release must be >= 0 pixels or None, got {self.gate_release!r}")
        check(self.window_scale_wait is None or isinstance(self.window_scale_wait, (int, np.integer))
              and not isinstance(self.window_scale_wait, bool) and 0 <= self.window_scale_wait <= 1000,
              f"window_scale_wait must be a whole number of epochs >= 0, got {self.window_scale_wait!r}")
        for name in ("window_scale", "scan_scale"):
            value = getattr(self, name)
            check(value is None or isinstance(value, (bool, np.bool_)),
                  f"{name} must be True, False or None, got {value!r}")
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
        return with_engine_defaults(self, "position", engine)

    def for_start_probe(self, guessed: bool, slices: int = 1,
                        counts_per_lit_pixel: float | None = None) -> "PositionOptions":
        """These options with ``window_scale`` and ``scan_scale`` None resolved: both off
        through ``slices`` > 1; on counting data of few counts per lit pixel ``window_scale``
        off, and ``scan_scale`` too at fewer (:func:`~.dose_rule.held_scales`: there refinement
        reads a scale that is not there); ``window_scale`` also off when the start probe is
        guessed from the data (its size may be wrong, and the scale would follow it); else on."""
        thin = int(slices) <= 1
        window_held, scan_held = held_scales(counts_per_lit_pixel)
        window = (not guessed and thin and not window_held) if self.window_scale is None else self.window_scale
        scan = (thin and not scan_held) if self.scan_scale is None else self.scan_scale
        if (window, scan) == (self.window_scale, self.scan_scale):
            return self
        return dataclasses.replace(self, window_scale=window, scan_scale=scan)

    def displacement_limit(self, n: int) -> float:
        return float(self.max_displacement) if self.max_displacement is not None else n / 4.0

    def loss_settled(self, slices: int = 1) -> float:
        """The loss's largest relative change over an epoch at which ``"auto"`` starts:
        :data:`LOSS_SETTLED_HELD_SCALE` where the scan's scale is held through ``slices`` > 1,
        else :data:`LOSS_SETTLED`. One slice with the scale held (few counts per lit pixel)
        keeps the thin rule: the early start cost 1.03–1.08× the plain run's NRMSE at 60
        epochs where the thin rule's cost 1.01–1.02× (small preset, 10⁵ and 3·10⁵ photons)."""
        return LOSS_SETTLED_HELD_SCALE if self.scan_scale is False and slices > 1 else LOSS_SETTLED

    def probe_settled(self, slices: int = 1) -> float:
        """The probe's largest relative change over an epoch at which ``"auto"`` starts:
        :data:`PROBE_SETTLED_HELD_SCALE` where the scan's scale is held through ``slices`` > 1,
        else :data:`PROBE_SETTLED` (as :meth:`loss_settled`)."""
        return PROBE_SETTLED_HELD_SCALE if self.scan_scale is False and slices > 1 else PROBE_SETTLED

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
        next epoch while undecided; with a gate (``gate_release``), ``noise_threshold`` 0 once it
        has opened (``state.gate_open``) or when refinement starts at a fixed epoch."""
        options = self
        if self.gate_release and self.noise_threshold and (getattr(state, "gate_open", False)
                                                           or self.start_epoch != AUTO_START):
            options = dataclasses.replace(options, noise_threshold=0.0)
        if self.start_epoch != AUTO_START:
            return options
        decided = state.positions_start
        return dataclasses.replace(options, start_epoch=int(decided) if decided is not None else state.epoch + 1)

    def active(self, epoch: int) -> bool:
        if self.start_epoch is None or self.start_epoch == AUTO_START:
            raise ValueError(f"start_epoch is {self.start_epoch!r}: resolve the options first "
                             "(PositionOptions.for_engine, then for_state)")
        return epoch >= self.start_epoch


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and np.isfinite(v)
