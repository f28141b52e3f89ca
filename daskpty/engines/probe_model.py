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
background residual sums. Once per epoch :func:`orthonormalize` turns the eigen-probes into an
orthogonal set (orthogonal to U_0 too, ‖U_k‖ = ‖U_0‖, strongest first) and returns the real
K × K matrix T with ``w_new = w_old · T`` for every pattern: the state carries T and every
chunk applies it to its own weights at its next visit (:meth:`PatternProbes.weights_for_step`),
so no weight ever travels for it.

Pure functions on NumPy/CuPy arrays; no dask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..physics import fft2, get_xp
from ..physics.backend import asarray_like, real_dots, to_numpy
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
#: The weights' Gauss–Newton curvature is measured on every CURVATURE_STRIDE-th pattern of a
#: chunk step (more often in short steps, so that at least CURVATURE_SAMPLES are measured).
CURVATURE_STRIDE = 32
CURVATURE_SAMPLES = 4
#: Largest change of a pattern's weights in one step (relative to ‖U_0‖): a trust region for
#: the Gauss–Newton steps, whose linear model of the far field holds only for small changes.
WEIGHT_TRUST = 0.05
#: Largest change of an eigen-probe in one round, relative to ‖U_0‖ (they are kept at ‖U_0‖).
#: Their least-squares step divides by the weights' spread, still tiny when the fit starts,
#: and in minibatch rounds a step grew from round to round: AD with K = 3 on a 24 × 24 raster
#: (R = 3) took steps of 0.45 ‖U_0‖ at once and up to 1.9 ‖U_0‖ later, and ended at 6.8× the
#: constant-probe NRMSE (worse than no OPR); with the limit 2.3×. bench_opr's scan (R = 1)
#: does not reach the limit often (five seeds, K = 2 / 3: LSQML 1.05 → 1.03×, AD 1.09 → 1.09×
#: / 1.12 → 1.12×).
EIGEN_TRUST = 0.05
#: Relative Tikhonov term of the intensity factors' least-squares step (LSQML).
INTENSITY_TIKHONOV = 1e-3

#: Each engine's defaults of the settings left None (:meth:`ProbeModelOptions.for_engine`),
#: measured on the drifting, flickering scan of benchmarks/bench_opr.py (docs/benchmarks.md,
#: OPR). AD takes the nearly exact weight curvature (damping 0.002: 1.43× → 1.14× the
#: constant-probe NRMSE); LSQML's weights need the stronger damping. LSQML's weights take
#: heavy-ball momentum (0.5, its object's own): without it the flux that each pattern's object
#: window took up before ``start_epoch`` comes back to the weight with a time constant of ~10
#: epochs, and the eigen-probes had to creep (0.02) or they fitted the weights' lag. K = 2,
#: 40 / 80 epochs, mean of five seeds: 1.33 / 1.43× the constant-probe NRMSE without momentum
#: (eigen step 0.02), 1.05 / 1.04× with it and full eigen-probe steps (0.5, as AD's).
ENGINE_DEFAULTS = {"lsqml": {"curvature_damping": 0.02, "eigen_step": 0.5, "weight_momentum": 0.5},
                   "ad": {"curvature_damping": 0.002, "eigen_step": 0.5, "weight_momentum": 0.0}}


