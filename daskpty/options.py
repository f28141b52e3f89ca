"""The settings of :func:`daskpty.reconstruct`, grouped by concern, and the one rule that merges
keyword shortcuts into their groups.

Each group is a small frozen dataclass validated in ``__post_init__`` (one line per mistake):

===================  ==================  ==========================================================
``reconstruct(...)``  class               keyword shortcuts
===================  ==================  ==========================================================
``engine=``          EngineOptions       ``noise``, ``loss``, ``optimizer``, ``lr``, ``seed``,
                                         ``rescale_probe`` and the engine's own fields (``beta``,
                                         ``alpha``, ...: ``LSQMLOptions`` / ``ADOptions`` /
                                         ``PIEOptions``)
``refine_positions=``  PositionOptions   (none: True / a dict / an instance)
``probe_model=``     ProbeModelOptions   ``opr_modes``, ``fit_intensity``, ``background``
``sample=``          SampleOptions       ``slices``, ``slice_spacing_m``
``execution=``       ExecutionOptions    ``n_workers``, ``chunk_length``, ``rounds_per_epoch``,
                                         ``persist``, ``device``, ``split_every``, ``sort``,
                                         ``tiles``
``run=``             RunOptions          ``checkpoint``, ``checkpoint_every``, ``resume``,
                                         ``progress``, ``dashboard``, ``callback``, ``check_data``
===================  ==================  ==========================================================

A group is given as an instance or a dict of its fields. **The merge rule**, the same for every
group: a shortcut keyword may repeat a value the group sets, never change it — one that differs
is an :class:`OptionError` naming both. A dict sets the keys it holds; an instance sets the
fields that differ from the class's defaults; a shortcut given as None is unset. A keyword that
names no setting is an :class:`OptionError` with the close matches.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .faults import OptionError  # noqa: F401 (also named here)
from .engines.positions import PositionOptions
from .engines.probe_model import ProbeModelOptions
from .execution.options import ExecutionOptions
from .engines.sample_options import SampleOptions
from .engines.specs import DEFAULT_ENGINE, ENGINE_SPECS, engine_spec


#: reconstruct's default number of epochs (also the CLI's --epochs)
DEFAULT_EPOCHS = 100


def _flag(name, value, none: bool = False):
    if not (isinstance(value, (bool, np.bool_)) or (none and value is None)):
        raise ValueError(f"{name} must be True{', False or None' if none else ' or False'}, got {value!r}")


@dataclass(frozen=True)
class EngineOptions:
    """What is fitted and how: the engine and its settings.

    name: a registered engine (``daskpty.engines.specs.ENGINE_SPECS``: ``"lsqml"``,
        ``"ad"``, ``"rpie"``, ``"epie"``).
    noise: noise model of the far-field correction and of the reported loss
        (``daskpty.physics.noise_models``).
    loss, optimizer, lr: AD only: its loss (default: ``noise``), optimiser and object step size.
    seed: seed of every random choice (extra probe modes); the engines are deterministic.
    rescale_probe: scale the probe so the model's total intensity matches the data before epoch 1.
    settings: fields of the engine's own options class (``LSQMLOptions``, ``ADOptions``,
        ``PIEOptions``), e.g. ``{"beta": 0.8}``.
    """

    name: str = DEFAULT_ENGINE
    noise: str = "gaussian"
    loss: str | None = None
    optimizer: str | None = None
    lr: float | None = None
    seed: int = 0
    rescale_probe: bool = True
    settings: dict = field(default_factory=dict)

    def __post_init__(self):
        self.spec()  # an unknown engine: one line with the close matches
        if isinstance(self.seed, (bool, np.bool_)) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _flag("rescale_probe", self.rescale_probe)
        if not isinstance(self.settings, dict):
            raise ValueError(f"engine settings must be a dict of the engine's option fields, got {self.settings!r}")
        valid = self.setting_names()
        unknown = sorted(set(self.settings) - valid)
        if unknown:
            raise OptionError(f"unknown option(s) {_hints(unknown, valid)} for engine {self.name!r}; "
                              f"valid: {sorted(valid)}")

    def spec(self):
        """The engine's spec (:mod:`daskpty.engines.specs`, without dask)."""
        return engine_spec(self.name)

    def setting_names(self) -> set:
        return {f.name for f in dataclasses.fields(self.spec().options)}

    def make(self, **parts):
        """The engine's validated options and a fresh execution adapter with ``parts``
        (:meth:`daskpty.execution.engine_registry.EngineSpec.make`): ``(options, adapter)``.
        (Imported here: the registry of adapters loads dask, and ``daskpty --help`` reads these
        classes without it.)"""
        from .execution.engine_registry import engine_spec as registered

        return registered(self.name).make(self.noise, self.loss, self.optimizer, self.lr, self.settings, **parts)


