"""The parts of the forward model an adapter composes: the sample, position refinement and a
varying probe (OPR eigen-probes and weights, intensity factors, background).

Every part has the same hooks (:class:`Part`): its per-pattern state at the start (kept with
each chunk), its payload fields, the arrays a checkpoint stores, what it does after the
engine's apply and at an epoch's begin and end, and its numbers for the epoch's history. A part
that is off is :data:`OFF`, whose hooks do nothing, so the adapter (:mod:`.adapter`) never asks
which parts are present; an engine that does not take a feature is refused by its spec first.
"""
from __future__ import annotations

import numpy as np

from ..engines import probe_model as pm
from ..engines import sample_model as sm
from ..engines.forward_model import THIN
from ..engines.eigen_probes import initial_eigen_probes
from ..engines.lsqml_opr import end_epoch as orthonormalise_eigen_probes
from ..engines.multislice_positions import initial_ratios
from ..engines.positions import (epoch_parameters, finish_epoch, initial_local, note_epoch_start, restore_rules,
                                 settle_start, start_arrays, start_from_arrays, step_maps)

#: Engine-state names of the probe model's global arrays (checkpoints, results).
EIGEN, TRANSFORM, BACKGROUND = "opr_eigen_probes", "opr_weight_transform", "background"
#: The position fits' arrays a checkpoint keeps.
FITS = ("affine", "affine_boost", "window_map", "window_gram")


class Part:
    """A part that is off: every hook does nothing. ``run`` is the adapter (options, core, sample)."""

    options = None
    rank, variant = 0, "plain"  # the engine's chunk step of the highest-ranked part runs
    per_pattern = False         # keeps per-pattern state with each chunk
    on_host = False             # its state stays in host memory on GPU workers
    refines = False             # moves the windows (tiles hold a wider halo)

    def start(self, nominal, run) -> dict:
        """Per-pattern state of a chunk before its first step, from its nominal positions."""
        return {}

    def payload(self, state) -> dict:
        """Fields of every chunk step's payload."""
        return {}

    def attach(self, state, probe, stored: dict) -> None:
        """Its arrays on a new state: from ``stored`` (a checkpoint's engine state) or initial."""

    def stored(self, state) -> dict:
        """Its arrays a checkpoint keeps to resume bit for bit."""
        return {}

    def check(self, run) -> None:
        """Refuse, in one line, an engine setting it cannot run with."""

    def after_apply(self, state, total, run) -> None:
        """Its global update after the engine's apply of a round's sum ``total``."""

    def after_rescale(self, state, before) -> None:
        """After the first epoch's probe rescale (``before``: the probe it started from)."""

    def begin_epoch(self, state) -> None:
        """At an epoch's start, after the engine's."""

    def end_epoch(self, state) -> None:
        """At an epoch's end, before the engine's."""

    def finish(self, state, run) -> None:
        """At an epoch's end, after :meth:`end_epoch` (on tiles: its own task, before the shares)."""

    def after_end(self, state) -> None:
        """After the engine's end of an epoch (``state.epoch`` the next one's)."""

    def epoch_scalars(self, state) -> dict:
        """Its numbers for the epoch's history entry."""
        return {}

    def reach(self, n: int) -> float:
        """Rows beyond a chunk's nominal windows its windows may move (tiles' halo)."""
        return 0.0

    def for_rounds(self, rounds: int, watching: bool = False) -> "Part":
        """The part for ``rounds`` rounds per epoch (``watching``: for a switch to one round)."""
        return self


OFF = Part()


class Sample(Part):
    """The sample and detector: ``model`` a :class:`~daskpty.engines.sample_model.SampleModel`
    (one slice in the far field, K slices and/or a near-field detector)."""

    def __init__(self, model: sm.SampleModel = THIN):
        self.options = self.model = model
        self.carries_position_sums = sm.carries_position_sums(model)

    def payload(self, state) -> dict:
        return {"sample": self.model}

    def slices(self, obj):
        """The object in the layout the sample keeps ((K, H, W) for a sample model)."""
        return sm.as_slices(obj, self.model)


class Positions(Part):
    """Position refinement (:class:`~daskpty.engines.positions.PositionOptions`): refined
    positions kept with each chunk, the affine fit and the windows' correction at an epoch's end
    (the engine core's ``resample`` moves its object)."""

    rank, variant, per_pattern, refines = 1, "refining", True, True

    def __init__(self, options, gradient_based: bool):
        self.options = options
        self.gradient_based = gradient_based

    def start(self, nominal, run) -> dict:
        local = initial_local(nominal, self.options, gradient_based=self.gradient_based)
        if not self.gradient_based and run.sample.carries_position_sums:  # shift steps through K slices
            local.update(initial_ratios(len(nominal)))
        return local

    def payload(self, state) -> dict:
        return {"positions": self.options.for_state(state), "affine": step_maps(state)}

    def attach(self, state, probe, stored: dict) -> None:
        for name in FITS:
            setattr(state, name, stored.get(name))
        state.positions_start = start_from_arrays(stored)
        restore_rules(state, stored)

    def stored(self, state) -> dict:
        fits = {name: getattr(state, name) for name in FITS if getattr(state, name) is not None}
        return {**fits, **start_arrays(state)}

    def begin_epoch(self, state) -> None:
        note_epoch_start(state, self.options)

    def finish(self, state, run) -> None:
        finish_epoch(state, self.options, run.core.resample)

    def after_end(self, state) -> None:
        settle_start(state, self.options)

    def epoch_scalars(self, state) -> dict:
        return epoch_parameters(state)

    def reach(self, n: int) -> float:
        return float(self.options.displacement_limit(n))