class ProbeModelDiverged(ValueError):
    """A per-pattern probe weight or intensity factor became non-finite (or absurdly large)."""


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
        probe and eigen-weight steps fit what it leaves (:meth:`PatternProbes.brightness_step`).
        The object then no longer takes up a flickering flux, but it learns the brightness-like
        part of its own amplitude more slowly. Since the weights take momentum (the default) it
        is behind on the drifting, flickering scan of bench_opr.py (K = 2, five seeds, ratio to
        the constant-probe NRMSE): 1.11 against 1.05× at 40 epochs, 1.30 against 1.04× at 80.
        Off by default.
    eigen_step: damping of the eigen-probe updates, 0 < step ≤ 1 (None: the engine's own,
        :data:`ENGINE_DEFAULTS`: 0.5).
    background_step: damping of the background update, 0 < step ≤ 1.
    max_weight: |weight| (relative to the mean probe) or intensity factor beyond which the run
        stops with :class:`ProbeModelDiverged`.
    curvature_damping: the weights' Levenberg–Marquardt damping, relative to the exit-wave
        curvature ‖U_k O_j‖² (see :meth:`PatternProbes.weight_curvature`); None: the engine's
        own (:data:`ENGINE_DEFAULTS`: LSQML 0.02, AD 0.002).
    weight_smoothing: σ in object pixels of a Gaussian smoothing of the eigen-probe weights
        (k ≥ 1) over neighbouring scan positions after each step (0: off). The probe's shape
        drifts slowly, so neighbours share it; the mean probe's weight (flux) is never smoothed.
        Within a chunk only (each chunk keeps its own weights).
    weight_momentum: heavy-ball momentum μ of the OPR weights' steps, 0 ≤ μ < 1: each pattern's
        step is Δw_j + μ v_j, v_j its last one (kept with the weights, ``opr_velocity``). None:
        the engine's own (:data:`ENGINE_DEFAULTS`: LSQML 0.5, as its object's momentum; AD 0).
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

    def for_engine(self, engine: str) -> "ProbeModelOptions":
        """These options with every setting left None set to ``engine``'s default."""
        return with_engine_defaults(self, ENGINE_DEFAULTS, engine)

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

    def check_run(self, n_patterns: int, probe_updated: bool, engine: str = "lsqml") -> None:
        """Refuse settings that cannot work on this data set or engine."""
        if self.brightness_first and engine != "lsqml":
            raise ValueError("probe model: brightness_first is an LSQML setting (AD steps every parameter "
                             "from one gradient); drop it or use engine='lsqml'")
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


def smooth_eigen_weights(weights, positions, sigma: float) -> np.ndarray:
    """``weights`` (B, K) with columns 1 … K−1 replaced by their Gaussian average (σ = ``sigma``
    pixels, cut at 3σ) over the patterns at ``positions`` (B, 2); column 0 (the mean probe's
    weight, the flux) as given. A new array; ``sigma`` 0 returns the weights unchanged."""
    weights = np.asarray(weights, dtype=np.float64)
    if not sigma or weights.shape[1] < 2 or len(weights) < 2:
        return weights
    from scipy.spatial import cKDTree

    pos = np.asarray(positions, dtype=np.float64)
    tree = cKDTree(pos)
    pairs = tree.sparse_distance_matrix(tree, 3.0 * sigma, output_type="coo_matrix")
    kernel = pairs.copy()
    kernel.data = np.exp(-0.5 * (pairs.data / sigma) ** 2)
    kernel.setdiag(1.0)  # the pattern itself (distance 0 is not stored)
    kernel = kernel.tocsr()
    norm = np.asarray(kernel.sum(axis=1)).ravel()
    out = weights.copy()
    out[:, 1:] = (kernel @ weights[:, 1:]) / norm[:, None]
    return out


