"""Options whose defaults depend on the engine: a field left None takes the engine's value."""
from __future__ import annotations

import dataclasses


def with_engine_defaults(options, part: str, engine: str):
    """``options`` (a frozen dataclass) with every field that is None and that engine ``engine``'s
    spec names in its ``<part>_defaults`` set to that value; the same object when nothing is unset.
    One line when the engine does not take ``part``."""
    from .specs import engine_spec  # the spec table imports the engines, which import these options

    defaults = getattr(engine_spec(engine), f"{part}_defaults")
    if defaults is None:
        raise ValueError(f"engine {engine!r} has no {part.replace('_', ' ')} defaults: it does not take that "
                         f"part; use an engine that does, or leave the part off")
    unset = {k: v for k, v in defaults.items() if getattr(options, k) is None}
    return dataclasses.replace(options, **unset) if unset else options
