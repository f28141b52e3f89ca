"""A probe that varies from pattern to pattern: OPR, per-pattern intensity, background.

Model (both engines). Pattern j sees the probe modes

    P_j0 = s_j · Σ_{k<K} w_jk U_k,    P_jm = s_j · P_m  (m ≥ 1 incoherent modes),

with U_0 = P_0 the mean probe (the state's first probe mode), U_1 … U_{K−1} the eigen-probes
of orthogonal probe relaxation (OPR; Odstrčil et al., Opt. Express 26, 3108, 2018) kept in the
state, w_j the pattern's real OPR weights (w_j0 ≈ 1 carries the flux of mode 0) and s_j² its
intensity factor (``fit_intensity``; with OPR as well, w_j0 stays 1 and s_j carries the flux).
The model intensity gains a fitted ``background``: one number or one value per detector pixel.

The weights and intensity factors are per-pattern state (``initial_local``): they live with
their chunk on its worker and are updated in the chunk step. What is global is small and
additive: the eigen-probe update numerators and preconditioners (summed over chunks), the
background residual sums. Once per epoch :func:`~.eigen_probes.orthonormalize` turns the
eigen-probes into an orthogonal set (orthogonal to U_0 too, ‖U_k‖ = ‖U_0‖, strongest first) and
returns the real K × K matrix T with ``w_new = w_old · T`` for every pattern: the state carries
T and every chunk applies it to its own weights at its next visit (:func:`model_local`), so no
weight ever travels for it.

Here: the options, the per-pattern state and its steps, the background. The eigen-probes are in
:mod:`.eigen_probes`, one chunk step's per-pattern probes in :mod:`.pattern_probes`. Pure
functions on NumPy/CuPy arrays; no dask.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..faults import ProbeModelDiverged  # noqa: F401 (also named here)
from .eigen_probes import effective_weights
from .engine_defaults import with_engine_defaults

BACKGROUNDS = (None, "constant", "pixel")
#: The probe model's per-pattern arrays (names in a chunk's per-pattern state): the OPR weights
#: and the intensity factors, each with its momentum (the last step taken, ``weight_momentum``).
PROBE_MODEL_KEYS = ("opr_weights", "opr_velocity", "intensity_scale", "intensity_velocity")
#: Per-pattern arrays in the eigen-probes' basis: the last orthonormalisation's T applies to them.
BASIS_KEYS = ("opr_weights", "opr_velocity")
#: Fewest patterns per OPR mode: K weights per pattern and K−1 eigen-probes need many more
#: patterns than modes to be determined (PtychoShelves' variable-probe examples use K ≤ 5 over
#: thousands of patterns).
PATTERNS_PER_MODE = 10
MAX_OPR_MODES = 16
#: Largest change of a pattern's weights in one step (relative to ‖U_0‖): a trust region for
#: the Gauss–Newton steps, whose linear model of the far field holds only for small changes.
WEIGHT_TRUST = 0.05
#: σ of :func:`flatten_brightness` in units of the pattern size n: the smooth part of the
#: brightness over the scan that the object's amplitude can carry (a window's content at scales
#: beyond about a probe radius). On the ideal ``simulate`` small preset (576 × 64², exact
#: positions, constant beam, R = 3), 60 epochs, ``fit_intensity`` alone: 1.18× the plain run's
#: NRMSE without the flattening, 1.00× with it.
BRIGHTNESS_SCALE = 0.25
#: Share of the smooth part of each step of the OPR weights' norm taken back with minibatch
#: rounds (:func:`damp_smooth_norm`). The ideal ``simulate`` small preset (576 × 64², constant
#: beam, K = 2, R = 3), seeds 0 / 1 / 2, NRMSE against the plain run's at 60 epochs: 0.5 1.034 /
#: 1.045 / 1.057×, 0.75 1.030 / 1.038 / 1.045×, 1 1.028 / 1.033 / 1.030×.
SMOOTH_NORM_DAMPING = 1.0
#: Shared eigen-probe weight rms (:func:`eigen_weight_sums`: √ of the mean product of the
#: weights of neighbouring patterns, relative to the mean probe's weight of 1; what noise fits
#: is not shared) from which a run whose rounds per epoch were "auto" goes on with one round per
#: epoch, once it has fitted the weights for :data:`VARYING_AFTER` epochs and the value has
#: stopped falling (:mod:`daskpty.execution.round_switch`). With minibatch rounds OPR stalls on a
#: probe that truly varies (the strongly drifting beam of bench_opr.py on a 24 × 24 raster,
#: R = 3: 1.8–2.7× the constant-probe NRMSE at 50 epochs), while on a constant beam one round
#: per epoch would slow the object (the ideal small preset from epoch 15 on: 1.49× the plain
#: run's at 60). Measured from the default start (epoch 15), R = 3, K = 2 and K = 3 with
#: intensity factors, LSQML and AD, from the sixth fitting epoch: ideal small preset 0.001–0.003;
#: bench_opr.py's beam (24 × 24 × 64²) held constant up to 0.019 but falling every epoch (it
#: first takes up what the object and the probe have not fitted yet: up to 0.05), at 10⁵ photons
#: at most 0.011, at 10⁴ 0.000 (seed 0) or 0.022 and growing (seed 1: object noise that
#: neighbours share; switched, it ended −3.5 % and +1.2 % off the runs kept at R = 3); drifting
#: ±30 % 0.04–0.08 and growing, ±7.5 % 0.016–0.04 (on some seeds falling to zero: those keep
#: their rounds).
VARYING_SHARED_RMS = 0.015
#: Epochs that fitted the eigen-probe weights before a run may switch to one round per epoch,
#: and the epoch (counted from ``start_epoch``) at which eigen-probes the data do not support
#: are dropped (:data:`EIGEN_SUPPORT_RMS`).
VARYING_AFTER = 6
#: Shared eigen-probe weight rms (as :data:`VARYING_SHARED_RMS`) below which, at the
#: :data:`VARYING_AFTER`-th epoch that fitted the weights, the eigen-probes are dropped
#: (``drop_unsupported_eigen``): every pattern's probe is then its weight times the mean probe,
#: as without OPR's shape modes. On a constant beam the weights take up part of what the
#: still-converging object should (the ideal small preset, K = 2 with intensity factors: 1.05–1.06×
#: the plain run's NRMSE at 60 epochs on seeds 5 and 6). Measured at that epoch (R = 3 unless
#: switched, K = 2 and 3 with intensity factors, LSQML): ideal small preset 0.0011–0.0026; beams
#: drifting ±7.5 % (24 × 24 × 64²) 0.010–0.016; a constant beam at 10⁴ photons 0.009 and 0.017.
EIGEN_SUPPORT_RMS = 0.005


@dataclass(frozen=True)
class ProbeModelOptions:
    """How the probe may vary over the scan (both engines).

    opr_modes: K, the modes of orthogonal probe relaxation counting the mean probe (0 or None:
        off; 1: one free weight of the mean probe per pattern; K ≥ 2 adds K − 1 eigen-probes).
    fit_intensity: fit a per-pattern intensity factor (flux fluctuations) multiplying every mode.
    background: None, ``"constant"`` (one fitted number added to every pixel of the model
        intensity) or ``"pixel"`` (one fitted value per detector pixel).
    start_epoch: first epoch that updates weights, intensities, eigen-probes and background
        (epochs count from 0; the object should have formed first). Default 15: on the drifting,
        flickering scan of bench_opr.py (40 epochs, K = 2) starting at 2 / 10 / 15 / 20 gives
        LSQML 1.64 / 1.60 / 1.49 / 1.50× and AD 1.30 / 1.22 / 1.14 / 1.16× the constant-probe
        NRMSE; the intensity factor alone likewise prefers 15.
    weight_step: damping of the per-pattern least-squares steps of weights and intensity
        factors (LSQML) or their preconditioned gradient steps (AD), 0 < step ≤ 1.
    brightness_first: LSQML: each pattern's brightness (the intensity factor, or OPR's mean-probe
        weight without one) takes its step before the object's in every round, and the object,
        probe and eigen-weight steps fit what it leaves (:meth:`~.pattern_probes.PatternProbes.brightness_step`).
        The object then no longer takes up a flickering flux, but it learns the brightness-like
        part of its own amplitude more slowly. Since the weights take momentum (the default) it
        is behind on the drifting, flickering scan of bench_opr.py (K = 2, five seeds, ratio to
        the constant-probe NRMSE): 1.11 against 1.05× at 40 epochs, 1.30 against 1.04× at 80.
        Off by default.
    eigen_step: damping of the eigen-probe updates, 0 < step ≤ 1 (None: the engine's own,
        ``EngineSpec.probe_model_defaults``: 0.5).
    background_step: damping of the background update, 0 < step ≤ 1.
    max_weight: |weight| (relative to the mean probe) or intensity factor beyond which the run
        stops with :class:`ProbeModelDiverged`.
    curvature_damping: the weights' Levenberg–Marquardt damping, relative to the exit-wave
        curvature ‖U_k O_j‖² (see :meth:`~.pattern_probes.PatternProbes.weight_curvature`); None: the engine's
        own (``EngineSpec.probe_model_defaults``: LSQML 0.02, AD 0.002).
    weight_smoothing: σ in object pixels of a Gaussian smoothing of the eigen-probe weights
        (k ≥ 1) over neighbouring scan positions after each step (0: off). The probe's shape
        drifts slowly, so neighbours share it; the mean probe's weight (flux) is never smoothed.
        Within a chunk only (each chunk keeps its own weights).
    weight_momentum: heavy-ball momentum μ of the OPR weights' steps, 0 ≤ μ < 1: each pattern's
        step is Δw_j + μ v_j, v_j its last one (kept with the weights, ``opr_velocity``). None:
        the engine's own (``EngineSpec.probe_model_defaults``: 0.5, LSQML's object's own momentum).
    flat_brightness: leave the smooth part over the scan of the fitted brightness to the object,
        which the data cannot tell it from: the intensity factors keep only their
        pattern-to-pattern part (:func:`flatten_model_local`), OPR's weights without them only
        that part of each step of their norm (:func:`damp_smooth_norm`). None: on with minibatch
        rounds, off with one round per epoch (:meth:`for_rounds`).
    flat_from_epoch: the first epoch whose steps flatten the intensity factors (None: each; a
        run watching for the switch to one round per epoch flattens them only after the watch,
        :meth:`for_rounds`).
    drop_unsupported_eigen: at the :data:`VARYING_AFTER`-th epoch that fitted the eigen-probe
        weights, drop the eigen-probes (their weights go to zero and stay there) when the
        weights' shared rms is below :data:`EIGEN_SUPPORT_RMS`: the data show no probe shape
        varying over the scan, and fitted weights would only take up object structure and noise.
        The intensity factors and the mean probe's weights go on.
    """

    opr_modes: int | None = 0
    fit_intensity: bool = False
    background: str | None = None
    start_epoch: int = 15
    weight_step: float = 0.5
    brightness_first: bool = False
    eigen_step: float | None = None
    background_step: float = 0.5
    max_weight: float = 100.0
    curvature_damping: float | None = None
    weight_smoothing: float = 0.0
    weight_momentum: float | None = None
    flat_brightness: bool | None = None
    flat_from_epoch: int | None = None
    drop_unsupported_eigen: bool = True

    def __post_init__(self):
        def check(ok, message):
            if not ok:
                raise ValueError(f"probe model: {message}")

        k = 0 if self.opr_modes is None else self.opr_modes
        check(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 0 <= k <= MAX_OPR_MODES,
              f"opr_modes must be an integer in 0 … {MAX_OPR_MODES}, got {self.opr_modes!r}")
        object.__setattr__(self, "opr_modes", int(k))
        check(isinstance(self.fit_intensity, (bool, np.bool_)),
              f"fit_intensity must be True or False, got {self.fit_intensity!r}")
        check(self.flat_brightness is None or isinstance(self.flat_brightness, (bool, np.bool_)),
              f"flat_brightness must be None, True or False, got {self.flat_brightness!r}")
        check(self.flat_from_epoch is None or isinstance(self.flat_from_epoch, (int, np.integer))
              and not isinstance(self.flat_from_epoch, bool) and self.flat_from_epoch >= 0,
              f"flat_from_epoch must be None or an integer >= 0, got {self.flat_from_epoch!r}")
        check(isinstance(self.brightness_first, (bool, np.bool_)),
              f"brightness_first must be True or False, got {self.brightness_first!r}")
        check(self.background in BACKGROUNDS,
              f"background must be None, 'constant' or 'pixel', got {self.background!r}")
        check(isinstance(self.start_epoch, (int, np.integer)) and self.start_epoch >= 0,
              f"start_epoch must be an integer >= 0, got {self.start_epoch!r}")
        for name in ("weight_step", "eigen_step", "background_step"):
            v = getattr(self, name)
            check(v is None and name == "eigen_step" or _number(v) and 0 < v <= 1,
                  f"{name} must lie in (0, 1], got {v!r}")
        check(self.curvature_damping is None or _number(self.curvature_damping) and 0 <= self.curvature_damping <= 1,
              f"curvature_damping must lie in [0, 1], got {self.curvature_damping!r}")
        check(_number(self.weight_smoothing) and self.weight_smoothing >= 0,
              f"weight_smoothing must be a number of pixels >= 0, got {self.weight_smoothing!r}")
        check(self.weight_momentum is None or _number(self.weight_momentum) and 0 <= self.weight_momentum < 1,
              f"weight_momentum must lie in [0, 1), got {self.weight_momentum!r}")
        check(_number(self.max_weight) and self.max_weight > 1,
              f"max_weight must be a number > 1, got {self.max_weight!r}")

    def for_rounds(self, rounds: int, watching: bool = False) -> "ProbeModelOptions":
        """These options with ``flat_brightness`` left None set for ``rounds`` rounds per epoch:
        on with minibatch rounds (more than one), off with one. ``watching``: the run goes on
        with one round per epoch once the eigen-probe weights show a varying probe
        (:mod:`daskpty.execution.round_switch`); then ``flat_from_epoch`` left None is the first
        epoch after that watch (:data:`VARYING_AFTER` fitting epochs), so that a run which
        switches has not left the smooth part of a varying brightness to the object first."""
        if self.flat_brightness is not None:
            return self
        flat = int(rounds) > 1
        after_watch = self.start_epoch + VARYING_AFTER if flat and watching and self.flat_from_epoch is None \
            else self.flat_from_epoch
        return dataclasses.replace(self, flat_brightness=flat, flat_from_epoch=after_watch)

    def for_engine(self, engine: str) -> "ProbeModelOptions":
        """These options with every setting left None set to ``engine``'s default."""
        return with_engine_defaults(self, "probe_model", engine)

    @classmethod
    def from_arguments(cls, opr_modes=None, fit_intensity=False, background=None,
                       probe_model=None) -> "ProbeModelOptions | None":
        """``reconstruct``'s shortcuts (and an optional ``probe_model`` dict / instance for the
        rest); None when nothing varies (today's code path, bit for bit)."""
        if isinstance(probe_model, cls):
            options = probe_model
        elif probe_model is None or isinstance(probe_model, dict):
            given = dict(probe_model or {})
            names = set(cls.__dataclass_fields__)
            unknown = sorted(set(given) - names)
            if unknown:
                raise TypeError(f"probe_model: unknown option(s) {unknown}; valid: {sorted(names)}")
            given.setdefault("opr_modes", opr_modes)
            given.setdefault("fit_intensity", fit_intensity)
            given.setdefault("background", background)
            options = cls(**given)
        else:
            raise TypeError(f"probe_model must be a dict or a ProbeModelOptions, got {probe_model!r}")
        return options if options.enabled else None

    @property
    def enabled(self) -> bool:
        return bool(self.opr_modes or self.fit_intensity or self.background)

    @property
    def per_pattern(self) -> bool:
        """Whether there is per-pattern state (weights or intensity factors)."""
        return bool(self.opr_modes or self.fit_intensity)

    @property
    def n_eigen(self) -> int:
        return max(self.opr_modes - 1, 0)

    @property
    def fit_mean_weight(self) -> bool:
        """w_j0 is fitted (OPR without a separate intensity factor)."""
        return self.opr_modes >= 1 and not self.fit_intensity

    def active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch

    def check_run(self, n_patterns: int, probe_updated: bool, engine: str) -> None:
        """Refuse settings that cannot work on this data set or engine."""
        from .specs import ENGINE_SPECS, engine_spec  # the spec table imports the engines, which import this

        if self.brightness_first and not engine_spec(engine).brightness_first:
            takers = " or ".join(f"engine={n!r}" for n, s in ENGINE_SPECS.items() if s.brightness_first)
            raise ValueError(f"probe model: brightness_first is an LSQML setting (AD steps every parameter "
                             f"from one gradient); drop it or use {takers}")
        k = self.opr_modes
        if k and n_patterns < PATTERNS_PER_MODE * k:
            raise ValueError(f"opr_modes={k} is too many for {n_patterns} patterns: OPR needs at least "
                             f"{PATTERNS_PER_MODE} patterns per mode (at most "
                             f"{max(n_patterns // PATTERNS_PER_MODE, 0)} modes here)")
        if k >= 2 and not probe_updated:
            raise ValueError(f"opr_modes={k} needs probe updates, but the probe is never updated "
                             "(probe_start_epoch=None); enable probe updates or drop OPR")


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and np.isfinite(v)


