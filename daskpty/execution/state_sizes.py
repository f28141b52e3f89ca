"""How many bytes an engine's state, carry or payload holds in arrays.

dask's ``sizeof`` counts such objects as a few bytes; the scatter's bound
(:mod:`.scatter`) and ``benchmarks/bench_tile_memory.py`` need the arrays inside.
"""
from __future__ import annotations


def held_bytes(value, seen: set | None = None) -> int:
    """Bytes of the arrays inside an engine state or carry (its fields, dicts, lists, holders
    such as an optimiser's memory), each array counted once.

    Not registered with ``dask.sizeof`` on purpose: dask then counts a carry as a few bytes
    ("unmanaged" memory) and never spills it. Spilling a tile's state does not free it (the next
    round's state shares its arrays) and its serialisation adds a copy: 4 workers of 800 MiB on
    the 26.7 Mpx benchmark object were restarted at 95 % with it registered, and only paused
    briefly without (benchmarks/bench_tile_memory.py counts states with this function)."""
    seen = set() if seen is None else seen  # (pass one set to count arrays shared between values once)

    def walk(v, depth):
        if depth > 6 or v is None or isinstance(v, (str, bytes, int, float, bool)):
            return 0
        if hasattr(v, "nbytes") and hasattr(v, "shape"):
            if id(v) in seen:
                return 0
            seen.add(id(v))
            return int(v.nbytes)
        if isinstance(v, dict):
            return sum(walk(x, depth + 1) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x, depth + 1) for x in v)
        if hasattr(v, "__dict__"):
            return sum(walk(x, depth + 1) for x in vars(v).values())
        return 0

    return walk(value, 0)
