"""Scan geometry helpers: probe diameter, nearest-neighbour step, overlap, compact ordering, and
the scale test that catches positions given in the wrong units.

NumPy/SciPy only (used by the simulator and by ``daskpty info``).
"""
from __future__ import annotations

import math

import numpy as np

from .units import LENGTH_UNITS, length_unit

#: fraction of the probe power inside the circle whose diameter defines "the probe diameter"
ENCLOSED_POWER = 0.9


def probe_diameter(probe, enclosed: float = ENCLOSED_POWER) -> float:
    """Diameter (pixels) of the circle, centred on the intensity centroid, holding ``enclosed``
    of the total power of all modes. probe: (M, n, n) or (n, n) complex."""
    p = np.asarray(probe)
    if p.ndim == 2:
        p = p[None]
    inten = (np.abs(p.astype(np.complex128)) ** 2).sum(axis=0)
    total = inten.sum()
    if not np.isfinite(total) or total <= 0:
        return float("nan")
    yy, xx = np.indices(inten.shape, dtype=np.float64)
    cy = (inten * yy).sum() / total
    cx = (inten * xx).sum() / total
    r = np.hypot(yy - cy, xx - cx).ravel()
    order = np.argsort(r, kind="stable")
    cum = np.cumsum(inten.ravel()[order]) / total
    k = int(np.searchsorted(cum, enclosed))
    return float(2.0 * r[order][min(k, r.size - 1)])


def nearest_neighbour_steps(positions) -> np.ndarray:
    """Distance (pixels) from each position to its nearest other position, via a KD-tree."""
    from scipy.spatial import cKDTree  # lazy: ~0.3 s, kept out of the CLI's start (io.validate imports this module)

    pos = np.asarray(positions, dtype=np.float64)
    if len(pos) < 2:
        return np.full(len(pos), np.nan)
    dist, _ = cKDTree(pos).query(pos, k=2)
    return dist[:, 1]


def linear_overlap(step: float, diameter: float) -> float:
    """Linear overlap 1 − step / diameter of two probe discs ``step`` apart (clipped at 0)."""
    if not np.isfinite(step) or not np.isfinite(diameter) or diameter <= 0:
        return float("nan")
    return float(max(0.0, 1.0 - step / diameter))


#: positions in object pixels look like a unit mistake when the whole scan spans less than
#: MIN_SPAN_PX, or less than one probe width with a median step below MIN_STEP_PX, or when the
#: median step exceeds MAX_STEP_WIDTHS probe widths (no two windows overlap)
MIN_SPAN_PX = 1.0
MIN_STEP_PX = 0.05
MAX_STEP_WIDTHS = 10.0
#: length units by metres per unit, for naming the likely intended unit
_UNIT_NAMES = {1.0: "m", 1e-3: "mm", 1e-6: "um", 1e-9: "nm"}


def _metres(v: float) -> str:
    for scale, name in ((1.0, "m"), (1e-3, "mm"), (1e-6, "µm"), (1e-9, "nm"), (1e-12, "pm")):
        if abs(v) >= scale or scale == 1e-12:
            return f"{v / scale:.3g} {name}"


def unit_mistake(positions, n: int, *, units: str | None = None,
                 pixel_m: float | None = None) -> str | None:
    """One line describing a likely unit mistake in ``positions`` ((N, 2) object pixels, ``n``
    the probe window / pattern size), or None when the scale is plausible.

    Too small: the scan spans < :data:`MIN_SPAN_PX` px, or less than one probe width with a
    median step < :data:`MIN_STEP_PX` px (metres declared 'um' or 'px'). Too large: a median
    step > :data:`MAX_STEP_WIDTHS` probe widths (millimetres declared 'm'). A single position,
    a scan at one point and a small honest scan (steps of pixels) pass. ``units``: the units the
    positions were declared in (named in the hint); ``pixel_m``: the object pixel, metres.
    """
    p = np.asarray(positions, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] != 2 or len(p) < 2 or not np.isfinite(p).all() or n < 1:
        return None
    distinct = np.unique(p, axis=0)  # repeated exposures at one spot are not steps
    if len(distinct) < 2:
        return None
    span = float(np.ptp(distinct, axis=0).max())
    step = float(np.median(nearest_neighbour_steps(distinct)))
    pixel_m = pixel_m if isinstance(pixel_m, (int, float)) and pixel_m > 0 else None
    in_m = (lambda px: f" ({_metres(px * pixel_m)})") if pixel_m else (lambda px: "")
    # the power of 1000 that would bring the median step to a typical quarter probe width
    power = round(math.log10(n / 4.0 / step) / 3.0)
    if span < MIN_SPAN_PX or (span < n and step < MIN_STEP_PX):
        power = max(1, power)
        what = (f"the scan spans only {span:.2g} px{in_m(span)} with a median step of {step:.2g} "
                f"px: far below one probe width of {n} px")
    elif step > MAX_STEP_WIDTHS * n:
        power = min(-1, power)
        what = (f"the median scan step is {step:.4g} px{in_m(step)}, {step / n:.0f} probe widths "
                f"of {n} px: no two probe windows overlap")
    else:
        return None
    factor = 1000.0 ** power
    size = f"about {max(factor, 1 / factor):.0e} times too {'small' if power > 0 else 'large'}"
    fix = "Re-import with the right --units (Python: units=...)."
    known, scale = _metres_per(units)
    if not known:
        guess = (f"the positions look {size}: were they given in metres (or another length "
                 f"unit) instead of object pixels?")
        fix = "Give them in object pixels, or re-import with the right --units."
    elif scale is None:
        guess = f"were the positions given in a length unit (m, mm, um, nm) but declared '{units}'?"
        fix = "Re-import with that --units and the geometry (--energy, --distance, --pixel-size)."
    else:
        scale *= factor
        true = min(_UNIT_NAMES, key=lambda s: abs(math.log10(s / scale)))
        guess = (f"were the positions given in '{_UNIT_NAMES[true]}' but declared '{units}'?"
                 if abs(math.log10(true / scale)) < 0.5 else
                 f"the positions look {size} for '{units}'.")
    return f"{what} — {guess} {fix}"


def _metres_per(units) -> tuple[bool, float | None]:
    """(known, metres per unit or None for pixels) via the importers' table."""
    key = length_unit(units)
    return (False, None) if key is None else (True, LENGTH_UNITS[key])


def _spread_bits(v: np.ndarray) -> np.ndarray:
    """Insert a zero bit between the bits of 32-bit integers (for Morton codes)."""
    v = v.astype(np.uint64) & np.uint64(0xFFFFFFFF)
    v = (v | (v << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    v = (v | (v << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    v = (v | (v << np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    v = (v | (v << np.uint64(2))) & np.uint64(0x3333333333333333)
    v = (v | (v << np.uint64(1))) & np.uint64(0x5555555555555555)
    return v


def morton_order(positions, cell: float) -> np.ndarray:
    """Permutation that sorts positions along a Z-order (Morton) curve of cells of size ``cell``.

    Consecutive patterns are then spatially close, so every contiguous chunk of the data set
    covers a compact patch of the object. Ties (same cell) keep (y, x) order.
    """
    pos = np.asarray(positions, dtype=np.float64)
    if len(pos) == 0:
        return np.zeros(0, dtype=np.int64)
    q = np.floor((pos - pos.min(axis=0)) / max(float(cell), 1e-12) + 0.5).astype(np.int64)
    code = _spread_bits(q[:, 0]) << np.uint64(1) | _spread_bits(q[:, 1])
    return np.lexsort((pos[:, 1], pos[:, 0], code))
