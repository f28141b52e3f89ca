"""When a scan counts as low-dose for the engines' defaults through slices.

Counting data below :data:`LOW_DOSE_COUNTS` counts per detector pixel (mean), reconstructed
through K > 1 slices, take no object momentum: LSQML's heavy ball and AD's SGD momentum both
feed an oscillation there (the epoch's object change turns against the last one, cosine −0.9 by
epoch 24 on abTEM's 3-slab sets, 9–16 counts per pixel), while at higher doses momentum pays.
Mean per-slab NRMSE at 30 epochs, momentum 0 against the engine's own (docs/benchmarks.md,
bench_electron.py and daskpty's weak-phase sets):

- LSQML: abTEM's sets 2–12 % lower; weak-phase sets 0–3 % lower at 10–30 counts, a tie at ~90,
  5–19 % higher at ~280, 4–39 % at ~900.
- AD: abTEM's sets 2–16 % lower (one diverged with K = 4's 0.6); weak-phase sets 8–13 % lower
  at 10–50 counts, a tie at ~90, 4–25 % higher at ~290, 14–60 % at ~980.

The dose is read by :func:`daskpty.io.dose.counts_per_pixel` (None for data that are not counts).
"""
from __future__ import annotations

LOW_DOSE_COUNTS = 100.0


def low_dose_through_slices(n_slices: int, counts_per_pixel: float | None) -> bool:
    """True for K > 1 slices and counting data below :data:`LOW_DOSE_COUNTS` counts per pixel."""
    return n_slices > 1 and counts_per_pixel is not None and counts_per_pixel < LOW_DOSE_COUNTS
