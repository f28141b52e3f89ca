"""When a scan counts as low-dose for the engines' defaults: through slices, and for the
scan's scale in position refinement.

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

**The scan's scale** of position refinement: on counting data the windows' scale
(``PositionOptions.window_scale``) is held below :data:`LOW_COUNTS_WINDOW_SCALE` mean counts per
lit pixel (:func:`daskpty.io.dose.counts_per_lit_pixel`), and the scan's scale
(``scan_scale``) too below :data:`LOW_COUNTS_SCAN_SCALE`. The amplitude (Gaussian) model fits
|Ψ| to √y, whose mean falls short of √λ by about 1/(8√λ): relatively most where the counts are
few, at high angles. A stretched object has less there, so at few counts the windows, and at
fewer the patterns' shifts too, read a scale on an exact scan, the same sign every epoch, and
the scan stretched until refining cost more than it gave. Small preset (576 × 64²), exact
positions, LSQML, ratio to the plain run's NRMSE at 30 / 60 epochs (``bench_never_worse.py
--dose D``, seeds 5 / 6), the scale free → the windows' scale held → both held (the default
in bold):

- 10⁶ photons (461 counts per lit pixel): **1.001 / 1.011** (free).
- 3·10⁵ (184): 1.007 / 1.030 (AD 1.010 / 1.048) → **1.003 / 1.008** (AD 1.000 / 1.000).
- 10⁵ (82): 1.04–1.07 / 1.14–1.17 (AD the same; the scan +0.43 %) → 1.015–1.022 / 1.033–1.035
  (AD 1.000–1.001, rPIE 1.007–1.013 / 1.020–1.029) → **1.008–1.010 / 1.014–1.015** (rPIE
  1.006–1.011 / 1.021–1.031).
- 7·10⁴ (63): the windows' scale held 1.017–1.033 / 1.033–1.051, so the scan's scale is held
  below 120, not 60; 5·10⁴ (49): **1.007 / 1.012**.
- 3·10⁴ (34): 1.13–1.21 / 1.28–1.34 → 1.028–1.055 / 1.045–1.064 (the shifts, sped up by
  ``affine_gain``, still stretched the scan +0.4 %) → **1.004–1.016 / 1.006–1.014**.
- 10⁴ (14): 1.19 / 1.36 → 1.03 / 1.04 (seed 5) → **1.012 / 1.015** (seed 7).
- medium preset (128²): 10⁶ (273) **1.008 / 1.026** free; 3·10⁵ (101) 1.021 / 1.072 → 1.006 / 1.012
  → **1.003 / 1.011**.

Holding costs scans whose scale is wrong: at 10⁵ a scan 1 % too large refined to 0.95× the
nominal run's NRMSE with the scale free, 1.02× with the windows' scale held, 1.01× with both;
one 1 px + 1.5 % + 0.5° off to 0.33×, 0.34×, 0.40×. At 3·10⁴ the 1 % scan to 1.09× with the
windows' scale held, 1.01× with both (0.45× and 0.43× for the 1.5 % one). A user who knows the
scan's scale is off at few counts frees it (``scan_scale=True, window_scale=True``) or
calibrates the step.
"""
from __future__ import annotations

LOW_DOSE_COUNTS = 100.0


def low_dose_through_slices(n_slices: int, counts_per_pixel: float | None) -> bool:
    """True for K > 1 slices and counting data below :data:`LOW_DOSE_COUNTS` counts per pixel."""
    return n_slices > 1 and counts_per_pixel is not None and counts_per_pixel < LOW_DOSE_COUNTS


#: Mean counts per lit pixel below which the windows' scale is held by default (above).
LOW_COUNTS_WINDOW_SCALE = 200.0
#: Mean counts per lit pixel below which the scan's scale is held too (above).
LOW_COUNTS_SCAN_SCALE = 120.0


def held_scales(counts_per_lit_pixel: float | None) -> tuple[bool, bool]:
    """``(window_scale held, scan_scale held)`` by default for data of ``counts_per_lit_pixel``
    (None: not counting data, nothing held): the module docstring."""
    if counts_per_lit_pixel is None:
        return False, False
    return counts_per_lit_pixel < LOW_COUNTS_WINDOW_SCALE, counts_per_lit_pixel < LOW_COUNTS_SCAN_SCALE
