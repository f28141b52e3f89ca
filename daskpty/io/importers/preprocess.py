"""Detector preprocessing on the way into a store: crop, orient, bin, dark, masks, clipping.

Order, per frame: crop the n × n window around the beam centre (raw detector pixels) →
subtract the dark frame and the constant background → non-finite values → 0, negatives → 0,
bad pixels (file mask) → 0 → transpose, flip rows, flip columns → sum b × b bins. The mask
follows the same geometry (a binned pixel is valid when all its detector pixels are).
Saturated pixels (raw value ≥ threshold in any frame), non-finite ones and hot pixels (mean or
variance far above their 5 × 5 neighbourhood) are found while the frames stream through and
marked invalid in the final mask.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..validate import fail


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """What to do to each detector frame (see the module docstring for the order).

    crop: output window size n in detector pixels (None: the whole square detector, or the
    largest centred square of a rectangular one); center: (row, col) of the direct beam in
    detector pixels, None = centre of mass of the mean pattern (one extra streaming pass) when
    cropping; bin: b × b summing (n must be a multiple); dark: (H, W) frame to subtract;
    background: constant to subtract; saturation: raw value at and above which a pixel counts as
    saturated; hot_sigma: robust z-score above which a pixel's mean or variance marks it hot.
    """

    crop: int | None = None
    center: tuple[float, float] | None = None
    bin: int = 1
    transpose: bool = False
    flip_y: bool = False
    flip_x: bool = False
    dark: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    background: float = 0.0
    saturation: float | None = None
    hot_sigma: float | None = None

    def __post_init__(self):
        if self.crop is not None and (int(self.crop) != self.crop or self.crop < 2):
            fail(f"crop must be an integer >= 2, got {self.crop!r}")
        if int(self.bin) != self.bin or self.bin < 1:
            fail(f"bin must be an integer >= 1, got {self.bin!r}")
        if self.center is not None and (len(self.center) != 2
                                        or not np.isfinite(np.asarray(self.center, float)).all()):
            fail(f"center must be two finite numbers (row, col), got {self.center!r}")
        if self.hot_sigma is not None and not self.hot_sigma > 0:
            fail(f"hot-pixel sigma must be positive, got {self.hot_sigma!r}")

    def needs_center(self, detector_shape) -> bool:
        """True when the beam centre must be found from the data (crop given, no centre)."""
        return self.crop is not None and self.center is None


def center_of_mass(mean_pattern, bad=None) -> tuple[float, float]:
    """(row, col) intensity centroid of a mean pattern, bad pixels and negatives ignored."""
    m = np.clip(np.nan_to_num(np.asarray(mean_pattern, dtype=np.float64)), 0, None)
    if bad is not None:
        m = np.where(bad, 0.0, m)
    total = m.sum()
    if not total > 0:
        fail("the mean pattern is empty (no counts), so the beam centre cannot be found; "
             "give it with --center ROW COL")
    rows, cols = m.sum(axis=1), m.sum(axis=0)
    return (float((rows * np.arange(m.shape[0])).sum() / total),
            float((cols * np.arange(m.shape[1])).sum() / total))


def crop_window(detector_shape, crop, center, b: int = 1):
    """(y0, y1, x0, x1) of the n × n crop around ``center``; DataError when it does not fit."""
    h, w = (int(s) for s in detector_shape)
    if center is not None:
        cy, cx = (float(c) for c in center)
        if not (0 <= cy <= h - 1 and 0 <= cx <= w - 1):
            fail(f"the beam centre ({cy:g}, {cx:g}) lies outside the {h} x {w} detector; give "
                 f"--center ROW COL inside it (rows 0..{h - 1}, columns 0..{w - 1})")
    if crop is None:
        n = min(h, w)
        n -= n % b
        if center is None or h == w == n:
            cy, cx = h / 2.0, w / 2.0
        y0 = int(np.clip(round(cy) - n // 2, 0, h - n))
        x0 = int(np.clip(round(cx) - n // 2, 0, w - n))
        return (y0, y0 + n, x0, x0 + n), n
    n = int(crop)
    if n > min(h, w):
        fail(f"the crop {n} x {n} is larger than the {h} x {w} detector; choose --crop <= "
             f"{min(h, w)}")
    if n % b:
        fail(f"the crop {n} is not a multiple of the binning {b}; choose --crop {n - n % b}")
    y0, x0 = int(round(cy)) - n // 2, int(round(cx)) - n // 2
    if y0 < 0 or x0 < 0 or y0 + n > h or x0 + n > w:
        room = 2 * int(min(round(cy), h - round(cy), round(cx), w - round(cx)))
        fail(f"a {n} x {n} crop around the beam centre ({cy:.1f}, {cx:.1f}) reaches past the edge "
             f"of the {h} x {w} detector; choose --crop <= {room - room % b} or another --center")
    return (y0, y0 + n, x0, x0 + n), n


def _bin(a, b: int, how=np.sum):
    if b == 1:
        return a
    *lead, h, w = a.shape
    return how(a.reshape(*lead, h // b, b, w // b, b), axis=(-3, -1))


def output_dtype(src_dtype, pre: Preprocess) -> np.dtype:
    """uint16 for ≤ 16-bit unsigned counts (unbinned), uint32 for other integers, float32 for
    float data or when a dark / background is subtracted."""
    src = np.dtype(src_dtype)
    if src.kind == "f" or pre.dark is not None or pre.background:
        return np.dtype("float32")
    if src.kind == "u" and src.itemsize <= 2 and pre.bin == 1:
        return np.dtype("uint16")
    if src.kind in "iub":
        return np.dtype("uint32")
    fail(f"detector data of dtype {src} cannot be imported; expected integer or float counts")


class Plan:
    """Preprocessing fixed for one import: the window, orientation, binning, and the tallies
    (saturated / non-finite pixels, mean and variance) gathered while frames stream through."""

    def __init__(self, pre: Preprocess, detector_shape, center, file_bad=None, src_dtype="f4"):
        self.pre = pre
        self.window, n = crop_window(detector_shape, pre.crop, center, pre.bin)
        self.center = None if center is None else tuple(float(c) for c in center)
        self.size = n // pre.bin
        y0, y1, x0, x1 = self.window
        h, w = (int(s) for s in detector_shape)
        dark = None
        if pre.dark is not None:
            dark = np.asarray(pre.dark, dtype=np.float64)
            if dark.shape != (h, w):
                fail(f"the dark frame has shape {dark.shape} but the detector is {h} x {w}")
            dark = dark[y0:y1, x0:x1]
        self.dark = dark
        self.bad = None if file_bad is None else np.asarray(file_bad, bool)[y0:y1, x0:x1]
        self.dtype = output_dtype(src_dtype, pre)
        self._limit = np.iinfo(self.dtype).max if self.dtype.kind == "u" else None
        self.saturated = np.zeros((n, n), bool)
        self.nonfinite = np.zeros((n, n), bool)
        self.n_negative = 0
        self.n_overflow = 0
        self.count = 0
        self.sum = np.zeros((self.size, self.size))
        self.sumsq = np.zeros((self.size, self.size))

    def orient(self, a):
        """Transpose / flips of the last two axes, as configured."""
        if self.pre.transpose:
            a = np.swapaxes(a, -1, -2)
        if self.pre.flip_y:
            a = a[..., ::-1, :]
        if self.pre.flip_x:
            a = a[..., :, ::-1]
        return a

    def apply(self, raw) -> np.ndarray:
        """Preprocess a (k, n, n) block of the raw window into the output dtype; tally it."""
        x = np.array(raw)  # a private, writeable copy (memory-mapped sources are read-only)
        if self.pre.saturation is not None:
            self.saturated |= (x >= self.pre.saturation).any(axis=0)
        if x.dtype.kind in "iub" and self.dark is None and not self.pre.background:
            if x.dtype.kind == "i":  # integer counts, nothing subtracted: stay exact
                neg = x < 0
                if neg.any():
                    self.n_negative += int(neg.sum())
                    x[neg] = 0
        else:
            x = x.astype(np.float64, copy=False)
            if self.dark is not None:
                x -= self.dark
            if self.pre.background:
                x -= float(self.pre.background)
            finite = np.isfinite(x)
            if not finite.all():
                self.nonfinite |= ~finite.all(axis=0)
                x[~finite] = 0.0
            neg = x < 0
            if neg.any():
                self.n_negative += int(neg.sum())
                x[neg] = 0.0
        if self.bad is not None:
            x[:, self.bad] = 0
        x = _bin(self.orient(x), self.pre.bin)
        if self._limit is not None and x.dtype != self.dtype:
            over = x > self._limit
            if over.any():
                self.n_overflow += int(over.sum())
                x = np.minimum(x, self._limit)
        self.count += x.shape[0]
        if self.pre.hot_sigma is not None:
            xf = x.astype(np.float64)
            self.sum += xf.sum(axis=0)
            self.sumsq += np.einsum("kij,kij->ij", xf, xf)
        return x.astype(self.dtype, copy=False)

    def hot_pixels(self) -> np.ndarray:
        """Output pixels whose mean or variance lies far above the median of its 5 × 5
        neighbourhood, in units of the local median absolute deviation."""
        from scipy.ndimage import median_filter  # lazy: scipy.ndimage stays out of the CLI's start

        hot = np.zeros((self.size, self.size), bool)
        if self.pre.hot_sigma is None or self.count == 0:
            return hot
        mean = self.sum / self.count
        var = np.clip(self.sumsq / self.count - mean ** 2, 0, None)
        for v in (mean, var):
            excess = v - median_filter(v, size=5, mode="nearest")
            scale = 1.4826 * median_filter(np.abs(excess), size=5, mode="nearest")
            floor = np.median(scale)
            hot |= excess > self.pre.hot_sigma * np.maximum(scale, floor if floor > 0 else 1e-12)
        return hot

    def mask(self) -> np.ndarray:
        """Final (n, n) output mask, True = valid."""
        bad = self.saturated | self.nonfinite
        if self.bad is not None:
            bad = bad | self.bad
        valid = _bin(self.orient(~bad), self.pre.bin, np.all) & ~self.hot_pixels()
        if not valid.any():
            fail("preprocessing marked every detector pixel invalid (mask, saturation, hot "
                 "pixels); check the mask convention (--mask-valid) and the thresholds")
        return valid

    def record(self) -> dict:
        """What was done, for the store's provenance."""
        y0, y1, x0, x1 = self.window
        valid = self.mask()
        return {
            "window_rows": [y0, y1], "window_cols": [x0, x1], "beam_center": self.center,
            "bin": self.pre.bin, "transpose": self.pre.transpose, "flip_y": self.pre.flip_y,
            "flip_x": self.pre.flip_x, "dark_subtracted": self.dark is not None,
            "background": float(self.pre.background), "saturation": self.pre.saturation,
            "hot_sigma": self.pre.hot_sigma, "negative_values_clipped": self.n_negative,
            "values_clipped_at_dtype_max": self.n_overflow,
            "pixels_saturated": int(self.saturated.sum()),
            "pixels_nonfinite": int(self.nonfinite.sum()),
            "pixels_hot": int(self.hot_pixels().sum()),
            "pixels_invalid": int((~valid).sum()), "output_dtype": str(self.dtype),
        }

    def summary(self) -> str:
        """One line for the provenance string."""
        r = self.record()
        parts = [f"crop rows {r['window_rows'][0]}:{r['window_rows'][1]} cols "
                 f"{r['window_cols'][0]}:{r['window_cols'][1]}"]
        if self.pre.bin > 1:
            parts.append(f"bin {self.pre.bin}")
        parts += [name for name in ("transpose", "flip_y", "flip_x") if r[name]]
        if r["dark_subtracted"]:
            parts.append("dark subtracted")
        if r["background"]:
            parts.append(f"background {r['background']:g} subtracted")
        parts.append(f"{r['negative_values_clipped']} negative values clipped")
        parts.append(f"{r['pixels_invalid']} invalid pixels masked")
        return ", ".join(parts)
