"""What an engine writes for the round loop: its chunk steps and state updates as one small class
of functions, an *engine core*, named by the engine's spec (:mod:`.specs`, ``core_path``).

Execution's one adapter (:mod:`daskpty.execution.adapter`) does the rest: the parts of the
forward model (sample, positions, probe model: their per-pattern state, payload fields, stored
arrays and epoch hooks), the payload, the first epoch's probe rescale and resume. A core's
functions get the adapter (``run``: ``run.options``, ``run.valid``, ``run.sample.model``) where
they need more than the state. Required: :attr:`EngineCore.steps`, :meth:`~EngineCore.new_state`,
:meth:`~EngineCore.apply`, :meth:`~EngineCore.end_epoch`, :meth:`~EngineCore.rescale_probe`;
the rest has defaults. No dask.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TileSteps:
    """An engine's update on row tiles (:class:`daskpty.execution.engine_protocol.RunsOnTiles`):
    ``round_sums(state, total, own, *earlier)``, ``apply(state, total, options, shares)``,
    ``end_sums(state, options, own)``, ``end_epoch(state, options, shares)``; ``fields``: state
    attributes in the object's frame, cut by rows; ``warped_fields``: those the window correction
    resamples; ``stages(options)``: rounds of shares an update needs."""

    fields: tuple
    warped_fields: tuple
    round_sums: Callable
    apply: Callable
    end_sums: Callable
    end_epoch: Callable
    stages: Callable = staticmethod(lambda options: 1)


@dataclass(frozen=True)
class InPlaceSteps:
    """An engine's update into arrays of the epoch's own (:class:`~daskpty.execution.engine_protocol.UpdatesInPlace`):
    ``begin_epoch(state, options)`` makes them, ``apply(state, total, options)`` and
    ``end_epoch(state, run)`` write into them."""

    begin_epoch: Callable
    apply: Callable
    end_epoch: Callable


class EngineCore:
    """An engine core's members and their defaults (see the module docstring)."""

    #: chunk steps by the parts present, ``step(payload, intensities, positions, local) -> Partial``:
    #: ``"plain"`` (one probe, fixed positions), ``"refining"`` (refined positions in ``local``),
    #: ``"varying"`` (a varying probe, positions refined or not)
    steps: dict = {}
    #: state attributes kept in device memory on GPU workers
    device_fields: tuple = ()
    tiles: TileSteps | None = None        # the update on row tiles (None: whole objects only)
    in_place: InPlaceSteps | None = None  # the update into the epoch's own arrays (None: new arrays)
    #: the loss alone by the parts present, as :attr:`steps`, for an ``apply`` that evaluates it
    #: (line searches; None: apply needs no evaluations)
    loss_steps: dict | None = None

    @staticmethod
    def flags(state, options) -> dict:
        """The engine's own fields of a round's payload (which parameters it updates)."""
        return {}

    @staticmethod
    def new_state(obj, probe, epoch: int, stored: dict):
        """A state from an object, a probe and the arrays of :meth:`stored` (empty: a fresh start)."""
        raise NotImplementedError

    @staticmethod
    def stored(state) -> dict:
        """The engine's arrays beyond object and probe that a checkpoint keeps."""
        return {}

    @staticmethod
    def apply(state, total, run):
        """The state after a round's reduced Partial ``total`` (None: the round held no pattern)."""
        raise NotImplementedError

    @staticmethod
    def begin_epoch(state, options):
        return state

    @staticmethod
    def end_epoch(state, run):
        """The epoch's end (momentum, normalisation); ``state.epoch`` += 1."""
        raise NotImplementedError

    @staticmethod
    def rescale_probe(state, sums):
        """The first epoch's probe rescale from Σ measured and Σ model intensity."""
        raise NotImplementedError

    @staticmethod
    def resample(state, matrix, offset) -> None:
        """Position refinement's window correction: O(x) ← O(matrix · x + offset) and the
        object-sized memory that moves with it."""
        raise NotImplementedError

    @staticmethod
    def apply_probe_model(state, total, model, run) -> None:
        """A varying probe's global update (eigen-probes, background) after ``apply``."""

    @staticmethod
    def copy_state(state):
        """A copy that :meth:`apply` may change without touching ``state``."""
        return copy.deepcopy(state)

    @staticmethod
    def unsupported(options, part: str) -> str | None:
        """What in ``options`` cannot run with ``part`` (``"tiles"``, ``"probe_model"``); None: all can."""
        return None

    @staticmethod
    def needs_evaluations(options) -> bool:
        """Whether ``apply`` evaluates the loss (through :attr:`loss_steps`)."""
        return False
