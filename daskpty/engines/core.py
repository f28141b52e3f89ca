"""What an engine writes for the round loop: an *engine core*, one small class of functions named
by the engine's spec (:mod:`.specs`, ``core_path``). Execution's one adapter
(:mod:`daskpty.execution.adapter`) adds the parts of the forward model, the payload, the first
epoch's probe rescale and resume. Functions that need more than the state get the adapter
(``run``: ``run.options``, ``run.valid``, ``run.sample.model``). Required: :attr:`~EngineCore.steps`,
``new_state``, ``apply``, ``end_epoch``, ``rescale_probe``; the rest has defaults. No dask.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TileSteps:
    """What the core's own update needs on row tiles (:mod:`daskpty.execution.tile_numbers`
    supplies the frame, the halo and the numbers): ``fields``, state attributes in the object's
    frame, cut by rows; ``warped_fields``, those the window correction resamples; the names of
    the whole-object numbers its ``apply`` takes as keywords (``round_numbers(options)``) and
    its ``end_epoch`` (``end_numbers``). The in-place update and end take them when the core
    has them (:class:`InPlaceSteps`)."""

    fields: tuple
    warped_fields: tuple
    round_numbers: Callable = staticmethod(lambda options: ("peak",))
    end_numbers: tuple = ()


@dataclass(frozen=True)
class InPlaceSteps:
    """The update into arrays of the epoch's own: ``begin_epoch(state, options)`` makes them,
    ``apply(state, total, options, **numbers)`` and ``end_epoch(state, run, **numbers)`` write
    into them (``numbers``: the whole-object numbers on a tile, :class:`TileSteps`)."""

    begin_epoch: Callable
    apply: Callable
    end_epoch: Callable


def chunk_steps(step_of, refine=None, vary=None, inject: str = "step", **by_sample) -> dict:
    """An engine's :attr:`EngineCore.steps` from its forward step ``step_of(sample)`` (the sample
    model's, :mod:`.sample_model`), its refining step ``refine`` and its varying-probe step
    ``vary`` (None: not taken), which take the forward step as keyword ``inject``;
    ``by_sample``: more keywords of theirs as functions of the sample."""

    def plain(p, intensities, positions, local=None):
        return step_of(p.sample)(p.object, p.probe, intensities, positions, options=p.options, valid=p.valid,
                                 **p.engine)

    def wrapped(p) -> dict:
        return dict(options=p.options, positions=p.positions, epoch=p.epoch, affine=p.affine, valid=p.valid,
                    frame=p.frame, **{inject: step_of(p.sample)}, **p.engine,
                    **{key: of(p.sample) for key, of in by_sample.items()})

    def refining(p, intensities, positions, local):
        return refine(p.object, p.probe, intensities, positions, local, **wrapped(p))

    def varying(p, intensities, positions, local):
        return vary(p.object, p.probe, intensities, positions, local, model=p.model, eigen=p.eigen,
                    transform=p.transform, background=p.background, **wrapped(p))

    steps = {"plain": plain, "refining": refining, "varying": varying}
    return {name: steps[name] for name, taken in (("plain", True), ("refining", refine), ("varying", vary)) if taken}


class EngineCore:
    """An engine core's members and their defaults (see the module docstring)."""

    #: chunk steps by the parts present, ``step(payload, intensities, positions, local) -> Partial``:
    #: ``"plain"`` (one probe, fixed positions), ``"refining"`` (refined positions in ``local``),
    #: ``"varying"`` (a varying probe, positions refined or not)
    steps: dict = {}
    device_fields: tuple = ()             # state attributes kept in GPU memory on GPU workers
    tiles: TileSteps | None = None        # the update on row tiles (None: whole objects only)
    in_place: InPlaceSteps | None = None  # the update into the epoch's own arrays (None: new arrays)
    loss_steps: dict | None = None        # the loss alone by parts, as steps, for a line search

    @staticmethod
    def flags(state, options) -> dict:
        """The engine's own fields of a round's payload (which parameters it moves)."""
        return {}

    @staticmethod
    def epoch_options(state, options):
        """The options the chunk steps of ``state``'s epoch run with (default: ``options``)."""
        return options

    @staticmethod
    def new_state(obj, probe, epoch: int, stored: dict):
        """A state from an object, a probe and the arrays of :meth:`stored` (empty: a fresh start)."""
        raise NotImplementedError

    @staticmethod
    def stored(state) -> dict:
        """The engine's arrays beyond object and probe that a checkpoint keeps."""
        return {}

    @staticmethod
    def apply(state, total, run, **numbers):
        """The state after a round's reduced Partial ``total`` (None: the round held no pattern);
        ``numbers``: the whole-object numbers when the state holds a tile (:class:`TileSteps`)."""
        raise NotImplementedError

    @staticmethod
    def begin_epoch(state, options):
        return state

    @staticmethod
    def end_epoch(state, run, **numbers):
        """The epoch's end (momentum, normalisation); ``state.epoch`` += 1; ``numbers`` as in
        :meth:`apply`."""
        raise NotImplementedError

    @staticmethod
    def rescale_probe(state, sums):
        """The first epoch's probe rescale from Σ measured and Σ model intensity."""
        raise NotImplementedError

    @staticmethod
    def resample(state, matrix, offset) -> None:
        """With refined positions, the window correction: O(x) ← O(matrix · x + offset) and the
        object-sized memory that moves with it."""
        raise NotImplementedError

    @staticmethod
    def apply_probe_model(state, total, model, run) -> None:
        """With a varying probe, its global update (eigen-probes, background) after ``apply``."""

    copy_state = staticmethod(copy.deepcopy)  # a copy apply may change without touching the original

    @staticmethod
    def unsupported(options, part: str) -> str | None:
        """What in ``options`` cannot run with ``part`` (``"tiles"``, ``"probe_model"``); None: all can."""
        return None

    @staticmethod
    def needs_evaluations(options) -> bool:
        """Whether ``apply`` evaluates the loss (through :attr:`loss_steps`)."""
        return False
