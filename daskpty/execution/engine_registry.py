"""The engines by name: each entry says its options class, how its adapter is made and which
forward-model features it takes, so that ``reconstruct``, the CLI and resume ask one table.

Adding an engine: its per-chunk math in ``daskpty/engines/<name>.py``, its adapter in
``daskpty/execution/<name>_adapter.py`` and one :class:`EngineSpec` line in :data:`ENGINES`.
A feature an engine does not declare is refused in one line, never ignored.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from functools import partial
from typing import Callable

from ..engines import ad, lsqml, pie
from .ad_adapter import ADAdapter
from .lsqml_adapter import LSQMLAdapter
from .pie_adapter import PIEAdapter

#: the optional forward-model features, as a user asks for them
FEATURES = {
    "positions": "position refinement (refine_positions)",
    "probe_model": "a varying probe (opr_modes, fit_intensity, background)",
    "multislice": "multislice or a near-field detector (slices, near-field data)",
}


@dataclass(frozen=True)
class EngineSpec:
    """One engine: ``options`` its frozen options class, ``adapter`` builds the execution adapter
    from validated options, ``features`` the keys of :data:`FEATURES` it takes, ``defaults`` option
    values of a named variant (ePIE is rPIE with α = 1), ``gradient_arguments`` whether the
    AD-style ``loss`` / ``optimizer`` / ``lr`` arguments apply."""

    name: str
    options: type
    adapter: Callable
    features: frozenset = frozenset()
    defaults: dict = dataclasses.field(default_factory=dict)
    gradient_arguments: bool = False
    summary: str = ""

    def make(self, noise: str, loss=None, optimizer=None, lr=None, engine_options: dict | None = None):
        """Validated options and a fresh adapter: ``(options, adapter)``."""
        engine_options = dict(engine_options or {})
        if not self.gradient_arguments and (loss is not None or optimizer is not None or lr is not None):
            raise TypeError(f"loss, optimizer and lr apply to engine='ad' only, not {self.name!r}")
        valid = {f.name for f in dataclasses.fields(self.options)}
        unknown = sorted(set(engine_options) - valid)
        if unknown:
            close = {u: difflib.get_close_matches(u, valid, n=1) for u in unknown}
            hints = ", ".join(f"{u!r} (did you mean {c[0]!r}?)" if c else repr(u) for u, c in close.items())
            raise TypeError(f"unknown option(s) {hints} for engine {self.name!r}; valid: {sorted(valid)}")
        settings = {**self.defaults, **engine_options}
        if self.gradient_arguments:
            options = self.options(loss=loss or noise, optimizer=optimizer, lr=lr, **settings)
        else:
            options = self.options(noise=noise, **settings)
        return options, self.adapter(options)

    def check_features(self, **requested: bool) -> None:
        """One-line ValueError when a requested feature (``positions=True``, ...) is not taken."""
        for key, wanted in requested.items():
            if wanted and key not in self.features:
                takers = sorted(name for name, spec in ENGINES.items() if key in spec.features)
                raise ValueError(f"engine {self.name!r} does not take {FEATURES[key]}; use engine "
                                 f"{' or '.join(repr(t) for t in takers)} for it, or leave it off")


_ALL = frozenset(FEATURES)

#: the registered engines, in the order the CLI lists them
ENGINES: dict[str, EngineSpec] = {
    "lsqml": EngineSpec("lsqml", lsqml.LSQMLOptions, LSQMLAdapter, _ALL,
                        summary="least-squares maximum likelihood (Odstrčil et al. 2018)"),
    "ad": EngineSpec("ad", ad.ADOptions, ADAdapter, _ALL, gradient_arguments=True,
                     summary="gradient descent with exact adjoints (SGD, Adam, CG)"),
    "rpie": EngineSpec("rpie", pie.PIEOptions, partial(PIEAdapter, name="rpie"), pie.FEATURES,
                       summary="regularised PIE in minibatch rounds (Maiden et al. 2017)"),
    "epie": EngineSpec("epie", pie.PIEOptions, partial(PIEAdapter, name="epie"), pie.FEATURES,
                       defaults=pie.VARIANTS["epie"], summary="extended PIE: rPIE with alpha = 1"),
}


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``; one-line ValueError (with close matches) otherwise."""
    spec = ENGINES.get(name) if isinstance(name, str) else None
    if spec is None:
        close = difflib.get_close_matches(str(name), ENGINES, n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {name!r}{hint}")
    return spec
