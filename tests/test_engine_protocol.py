"""Every registered engine's adapter, with any of its parts composed, has the interface the round
loop uses (execution/engine_protocol.py); a feature an engine does not take is refused."""
from __future__ import annotations

import pytest

from daskpty.engines.position_options import PositionOptions
from daskpty.engines.probe_model import ProbeModelOptions
from daskpty.execution.engine_protocol import EngineAdapter, RunsOwnRounds
from daskpty.execution.engine_registry import ENGINES, FEATURES, engine_spec
from daskpty.engines.sample_model import SampleModel


@pytest.mark.parametrize("name", list(ENGINES))
def test_registered_adapters_have_the_interface(name):
    options, adapter = engine_spec(name).make("gaussian")
    assert isinstance(adapter, EngineAdapter)
    assert adapter.name == name and adapter.options is options
    assert isinstance(adapter, RunsOwnRounds) == (name == "ad")


@pytest.mark.parametrize("name", [n for n, s in ENGINES.items() if "probe_model" in s.features])
def test_varying_probe_adapters_keep_the_interface(name):
    _, adapter = engine_spec(name).make("gaussian", optimizer="adam" if name == "ad" else None,
                                        probe_model=ProbeModelOptions(opr_modes=2))
    assert isinstance(adapter, EngineAdapter)


@pytest.mark.parametrize("name", [n for n, s in ENGINES.items() if "multislice" in s.features])
def test_adapters_with_every_part_keep_the_interface(name):
    """One adapter class per engine: slices, positions and a varying probe are parts it holds."""
    spec = engine_spec(name)
    _, plain = spec.make("gaussian", optimizer="adam" if name == "ad" else None)
    model = ProbeModelOptions(opr_modes=2) if "probe_model" in spec.features else None
    _, adapter = spec.make("gaussian", optimizer="adam" if name == "ad" else None, probe_model=model,
                           sample=SampleModel(3), positions=PositionOptions())
    assert type(adapter) is type(plain) and isinstance(adapter, EngineAdapter)


@pytest.mark.parametrize("name", list(ENGINES))
def test_features_not_declared_are_refused(name):
    spec = engine_spec(name)
    for feature in FEATURES:
        if feature in spec.features:
            spec.check_features(**{feature: True})
        else:
            with pytest.raises(ValueError, match=f"engine {name!r} does not take"):
                spec.check_features(**{feature: True})
        spec.check_features(**{feature: False})   # not asked for: never refused
