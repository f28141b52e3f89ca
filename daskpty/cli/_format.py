"""Small formatting helpers for the command line."""
from __future__ import annotations

import math


def human_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_metres(m) -> str:
    if m is None or not math.isfinite(m):
        return "?"
    if m == 0:
        return "0 m"
    for unit, scale in (("m", 1.0), ("mm", 1e-3), ("µm", 1e-6), ("nm", 1e-9), ("pm", 1e-12)):
        if abs(m) >= scale or unit == "pm":
            return f"{m / scale:.3g} {unit}"
    return f"{m:g} m"