# --- per-pattern state -------------------------------------------------------------------------

def initial_local(n_patterns: int, options: ProbeModelOptions) -> dict:
    """The per-pattern state of one chunk: ``opr_weights`` (B, K) = [1, 0, …] (with
    ``weight_momentum`` also their last step ``opr_velocity`` (B, K) = 0) and/or
    ``intensity_scale`` (B, 1) = 1 (intensity factors s_j²), float64. ``options`` resolved for
    the engine (:meth:`ProbeModelOptions.for_engine`)."""
    local = {}
    if options.opr_modes:
        w = np.zeros((n_patterns, options.opr_modes))
        w[:, 0] = 1.0
        local["opr_weights"] = w
        if options.weight_momentum:
            local["opr_velocity"] = np.zeros_like(w)
    if options.fit_intensity:
        local["intensity_scale"] = np.ones((n_patterns, 1))
        if options.weight_momentum:
            local["intensity_velocity"] = np.zeros((n_patterns, 1))
    return local


def model_local(local: dict | None, transform) -> dict:
    """The probe model's per-pattern arrays of a chunk's ``local``, those in the eigen-probes'
    basis (weights, their velocity) moved into the current one by the last epoch's T."""
    out = {k: local[k] for k in PROBE_MODEL_KEYS if local and k in local}
    if transform is not None:
        out.update({k: effective_weights(out[k], transform) for k in BASIS_KEYS if k in out})
    return out