@dataclass(frozen=True)
class RunOptions:
    """How a run is kept and watched.

    checkpoint: reconstruction store updated atomically every ``checkpoint_every`` epochs, at
        the end and on Ctrl-C / SIGTERM (None: none).
    checkpoint_every: epochs between checkpoint writes.
    resume: reconstruction store (a checkpoint) to continue from (None: start afresh).
    progress: show progress on stderr (None: when a terminal or notebook is watching).
    dashboard: publish progress and images to the dask dashboard's ``/daskpty`` page.
    callback: ``callback(epoch, state, metrics)`` after every epoch; False stops the run.
    check_data: look at every intensity once before the first epoch and refuse bad values
        (persisted data where they were placed: their source is read once).
    """

    checkpoint: str | os.PathLike | None = None
    checkpoint_every: int = 10
    resume: str | os.PathLike | None = None
    progress: bool | None = None
    dashboard: bool = False
    callback: Callable | None = None
    check_data: bool = True

    def __post_init__(self):
        every = self.checkpoint_every
        if isinstance(every, (bool, np.bool_)) or not isinstance(every, (int, np.integer)):
            raise ValueError(f"checkpoint_every must be an integer, got {every!r}")
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every!r}")
        for name in ("checkpoint", "resume"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path or None, got {value!r}")
        _flag("progress", self.progress, none=True)
        _flag("dashboard", self.dashboard)
        _flag("check_data", self.check_data)
        if self.callback is not None and not callable(self.callback):
            raise ValueError(f"callback must be callable or None, got {self.callback!r}")


@dataclass(frozen=True)
class Group:
    """One option group: ``reconstruct``'s keyword for it, its title (the CLI's --help groups
    follow these), its class and its keyword shortcuts (field names of the class)."""

    keyword: str
    title: str
    cls: type
    shortcuts: tuple = ()


#: the groups in the order ``reconstruct``'s docstring and ``daskpty reconstruct --help`` list them
GROUPS = (
    Group("engine", "engine", EngineOptions, ("noise", "loss", "optimizer", "lr", "seed", "rescale_probe")),
    Group("probe_model", "probe model", ProbeModelOptions, ("opr_modes", "fit_intensity", "background")),
    Group("refine_positions", "positions", PositionOptions),
    Group("sample", "sample and geometry", SampleOptions, ("slices", "slice_spacing_m")),
    Group("execution", "execution", ExecutionOptions,
          ("n_workers", "chunk_length", "rounds_per_epoch", "persist", "device", "split_every", "sort",
           "tiles")),
    Group("run", "run (checkpoints and monitoring)", RunOptions,
          ("checkpoint", "checkpoint_every", "resume", "progress", "dashboard", "callback", "check_data")),
)
SHORTCUTS = {name: group for group in GROUPS for name in group.shortcuts}


def default_of(cls: type, name: str):
    """The default of field ``name`` of the option class ``cls`` (for --help texts)."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def defaults_text(cls: type, skip=()) -> str:
    """``name=default, ...`` of the option class ``cls`` (for --help texts), fields in ``skip``
    left out; a default that differs by engine reads ``lsqml-value (ad: ad-value)``: the first
    engine's value, then each engine whose value differs from it (engines that do not take the part
    left out)."""
    base = cls()
    by_engine = {}
    if hasattr(base, "for_engine"):
        part = {PositionOptions: "position", ProbeModelOptions: "probe_model"}[cls]
        by_engine = {name: base.for_engine(name) for name, spec in ENGINE_SPECS.items()
                     if getattr(spec, f"{part}_defaults") is not None}
    first = next(iter(by_engine.values()), base)
    items = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = getattr(first, f.name)
        text = f"{f.name}={'auto' if value is None else value}"
        for name, options in list(by_engine.items())[1:]:
            if getattr(options, f.name) != value:
                text += f" ({name}: {getattr(options, f.name)})"
        items.append(text)
    return ", ".join(items)


def _hints(unknown, valid) -> str:
    """``'x' (did you mean 'y'?), 'z'`` for the unknown names."""
    out = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        out.append(f"{name!r} (did you mean {' or '.join(repr(c) for c in close)}?)" if close else repr(name))
    return ", ".join(out)


def _set_fields(cls: type, group, keyword: str) -> dict:
    """The fields a group sets: a dict's keys (unknown ones refused), an instance's non-defaults."""
    names = set(cls.__dataclass_fields__)
    if group is None:
        return {}
    if isinstance(group, dict):
        unknown = sorted(set(group) - names)
        if unknown:
            raise OptionError(f"{keyword}: unknown option(s) {_hints(unknown, names)}; valid: {sorted(names)}")
        return dict(group)
    if isinstance(group, cls):
        return {n: getattr(group, n) for n in names if _differs(getattr(group, n), default_of(cls, n))}
    raise OptionError(f"{keyword} must be a {cls.__name__} or a dict of its fields, got {type(group).__name__}")


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except (ValueError, TypeError):  # arrays and the like: compare by identity
        return a is not b


def merge(cls: type, group, shortcuts: dict, keyword: str, merged: tuple = ()):
    """``group`` (None, a dict of fields or a ``cls``) with the ``shortcuts`` the caller gave,
    by the module's merge rule (``merged``: shortcuts already merged with the group's value);
    the merged, validated ``cls``."""
    base = group if isinstance(group, cls) else None
    fields = _set_fields(cls, group, keyword)
    for name, value in shortcuts.items():
        if name in fields and name not in merged and _differs(fields[name], value):
            raise OptionError(f"{name} is given twice: {name}={value!r} and {keyword}'s {name}="
                              f"{fields[name]!r}; give it once (or the same value)")
    fields.update(shortcuts)
    if base is not None:
        return dataclasses.replace(base, **shortcuts) if shortcuts else base
    return cls(**fields)


def _other_engines(unknown, name) -> str:
    """``'beta' is a setting of engine 'lsqml', not 'rpie'`` for settings of other engines."""
    found = []
    for key in unknown:
        owners = [e for e, spec in ENGINE_SPECS.items() if key in spec.options.__dataclass_fields__]
        if owners:
            found.append(f"{key!r} is a setting of engine {' and '.join(repr(o) for o in owners)}, not {name!r}")
    return "; ".join(found)


@dataclass(frozen=True)
class Options:
    """Every group of one ``reconstruct`` call, merged and validated (``positions`` and
    ``probe_model`` None when off)."""

    engine: EngineOptions
    positions: PositionOptions | None
    probe_model: ProbeModelOptions | None
    sample: SampleOptions
    execution: ExecutionOptions
    run: RunOptions
    #: the execution settings the caller set (a dict's keys, an instance's non-defaults, shortcuts
    #: not None): a resumed run keeps the store's value of the others (``tiles``)
    execution_given: frozenset = frozenset()


def resolve(engine=DEFAULT_ENGINE, *, refine_positions=False, probe_model=None, sample=None, execution=None,
            run=None, **shortcuts) -> Options:
    """``reconstruct``'s groups and keyword shortcuts as one :class:`Options` (before any work)."""
    groups = {"probe_model": probe_model, "sample": sample, "execution": execution, "run": run}
    engine_group = {"name": engine} if isinstance(engine, str) else engine
    by_group: dict[str, dict] = {g.keyword: {} for g in GROUPS}
    settings = {}
    name = engine_group.name if isinstance(engine_group, EngineOptions) else \
        (engine_group or {}).get("name", DEFAULT_ENGINE) if isinstance(engine_group, dict) else None
    for key, value in shortcuts.items():
        if value is None and key in SHORTCUTS:
            continue  # None leaves a shortcut unset (the defaults of reconstruct's old signature)
        if key in SHORTCUTS:
            by_group[SHORTCUTS[key].keyword][key] = value
        else:
            settings[key] = value
    if settings:  # the engine's own fields, else typos
        try:
            valid = EngineOptions(name=name).setting_names() if isinstance(name, str) else set()
        except ValueError:
            valid = set()
        unknown = sorted(set(settings) - valid)
        elsewhere = _other_engines(unknown, name)
        if elsewhere:
            raise OptionError(f"{elsewhere}; engine {name!r} takes {sorted(valid)}")
        if unknown:
            known = set(SHORTCUTS) | valid | {g.keyword for g in GROUPS} | {"probe", "object", "probe_modes",
                                                                          "client"}
            raise OptionError(f"unknown option(s) {_hints(unknown, known)} for engine {name!r}; valid: "
                              f"the option groups, their shortcuts (daskpty.options.SHORTCUTS) and "
                              f"the engine's {sorted(valid)}")
        given = engine_group.settings if isinstance(engine_group, EngineOptions) else \
            dict((engine_group or {}).get("settings") or {})
        for key, value in settings.items():
            if key in given and _differs(given[key], value):
                raise OptionError(f"{key} is given twice: {key}={value!r} and engine's settings "
                                  f"{key}={given[key]!r}; give it once (or the same value)")
        by_group["engine"]["settings"] = {**given, **settings}
    merged = {g.keyword: merge(g.cls, engine_group if g.keyword == "engine" else groups[g.keyword],
                               by_group[g.keyword], g.keyword, merged=("settings",))
              for g in GROUPS if g.keyword != "refine_positions"}
    engine_options = merged["engine"]
    model = merged["probe_model"] if merged["probe_model"].enabled else None
    if isinstance(refine_positions, dict):
        _set_fields(PositionOptions, refine_positions, "refine_positions")  # a typo: its close match
    positions = PositionOptions.from_argument(refine_positions)
    spec = engine_options.spec()  # a feature the engine does not take: one line, before any work
    spec.check_features(positions=positions is not None, probe_model=model is not None)
    return Options(engine=engine_options,
                   positions=None if positions is None else positions.for_engine(engine_options.name),
                   probe_model=model, sample=merged["sample"], execution=merged["execution"], run=merged["run"],
                   execution_given=frozenset(_set_fields(ExecutionOptions, execution, "execution"))
                   | frozenset(by_group["execution"]))


__all__ = ["DEFAULT_EPOCHS", "GROUPS", "SHORTCUTS", "EngineOptions", "ExecutionOptions", "OptionError", "Options",
           "PositionOptions", "ProbeModelOptions", "RunOptions", "SampleOptions", "default_of", "defaults_text", "merge",
           "resolve"]
