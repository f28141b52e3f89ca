"""Half-set Fourier ring correlation: a figure of merit for measured data, which has no ground truth.

The patterns are split into two spatially interleaved halves, each half is reconstructed on its own,
the two objects are registered (sub-pixel shift, linear phase ramp, global complex scale) and their
Fourier ring correlation is computed over the region both halves illuminate, apodised by a window
that falls smoothly to zero at the region's edge. Two reconstructions from independent photons
agree only where both resolve the same structure, so the FRC against the ½-bit threshold estimates
the resolution, and its mean over 0.1–0.6 Nyquist is a single number to compare settings by.

:func:`registered_frc` (two images, NumPy/SciPy only) and :func:`split_halves` are usable on their
own; :func:`half_set_frc` runs the two reconstructions with :func:`daskpty.reconstruct` (dask is
imported only then). Re-exported by :mod:`daskpty.metrics`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .metrics import Alignment, _check_mask, _check_pair, align, frc

__all__ = ["BAND", "HalfSetFRC", "common_region", "half_set_frc", "illumination_map", "registered_frc",
           "split_halves"]

#: Band of the mean FRC, as fractions of the Nyquist frequency (0.5 cycles/pixel).
BAND = (0.1, 0.6)

#: Reconstruct options that cannot be shared by the two half reconstructions.
_REFUSED = ("object", "resume", "checkpoint")


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
    from .io.scan import nearest_neighbour_steps

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
    from .physics import split_positions

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
    from scipy.ndimage import distance_transform_edt

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


# --------------------------------------------------------------------------------------------------
# the half-set measurement


def half_set_frc(data, *, split="checkerboard", fraction: float = 0.3, ramp: bool = True,
                 taper: float | None = None, band=BAND, client=None, n_workers: int | None = None,
                 **reconstruct_options) -> HalfSetFRC:
    """Reconstruct two interleaved halves of ``data`` apart and return their registered FRC.

    Parameters
    ----------
    data : str or PtychoData
        A data-set store path or an opened data set (e.g. from :func:`daskpty.from_arrays`).
    split : {"checkerboard", "alternate"} or array of bool
        How to halve the patterns (:func:`split_halves`), or a boolean array of length N marking
        the second half.
    fraction : float
        The region compared is where both halves' illumination (``Σ |probe|²`` of their own
        reconstructed probe at their positions) exceeds this fraction of its maximum.
    ramp, taper, band
        Passed to :func:`registered_frc`.
    client, n_workers
        Cluster for both reconstructions (one embedded cluster serves both when none is given).
    **reconstruct_options
        Passed to :func:`daskpty.reconstruct` for both halves (``epochs``, ``rounds_per_epoch``,
        ``engine``, ``probe``, ...). The halves share the object frame of the whole scan, so
        ``object``, ``resume`` and ``checkpoint`` are refused.

    Returns
    -------
    HalfSetFRC
        With ``halves`` (the two Reconstruction results), ``indices`` and ``seconds_per_epoch``.
    """
    from .api import reconstruct
    from .engines.initial import object_frame
    from .execution.cluster import client_context
    from .io.store import from_arrays, open_data

    refused = sorted(set(reconstruct_options) & set(_REFUSED))
    if refused:
        raise TypeError(f"half_set_frc does not take {refused}: the halves share a fresh object frame")
    if isinstance(data, (str, bytes)) or hasattr(data, "__fspath__"):
        data = open_data(data)
    positions = np.asarray(data.positions, dtype=np.float64)
    n = int(data.intensities.shape[-1])
    if isinstance(split, str):
        idx_a, idx_b = split_halves(positions, split)
    else:
        second = np.asarray(split, dtype=bool)
        if second.shape != (len(positions),):
            raise ValueError(f"a split array must have one boolean per pattern ({len(positions)}); "
                             f"got shape {second.shape}")
        idx_a, idx_b = np.nonzero(~second)[0], np.nonzero(second)[0]
    if min(len(idx_a), len(idx_b)) == 0:
        raise ValueError("one half of the split is empty")
    shape, origin = object_frame(positions, n)
    frame = positions + origin
    halves = []
    with client_context(client, n_workers=n_workers) as c:
        for idx in (idx_a, idx_b):
            half = from_arrays(data.intensities[idx], frame[idx], mask=getattr(data, "mask", None),
                               probe=getattr(data, "probe", None))
            halves.append(reconstruct(half, object=np.ones(shape, dtype=np.complex64), client=c,
                                      **reconstruct_options))
    ra, rb = halves
    region = common_region(illumination_map(ra.probe, ra.positions, shape),
                           illumination_map(rb.probe, rb.positions, shape), fraction)
    if not region.any():
        raise ValueError("the two halves share no illuminated region; lower `fraction`")
    result = registered_frc(ra.object, rb.object, region, ramp=ramp, taper=taper, band=band)
    seconds = [h.get("seconds") for r in halves for h in (r.history[1:] or r.history)
               if h.get("seconds") is not None]
    return HalfSetFRC(**{**result.__dict__, "halves": (ra, rb), "indices": (idx_a, idx_b),
                         "seconds_per_epoch": float(np.median(seconds)) if seconds else None})