def step_weights(weights, step, free: slice, options: ProbeModelOptions, velocity=None):
    """``weights`` (B, K) after the step ``step`` (B, len(free)) of their ``free`` columns, with
    heavy-ball momentum: Δ = step + μ v (μ = ``options.weight_momentum``, v = ``velocity``, the
    last Δ). Returns ``(weights, velocity)``, new arrays (velocity None without one)."""
    weights = np.array(weights, dtype=np.float64)
    move = np.asarray(step, np.float64)
    if velocity is not None:
        velocity = np.array(velocity, dtype=np.float64)
        move = move + (options.weight_momentum or 0.0) * velocity[:, free]
        velocity[:, free] = move
    weights[:, free] += move
    return weights, velocity


def step_factors(factors, step, options: ProbeModelOptions, velocity=None):
    """Per-pattern factors (B,) after ``step`` (B,) with the momentum of :func:`step_weights`,
    kept ≥ 0. Returns ``(factors, velocity)``; velocity (B, 1) or None."""
    factors, velocity = step_weights(np.asarray(factors)[:, None], np.asarray(step)[:, None], slice(0, 1),
                                     options, velocity)
    return np.maximum(factors[:, 0], 0.0), velocity


def smooth_eigen_weights(weights, positions, sigma: float) -> np.ndarray:
    """``weights`` (B, K) with columns 1 … K−1 replaced by their Gaussian average (σ = ``sigma``
    pixels, cut at 3σ) over the patterns at ``positions`` (B, 2); column 0 (the mean probe's
    weight, the flux) as given. A new array; ``sigma`` 0 returns the weights unchanged."""
    weights = np.asarray(weights, dtype=np.float64)
    if not sigma or weights.shape[1] < 2 or len(weights) < 2:
        return weights
    kernel, norm = _gaussian_kernel(positions, sigma)
    out = weights.copy()
    out[:, 1:] = (kernel @ weights[:, 1:]) / norm[:, None]
    return out


