"""AD options, state and the per-round / per-epoch updates (:func:`apply`, :func:`end_epoch`)."""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ...physics.backend import get_xp
from ..dose_rule import low_dose_through_slices
from ..partials import Partial
from ..positions import accumulate_position_sums, restore_rules, start_arrays, start_from_arrays
from ...physics.noise_models import get_noise_model
from .losses import DEFAULT_EPS
from .optimizers import SGD, Adam, ConjugateGradient, OptimizerState

OPTIMIZERS = ("adam", "sgd", "cg")
SCHEDULES = ("constant", "exponential", "step")

#: Per-optimiser default learning rates (object, probe); see :class:`ADOptions`.
#: SGD's momentum for one slice (:meth:`ADOptions.for_slices` for K slices)
SGD_MOMENTUM = 0.9

DEFAULT_LR = {"adam": (0.05, 0.01), "sgd": (0.25, 0.05), "cg": (0.5, 0.1)}


# --------------------------------------------------------------------------------------------------
# Options and state


@dataclass(frozen=True)
class ADOptions:
    """Settings of the AD engine.

    Defaults (amplitude loss; SGD with Nesterov momentum 0.9 at lr 0.25 / 0.05 on the
    illumination-preconditioned gradients — Adam for the intensity loss, whose gradient scale
    follows the photon count; probe updates from epoch 1) reach LSQML's object error within about
    three times its epochs without tuning (tests/test_ad.py; on the simulator's small preset SGD
    reached NRMSE 0.098 / 0.020 after 30 / 100 epochs where Adam at its defaults reached
    0.41 / 0.34).

    loss: ``"gaussian"`` (amplitude least squares), ``"poisson"`` (negative log-likelihood) or
        ``"intensity"`` (intensity least squares).
    optimizer: None (default: ``"sgd"``, or ``"adam"`` for the intensity loss), ``"adam"``, ``"sgd"`` (``momentum``, ``nesterov``) or ``"cg"`` (nonlinear conjugate
        gradient with a loss-only line search; needs loss evaluations from the driver, see
        :func:`apply`; meant for ``rounds_per_epoch = 1``).
    lr, probe_lr: step sizes of object and probe (None: the optimiser's default, :data:`DEFAULT_LR`:
        Adam 0.05 / 0.01, SGD 0.25 / 0.05, CG 0.5 / 0.1).
        Adam: the per-element step relative to the parameter's scale (mean |O| over the well-lit
        region, rms |P|), so it needs no knowledge of the photon count or loss scale.
        SGD: multiplies the (preconditioned) gradient; for the amplitude loss, g_O = −2 ΔO_LSQML,
        so lr = 0.5 with preconditioning is one unscaled LSQML/ePIE step (Poisson: about twice
        that). The intensity loss's gradient is ~4ŷ times larger: scale SGD/CG rates down by about
        1/(4·typical ŷ) or use Adam. CG: a diagonal preconditioner (the first trial step is one SGD step).
    schedule: ``"constant"``, ``"exponential"`` (lr · decay^epoch) or ``"step"``
        (lr · decay^(epoch // decay_every)); epochs count from each parameter's start epoch.
    object_start_epoch, probe_start_epoch: first epoch updating each (None: never);
    object_stop_epoch, probe_stop_epoch: first epoch no longer updating it (None: never stop).
    precondition: divide the object gradient by Σ|S_f P|² + δ·max and the probe gradient by
        Σ_j|O_j|² + δ·max (same round's patterns); delta: that δ.
    beta1, beta2, adam_eps: Adam's moment decays and denominator floor.
    momentum, nesterov: SGD momentum. None: :data:`SGD_MOMENTUM` (0.9) for one slice; for K
        slices μ_K = max(0, 1 − K (1 − 0.9)) (0.8, 0.7, ... ; :meth:`for_slices`): the slices'
        updates add up in the low spatial frequencies they share, so K of them at one slice's
        momentum take about K times its step (on a 3-slab electron scan 0.9 diverges and 0.7
        converges: docs/benchmarks.md, bench_electron.py); 0 through slices on low-dose
        counting data (:mod:`~daskpty.engines.dose_rule`).
    cg_c1, cg_backtrack, cg_max_evaluations: Armijo constant, backtracking factor, loss evaluations
        (map-reduces) allowed per CG iteration.
    orthogonalize: SVD-orthogonalise probe modes after each epoch (optimiser memory is rotated too).
    normalize_every: remove the object/probe scale ambiguity every this many epochs (0: never).
    eps: small number added where intensities are divided (part of the loss definitions).
    """

    loss: str = "gaussian"
    optimizer: str | None = None
    lr: float | None = None
    probe_lr: float | None = None
    schedule: str = "constant"
    decay: float = 1.0
    decay_every: int = 10
    object_start_epoch: int | None = 0
    object_stop_epoch: int | None = None
    probe_start_epoch: int | None = 1
    probe_stop_epoch: int | None = None
    precondition: bool = True
    delta: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    momentum: float | None = None
    nesterov: bool = True
    cg_c1: float = 1e-4
    cg_backtrack: float = 0.5
    cg_max_evaluations: int = 6
    orthogonalize: bool = True
    normalize_every: int = 1
    eps: float = DEFAULT_EPS

    def __post_init__(self):
        def check(cond, msg):
            if not cond:
                raise ValueError(msg)

        get_noise_model(self.loss, what="loss")
        if self.optimizer is None:  # SGD+Nesterov converges fastest on counting data; Adam is the
            # robust choice for the intensity loss, whose gradient scale follows the photon count
            object.__setattr__(self, "optimizer", "adam" if self.loss == "intensity" else "sgd")
        check(self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("lr", "probe_lr"):
            v = getattr(self, name)
            check(v is None or (_is_number(v) and v > 0 and math.isfinite(v)),
                  f"{name} must be a positive number or None, got {v!r}")
        check(_is_number(self.decay) and 0 < self.decay <= 1, f"decay must lie in (0, 1], got {self.decay!r}")
        check(isinstance(self.decay_every, (int, np.integer)) and self.decay_every >= 1,
              f"decay_every must be a positive integer, got {self.decay_every!r}")
        for name in ("object_start_epoch", "object_stop_epoch", "probe_start_epoch", "probe_stop_epoch"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, (int, np.integer)) and v >= 0),
                  f"{name} must be a non-negative integer or None, got {v!r}")
        for p in ("object", "probe"):
            a, b = getattr(self, f"{p}_start_epoch"), getattr(self, f"{p}_stop_epoch")
            check(a is None or b is None or b > a, f"{p}_stop_epoch ({b}) must be after {p}_start_epoch ({a})")
        check(_is_number(self.delta) and self.delta > 0, f"delta must be positive, got {self.delta!r}")
        check(0 <= self.beta1 < 1, f"beta1 must lie in [0, 1), got {self.beta1!r}")
        check(0 <= self.beta2 < 1, f"beta2 must lie in [0, 1), got {self.beta2!r}")
        check(self.adam_eps > 0, f"adam_eps must be positive, got {self.adam_eps!r}")
        check(self.momentum is None or (_is_number(self.momentum) and 0 <= self.momentum < 1),
              f"momentum must lie in [0, 1) or be None, got {self.momentum!r}")
        check(0 < self.cg_c1 < 0.5, f"cg_c1 must lie in (0, 0.5), got {self.cg_c1!r}")
        check(0 < self.cg_backtrack < 1, f"cg_backtrack must lie in (0, 1), got {self.cg_backtrack!r}")
        check(isinstance(self.cg_max_evaluations, (int, np.integer)) and self.cg_max_evaluations >= 1,
              f"cg_max_evaluations must be a positive integer, got {self.cg_max_evaluations!r}")
        check(isinstance(self.normalize_every, (int, np.integer)) and self.normalize_every >= 0,
              f"normalize_every must be a non-negative integer, got {self.normalize_every!r}")
        check(_is_number(self.eps) and self.eps >= 0, f"eps must be non-negative, got {self.eps!r}")

    @property
    def object_lr(self) -> float:
        return float(self.lr if self.lr is not None else DEFAULT_LR[self.optimizer][0])

    @property
    def probe_lr_value(self) -> float:
        return float(self.probe_lr if self.probe_lr is not None else DEFAULT_LR[self.optimizer][1])

    def active(self, name: str, epoch: int) -> bool:
        start, stop = getattr(self, f"{name}_start_epoch"), getattr(self, f"{name}_stop_epoch")
        return start is not None and epoch >= start and (stop is None or epoch < stop)

    def learning_rate(self, name: str, epoch: int) -> float:
        base = self.object_lr if name == "object" else self.probe_lr_value
        e = max(0, epoch - (getattr(self, f"{name}_start_epoch") or 0))
        if self.schedule == "exponential":
            return base * self.decay**e
        if self.schedule == "step":
            return base * self.decay ** (e // self.decay_every)
        return base

    def for_slices(self, n_slices: int, counts_per_pixel: float | None = None) -> "ADOptions":
        """These options with ``momentum`` None resolved for an object of ``n_slices`` slices and
        data of ``counts_per_pixel`` mean counts per pixel (None: not counts):
        :mod:`~daskpty.engines.dose_rule`."""
        if self.momentum is not None:
            return self
        if low_dose_through_slices(n_slices, counts_per_pixel):
            momentum = 0.0
        else:
            momentum = max(0.0, 1.0 - n_slices * (1.0 - SGD_MOMENTUM)) if n_slices > 1 else SGD_MOMENTUM
        return dataclasses.replace(self, momentum=round(momentum, 12))

    def make_optimizer(self):
        if self.optimizer == "adam":
            return Adam(self.beta1, self.beta2, self.adam_eps)
        if self.optimizer == "sgd":
            return SGD(SGD_MOMENTUM if self.momentum is None else self.momentum, self.nesterov)
        return ConjugateGradient(self.cg_c1, self.cg_backtrack, self.cg_max_evaluations)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass
class ADState:
    """Object (H, W) and probe (M, n, n) on the host, the epoch, and the optimiser's memory.

    illumination: this epoch's Σ|S_f P|² (object frame, max over rounds) for masks and scale removal.
    iteration: optimiser steps taken. last_loss: loss of the last round (sum over its patterns).
    """

    object: np.ndarray
    probe: np.ndarray
    epoch: int = 0
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    illumination: np.ndarray | None = None
    iteration: int = 0
    last_loss: float = float("nan")
    extra: dict = field(default_factory=dict)
    affine: np.ndarray | None = None        # position refinement (see daskpty.engines.positions)
    affine_boost: np.ndarray | None = None
    affine_sums: dict | None = None
    window_sums: dict | None = None         # the windows' deformation sums of this epoch (positions)
    window_deformation: np.ndarray | None = None  # L (2, 2) of the last epoch, for the history
    window_map: np.ndarray | None = None    # the positions' map of the next epoch (3, 2), or None
    window_gram: np.ndarray | None = None   # the windows' normal matrix (4, 4) last formed
    positions_start: int | None = None   # start epoch decided by start_epoch='auto' (positions)
    epoch_start_probe: np.ndarray | None = None  # the probe at the epoch's start, while undecided
    eigen_probes: np.ndarray | None = None      # varying probe (engines.probe_model)
    weight_transform: np.ndarray | None = None
    eigen_weight_sums: np.ndarray | None = None  # this epoch's count and Σ_j w_jk of the eigen-weights (K,)
    eigen_lag_sums: np.ndarray | None = None  # this epoch's Σ of neighbours' weight products and their count
    background: np.ndarray | None = None

    def active(self, name: str, options: ADOptions) -> bool:
        return options.active(name, self.epoch)

    def to_arrays(self) -> dict:
        """Everything beyond object, probe and epoch, as flat ``name -> ndarray`` (checkpoints; no
        pickle). Names contain no ``/``: ``optimizer.<slot>.<parameter>`` for arrays,
        ``optimizer_scalar.<key>`` for 0-d floats, ``iteration``."""
        out = {"optimizer." + k.replace("/", "."): np.asarray(v) for k, v in self.optimizer.arrays.items()}
        out.update({"optimizer_scalar." + k.replace("/", "."): np.asarray(float(v), dtype=np.float64)
                    for k, v in self.optimizer.scalars.items()})
        out["iteration"] = np.asarray(self.iteration, dtype=np.int64)
        for name in ("affine", "affine_boost", "window_map", "window_gram"):
            if getattr(self, name) is not None:
                out[name] = np.asarray(getattr(self, name))
        return {**out, **start_arrays(self)}

    @classmethod
    def from_arrays(cls, obj, probe, epoch: int = 0, arrays: dict | None = None) -> "ADState":
        """Inverse of :meth:`to_arrays` (``arrays`` None or empty: a fresh optimiser)."""
        opt = OptimizerState()
        iteration = 0
        for name, value in (arrays or {}).items():
            if name.startswith("optimizer_scalar."):
                opt.scalars[name[len("optimizer_scalar."):].replace(".", "/")] = float(np.asarray(value))
            elif name.startswith("optimizer."):
                opt.arrays[name[len("optimizer."):].replace(".", "/", 1)] = np.asarray(value)
            elif name == "iteration":
                iteration = int(np.asarray(value))
        arrays = arrays or {}
        return restore_rules(cls(object=obj, probe=probe, epoch=int(epoch), optimizer=opt, iteration=iteration,
                                 affine=arrays.get("affine"), affine_boost=arrays.get("affine_boost"),
                                 window_map=arrays.get("window_map"), window_gram=arrays.get("window_gram"),
                                 positions_start=start_from_arrays(arrays)), arrays)


# --------------------------------------------------------------------------------------------------
# apply / epochs


def _preconditioned(g, illum, delta: float, peak: float | None = None):
    """g / (W + δ max W); ``peak``: max W when ``illum`` is only a tile of the object's."""
    peak = float(illum.max()) if peak is None else peak
    return g / (illum + delta * peak).astype(illum.dtype, copy=False)


def _lit_mean_abs(obj, illum) -> float:
    lit = illum > 0.5 * illum.max()
    return float(get_xp(obj).abs(obj[lit]).mean()) if bool(lit.any()) else 1.0


def apply(state: ADState, total: Partial, options: ADOptions, evaluate=None, *, peak: float | None = None,
          lit_mean: float | None = None) -> ADState:
    """One optimiser step from a reduced gradient partial.

    ``evaluate(params) -> float``, with ``params`` a dict holding trial ``"object"`` and/or
    ``"probe"`` arrays, returns the loss (sum over the same patterns as ``total``); only the CG
    optimiser calls it (its line search) and it is required there. ``peak`` (the round's largest
    illumination) and ``lit_mean`` (Adam's mean |O| where lit) come from outside when the state
    holds only a tile of the object (:mod:`.tiles`); None: computed here.
    """
    if total is None:
        return state
    accumulate_position_sums(state, total)
    xp = get_xp(state.object)  # NumPy, or CuPy for a state on a GPU worker's device
    params, grads, pre, lrs = {}, {}, {}, {}
    epoch = state.epoch
    illum_box = total.boxes.get("illumination")
    full_illum = None
    if illum_box is not None:
        full_illum = xp.zeros(state.object.shape, dtype=illum_box.data.dtype)
        illum_box.add_into(full_illum)
    if "object_grad" in total.boxes:
        box = total.boxes["object_grad"]
        g = xp.zeros(state.object.shape, dtype=np.result_type(state.object.dtype, box.data.dtype))
        box.add_into(g)
        params["object"], grads["object"] = state.object, g
        pre["object"] = _preconditioned(g, full_illum, options.delta, peak) if options.precondition else g
        lrs["object"] = options.learning_rate("object", epoch)
        if options.optimizer == "adam":
            lrs["object"] *= _lit_mean_abs(state.object, full_illum) if lit_mean is None else lit_mean
    if "probe_grad" in total.arrays:
        g = total.arrays["probe_grad"].astype(np.result_type(state.probe.dtype, total.arrays["probe_grad"].dtype))
        params["probe"], grads["probe"] = state.probe, g
        pre["probe"] = (_preconditioned(g, total.arrays["probe_illumination"][None], options.delta)
                        if options.precondition else g)
        lrs["probe"] = options.learning_rate("probe", epoch)
        if options.optimizer == "adam":
            lrs["probe"] *= float(xp.sqrt(xp.mean(xp.abs(state.probe) ** 2)))

    if full_illum is not None:
        state.illumination = full_illum if state.illumination is None else xp.maximum(state.illumination,
                                                                                      full_illum)
    if not grads:
        return state
    optimizer = options.make_optimizer()
    loss0 = float(total.scalars.get("loss", float("nan")))
    if options.optimizer == "cg":
        if evaluate is None:
            raise RuntimeError("the CG optimiser needs loss evaluations for its line search: call "
                               "apply(..., evaluate=...) (ADAdapter.run_round does this)")
        new, state.optimizer = optimizer.step(params, grads, pre, lrs, loss0, evaluate, state.optimizer)
    else:
        new, state.optimizer = optimizer.step(params, pre, lrs, state.optimizer)
    state.object = new.get("object", state.object)
    state.probe = new.get("probe", state.probe)
    state.iteration += 1
    state.last_loss = loss0
    return state


def begin_epoch(state: ADState, options: ADOptions) -> ADState:
    """Reset the epoch's illumination (it is rebuilt from the rounds' partials)."""
    state.illumination = None
    state.affine_sums = None
    return state


def normalizes_now(state: ADState, options: ADOptions) -> bool:
    """Whether this epoch's end removes the scale ambiguity (every ``options.normalize_every``)."""
    return bool(options.normalize_every) and (state.epoch + 1) % options.normalize_every == 0


def end_epoch(state: ADState, options: ADOptions, *, scales=None) -> ADState:
    """Probe-mode orthogonalisation, scale-ambiguity removal (optimiser memory follows), epoch += 1.
    ``scales``: per slice the mean |O_k| where lit, when the state holds only a tile of the object."""
    if options.orthogonalize and state.probe.shape[0] > 1 and state.active("probe", options):
        orthogonalize_probe(state)
    if normalizes_now(state, options):
        normalize_scale(state, options, scales)
    state.epoch += 1
    return state


def orthogonalize_probe(state: ADState) -> None:
    """P ← Uᴴ P (SVD, strongest mode first); linear optimiser memory is rotated the same way
    (Adam's second moment by |Uᴴ|², an approximation)."""
    m = state.probe.shape[0]
    xp = get_xp(state.probe)
    a = state.probe.reshape(m, -1).astype(np.complex128)
    u, s, vh = xp.linalg.svd(a, full_matrices=False)
    state.probe = (s[:, None] * vh).reshape(state.probe.shape).astype(state.probe.dtype)
    uh = u.conj().T
    for key, arr in list(state.optimizer.arrays.items()):
        slot, name = key.split("/", 1)
        if name != "probe" or arr.shape[0] != m:
            continue
        flat = arr.reshape(m, -1)
        if slot == "v":
            new = (xp.abs(uh) ** 2) @ flat
        else:
            new = uh @ flat
        state.optimizer.arrays[key] = new.reshape(arr.shape).astype(arr.dtype)


def normalize_scale(state: ADState, options: ADOptions, scales=None) -> None:
    """Remove the scale ambiguity O_k c_k, P / Π c_k: mean |O_k| = 1 where slice k is lit, slice by
    slice for a (K, H, W) object (one c for an (H, W) one), so that the model is unchanged
    (``scales``: those means, 0 where nothing is lit, when the state holds only a tile).

    The optimiser memory follows: with O_k' = O_k / c_k and P' = C P (C = Π c_k), raw gradients
    scale as c_k (slice k) and 1/C (probe), preconditioned ones as the parameters (exactly in one
    slice; through slices the illumination's change from the slices before is left out).
    """
    if state.illumination is None and scales is None:
        return
    layers = state.object if state.object.ndim == 3 else state.object[None]
    if scales is None:
        illum = state.illumination if state.illumination.ndim == 3 else state.illumination[None]
        scales = [_lit_mean_abs(layers[k], illum[k]) for k in range(layers.shape[0])]
    c = np.array([float(v) if v > 0 and math.isfinite(v) else 1.0 for v in np.ravel(scales)])
    if np.all(c == 1.0):
        return
    xp = get_xp(state.object)
    per_slice = xp.asarray(c.astype(np.float32))[:, None, None]
    state.object = (layers / per_slice).astype(state.object.dtype).reshape(state.object.shape)
    total = float(np.prod(c))
    state.probe = (state.probe * total).astype(state.probe.dtype)
    if state.eigen_probes is not None:  # they scale with the mean probe (weights unchanged)
        state.eigen_probes = (state.eigen_probes * total).astype(state.eigen_probes.dtype)
    param = {"object": 1.0 / per_slice, "probe": total}
    raw = {"object": per_slice, "probe": 1.0 / total}
    fed = param if options.precondition else raw   # what the optimiser was fed (s or g)
    for key, arr in list(state.optimizer.arrays.items()):
        slot, name = key.split("/", 1)
        if name not in param:
            continue
        if slot == "v":
            f = fed[name] ** 2
        elif slot == "cg_g":
            f = raw[name]
        else:   # m, b, cg_d, cg_s
            f = fed[name]
        if name == "object":
            shaped = arr if arr.ndim == 3 else arr[None]
            state.optimizer.arrays[key] = (shaped * f).astype(arr.dtype).reshape(arr.shape)
        else:
            state.optimizer.arrays[key] = (arr * f).astype(arr.dtype)
