"""The engines by name with their execution adapters: each entry of
:data:`daskpty.engines.specs.ENGINE_SPECS` (options class, features, defaults) with how its adapter
is made, so that ``reconstruct`` and resume make adapters from one table.

Adding an engine: its spec in :mod:`daskpty.engines.specs`, its adapter in
``daskpty/execution/<name>_adapter.py`` and one line in :data:`ADAPTERS`.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from functools import partial
from typing import Callable

from ..engines import specs
from ..engines.specs import FEATURES  # noqa: F401  (re-exported)
from .ad_adapter import ADAdapter
from .lsqml_adapter import LSQMLAdapter
from .pie_adapter import PIEAdapter

#: engine name -> the adapter factory, called with the engine's validated options
ADAPTERS: dict[str, Callable] = {
    "lsqml": LSQMLAdapter,
    "ad": ADAdapter,
    "rpie": partial(PIEAdapter, name="rpie"),
    "epie": partial(PIEAdapter, name="epie"),
}


@dataclass(frozen=True)
class EngineSpec(specs.EngineSpec):
    """An engine's spec with ``adapter``, which builds its execution adapter from validated options."""

    adapter: Callable | None = None

    def make(self, noise: str, loss=None, optimizer=None, lr=None, engine_options: dict | None = None):
        """Validated options and a fresh adapter: ``(options, adapter)``."""
        engine_options = dict(engine_options or {})
        if not self.gradient_based and (loss is not None or optimizer is not None or lr is not None):
            takers = " or ".join(f"engine={n!r}" for n, s in ENGINES.items() if s.gradient_based)
            raise TypeError(f"loss, optimizer and lr apply to {takers} only, not {self.name!r}")
        valid = {f.name for f in dataclasses.fields(self.options)}
        unknown = sorted(set(engine_options) - valid)
        if unknown:
            close = {u: difflib.get_close_matches(u, valid, n=1) for u in unknown}
            hints = ", ".join(f"{u!r} (did you mean {c[0]!r}?)" if c else repr(u) for u, c in close.items())
            raise TypeError(f"unknown option(s) {hints} for engine {self.name!r}; valid: {sorted(valid)}")
        settings = {**self.defaults, **engine_options}
        if self.gradient_based:
            options = self.options(loss=loss or noise, optimizer=optimizer, lr=lr, **settings)
        else:
            options = self.options(noise=noise, **settings)
        return options, self.adapter(options)


#: the registered engines, in the spec table's order
ENGINES: dict[str, EngineSpec] = {
    name: EngineSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}, adapter=ADAPTERS[name])
    for name, spec in specs.ENGINE_SPECS.items()
}


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name`` with its adapter; one-line ValueError (with close matches) otherwise."""
    return ENGINES[specs.engine_spec(name).name]
