"""Length units of scan positions: metres per unit, and the spellings accepted for them.

The bottom of io (no daskpty import): the importers' geometry (:func:`~daskpty.io.importers.geometry.unit_scale`)
and the scale test of :mod:`daskpty.io.scan` both read this table.
"""
from __future__ import annotations

#: length units accepted for positions (metres per unit); "px" means object pixels already
LENGTH_UNITS = {"m": 1.0, "mm": 1e-3, "um": 1e-6, "µm": 1e-6, "micron": 1e-6, "microns": 1e-6,
                "nm": 1e-9, "a": 1e-10, "å": 1e-10, "angstrom": 1e-10, "px": None,
                "pixel": None, "pixels": None}
_SPELLINGS = {"meters": "m", "ms": "m", "micrometer": "um", "micrometre": "um", "nanom": "nm",
              "nanometer": "nm"}


def length_unit(units) -> str | None:
    """The key of :data:`LENGTH_UNITS` that ``units`` spells, or None when it names no known unit."""
    if not isinstance(units, str):
        return None
    key = units.strip().lower().replace("meter", "m").replace("metre", "m")
    key = _SPELLINGS.get(key, key)
    return key if key in LENGTH_UNITS else None
