"""The engines by name with their execution adapters: each entry of
:data:`daskpty.engines.specs.ENGINE_SPECS` (options class, features, defaults, core) makes its
adapter (:func:`.adapter.adapter_class`), so that ``reconstruct`` and resume make adapters from
one table, and an engine registered there runs without a line here.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from ..engines import specs
from ..engines.specs import FEATURES  # noqa: F401  (re-exported)
from .adapter import adapter_class


@dataclass(frozen=True)
class EngineSpec(specs.EngineSpec):
    """An engine's spec that makes its execution adapter."""

    @property
    def adapter(self) -> type:
        """The engine's adapter class (:func:`.adapter.adapter_class`)."""
        return adapter_class(specs.engine_spec(self.name))

    def make(self, noise: str, loss=None, optimizer=None, lr=None, engine_options: dict | None = None,
             slices: int | None = None, counts_per_pixel: float | None = None, **parts):
        """Validated options and a fresh adapter with ``parts`` (``positions``, ``probe_model``,
        ``sample``, ``valid``): ``(options, adapter)``; ``slices``: the adapter's options resolved
        for that many slices and data of ``counts_per_pixel`` (``for_slices``, where the options
        have it; :func:`daskpty.io.dose.counts_per_pixel`)."""
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
        run_options = options.for_slices(slices, counts_per_pixel) if slices and hasattr(options, "for_slices") else options
        return options, self.adapter(run_options, **parts)


class _Engines(Mapping):
    """The registered engines by name, read from the spec table each time."""

    def __getitem__(self, name: str) -> EngineSpec:
        spec = specs.ENGINE_SPECS[name]
        return EngineSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})

    def __iter__(self):
        return iter(specs.ENGINE_SPECS)

    def __len__(self) -> int:
        return len(specs.ENGINE_SPECS)


#: the registered engines, in the spec table's order
ENGINES: Mapping[str, EngineSpec] = _Engines()


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name`` with its adapter; one-line ValueError (with close matches) otherwise."""
    return ENGINES[specs.engine_spec(name).name]
