"""One adapter for every engine: it binds an engine's core (:mod:`daskpty.engines.core`, named
by the engine's spec) and the parts of the forward model (:mod:`.parts`) to the round loop of
:mod:`.driver`, :mod:`.epoch_graph` and :mod:`.tile_graph` (protocol: :mod:`.engine_protocol`).

:func:`adapter_class` makes the class of an engine once: :class:`Adapter`, with
:class:`InPlace`, :class:`OnTiles` and :class:`OwnRounds` where the core offers an in-place
update, tiles or loss evaluations. The chunk step that runs is the core's step for the
highest-ranked part present (``"plain"``, ``"refining"``, ``"varying"``).
"""
from __future__ import annotations

import copyreg
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engines import sample_model as sm
from ..engines.partials import Partial
from ..engines.tile_frame import frame_of
from . import parts as _parts
from . import tile_numbers
from .rounds import ChunkedData, map_reduce


@dataclass
class Payload:
    """What every chunk step of a round reads: the state's arrays, the options, the core and the
    variant of its step, the engine's own fields (``engine``) and the parts' fields."""

    object: Any
    probe: Any
    options: Any
    valid: Any
    epoch: int
    core: Any
    variant: str
    engine: dict
    frame: Any = None       # a tile's place in the object (None: the whole object)
    sample: Any = None      # the parts' fields (:meth:`.parts.Part.payload`)
    positions: Any = None
    affine: Any = None
    model: Any = None
    eigen: Any = None
    transform: Any = None
    background: Any = None


def chunk(intensities, positions, payload: Payload, local=None):
    """The chunk step of the payload's engine and parts (``positions`` the nominal ones)."""
    return payload.core.steps[payload.variant](payload, intensities, positions, local)


def loss_chunk(intensities, positions, payload: Payload, local=None):
    """The loss alone (line searches), at the refined positions when refining (none move)."""
    return payload.core.loss_steps[payload.variant](payload, intensities, positions, local)


def forward_sums_chunk(intensities, positions, payload: Payload):
    """Σ measured and Σ model intensity of a chunk (the first epoch's probe rescale)."""
    return sm.forward_sums(payload.sample)(payload.object, payload.probe, intensities, positions,
                                           valid=payload.valid)


