"""Every registered engine's adapter, and the feature adapters built on them, have the interface the
round loop uses (execution/engine_protocol.py); a feature an engine does not take is refused."""
from __future__ import annotations

import pytest

from daskpty.engines.probe_model import ProbeModelOptions
from daskpty.execution.engine_protocol import EngineAdapter, RunsOwnRounds
from daskpty.execution.engine_registry import ENGINES, FEATURES, engine_spec
from daskpty.execution.multislice_adapter import MultisliceADAdapter, MultisliceLSQMLAdapter
from daskpty.execution.variable_probe import with_probe_model


@pytest.mark.parametrize("name", list(ENGINES))
def test_registered_adapters_have_the_interface(name):
    options, adapter = engine_spec(name).make("gaussian")
    assert isinstance(adapter, EngineAdapter)
    assert adapter.name == name and adapter.options is options
    assert isinstance(adapter, RunsOwnRounds) == (name == "ad")


@pytest.mark.parametrize("name", [n for n, s in ENGINES.items() if "probe_model" in s.features])
def test_varying_probe_adapters_keep_the_interface(name):
    _, adapter = engine_spec(name).make("gaussian", optimizer="adam" if name == "ad" else None)
    assert isinstance(with_probe_model(adapter, ProbeModelOptions(opr_modes=2)), EngineAdapter)


def test_multislice_adapters_keep_the_interface():
    lsqml_options, _ = engine_spec("lsqml").make("gaussian")
    ad_options, _ = engine_spec("ad").make("gaussian")
    assert isinstance(MultisliceLSQMLAdapter(lsqml_options), EngineAdapter)
    assert isinstance(MultisliceADAdapter(ad_options), EngineAdapter)


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
