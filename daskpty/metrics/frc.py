"""Fourier ring correlation, and the parts of the half-set FRC that need no reconstruction.

The half-set FRC is a figure of merit for measured data, which has no ground truth: the patterns are
split into two spatially interleaved halves (:func:`split_halves`), each half is reconstructed on its
own (:func:`daskpty.workflows.half_set_frc` runs both), and the two objects are registered and
compared by :func:`registered_frc` over the region both halves illuminate (:func:`common_region`),
apodised by a window that falls smoothly to zero at the region's edge.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.ndimage import distance_transform_edt

from ..io.scan import nearest_neighbour_steps
from ..physics import split_positions
from .registration import Alignment, _check_mask, _check_pair, align

@dataclass(frozen=True)
class FRCResult:
    """Result of :func:`frc`.

    Attributes
    ----------
    frequency : ndarray
        Ring centre frequencies in cycles/pixel, 0 … 0.5.
    frc : ndarray
        Fourier ring correlation per ring.
    half_bit : ndarray
        ½-bit threshold per ring (van Heel & Schatz 2005).
    n_pixels : ndarray
        Number of Fourier pixels in each ring.
    resolution : float or None
        First frequency (above DC, linearly interpolated between rings) where ``frc`` drops below
        ``half_bit``; ``None`` if it never does.
    """

    frequency: np.ndarray
    frc: np.ndarray
    half_bit: np.ndarray
    n_pixels: np.ndarray
    resolution: float | None


def frc(a, b, *, n_bins=None, window=True) -> FRCResult:
    """Fourier ring correlation of two images with the ½-bit threshold.

    ``FRC(ring) = Re sum A conj(B) / sqrt(sum |A|^2 sum |B|^2)`` over the Fourier pixels of each ring
    (``A``, ``B`` the 2-D DFTs). The real part is the standard (unbiased) definition; for complex
    reconstructions remove the global phase first (e.g. with :func:`align`). Threshold
    ``T(n) = (0.2071 + 1.9102/sqrt(n)) / (1.2071 + 0.9102/sqrt(n))`` with ``n`` the ring's pixel count
    (van Heel & Schatz 2005).

    Parameters
    ----------
    a, b : array_like, shape (H, W)
        Real or complex images of equal shape (e.g. two independent reconstructions).
    n_bins : int, optional
        Number of rings between 0 and 0.5 cycles/pixel; ring ``i`` collects pixels with
        ``round(|f| / (0.5/n_bins)) == i``. Default ``min(H, W) // 2`` (one-pixel rings). Corner
        pixels beyond 0.5 cycles/pixel are ignored, as are empty rings.
    window : bool or float
        Apodise both images with a separable Tukey window before the DFT to suppress the edge
        discontinuity of non-periodic images. ``True`` uses taper fraction 0.25; a float in (0, 1]
        sets it (1 = Hann). ``False``: no window.

    Returns
    -------
    FRCResult
    """
    a, b = _check_pair(a, b, names=("a", "b"))
    h, w = a.shape
    a = a.astype(np.complex128)
    b = b.astype(np.complex128)
    if window is not False and window is not None:
        alpha = 0.25 if window is True else float(window)
        if not 0 < alpha <= 1:
            raise ValueError(f"window taper fraction must lie in (0, 1]; got {window}")
        from scipy.signal.windows import tukey  # lazy: scipy.signal takes ~1-2 s to import

        win = tukey(h, alpha)[:, None] * tukey(w, alpha)[None, :]
        a = a * win
        b = b * win
    A = np.fft.fft2(a)
    B = np.fft.fft2(b)
    if n_bins is None:
        n_bins = max(min(h, w) // 2, 1)
    n_bins = int(n_bins)
    if n_bins < 1:
        raise ValueError(f"n_bins must be positive; got {n_bins}")
    width = 0.5 / n_bins
    radius = np.hypot(np.fft.fftfreq(h)[:, None], np.fft.fftfreq(w)[None, :])
    idx = np.rint(radius / width).astype(np.int64)
    keep = idx <= n_bins
    idx = idx[keep]
    count = np.bincount(idx, minlength=n_bins + 1)
    num = np.bincount(idx, weights=np.real(A * np.conj(B))[keep], minlength=n_bins + 1)
    pa = np.bincount(idx, weights=(np.abs(A) ** 2)[keep], minlength=n_bins + 1)
    pb = np.bincount(idx, weights=(np.abs(B) ** 2)[keep], minlength=n_bins + 1)
    ring = np.nonzero(count)[0]
    den = np.sqrt(pa[ring] * pb[ring])
    values = np.divide(num[ring], den, out=np.zeros(ring.size), where=den > 0)
    n = count[ring].astype(np.float64)
    rn = np.sqrt(n)
    half_bit = (0.2071 + 1.9102 / rn) / (1.2071 + 0.9102 / rn)
    freq = ring * width

    resolution = None
    below = np.nonzero((values < half_bit) & (ring > 0))[0]
    if below.size:
        i = int(below[0])
        resolution = float(freq[i])
        if i > 0 and ring[i - 1] > 0:  # interpolate the crossing between the previous ring and this one
            d0 = values[i - 1] - half_bit[i - 1]
            d1 = values[i] - half_bit[i]
            resolution = float(freq[i - 1] + (freq[i] - freq[i - 1]) * d0 / (d0 - d1))
    return FRCResult(frequency=freq, frc=values, half_bit=half_bit, n_pixels=count[ring], resolution=resolution)



#: Band of the mean FRC, as fractions of the Nyquist frequency (0.5 cycles/pixel).
BAND = (0.1, 0.6)


@dataclass(frozen=True)
class HalfSetFRC:
    """FRC of two registered reconstructions (see :func:`registered_frc`, :func:`half_set_frc`).

    Attributes
    ----------
    frequency : ndarray
        Ring centre frequencies in cycles/pixel, 0 … 0.5 (Nyquist = 0.5).
    frc : ndarray
        Fourier ring correlation per ring.
    half_bit : ndarray
        ½-bit threshold per ring (van Heel & Schatz 2005).
    n_pixels : ndarray
        Fourier pixels per ring.
    resolution : float or None
        First frequency (cycles/pixel) at or above the band's lower edge where ``frc`` falls below
        ``half_bit`` (linearly interpolated); None if it never does. The rings below the band are
        left out: they hold few pixels and are dominated by smooth phase that the two halves leave
        undetermined, which says nothing about resolution (the full curve is in ``frc``).
    mean_frc : float
        Mean of ``frc`` over the rings inside ``band`` (fractions of Nyquist).
    band : tuple of float
        The band of ``mean_frc``.
    alignment : Alignment
        Shift, phase ramp and complex scale that took the second image onto the first.
    mask : ndarray of bool
        The region compared (in the frame of the inputs).
    halves : tuple of Reconstruction, optional
        The two reconstructions (:func:`half_set_frc` only).
    indices : tuple of ndarray, optional
        Pattern indices of the two halves (:func:`half_set_frc` only).
    seconds_per_epoch : float, optional
        Median wall time per epoch over both half reconstructions (:func:`half_set_frc` only).
    """

    frequency: np.ndarray
    frc: np.ndarray
    half_bit: np.ndarray
    n_pixels: np.ndarray
    resolution: float | None
    mean_frc: float
    band: tuple
    alignment: Alignment
    mask: np.ndarray
    halves: tuple | None = None
    indices: tuple | None = None
    seconds_per_epoch: float | None = None

    @property
    def half_period_px(self) -> float | None:
        """Half-period resolution in object pixels, ``1 / (2 · resolution)``; None without a crossing."""
        return None if not self.resolution else 0.5 / self.resolution

    def __repr__(self):
        res = "no ½-bit crossing" if self.resolution is None else (
            f"½-bit crossing {self.resolution:.3f} cycles/px (half period {self.half_period_px:.2f} px)")
        return (f"HalfSetFRC(mean FRC {self.mean_frc:.3f} over {self.band[0]}–{self.band[1]} Nyquist, "
                f"{res}, {int(self.mask.sum())} px compared)")


# --------------------------------------------------------------------------------------------------
# splitting and regions


def split_halves(positions, method: str = "checkerboard") -> tuple[np.ndarray, np.ndarray]:
    """Split scan positions into two interleaved halves; returns two sorted index arrays.

    ``"checkerboard"``: positions grouped into rows (sorted by y, a new row wherever y jumps by more
    than half the median nearest-neighbour step), and coloured by the parity of row number plus rank
    within the row (sorted by x). On a raster, jittered or not, that is a checkerboard: every
    neighbour of a position lies in the other half and each half keeps an even, isotropic coverage.
    On scans without rows (spirals) it alternates along x. ``"alternate"``: even and odd indices
    in the order given.
    """
    pos = np.asarray(positions, dtype=np.float64)
    if pos.ndim != 2 or pos.shape[1] != 2:
        raise ValueError(f"positions must have shape (N, 2); got {pos.shape}")
    if len(pos) < 2:
        raise ValueError("half-set FRC needs at least two scan positions")
    if method not in ("checkerboard", "alternate"):
        raise ValueError(f"split must be 'checkerboard', 'alternate' or a boolean array; got {method!r}")
    index = np.arange(len(pos))
    if method == "alternate":
        return index[0::2], index[1::2]
    step = float(np.median(nearest_neighbour_steps(pos)))
    by_y = np.argsort(pos[:, 0], kind="stable")
    row = np.zeros(len(pos), dtype=np.int64)
    row[by_y] = np.concatenate([[0], np.cumsum(np.diff(pos[by_y, 0]) > 0.5 * step)])
    order = np.lexsort((pos[:, 1], row))               # by row, then by x within the row
    rank = np.empty(len(pos), dtype=np.int64)
    starts = np.searchsorted(row[order], row[order])   # first slot of each position's row
    rank[order] = np.arange(len(pos)) - starts
    colour = ((row + rank) % 2).astype(bool)
    return index[~colour], index[colour]


def illumination_map(probe, positions, shape) -> np.ndarray:
    """Σ_j Σ_k |P_k|² placed at each position's integer window (float64, shape ``shape``)."""
    p = np.asarray(probe)
    if p.ndim == 2:
        p = p[None]
    power = (np.abs(p.astype(np.complex128)) ** 2).sum(axis=0)
    n = power.shape[-1]
    corners, _ = split_positions(positions, n)
    out = np.zeros(shape, dtype=np.float64)
    for y, x in corners:
        out[y:y + n, x:x + n] += power
    return out