class Adapter:
    """Engine ``spec`` (class attribute) with its parts: ``positions`` (PositionOptions),
    ``probe_model`` (ProbeModelOptions), each None when off, ``sample`` (SampleModel, None: THIN), or parts."""

    spec = None
    chunk_function = staticmethod(chunk)

    def __init__(self, options=None, valid=None, positions=None, *, probe_model=None, sample=None):
        self.name, self.core = self.spec.name, self.spec.core
        self.options = self.spec.options() if options is None else options
        self.valid = valid
        self.positions, self.probe_model, self.sample = _parts.compose(self.spec, positions, probe_model, sample)
        self._each("check", self)

    def __reduce__(self):
        """Pickled with the engine's spec: the class is made by :func:`adapter_class`."""
        if type(self) is adapter_class(self.spec):
            return _restore, (self.spec, self.__dict__)
        return copyreg.__newobj__, (type(self),), self.__dict__

    @property
    def parts(self) -> tuple:
        """The parts in the order their epoch-end hooks run."""
        return self.sample, self.probe_model, self.positions

    def _merged(self, hook: str, *args) -> dict:
        """Every part's ``hook(*args)`` dict, merged."""
        return {key: value for part in self.parts for key, value in getattr(part, hook)(*args).items()}

    def _each(self, hook: str, state, *args):
        """Every part's ``hook(state, *args)`` in turn; returns ``state``."""
        for part in self.parts:
            getattr(part, hook)(state, *args)
        return state

    @property
    def device_fields(self) -> tuple:
        """What lives in device memory on GPU workers (:mod:`.device_state`)."""
        return () if any(part.on_host for part in self.parts) else self.core.device_fields

    @property
    def local_state(self) -> bool:
        """Whether chunks carry per-pattern state from round to round."""
        return any(part.per_pattern for part in self.parts)

    def initial_local(self, nominal) -> dict:
        return self._merged("start", nominal, self)

    def payload(self, state) -> Payload:
        fields = self._merged("payload", state)
        variant = max(self.parts, key=lambda part: part.rank).variant
        options = self.core.epoch_options(state, self.options)   # (LSQML: the noise model's warm-up)
        return Payload(state.object, state.probe, options, self.valid, state.epoch, self.core, variant,
                       self.core.flags(state, self.options), frame_of(state), **fields)

    def epoch_scalars(self, state) -> dict:
        return self._merged("epoch_scalars", state)

    def _after_apply(self, state, total):
        return self._each("after_apply", state, total, self)

    def apply(self, state, total):
        return self._after_apply(self.core.apply(state, total, self), total)

    def copy_state(self, state):
        return self.core.copy_state(state)

    def begin_epoch(self, state):
        return self._each("begin_epoch", self.core.begin_epoch(state, self.options))

    def _end_epoch(self, state, end, finish: bool = True):
        self._each("end_epoch", state)
        if finish:
            self._each("finish", state, self)
        return self._each("after_end", end(state))

    def end_epoch(self, state):
        return self._end_epoch(state, lambda s: self.core.end_epoch(s, self))

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        """A state from an object, a probe and (when resuming) the arrays of :meth:`engine_state`."""
        stored = engine_state or {}
        state = self.core.new_state(self.sample.slices(obj), probe, epoch, stored)
        return self._each("attach", state, probe, stored)

    def engine_state(self, state) -> dict:
        """The arrays beyond object and probe needed to continue bit for bit (checkpoints)."""
        return {**self._merged("stored", state), **self.core.stored(state)}

    def _rescaled(self, state, sums):
        before = state.probe
        return self._each("after_rescale", self.core.rescale_probe(state, sums), before)

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy."""
        sums = map_reduce(client, data, forward_sums_chunk, self.payload(state), split_every=split_every)
        return self._rescaled(state, sums)

    def initialise_from_total(self, state, measured: float | None, n_patterns: int):
        """:meth:`initialise` without a pass over the data, where the model's Σŷ has a closed form:
        one slice in the far field, no detector mask and a uniform object c (the usual start),
        where the unitary FFTs give Σŷ = N |c|² Σ_m ‖P_m‖² (Parseval; a window's sub-pixel shift
        keeps its norm). ``measured``: Σy, from the value check's pass. None where that does not
        hold (no Σy, a mask, slices, a near-field detector, an object that varies): the caller
        runs :meth:`initialise` then."""
        if measured is None or self.valid is not None or self.sample.model is not _parts.THIN:
            return None
        obj = np.asarray(state.object)
        if obj.ndim != 2 or obj.size == 0 or not np.all(obj == obj.flat[0]):
            return None
        power = float(np.sum(np.abs(np.asarray(state.probe, np.complex128)) ** 2))
        model = float(n_patterns) * float(abs(complex(obj.flat[0])) ** 2) * power
        return self._rescaled(state, Partial(scalars={"sum_measured": float(measured), "sum_model": model,
                                                      "n": float(n_patterns)}))


class InPlace:
    """The update into arrays of the epoch's own (:class:`.engine_protocol.UpdatesInPlace`)."""

    def begin_epoch_owned(self, state):
        return self.core.in_place.begin_epoch(self.begin_epoch(state), self.options)

    def apply_in_place(self, state, total):
        return self._after_apply(self.core.in_place.apply(state, total, self.options), total)

    def end_epoch_owned(self, state):
        return self._end_epoch(state, lambda s: self.core.in_place.end_epoch(s, self))


