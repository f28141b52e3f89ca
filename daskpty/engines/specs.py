"""The engines by name, without dask: what each takes and its defaults, so that the CLI, the
options and execution's registry (which adds each engine's adapter) read one table.

Adding an engine: its per-chunk math and its core (:mod:`daskpty.engines.core`) in
``daskpty/engines``, and one :class:`EngineSpec` line in :data:`ENGINE_SPECS`.
A feature an engine does not declare is refused in one line, never ignored.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass

#: the optional forward-model features, as a user asks for them
FEATURES = {
    "positions": "position refinement (refine_positions)",
    "probe_model": "a varying probe (opr_modes, fit_intensity, background)",
    "multislice": "multislice or a near-field detector (slices, near-field data)",
}


@dataclass(frozen=True)
class EngineSpec:
    """One engine.

    options_path: ``"module:Class"`` of its frozen options class (:attr:`options`; imported when
    asked, so the table loads without the engines and the engines may read it); core_path: the
    same of its core (:attr:`core`, :mod:`daskpty.engines.core`); features: the keys of :data:`FEATURES` it takes;
    defaults: option values of a named variant of ``variant_of`` (ePIE is rPIE with α = 1);
    gradient_based: it steps every parameter from one gradient, so the ``loss`` / ``optimizer`` /
    ``lr`` arguments apply (and positions keep Adam's second moment); brightness_first: it can fit
    the intensity factors before the other parameters (``ProbeModelOptions.brightness_first``);
    position_defaults, probe_model_defaults: the values of the ``PositionOptions`` /
    ``ProbeModelOptions`` settings left None (``for_engine``); None where the feature is not taken.
    """

    name: str
    options_path: str
    summary: str
    features: frozenset = frozenset()
    defaults: dict = dataclasses.field(default_factory=dict)
    variant_of: str | None = None
    gradient_based: bool = False
    brightness_first: bool = False
    position_defaults: dict | None = None
    probe_model_defaults: dict | None = None
    core_path: str = ""

    @property
    def options(self) -> type:
        """The engine's options class."""
        return _imported(self.options_path)

    @property
    def core(self) -> type:
        """The engine's core (:class:`daskpty.engines.core.EngineCore`): its chunk steps and updates."""
        return _imported(self.core_path)

    def check_features(self, **requested: bool) -> None:
        """One-line ValueError when a requested feature (``positions=True``, ...) is not taken."""
        for key, wanted in requested.items():
            if wanted and key not in self.features:
                takers = sorted(name for name, spec in ENGINE_SPECS.items() if key in spec.features)
                raise ValueError(f"engine {self.name!r} does not take {FEATURES[key]}; use engine "
                                 f"{' or '.join(repr(t) for t in takers)} for it, or leave it off")


def _imported(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_ALL = frozenset(FEATURES)
#: the PIE family: refined positions, and K slices and/or a near-field detector (:func:`.pie.chunk_step`)
_PIE = frozenset({"positions", "multislice"})
_PIE_CORE = "daskpty.engines.pie_core:PIECore"

#: Position refinement's settings left None, measured on the 576 × 64² scan of
#: benchmarks/bench_positions.py (docs/benchmarks.md). The PIE family takes LSQML's shift,
#: momentum and fits.
_SHIFT_POSITIONS = {"affine_gain": 6.0, "start_epoch": "auto", "window_every": 1, "noise_threshold": 1.0,
                    "gate_release": 0.0, "window_scale_wait": 0}
_GRADIENT_POSITIONS = {"affine_gain": 2.0, "start_epoch": "auto", "window_every": 2, "noise_threshold": 5.0,
                       "gate_release": 0.05, "window_scale_wait": 8}  # = position_fits.PATTERNS_STILL

#: The probe model's settings left None, measured on the drifting, flickering scan of
#: benchmarks/bench_opr.py (docs/benchmarks.md, OPR). A gradient engine takes the nearly exact
#: weight curvature (damping 0.002: 1.43× → 1.14× the constant-probe NRMSE); LSQML's weights need
#: the stronger damping, and take heavy-ball momentum (0.5, its object's own): without it the
#: flux that each pattern's object window took up before ``start_epoch`` comes back to the weight
#: with a time constant of ~10 epochs, and the eigen-probes had to creep (0.02) or they fitted
#: the weights' lag. K = 2, 40 / 80 epochs, mean of five seeds: 1.33 / 1.43× the constant-probe
#: NRMSE without momentum (eigen step 0.02), 1.05 / 1.04× with it and full eigen-probe steps.
#: AD takes the same momentum: K = 3 with intensity factors, seeds 0 / 1 / 2, the constant-probe
#: NRMSE at 50 epochs without / with it: 16 × 16 raster 0.97 / 0.81 / 0.90 → 0.82 / 0.74 / 0.82;
#: 24 × 24 (R = 3 → 1) 1.34 / 1.59 / 1.29 → 1.27 / 1.48 / 1.12; the same drifting ±7.5 %
#: 1.21 / 1.16 / 2.43 → 1.07 / 0.96 / 1.47.
_LSQML_PROBE_MODEL = {"curvature_damping": 0.02, "eigen_step": 0.5, "weight_momentum": 0.5}
_GRADIENT_PROBE_MODEL = {"curvature_damping": 0.002, "eigen_step": 0.5, "weight_momentum": 0.5}

#: the registered engines, in the order the CLI lists them (the first is the default)
ENGINE_SPECS: dict[str, EngineSpec] = {
    "lsqml": EngineSpec("lsqml", "daskpty.engines.lsqml:LSQMLOptions", "least-squares maximum likelihood (Odstrčil et al. 2018)",
                        _ALL, brightness_first=True, position_defaults=_SHIFT_POSITIONS,
                        probe_model_defaults=_LSQML_PROBE_MODEL, core_path="daskpty.engines.lsqml_core:LSQMLCore"),
    "ad": EngineSpec("ad", "daskpty.engines.ad:ADOptions", "gradient descent with exact adjoints (SGD, Adam, CG)", _ALL,
                     gradient_based=True, position_defaults=_GRADIENT_POSITIONS,
                     probe_model_defaults=_GRADIENT_PROBE_MODEL, core_path="daskpty.engines.ad.core:ADCore"),
    "rpie": EngineSpec("rpie", "daskpty.engines.pie:PIEOptions",
                       "regularised PIE in minibatch rounds (Maiden et al. 2017)", _PIE,
                       position_defaults=_SHIFT_POSITIONS, core_path=_PIE_CORE),
    "epie": EngineSpec("epie", "daskpty.engines.pie:PIEOptions", "extended PIE: rPIE with alpha = 1", _PIE,
                       defaults={"alpha": 1.0, "probe_alpha": 1.0}, variant_of="rpie",
                       position_defaults=_SHIFT_POSITIONS, core_path=_PIE_CORE),
}
DEFAULT_ENGINE = next(iter(ENGINE_SPECS))


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``; one-line ValueError (with close matches) otherwise."""
    spec = ENGINE_SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        close = difflib.get_close_matches(str(name), ENGINE_SPECS, n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"engine must be one of {list(ENGINE_SPECS)}, got {name!r}{hint}")
    return spec