def effective_weights(weights, transform) -> np.ndarray:
    """Stored weights in the current eigen-probe basis (``weights · T``; T None: as stored)."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights if transform is None else weights @ np.asarray(transform, dtype=np.float64)


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


# --- the eigen-probes --------------------------------------------------------------------------

def initial_eigen_probes(probe0, n_eigen: int, seed: int = 0) -> np.ndarray:
    """K − 1 starting eigen-probes (K−1, n, n) complex64, orthogonal to P_0 and to each other,
    each as strong as P_0 (their weights start at zero), in the order of how a beam drifts:

    1. defocus, the derivative of P_0 along the beam: i F⁻¹(|k|² F P_0) (a change of the
       propagation distance to the sample, or of the lens' focus);
    2. a real-space curvature of the phase, P_0 · i(r² − ⟨r²⟩) (a change of the lens' focal
       length seen at the sample);
    then seeded noise. Not the beam's pointing (the shifts ∂P_0/∂y, ∂P_0/∂x): a pattern's probe
    shifted is its window moved, which position refinement fits, and as eigen-probes the shifts
    fitted the object's errors along the scan (bench_opr.py's scan, five seeds, LSQML / AD:
    K = 3 1.38 / 1.12× the constant-probe NRMSE with the shift ∂P_0/∂y second, 1.08 / 1.09×
    with the curvature second; K = 4 1.63 / 1.20× with both shifts, 1.20 / 1.16× without)."""
    probe0 = np.asarray(to_numpy(probe0), dtype=np.complex128)
    n = probe0.shape[-1]
    if n_eigen == 0:
        return np.zeros((0, n, n), np.complex64)
    power = np.abs(probe0) ** 2
    total = power.sum() or 1.0
    y, x = _coordinates_about_power_centre(probe0)
    r2 = y * y + x * x
    spectrum = np.fft.fft2(probe0)
    k = np.fft.fftfreq(n)
    ky, kx = np.meshgrid(k, k, indexing="ij")
    directions = [np.fft.ifft2(1j * (ky * ky + kx * kx) * spectrum),
                  probe0 * 1j * (r2 - (power * r2).sum() / total)]
    rng = np.random.default_rng(seed)
    while len(directions) < n_eigen:
        directions.append(probe0 * (rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))))
    eigen, _ = orthonormalize(probe0, np.stack(directions[:n_eigen]))
    return eigen


def _real_view(a, required: bool = True):
    """A complex array (..., m) whose last axis is contiguous as a real one (..., 2m), no copy
    (None when the namespace cannot, and not ``required``; else a contiguous copy)."""
    try:
        return a.view(a.real.dtype)
    except (ValueError, TypeError):
        if not required:
            return None
        xp = get_xp(a)
        return xp.ascontiguousarray(a).view(a.real.dtype)


def _real_rows(a):
    """Complex rows (K, ...) as real rows (K, 2·size): the real inner product Re⟨a, b⟩."""
    a = np.asarray(a, dtype=np.complex128).reshape(len(a), -1)
    return np.concatenate([a.real, a.imag], axis=1)


def unseen_directions(probe0) -> np.ndarray:
    """The changes of P_0 that the data cannot tell from the object (3, n, n): i P_0 (a pattern's
    own phase: its intensities do not change) and i y P_0, i x P_0 (a linear phase across the
    probe, y and x from its centre of power: the same as a local phase gradient of the object).

    Weights that vary smoothly over the scan along these let a smooth object phase trade with
    the probe: an object phase c·y² looks, pattern by pattern, like a probe tilt 2c·y_j. OPR
    then drifts along that valley instead of fitting the beam (the 22 × 22 scan at a 2.5 px step
    of bench_opr.py, defocus drift only: object NRMSE 0.027 (LSQML) and 0.044 (AD) with such
    eigen-probes, worse than no OPR (0.018 / 0.016); 0.016 / 0.016 without them), so
    :func:`orthonormalize` keeps the eigen-probes orthogonal to them."""
    p = np.asarray(to_numpy(probe0), dtype=np.complex128)
    y, x = _coordinates_about_power_centre(p)
    return np.stack([1j * p, 1j * y * p, 1j * x * p])


def _coordinates_about_power_centre(probe0) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates (y, x), each (n, n), measured from the probe's centre of power."""
    power = np.abs(probe0) ** 2
    total = power.sum() or 1.0
    c = np.arange(probe0.shape[-1]) - (probe0.shape[-1] - 1) / 2.0
    y, x = np.meshgrid(c, c, indexing="ij")
    return y - (power * y).sum() / total, x - (power * x).sum() / total


def orthonormalize(probe0, eigen) -> tuple[np.ndarray, np.ndarray | None]:
    """Eigen-probes made orthogonal to P_0, to the changes the data do not see
    (:func:`unseen_directions`, whose parts are dropped) and to each other (real inner product;
    SVD, strongest first), each of norm ‖P_0‖, and the K × K real matrix T that keeps every
    pattern's probe, but for the dropped parts: Σ_k w_k U_k = Σ_k (w T)_k U'_k with
    U_0 = U'_0 = P_0. Returns ``(eigen', T)``."""
    eigen = np.asarray(to_numpy(eigen))
    k1 = eigen.shape[0]
    if k1 == 0:
        return eigen.astype(np.complex64), None
    p0 = _real_rows(to_numpy(probe0)[None])[0]
    norm0 = float(np.sqrt(p0 @ p0))
    rows = _real_rows(eigen)
    unseen = np.linalg.qr(_real_rows(unseen_directions(probe0)).T)[0]  # orthonormal columns, ⟂ P_0
    rows = rows - (rows @ unseen) @ unseen.T
    coef = rows @ p0 / (norm0 * norm0)                        # component along U_0
    rest = rows - coef[:, None] * p0[None]
    u, s, vh = np.linalg.svd(rest, full_matrices=False)
    keep = s > 1e-12 * max(float(s.max()), 1e-300)
    vh = np.where(keep[:, None], vh, 0.0)                    # a vanished mode stays zero
    new_rows = norm0 * vh                                     # U'_l, norm ‖U_0‖
    transform = np.zeros((k1 + 1, k1 + 1))
    transform[0, 0] = 1.0
    transform[1:, 0] = coef
    transform[1:, 1:] = u * (s / norm0)[None, :]              # U_k − c_k U_0 = Σ_l B_kl U'_l
    half = new_rows.shape[1] // 2
    new = (new_rows[:, :half] + 1j * new_rows[:, half:]).reshape(eigen.shape)
    return new.astype(np.complex64), transform