class OnTiles:
    """The state cut into row tiles (:class:`.engine_protocol.RunsOnTiles`)."""

    tile_sums_function = staticmethod(forward_sums_chunk)

    @property
    def tile_round_stages(self) -> int:
        return tile_numbers.stages(self._round_numbers)

    @property
    def _round_numbers(self) -> tuple:
        return self.core.tiles.round_numbers(self.options)

    def tiles_unsupported(self) -> str | None:
        return self.core.unsupported(self.options, "tiles")

    def tile_finish_positions(self, state) -> None:
        self._each("finish", state, self)

    def tile_initialise(self, state, sums):
        return self._rescaled(state, sums)

    def tile_begin_epoch(self, state):
        """An engine that updates in place begins with arrays of the epoch's own."""
        return self.begin_epoch_owned(state) if isinstance(self, InPlace) else self.begin_epoch(state)

    def tile_round_sums(self, state, total, own, *earlier):
        return tile_numbers.round_share(self._round_numbers, state, total, own, *earlier)

    def tile_apply(self, state, total, shares):
        """The core's update (in place where it has one) with the round's whole-object numbers."""
        numbers = tile_numbers.round_numbers(self._round_numbers, state, shares)
        if total is not None:
            state = (self.core.in_place.apply(state, total, self.options, **numbers) if isinstance(self, InPlace)
                     else self.core.apply(state, total, self, **numbers))
        return self._after_apply(state, total)

    def tile_end_sums(self, state, own):
        return tile_numbers.end_share(self.core.tiles.end_numbers, state, self.options, own)

    def tile_end_epoch(self, state, shares):
        """``end_epoch`` on a tile, after :meth:`tile_finish_positions`."""
        numbers = tile_numbers.end_numbers(self.core.tiles.end_numbers, state, shares)
        end = self.core.in_place.end_epoch if isinstance(self, InPlace) else self.core.end_epoch
        return self._end_epoch(state, lambda s: end(s, self, **numbers), finish=False)


class OwnRounds:
    """Rounds with loss-only map-reduces for the core's apply (:class:`.engine_protocol.RunsOwnRounds`)."""

    loss_function = staticmethod(loss_chunk)

    @property
    def needs_evaluations(self) -> bool:
        return self.core.needs_evaluations(self.options)

    def apply(self, state, total, evaluate=None):
        return self._after_apply(self.core.apply(state, total, self, evaluate=evaluate), total)

    def run_round(self, client, data: ChunkedData, state, *, round_index: int = 0, rounds: int = 1,
                  split_every: int | None = None, local: dict | None = None):
        """Gradient map-reduce, then apply, with loss-only map-reduces on the same slice when the
        core asks for them. Returns ``(state, total)``; ``total.scalars["loss_evaluations"]``
        counts the extra map-reduces."""
        slice_of = dict(round_index=round_index, rounds=rounds, split_every=split_every, local=local)
        payload = self.payload(state)
        total = map_reduce(client, data, self.chunk_function, payload, **slice_of)
        count = 0

        def evaluate(params):
            nonlocal count
            count += 1
            trial = dataclasses.replace(payload, object=params.get("object", payload.object),
                                        probe=params.get("probe", payload.probe))
            return map_reduce(client, data, self.loss_function, trial, **slice_of).scalars.get("loss", float("nan"))

        state = self.apply(state, total, evaluate=evaluate if self.needs_evaluations else None)
        if total is not None:
            total.scalars["loss_evaluations"] = float(count)
        return state, total


_CLASSES: dict = {}


def adapter_class(spec) -> type:
    """The adapter class of engine ``spec``: :class:`Adapter` with the core's optional groups."""
    made = _CLASSES.get(spec.name)
    if made is None or made.spec != spec:
        core = spec.core
        groups = [cls for cls, offered in ((OwnRounds, core.loss_steps), (InPlace, core.in_place),
                                           (OnTiles, core.tiles)) if offered]
        fields = {"tile_fields": core.tiles.fields, "tile_warped_fields": core.tiles.warped_fields} if core.tiles else {}
        made = _CLASSES[spec.name] = type(f"Adapter[{spec.name}]", (*groups, Adapter), {"spec": spec, **fields})
    return made


def _restore(spec, fields: dict):
    adapter = adapter_class(spec).__new__(adapter_class(spec))
    adapter.__dict__.update(fields)
    return adapter