def common_region(illumination_a, illumination_b, fraction: float = 0.3) -> np.ndarray:
    """Pixels where both illuminations exceed ``fraction`` of their own maximum."""
    ia, ib = _check_pair(illumination_a, illumination_b, names=("illumination_a", "illumination_b"))
    ia, ib = np.real(ia), np.real(ib)
    if not (ia.max() > 0 and ib.max() > 0):
        raise ValueError("an illumination map is zero everywhere")
    return (ia > fraction * ia.max()) & (ib > fraction * ib.max())


def _taper(mask: np.ndarray, width: float) -> np.ndarray:
    """Raised-cosine window: 0 outside ``mask``, rising to 1 over ``width`` pixels inside it."""
    d = distance_transform_edt(np.pad(mask, 1))[1:-1, 1:-1]  # distance to the nearest pixel outside
    return 0.5 - 0.5 * np.cos(np.pi * np.clip(d / max(width, 1e-9), 0.0, 1.0))


# --------------------------------------------------------------------------------------------------
# FRC of two registered images


def registered_frc(a, b, mask=None, *, subpixel: bool = True, ramp: bool = True, taper: float | None = None,
                   n_bins: int | None = None, band=BAND) -> HalfSetFRC:
    """Register ``b`` onto ``a`` and return their FRC over ``mask``, apodised.

    Registration: :func:`daskpty.metrics.align` inside ``mask`` (sub-pixel shift, linear phase ramp
    if ``ramp``, global complex scale, which removes the global phase). Both images are then cut to
    the bounding box of ``mask``, their window-weighted means removed (so the window's own spectrum
    does not correlate the low rings) and multiplied by a raised-cosine window that is 0 outside
    ``mask`` and reaches 1 ``taper`` pixels inside it (default: a tenth of the box's shorter side,
    at least 2). The FRC is :func:`daskpty.metrics.frc` of the results (real part of the
    normalised cross-spectrum per ring) with the ½-bit threshold.

    Parameters
    ----------
    a, b : array_like, shape (H, W)
        Complex (or real) images in roughly the same frame.
    mask : array_like of bool, shape (H, W), optional
        The region to compare (e.g. :func:`common_region`); default all pixels. Keep it a few
        pixels clear of the border: the sub-pixel shift is periodic.
    band : (float, float)
        Band of ``mean_frc`` in fractions of Nyquist.

    Returns
    -------
    HalfSetFRC
        ``halves``, ``indices`` and ``seconds_per_epoch`` are None.
    """
    a, b = _check_pair(a, b, names=("a", "b"))
    m = _check_mask(mask, a.shape)
    lo, hi = (float(v) for v in band)
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"band must satisfy 0 <= low < high <= 1 (fractions of Nyquist); got {band}")
    b_aligned, params = align(b, a, mask=m, subpixel=subpixel, ramp=ramp, return_params=True)
    rows, cols = np.nonzero(m)
    box = (slice(rows.min(), rows.max() + 1), slice(cols.min(), cols.max() + 1))
    mc = m[box]
    width = max(2.0, 0.1 * min(mc.shape)) if taper is None else float(taper)
    win = _taper(mc, width)
    if not win.any():
        raise ValueError("the region is too thin for the window; pass a smaller taper")
    total = win.sum()
    windowed = []
    for img in (np.asarray(a, dtype=np.complex128)[box], np.asarray(b_aligned, dtype=np.complex128)[box]):
        windowed.append((img - (win * img).sum() / total) * win)
    curve = frc(windowed[0], windowed[1], n_bins=n_bins, window=False)
    nyquist = curve.frequency / 0.5
    inside = (nyquist >= lo) & (nyquist <= hi)
    mean = float(curve.frc[inside].mean()) if inside.any() else float("nan")
    return HalfSetFRC(frequency=curve.frequency, frc=curve.frc, half_bit=curve.half_bit,
                      n_pixels=curve.n_pixels, resolution=_crossing(curve, lo * 0.5), mean_frc=mean,
                      band=(lo, hi), alignment=params, mask=m)


def _crossing(curve, start: float) -> float | None:
    """First ½-bit crossing at or above frequency ``start`` (interpolated between rings)."""
    f, v, t = curve.frequency, curve.frc, curve.half_bit
    below = np.nonzero((v < t) & (f >= start) & (f > 0))[0]
    if not below.size:
        return None
    i = int(below[0])
    if i == 0 or f[i - 1] < start:
        return float(f[i])
    d0, d1 = v[i - 1] - t[i - 1], v[i] - t[i]
    return float(f[i - 1] + (f[i] - f[i - 1]) * d0 / (d0 - d1))