# --- one chunk's per-pattern probes -----------------------------------------------------------

class PatternProbes:
    """The per-pattern probes of one chunk step, and what the step learns about them.

    ``probe_ft`` (M, n, n) spectra of the state's probe modes; ``eigen`` (K−1, n, n) the
    eigen-probes (real space); ``local`` the step's per-pattern state (already transformed by the
    last epoch's T, see :meth:`weights_for_step`). Methods are called per sub-batch of patterns
    by the engines' chunk steps; everything stays in the namespace of the chunk's data.
    """

    def __init__(self, options: ProbeModelOptions, probe, eigen, local: dict, like, *, active: bool,
                 background=None, cdtype=np.complex64):
        xp = get_xp(like)
        self.xp, self.options, self.active = xp, options, active
        self.cdtype = cdtype = np.dtype(cdtype)
        self.rdtype = rdtype = np.float64 if cdtype == np.complex128 else np.float32
        probe = asarray_like(probe, like).astype(cdtype, copy=False)
        self.n_modes, self.n = probe.shape[0], probe.shape[-1]
        self.weights = None if "opr_weights" not in local else np.asarray(local["opr_weights"], np.float64)
        self.velocity = None if "opr_velocity" not in local else np.asarray(local["opr_velocity"], np.float64)
        self.intensity_velocity = local.get("intensity_velocity")   # of s_j (LSQML's momentum)
        scale = local.get("intensity_scale")
        self.amplitude = None if scale is None else np.sqrt(np.maximum(np.asarray(scale, np.float64)[:, 0], 0))
        n_patterns = len(next(iter(local.values()))) if local else 0
        self.n_patterns = n_patterns
        if self.weights is not None:
            basis = probe[:1]
            if options.n_eigen:
                basis = xp.concatenate([basis, asarray_like(eigen, like).astype(cdtype, copy=False)])
            self.basis = basis                                  # U (K, n, n)
            self.basis_ft = fft2(basis)                         # F U
            self.basis_ft_flat = self.basis_ft.reshape(len(basis), -1)
            # F U as real rows (K, 2n²): real coefficients times complex rows, and Re⟨F U_k, G⟩,
            # are then single real matrix products (no complex multiply by a real number).
            self.basis_ft_real = _real_view(self.basis_ft_flat)
        self.probe = probe
        self.probe_ft = fft2(probe)
        self.background = None if background is None else asarray_like(background, like).astype(rdtype)

    # per-pattern coefficients (host, float64) of a sub-batch
    def _amp(self, batch):
        return np.ones(batch.stop - batch.start) if self.amplitude is None else self.amplitude[batch]

    def mode_factors(self, batch) -> np.ndarray:
        """dP_jm/dP_m per pattern and mode (b, M): s_j w_j0 for mode 0, s_j for the others."""
        amp = self._amp(batch)
        f = np.repeat(amp[:, None], self.n_modes, axis=1)
        if self.weights is not None:
            f[:, 0] *= self.weights[batch, 0]
        return f

    def spectra(self, batch, out):
        """F P_j (b, M, n, n) of a sub-batch into ``out``: mode 0 as one real product
        (b, K) @ (K, 2n²) of the coefficients s_j w_jk and the eigen-probe spectra."""
        xp = self.xp
        amp = self._amp(batch)
        b = batch.stop - batch.start
        if self.weights is None:
            xp.multiply(xp.asarray(amp.astype(self.rdtype))[:, None, None, None], self.probe_ft[None], out=out)
            return out
        coeff = xp.asarray((self.weights[batch] * amp[:, None]).astype(self.rdtype))
        target = out[:, 0].reshape(b, -1)
        dst = _real_view(target, required=False)
        if dst is not None:
            xp.matmul(coeff, self.basis_ft_real, out=dst)
        else:  # a namespace whose views cannot reinterpret a strided complex array
            target[...] = (coeff @ self.basis_ft_real).view(self.cdtype)
        if self.n_modes > 1:
            xp.multiply(xp.asarray(amp.astype(self.rdtype))[:, None, None, None], self.probe_ft[None, 1:],
                        out=out[:, 1:])
        return out

    def eigen_coefficients(self, batch) -> np.ndarray | None:
        """s_j w_jk for k ≥ 1 (b, K−1): how each eigen-probe enters pattern j's probe."""
        if self.weights is None or not self.options.n_eigen:
            return None
        return self.weights[batch, 1:] * self._amp(batch)[:, None]

    def weight_rhs(self, spec0_flat):
        """Re⟨F U_k, G_j0⟩ per pattern (b, K): ⟨S_f U_k O_j, χ_j0⟩ without another FFT."""
        return _real_view(spec0_flat) @ self.basis_ft_real.T

    # --- hooks of the LSQML chunk step (see lsqml.chunk_step) -----------------------------------

    def begin(self, step: int, n_patterns: int, update_probe: bool) -> None:
        """Buffers of one chunk step (sub-batches of ``step`` patterns) and what it will learn."""
        xp, n = self.xp, self.n
        self.buffer = xp.empty((step, self.n_modes, n, n), self.cdtype)
        self.want_weights = self.active and update_probe and self.weights is not None
        self.want_eigen = self.want_weights and self.options.n_eigen > 0
        self.want_intensity = self.active and self.amplitude is not None
        self.want_background = self.active and self.background is not None
        # LSQML with brightness_first: the brightness steps in pass 1 (see brightness_step)
        self.steps_brightness_first = bool(self.options.brightness_first) and (
            self.want_intensity or self.want_weights and self.options.fit_mean_weight)
        self.brightness = None
        if self.steps_brightness_first:
            self.brightness = xp.zeros(n_patterns)
            self._psi = xp.empty((step, self.n_modes if self.want_intensity else 1, n, n), self.cdtype)
        k = 0 if self.weights is None else len(self.basis)
        if self.want_weights:
            self.rhs = xp.empty((n_patterns, k))
            self.obj_power = xp.empty(n_patterns)               # ⟨|O_j|²⟩ over the window
            self.sample_stride = max(1, min(CURVATURE_STRIDE, n_patterns // CURVATURE_SAMPLES))
            self._samples = xp.empty((len(range(0, n_patterns, self.sample_stride)), n, n), self.cdtype)
            self._curvature = np.zeros((k, k))
            self._curvature_count = 0
        if self.want_eigen:
            self.eigen_num = xp.zeros((k - 1, n * n), self.cdtype)
            self.eigen_mean_num = xp.zeros(n * n, self.cdtype)
            self.eigen_moments = np.zeros((k - 1, 4))
        if self.want_intensity:
            self.int_num = xp.empty(n_patterns)
            self.int_den = xp.empty(n_patterns)
            self._powers = xp.empty((step, n * n), self.rdtype)

    def mode_factors_xp(self, batch):
        return self.xp.asarray(self.mode_factors(batch).astype(self.rdtype))

    def pattern_terms(self, batch, o, g, w, intensity: bool = True) -> None:
        """Pass 1, before the object patches are conjugated: ⟨|O_j|²⟩ and the sampled
        curvature of the weights (see :meth:`_sample_curvature`) and, for the intensity factor,
        Re⟨ψ_j, χ_j⟩ = Re⟨O_j, g_j⟩ and ‖ψ_j‖² = ⟨|O_j|², Σ_k |S_f P_jk|²⟩."""
        xp = self.xp
        b = batch.stop - batch.start
        if self.want_weights:
            self.obj_power[batch] = real_dots(o, o) / float(self.n * self.n)
            first = (-batch.start) % self.sample_stride
            if first < b:                                       # kept for _sample_curvature
                at = (batch.start + first) // self.sample_stride
                rows = o[first::self.sample_stride]
                self._samples[at:at + len(rows)] = rows
        if self.want_intensity and intensity:    # (else brightness_step formed them)
            p = self._powers[:b]
            flat = o.reshape(b, -1)
            xp.multiply(flat.real, flat.real, out=p)
            p += xp.square(flat.imag)
            self.int_num[batch] = real_dots(o, g)
            self.int_den[batch] = real_dots(p.reshape(o.shape), w)

    def brightness_step(self, batch, o, shifted, chi) -> None:
        """LSQML with ``brightness_first`` (a no-op otherwise), pass 1, between the far-field
        correction and the object gradient: each pattern's brightness takes its damped
        least-squares step first, r_j = ``weight_step`` · Re⟨ψ_j, χ_j⟩ / ‖ψ_j‖² (a relative
        change, applied by :func:`~daskpty.engines.lsqml_opr.new_model_local`), and
        χ_j ← χ_j − r_j ψ_j in place, the residual that step leaves. The brightness is the
        intensity factor s_j (every mode) or, for OPR without one, pattern j's mode-0 probe
        Σ_k w_jk U_k (its weights scale together). The object, probe and eigen-weight steps of
        the round then fit what the new brightness leaves instead of explaining it a second
        time (a Gauss–Seidel split). With the joint step the object takes up part of every
        pattern's flux error where only that pattern lights it: from the true object, 12 % rms
        flux flicker fitted for 40 epochs leaves 0.84 % jointly and 0.34 % this way
        (docs/benchmarks.md, OPR). Sets ``int_num`` / ``int_den`` of the intensity factor (see
        :meth:`pattern_terms`)."""
        if not self.steps_brightness_first:
            return
        modes = slice(0, self.n_modes if self.want_intensity else 1)
        xp, b = self.xp, batch.stop - batch.start
        psi = xp.multiply(shifted[:, modes], o[:, None], out=self._psi[:b])     # ψ_j
        num, den = real_dots(psi, chi[:, modes]), real_dots(psi, psi)
        if self.want_intensity:
            self.int_num[batch], self.int_den[batch] = num, den
        r = self.options.weight_step * num / (den + INTENSITY_TIKHONOV * den.mean() + 1e-30)
        self.brightness[batch] = r
        psi *= xp.asarray(r.astype(self.rdtype))[:, None, None, None]
        chi[:, modes] -= psi

    def _sample_curvature(self) -> None:
        """The Gauss–Newton curvature of the weights, measured exactly (once per chunk step) on
        every ``sample_stride``-th pattern: H_kl = Σ Re(conj Ψ̂ D_k) Re(conj Ψ̂ D_l) / ⟨|O_j|²⟩
        with D_k = F(U_k O_j) (the far-field direction of w_jk per unit s_j) and Ψ̂ = Ψ_j0 / √ŷ_j
        (the sub-pixel shift and the detector mask ignored). Only the component of D_k in phase
        with the far field changes the intensity: for a defocus-like eigen-probe it is a few per
        mille of ‖D_k‖², so the exit-wave Gram Σ Re(conj U_k U_l)|O_j|² would make the weights'
        steps hundreds of times too short. K FFTs per sampled pattern (M − 1 more with
        incoherent modes)."""
        xp = self.xp
        ob = self._samples
        s = ob.shape[0]
        if s == 0:
            return
        k, n2 = len(self.basis), self.n * self.n
        d = fft2(self.basis[None] * ob[:, None]).reshape(s, k, n2)       # D_k per unit s_j
        idx = slice(0, s * self.sample_stride, self.sample_stride)
        amp = self._amp(slice(0, self.n_patterns))[idx]
        coeff = xp.asarray((self.weights[idx] * amp[:, None]).astype(self.rdtype))
        psi = (coeff[:, :, None] * d).sum(axis=1)                        # Ψ_j0 = Σ_k s_j w_jk D_k
        power = xp.square(psi.real) + xp.square(psi.imag)
        for m in range(1, self.n_modes):
            other = fft2(self.probe[m][None] * ob).reshape(s, n2) * xp.asarray(amp.astype(self.rdtype))[:, None]
            power += xp.square(other.real) + xp.square(other.imag)
        level = power.mean(axis=1, keepdims=True)
        hat = psi / xp.sqrt(power + 1e-6 * level + 1e-30)
        proj = hat.real[:, None] * d.real + hat.imag[:, None] * d.imag  # Re(conj Ψ̂ D_k)
        curv = to_numpy(proj @ proj.transpose(0, 2, 1)).astype(np.float64)   # (s, K, K)
        mean_power = np.maximum(to_numpy(self.obj_power[idx]), 1e-30)
        self._curvature += (curv / mean_power[:, None, None]).sum(axis=0)
        self._curvature_count += s

    def weight_curvature(self) -> np.ndarray:
        """The weights' curvature matrices per unit s_j² (B, K, K): the sampled Gauss–Newton
        curvature per unit ⟨|O|²⟩, plus ``curvature_damping`` times the exit-wave one
        (diag ‖U_k‖², the whole change of the exit wave), times each pattern's ⟨|O_j|²⟩. The
        damping is the Levenberg–Marquardt term of a weight whose far-field change is nearly in
        quadrature: its intensity changes at second order, which the Gauss–Newton curvature
        leaves out, so an undamped step overshoots."""
        damping = self.options.curvature_damping
        unit = self._curvature / max(self._curvature_count, 1)
        norms = to_numpy(self.xp.sum(self.xp.abs(self.basis.reshape(len(self.basis), -1)) ** 2, axis=1))
        unit = unit + damping * np.diag(np.asarray(norms, np.float64))
        return np.asarray(self.obj_power, np.float64)[:, None, None] * unit[None]

    def probe_terms(self, batch, spec, spectra_sum) -> None:
        """Pass 1: the shared modes' probe sums Σ_j (∂P_jm/∂P_m) G_jm into ``spectra_sum``
        (M, n²), the weights' right-hand sides and Gram matrices, the eigen-probe numerators
        Σ_j s_j w_jk G_j0 and preconditioners Σ_j (s_j w_jk)² |O_j|².

        Mode 0's sum and the eigen-probe numerators are one real product (1 + K−1, b) @ (b, 2n²)
        (their coefficients are real), the other modes' one (b,) @ (b, (M−1)n²); each in the
        data's precision over the sub-batch, added into the caller's (float64 in AD) sums."""
        xp = self.xp
        b = batch.stop - batch.start
        flat = spec.reshape(b, self.n_modes, -1)
        amp = self._amp(batch)
        factor0 = amp if self.weights is None else amp * self.weights[batch, 0]
        coeff = factor0[None]
        if self.want_eigen:
            c = self.eigen_coefficients(batch)
            coeff = np.concatenate([coeff, amp[None], c.T])
        spec0 = flat[:, 0]
        rows = (xp.asarray(coeff.astype(self.rdtype)) @ _real_view(spec0)).view(self.cdtype)
        spectra_sum[0] += rows[0]
        if self.n_modes > 1:
            rest = flat[:, 1:].reshape(b, -1)
            spectra_sum[1:] += (xp.asarray(amp.astype(self.rdtype)) @ rest).reshape(self.n_modes - 1, -1)
        if self.want_weights:
            self.rhs[batch] = self.weight_rhs(spec0)
        if self.want_eigen:
            self.eigen_mean_num += rows[1]
            self.eigen_num += rows[2:]
            m = to_numpy(self.obj_power[batch])
            w = self.weights[batch, 1:]
            self.eigen_moments += np.stack([w.sum(axis=0), (c * amp[:, None] * m[:, None]).sum(axis=0),
                                            (c * c * m[:, None]).sum(axis=0),
                                            np.full(w.shape[1], (amp * amp * m).sum())], axis=1)

    def background_terms(self, loss: str, yhat, y, valid, eps: float) -> None:
        """AD: ∂L/∂b per pixel, Σ_j h'(ŷ_j), and its Gauss–Newton curvature, summed over the
        sub-batch (ŷ includes the background): amplitude loss (√ŷ − √y)²: 1 − √(y/ŷ) and
        1/(2ŷ); Poisson: 1 − y/ŷ and 1/ŷ; intensity (ŷ − y)²: 2(ŷ − y) and 2."""
        xp = self.xp
        level = yhat + eps
        if loss == "gaussian":
            grad = 1 - xp.sqrt(y / level)
            curv = 0.5 / level
        elif loss == "poisson":
            grad = 1 - y / level
            curv = 1 / level
        else:
            grad = 2 * (yhat - y)
            curv = xp.full_like(yhat, 2.0)
        if valid is not None:
            grad = grad * valid
            curv = curv * valid
        b = yhat.shape[0]
        if not hasattr(self, "bg_grad"):
            self.bg_grad = xp.zeros(self.n * self.n)
            self.bg_curv = xp.zeros(self.n * self.n)
        self.bg_grad += grad.reshape(b, -1).sum(axis=0, dtype=np.float64)
        self.bg_curv += curv.reshape(b, -1).sum(axis=0, dtype=np.float64)

    def finish(self, part, measured, model) -> None:
        """End of the chunk step: the additive sums into ``part.arrays``; the per-pattern terms
        to the host (read by the engine's weight update)."""
        n = self.n
        if self.want_background and hasattr(self, "bg_grad"):       # AD
            part.arrays["background_grad"] = to_numpy(self.bg_grad)
            part.arrays["background_curvature"] = to_numpy(self.bg_curv)
        elif self.want_background:                                  # LSQML
            part.arrays["background_residual"] = to_numpy(measured - model)
        if self.want_eigen:
            k1 = self.options.n_eigen
            part.arrays["opr_eigen_num"] = self.eigen_num.reshape(k1, n, n)
            part.arrays["opr_eigen_mean_num"] = self.eigen_mean_num.reshape(1, n, n)
            part.arrays["opr_eigen_moments"] = self.eigen_moments
        if self.want_weights:
            self._sample_curvature()
        for name in ("rhs", "obj_power", "int_num", "int_den", "brightness"):
            if getattr(self, name, None) is not None:
                setattr(self, name, to_numpy(getattr(self, name)))


def centred_eigen_terms(arrays, count: float):
    """The eigen-probes' update numerators and denominators with every pattern's weights taken
    relative to their mean over the patterns summed, w_jk − w̄_k: Σ_j s_j (w_jk − w̄_k) G_j0 (in
    Fourier space, (K−1, n, n)) and Σ_j s_j² (w_jk − w̄_k)² ⟨|O_j|²⟩ ((K−1, 1, 1)), from the additive
    sums of the chunk steps. The mean probe takes Σ_j G_j0 in the same round: an eigen-probe
    stepped with the plain Σ_j s_j w_jk G_j0 would take the share w̄_k of it a second time
    (PtychoShelves and Pty-Chi likewise step the eigen-probes along δP_j − mean δP)."""
    num = np.asarray(arrays["opr_eigen_num"])
    moments = np.asarray(arrays["opr_eigen_moments"], np.float64)
    mean = moments[:, 0] / max(count, 1.0)
    num = num - (mean[:, None, None] * np.asarray(arrays["opr_eigen_mean_num"])).astype(num.dtype)
    den = moments[:, 2] - 2 * mean * moments[:, 1] + mean * mean * moments[:, 3]
    return num, np.maximum(den, 0.0).reshape(-1, 1, 1)


def limit_eigen_step(step, probe0, trust: float):
    """``step`` (K−1, n, n) with each eigen-probe's change scaled down to at most ``trust`` ·
    ‖P_0‖ (see :data:`EIGEN_TRUST`), its direction kept."""
    xp = get_xp(step)
    norms = xp.sqrt(xp.sum(xp.abs(step.reshape(len(step), -1)) ** 2, axis=1))
    limit = trust * float(xp.linalg.norm(probe0))
    scale = xp.minimum(1.0, limit / xp.maximum(norms, 1e-30))
    return step * scale.astype(step.real.dtype)[:, None, None]


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


def background_frame(background, n: int) -> np.ndarray | None:
    """The background as an (n, n) float32 frame (a constant one stored as shape (1, 1))."""
    if background is None:
        return None
    b = np.asarray(background, dtype=np.float32)
    return np.broadcast_to(b, (n, n)) if b.shape == (1, 1) else b


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