def eigen_weight_sums(new: dict) -> dict:
    """A chunk's sums for the eigen-probe weights' rms: Σ_j Σ_k≥1 w_jk² (``opr_eigen_sq``) and
    the number of terms (``opr_eigen_terms``), and for their shared rms
    (:data:`VARYING_SHARED_RMS`) Σ_j Σ_k≥1 w_jk w_(j+1)k over the step's consecutive patterns
    (neighbours along the chunk's curve through the scan; ``opr_eigen_lag``, with its
    ``opr_eigen_lag_terms``), from the weights a step fitted (``new["opr_weights"]``, (B, K));
    empty without eigen-probes."""
    w = new.get("opr_weights")
    if w is None or np.shape(w)[1] < 2:
        return {}
    eigen = np.asarray(w, np.float64)[:, 1:]
    return {"opr_eigen_sq": float(np.sum(eigen * eigen)), "opr_eigen_terms": float(eigen.size),
            "opr_eigen_lag": float(np.sum(eigen[1:] * eigen[:-1])), "opr_eigen_lag_terms": float(eigen[1:].size)}


def flatten_brightness(values, positions, sigma: float) -> np.ndarray:
    """Positive factors ``values`` (B, 1) divided by their Gaussian-weighted geometric mean
    (σ = ``sigma`` pixels, cut at 3σ) over the patterns at ``positions`` (B, 2): what is left
    varies from pattern to pattern, not smoothly over the scan. A new array."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return values
    kernel, norm = _gaussian_kernel(positions, sigma)
    smooth = (kernel @ np.log(np.maximum(values[:, 0], 1e-12))) / norm
    return values * np.exp(-smooth)[:, None]


def flattens(options: ProbeModelOptions, epoch: int) -> bool:
    """Whether the steps of ``epoch`` leave the intensity factors' smooth part to the object
    (``flat_brightness``, from ``flat_from_epoch`` on)."""
    if not options.flat_brightness:
        return False
    return options.flat_from_epoch is None or int(epoch) >= options.flat_from_epoch


def flatten_model_local(new: dict, positions, options: ProbeModelOptions, n: int, epoch: int) -> dict:
    """``new`` with the intensity factors flattened over the scan (:func:`flatten_brightness`,
    σ = :data:`BRIGHTNESS_SCALE` · n for patterns of n² pixels) when the steps of ``epoch`` do
    (:func:`flattens`).

    A brightness that varies smoothly over the scan is the same data as a smooth object
    amplitude (each window sees one number either way), so the data cannot say which of the two
    to change and minibatch rounds walk between them; the object keeps that part, the pattern
    factors what changes from one pattern to its neighbours (a flickering flux). With one round
    per epoch nothing walks, and flattening would cost what the overlap can tell of a
    flickering flux's local mean, so it is off there (:meth:`ProbeModelOptions.for_rounds`; the
    strongly drifting, flickering scan of bench_opr.py, K = 3 with intensity factors, seeds
    0 / 1 / 2, the constant-probe NRMSE at 50 epochs: LSQML 1.45 / 1.16 / 1.28× flattened,
    1.02 / 0.76 / 0.83× not; AD 1.44 / 1.22 / 1.31× and 0.96 / 0.81 / 0.90×). OPR's weights
    without intensity factors: :func:`damp_smooth_norm`."""
    if not flattens(options, epoch) or positions is None:
        return new
    sigma = BRIGHTNESS_SCALE * n
    out = dict(new)
    if "intensity_scale" in new:
        out["intensity_scale"] = flatten_brightness(new["intensity_scale"], positions, sigma)
    return out


def damp_smooth_norm(before, after, velocity, positions, options: ProbeModelOptions, n: int):
    """OPR weights without intensity factors, when ``options.flat_brightness``: ``after`` (B, K),
    the weights stepped from ``before``, with :data:`SMOOTH_NORM_DAMPING` of the smooth part over
    the scan (:func:`flatten_brightness`, σ = :data:`BRIGHTNESS_SCALE` · n) of the step of each
    pattern's weight norm (its brightness) taken back, every weight of the pattern scaled alike
    (the probe's shape, the eigen-probes' share, as stepped); ``velocity`` (the last move, or
    None) follows. Returns ``(weights, velocity)``.

    The smooth brightness and a smooth object amplitude are the same data, and in every
    minibatch round the object and the weights each take a full step for it, overshooting
    together (the ideal ``simulate`` small preset, 576 × 64², constant beam, K = 2 at three
    rounds per epoch: 1.19× the plain run's NRMSE at 60 epochs, the loss rising 14 % in one
    epoch; 1.03× with the smooth part taken back). The mean probe's weight alone is no
    brightness where eigen-probes share the probe, so the norm is what is held: flattening
    w_j0 alone cost the gently drifting scan of bench_opr.py 1.84× the constant-probe NRMSE."""
    if not options.flat_brightness or not options.fit_mean_weight or positions is None or len(after) < 2:
        return after, velocity
    power_before = np.maximum((np.asarray(before, np.float64) ** 2).sum(axis=1, keepdims=True), 1e-300)
    ratio = np.sqrt(np.maximum((after * after).sum(axis=1, keepdims=True), 1e-300) / power_before)
    factor = (flatten_brightness(ratio, positions, BRIGHTNESS_SCALE * n) / ratio) ** SMOOTH_NORM_DAMPING
    damped = after * factor
    if velocity is not None:
        velocity = velocity + (damped - after)
    return damped, velocity


def _gaussian_kernel(positions, sigma: float):
    """The sparse Gaussian kernel (σ = ``sigma`` pixels, cut at 3σ, the pattern itself 1) between
    the patterns at ``positions`` (B, 2), CSR, and its row sums."""
    from scipy.spatial import cKDTree

    tree = cKDTree(np.asarray(positions, dtype=np.float64))
    pairs = tree.sparse_distance_matrix(tree, 3.0 * sigma, output_type="coo_matrix")
    kernel = pairs.copy()
    kernel.data = np.exp(-0.5 * (pairs.data / sigma) ** 2)
    kernel.setdiag(1.0)  # the pattern itself (distance 0 is not stored)
    kernel = kernel.tocsr()
    return kernel, np.asarray(kernel.sum(axis=1)).ravel()


def add_eigen_lag_sums(sums, scalars: dict):
    """``sums`` ([Σ of neighbours' eigen-weight products, their count], or None) with a round's
    chunk scalars (:func:`eigen_weight_sums`) added."""
    if not scalars.get("opr_eigen_lag_terms"):
        return sums
    new = np.array([scalars["opr_eigen_lag"], scalars["opr_eigen_lag_terms"]], np.float64)
    return new if sums is None else sums + new


def eigen_unsupported(state, options: ProbeModelOptions) -> bool:
    """Whether the epoch ending now drops the eigen-probes (``drop_unsupported_eigen``): it is the
    :data:`VARYING_AFTER`-th that fitted their weights, and the weights' shared rms over its
    rounds (``state.eigen_lag_sums``) is below :data:`EIGEN_SUPPORT_RMS`."""
    sums = state.eigen_lag_sums
    if not options.drop_unsupported_eigen or sums is None or sums[1] <= 0 or state.eigen_probes is None:
        return False
    if state.epoch - options.start_epoch + 1 != VARYING_AFTER:
        return False
    return float(np.sqrt(max(sums[0], 0.0) / sums[1])) < EIGEN_SUPPORT_RMS


def drop_eigen_probes(state) -> None:
    """Eigen-probes to zero, so the epoch's orthonormalisation gives the weight transform that
    zeroes every pattern's eigen-weights (and their momentum); zero eigen-probes are a fixed
    point of every later step (no weight or eigen-probe update has a direction)."""
    state.eigen_probes = np.zeros_like(state.eigen_probes)
    state.eigen_weight_sums = None   # their mean moves nothing into the mean probe


def check_finite(local: dict, options: ProbeModelOptions, epoch: int) -> None:
    """Stop with :class:`ProbeModelDiverged` when weights or intensities go non-finite or huge."""
    for name, what in (("opr_weights", "OPR weights"), ("intensity_scale", "intensity factors")):
        if name not in local:
            continue
        v = np.asarray(local[name])
        bad = ~np.isfinite(v)
        big = np.abs(np.where(bad, 0.0, v)) > options.max_weight
        if bad.any() or big.any():
            count = int((bad | big).any(axis=1).sum())
            raise ProbeModelDiverged(
                f"the probe model diverged in epoch {epoch + 1}: {count} pattern(s) have "
                f"{'non-finite' if bad.any() else f'|value| > {options.max_weight:g}'} {what}; "
                "lower weight_step, start later (start_epoch) or use fewer opr_modes")


def solve_weight_steps(gram, rhs, tikhonov: float = 1e-2, trust: float | None = None) -> np.ndarray:
    """Per-pattern least-squares steps Δw = (G + λ diag G)⁻¹ h, (B, K) float64 (each weight
    damped relative to its own curvature: the eigen-probes' is far below the mean probe's),
    each pattern's step scaled down to |Δw|∞ ≤ ``trust`` (the weights are relative to ‖U_0‖)."""
    gram = np.asarray(gram, dtype=np.float64)
    rhs = np.asarray(rhs, dtype=np.float64)
    k = gram.shape[-1]
    diag = np.einsum("bkk->bk", gram)
    floor = tikhonov * diag + 1e-30 * (1.0 + diag.max(axis=1, keepdims=True))
    gram = gram + floor[:, :, None] * np.eye(k)[None]
    step = np.linalg.solve(gram, rhs[..., None])[..., 0]
    if trust is not None:
        big = np.abs(step).max(axis=1, keepdims=True)
        step = step * np.minimum(1.0, trust / np.maximum(big, 1e-300))
    return step


def initial_background(options: ProbeModelOptions, n: int) -> np.ndarray | None:
    if options.background == "constant":
        return np.zeros((1, 1), np.float32)
    if options.background == "pixel":
        return np.zeros((n, n), np.float32)
    return None


def step_background(background, residual_sum, count: float, options: ProbeModelOptions, valid=None):
    """bg ← max(0, bg + step · mean_j (y_j − ŷ_j)) (per pixel, or over all valid pixels for a
    constant): the Gauss–Newton step of the intensity residual, kept non-negative.
    ``residual_sum``: Σ_j (y_j − ŷ_j) per pixel (n·n,), ``count`` the patterns summed."""
    residual = np.asarray(residual_sum, dtype=np.float64)
    n = int(round(np.sqrt(residual.size)))
    residual = residual.reshape(n, n)
    if valid is not None:
        residual = residual * valid
    if np.shape(background) == (1, 1):
        pixels = residual.size if valid is None else max(int(np.count_nonzero(valid)), 1)
        delta = residual.sum() / (count * pixels)
    else:
        delta = residual / count
    return np.maximum(np.asarray(background, np.float64) + options.background_step * delta, 0).astype(np.float32)
