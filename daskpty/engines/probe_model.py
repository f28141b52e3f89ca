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

BACKGROUNDS = (None, "constant", "pixel")
#: The probe model's per-pattern arrays (names in a chunk's per-pattern state).
PROBE_MODEL_KEYS = ("opr_weights", "intensity_scale")
#: Fewest patterns per OPR mode: K weights per pattern and K−1 eigen-probes need many more
#: patterns than modes to be determined (PtychoShelves' variable-probe examples use K ≤ 5 over
#: thousands of patterns).
PATTERNS_PER_MODE = 10
MAX_OPR_MODES = 16


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
        (epochs count from 0; the object should have formed first).
    weight_step: damping of the per-pattern least-squares steps of weights and intensity
        factors (LSQML) or their preconditioned gradient steps (AD), 0 < step ≤ 1.
    eigen_step: damping of the eigen-probe updates, 0 < step ≤ 1.
    background_step: damping of the background update, 0 < step ≤ 1.
    max_weight: |weight| (relative to the mean probe) or intensity factor beyond which the run
        stops with :class:`ProbeModelDiverged`.
    """

    opr_modes: int | None = 0
    fit_intensity: bool = False
    background: str | None = None
    start_epoch: int = 2
    weight_step: float = 0.5
    eigen_step: float = 0.5
    background_step: float = 0.5
    max_weight: float = 100.0

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
        check(self.background in BACKGROUNDS,
              f"background must be None, 'constant' or 'pixel', got {self.background!r}")
        check(isinstance(self.start_epoch, (int, np.integer)) and self.start_epoch >= 0,
              f"start_epoch must be an integer >= 0, got {self.start_epoch!r}")
        for name in ("weight_step", "eigen_step", "background_step"):
            v = getattr(self, name)
            check(_number(v) and 0 < v <= 1, f"{name} must lie in (0, 1], got {v!r}")
        check(_number(self.max_weight) and self.max_weight > 1,
              f"max_weight must be a number > 1, got {self.max_weight!r}")

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

    def check_run(self, n_patterns: int, probe_updated: bool) -> None:
        """Refuse settings that cannot work on this data set."""
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
    """The per-pattern state of one chunk: ``opr_weights`` (B, K) = [1, 0, …] and/or
    ``intensity_scale`` (B, 1) = 1 (intensity factors s_j²), float64."""
    local = {}
    if options.opr_modes:
        w = np.zeros((n_patterns, options.opr_modes))
        w[:, 0] = 1.0
        local["opr_weights"] = w
    if options.fit_intensity:
        local["intensity_scale"] = np.ones((n_patterns, 1))
    return local


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
    """K − 1 starting eigen-probes (K−1, n, n) complex64: the mean probe times a defocus-like
    phase i(r² − ⟨r²⟩), then y and x (shift-like), then seeded noise; orthogonal to P_0 and to
    each other, each as strong as P_0 (their weights start at zero)."""
    probe0 = np.asarray(to_numpy(probe0), dtype=np.complex128)
    n = probe0.shape[-1]
    if n_eigen == 0:
        return np.zeros((0, n, n), np.complex64)
    power = np.abs(probe0) ** 2
    c = (np.arange(n) - (n - 1) / 2.0)
    y, x = np.meshgrid(c, c, indexing="ij")
    total = power.sum() or 1.0
    cy, cx = (power * y).sum() / total, (power * x).sum() / total
    y, x = y - cy, x - cx
    r2 = y * y + x * x
    radius = np.sqrt((power * r2).sum() / total) or n / 4.0
    shapes = [1j * (r2 / radius**2 - (power * r2).sum() / total / radius**2), y / radius, x / radius]
    rng = np.random.default_rng(seed)
    while len(shapes) < n_eigen:
        shapes.append(rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n)))
    basis = np.stack([probe0] + [probe0 * s for s in shapes[:n_eigen]])
    eigen, _ = orthonormalize(basis[0], basis[1:])
    return eigen


def _real_rows(a):
    """Complex rows (K, ...) as real rows (K, 2·size): the real inner product Re⟨a, b⟩."""
    a = np.asarray(a, dtype=np.complex128).reshape(len(a), -1)
    return np.concatenate([a.real, a.imag], axis=1)


def orthonormalize(probe0, eigen) -> tuple[np.ndarray, np.ndarray | None]:
    """Eigen-probes made orthogonal to P_0 and to each other (real inner product; SVD, strongest
    first), each of norm ‖P_0‖, and the K × K real matrix T that keeps every pattern's probe:
    Σ_k w_k U_k = Σ_k (w T)_k U'_k with U_0 = U'_0 = P_0. Returns ``(eigen', T)``."""
    eigen = np.asarray(to_numpy(eigen))
    k1 = eigen.shape[0]
    if k1 == 0:
        return eigen.astype(np.complex64), None
    p0 = _real_rows(to_numpy(probe0)[None])[0]
    norm0 = float(np.sqrt(p0 @ p0))
    rows = _real_rows(eigen)
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
        """F P_j (b, M, n, n) of a sub-batch into ``out``."""
        xp = self.xp
        amp = self._amp(batch)
        b = batch.stop - batch.start
        if self.weights is None:
            xp.multiply(xp.asarray(amp.astype(self.rdtype))[:, None, None, None], self.probe_ft[None], out=out)
            return out
        coeff = xp.asarray((self.weights[batch] * amp[:, None]).astype(self.cdtype))
        out[:, 0] = (coeff @ self.basis_ft_flat).reshape(b, self.n, self.n)
        if self.n_modes > 1:
            xp.multiply(xp.asarray(amp.astype(self.rdtype))[:, None, None, None], self.probe_ft[None, 1:],
                        out=out[:, 1:])
        return out

    def eigen_coefficients(self, batch) -> np.ndarray | None:
        """s_j w_jk for k ≥ 1 (b, K−1): how each eigen-probe enters pattern j's probe."""
        if self.weights is None or not self.options.n_eigen:
            return None
        return self.weights[batch, 1:] * self._amp(batch)[:, None]

    def weight_gram(self, powers_flat):
        """Σ_r Re(conj U_k U_l) |O_j|² per pattern (b, K, K) (the shift of the window ignored)."""
        xp = self.xp
        k = len(self.basis)
        if not hasattr(self, "_products"):
            u = self.basis.reshape(k, -1)
            prod = (xp.conj(u)[:, None] * u[None]).real.astype(self.rdtype)   # (K, K, n²)
            self._products = prod.reshape(k * k, -1).T                          # (n², K²)
        return (powers_flat @ self._products).reshape(-1, k, k)

    def weight_rhs(self, spec0_flat):
        """Re⟨F U_k, G_j0⟩ per pattern (b, K): ⟨S_f U_k O_j, χ_j0⟩ without another FFT."""
        return (spec0_flat @ self.xp.conj(self.basis_ft_flat).T).real


    # --- hooks of the LSQML chunk step (see lsqml.chunk_step) -----------------------------------

    def begin(self, step: int, n_patterns: int, update_probe: bool) -> None:
        """Buffers of one chunk step (sub-batches of ``step`` patterns) and what it will learn."""
        xp, n = self.xp, self.n
        self.buffer = xp.empty((step, self.n_modes, n, n), self.cdtype)
        self.want_weights = self.active and update_probe and self.weights is not None
        self.want_eigen = self.want_weights and self.options.n_eigen > 0
        self.want_intensity = self.active and self.amplitude is not None
        self.want_background = self.active and self.background is not None
        k = 0 if self.weights is None else len(self.basis)
        if self.want_weights:
            self.rhs = xp.empty((n_patterns, k))
            self.gram = xp.empty((n_patterns, k, k))
        if self.want_eigen:
            self.eigen_num = xp.zeros((k - 1, n * n), self.cdtype)
            self.eigen_den = xp.zeros((k - 1, n * n), self.rdtype)
        if self.want_intensity:
            self.int_num = xp.empty(n_patterns)
            self.int_den = xp.empty(n_patterns)
        self._powers = xp.empty((step, n * n), self.rdtype)

    def mode_factors_xp(self, batch):
        return self.xp.asarray(self.mode_factors(batch).astype(self.rdtype))

    def pattern_terms(self, batch, o, g, w) -> None:
        """Pass 1, before the object patches are conjugated: |O_j|² and, for the intensity
        factor, Re⟨ψ_j, χ_j⟩ = Re⟨O_j, g_j⟩ and ‖ψ_j‖² = ⟨|O_j|², Σ_k |S_f P_jk|²⟩."""
        xp = self.xp
        b = batch.stop - batch.start
        if not (self.want_weights or self.want_intensity):
            return
        p = self._powers[:b]
        flat = o.reshape(b, -1)
        xp.multiply(flat.real, flat.real, out=p)
        p += xp.square(flat.imag)
        if self.want_intensity:
            self.int_num[batch] = real_dots(o, g)
            self.int_den[batch] = real_dots(p.reshape(o.shape), w)

    def probe_terms(self, batch, spec, spectra_sum) -> None:
        """Pass 1: the shared modes' probe sums Σ_j (∂P_jm/∂P_m) G_jm into ``spectra_sum``
        (M, n²), the weights' right-hand sides and Gram matrices, the eigen-probe numerators
        Σ_j s_j w_jk G_j0 and preconditioners Σ_j (s_j w_jk)² |O_j|²."""
        xp = self.xp
        b = batch.stop - batch.start
        flat = spec.reshape(b, self.n_modes, -1)
        factors = self.mode_factors(batch).astype(spectra_sum.dtype)
        for m in range(self.n_modes):
            spectra_sum[m] += xp.asarray(factors[:, m]) @ flat[:, m]
        if self.want_weights:
            self.rhs[batch] = self.weight_rhs(flat[:, 0])
            self.gram[batch] = self.weight_gram(self._powers[:b])
        if self.want_eigen:
            c = self.eigen_coefficients(batch)
            self.eigen_num += xp.asarray(c.T.astype(self.cdtype)) @ flat[:, 0]
            self.eigen_den += xp.asarray((c * c).T.astype(self.rdtype)) @ self._powers[:b]

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
            part.arrays["opr_eigen_den"] = self.eigen_den.reshape(k1, n, n)
        for name in ("rhs", "gram", "int_num", "int_den"):
            if hasattr(self, name):
                setattr(self, name, to_numpy(getattr(self, name)))


def solve_weight_steps(gram, rhs, tikhonov: float = 1e-2) -> np.ndarray:
    """Per-pattern least-squares steps Δw = (G + λ mean diag G)⁻¹ h, (B, K) float64."""
    gram = np.asarray(gram, dtype=np.float64)
    rhs = np.asarray(rhs, dtype=np.float64)
    k = gram.shape[-1]
    diag = np.einsum("bkk->bk", gram)
    floor = tikhonov * diag.mean(axis=1) + 1e-30
    gram = gram + floor[:, None, None] * np.eye(k)[None]
    return np.linalg.solve(gram, rhs[..., None])[..., 0]


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