class ProbeModel(Part):
    """A varying probe (:class:`~daskpty.engines.probe_model.ProbeModelOptions`, resolved for
    the engine): per-pattern weights and intensity factors with the chunks, the eigen-probes,
    the last orthonormalisation's weight transform T and the background in the state."""

    rank, variant, on_host = 2, "varying", True

    def __init__(self, model: pm.ProbeModelOptions, given: pm.ProbeModelOptions | None = None):
        self.options = self.model = model
        self.given = model if given is None else given   # before :meth:`for_rounds`
        self.per_pattern = model.per_pattern

    def start(self, nominal, run) -> dict:
        return pm.initial_local(len(nominal), self.model)

    def payload(self, state) -> dict:
        return {"model": self.model, "eigen": state.eigen_probes, "transform": state.weight_transform,
                "background": state.background}

    def attach(self, state, probe, stored: dict) -> None:
        eigen = stored.get(EIGEN)
        if eigen is None and self.model.n_eigen:
            eigen = initial_eigen_probes(np.asarray(probe)[0], self.model.n_eigen)
        state.eigen_probes = None if eigen is None else np.asarray(eigen, np.complex64)
        state.weight_transform = stored.get(TRANSFORM)
        background = stored.get(BACKGROUND)
        n = np.shape(probe)[-1]
        state.background = pm.initial_background(self.model, n) if background is None else np.asarray(background)

    def stored(self, state) -> dict:
        arrays = ((EIGEN, state.eigen_probes), (TRANSFORM, state.weight_transform), (BACKGROUND, state.background))
        return {name: value for name, value in arrays if value is not None}

    def check(self, run) -> None:
        reason = run.core.unsupported(run.options, "probe_model")
        if reason:
            raise ValueError(f"opr_modes / fit_intensity / background with engine={run.name!r} cannot run with "
                             f"{reason}: its steps do not move per-pattern parameters; choose another optimizer")

    def after_apply(self, state, total, run) -> None:
        if total is not None:
            run.core.apply_probe_model(state, total, self.model, run)
            state.eigen_lag_sums = pm.add_eigen_lag_sums(state.eigen_lag_sums, total.scalars)

    def after_rescale(self, state, before) -> None:
        """The eigen-probes scale with the mean probe."""
        if state.eigen_probes is not None:
            b, a = np.linalg.norm(before[0]), np.linalg.norm(state.probe[0])
            if b > 0:
                state.eigen_probes = (state.eigen_probes * np.float32(a / b)).astype(np.complex64)

    def end_epoch(self, state) -> None:
        if pm.eigen_unsupported(state, self.model):
            pm.drop_eigen_probes(state)
        state.eigen_lag_sums = None
        orthonormalise_eigen_probes(state, self.model)

    def epoch_scalars(self, state) -> dict:
        out = {} if state.background is None else {"background_mean": float(np.mean(state.background))}
        if self.model.n_eigen and state.eigen_probes is not None and not np.any(state.eigen_probes):
            out["opr_eigen_dropped"] = 1.0
        return out

    def for_rounds(self, rounds: int, watching: bool = False) -> "ProbeModel":
        """The part with the settings that follow the rounds per epoch resolved for ``rounds``
        (``watching``: for a switch to one round, :meth:`ProbeModelOptions.for_rounds`) from the
        options as given (a run that goes on with one round resolves them again)."""
        return ProbeModel(self.given.for_rounds(rounds, watching), self.given)


def sample_model(sample) -> sm.SampleModel:
    """The engines' :class:`SampleModel` of a resolved sample (:class:`daskpty.engines.sample_options.ResolvedSample`):
    :data:`THIN` for one slice in the far field (the single-slice code path, bit for bit)."""
    if not sample.multislice:
        return THIN
    kernel = None if sample.kernel is None else np.asarray(sample.kernel, np.complex64)
    detector = None if sample.detector_kernel is None else np.asarray(sample.detector_kernel, np.complex64)
    return sm.SampleModel(sample.n_slices, kernel, detector)


def compose(spec, positions=None, probe_model=None, sample=None) -> tuple[Part, Part, Sample]:
    """The parts of engine ``spec`` from their options (None: off; a :class:`Part` as it is):
    ``(positions, probe model, sample)``; positions and the probe model with the engine's
    defaults for the settings left None."""
    return (_part(positions, lambda o: Positions(o.for_engine(spec.name), spec.gradient_based)),
            _part(probe_model, lambda o: ProbeModel(o.for_engine(spec.name))),
            sample if isinstance(sample, Sample) else Sample(THIN if sample is None else sample))


def _part(value, make) -> Part:
    return value if isinstance(value, Part) else OFF if value is None else make(value)
