"""Options whose defaults depend on the engine: a field left None takes the engine's value."""
from __future__ import annotations

import dataclasses


def with_engine_defaults(options, defaults: dict, engine: str):
    """``options`` (a frozen dataclass) with every field that is None and that ``defaults[engine]``
    names set to that value; the same object when nothing is unset."""
    unset = {k: v for k, v in defaults[engine].items() if getattr(options, k) is None}
    return dataclasses.replace(options, **unset) if unset else options
