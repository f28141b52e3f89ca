"""Recognise a probable near-field (holographic) scan stored as far field.

A far-field pattern is the Fourier transform of the exit wave: moving the probe over the sample
changes its speckle but does not move it across the detector. A near-field pattern is an in-line
hologram, a magnified image of the illuminated part of the sample: when the probe moves by Δr,
the sample's features move across the detector by M·Δr. So, after dividing each frame by the
mean pattern (which takes out the beam's own footprint and fringes), neighbouring frames of a
near-field scan match each other *shifted*, and the shifts follow the scan positions through one
linear map; in the far field the best-matching shifts are speckle coincidences, unrelated to the
positions. :func:`near_field_evidence` measures that on a short run of frames;
:func:`near_field_hint` turns it into one line for ``daskpty import`` and ``daskpty info``.

A strongly defocused probe over a smooth sample also casts a shadow image in the far field (a
Ronchigram) that moves with the scan, so the test says *probable*, and the message says so.
Electron data (wavelength below 0.1 Å), where such shadow images are common and near-field
ptychography is not, are never flagged. Measured: the P25 near-field file R² 0.99, shifts of
7 px; daskpty's simulated far-field scans R² about 0.5.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: frames read from a store for the test (a contiguous run from the middle of the scan), binned
#: to at most MAX_SIDE pixels a side (a 512² detector: 4 x 4 bins), so the test stays cheap
SAMPLE_FRAMES, MAX_SIDE = 256, 128
#: pairs: each anchor with its nearest neighbours in position
ANCHORS, NEIGHBOURS = 48, 3
#: how well the best-match shifts must follow the positions (R² of the linear fit), how strong
#: the matches must be (median normalised cross-correlation) and how far they must move (px)
MIN_R2, MIN_CORRELATION, MIN_SHIFT_PX = 0.9, 0.3, 2.0
#: below this wavelength the radiation is electrons (300 keV: 0.020 Å; 12 keV X-rays: 1 Å)
ELECTRON_WAVELENGTH_M = 1e-11


@dataclass(frozen=True)
class NearFieldEvidence:
    """What :func:`near_field_evidence` measured."""

    r2: float            # how well detector shifts follow the scan positions (linear fit)
    correlation: float   # median peak normalised cross-correlation of neighbouring frames
    shift_px: float      # median length of the best-match shift, detector pixels
    n_pairs: int

    @property
    def looks_near_field(self) -> bool:
        return (self.n_pairs >= 8 and self.r2 >= MIN_R2 and self.correlation >= MIN_CORRELATION
                and self.shift_px >= MIN_SHIFT_PX)


def near_field_evidence(frames, positions, mean=None) -> NearFieldEvidence:
    """Do the frames move across the detector with the scan, as near-field holograms do?

    ``frames`` (N, H, W) intensities, ``positions`` (N, 2) in any consistent unit, ``mean`` the
    mean pattern (default: the frames' own mean).
    """
    frames = np.asarray(frames, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.float64)
    n = len(frames)
    if n < 3:
        return NearFieldEvidence(float("nan"), float("nan"), float("nan"), 0)
    mean = frames.mean(axis=0) if mean is None else np.asarray(mean, dtype=np.float64)
    lit = mean > 0.05 * mean.max() if mean.max() > 0 else np.zeros(mean.shape, bool)
    if lit.sum() < 16:
        return NearFieldEvidence(float("nan"), float("nan"), float("nan"), 0)
    flat = np.where(lit, frames / np.where(lit, mean, 1.0) - 1.0, 0.0)
    flat -= np.where(lit, flat.sum(axis=(1, 2), keepdims=True) / lit.sum(), 0.0)
    power = np.sqrt((flat ** 2).sum(axis=(1, 2)))
    cache: dict[int, np.ndarray] = {}

    def spectrum(i):
        if i not in cache:
            cache[i] = np.fft.rfft2(flat[i])
        return cache[i]

    h, w = frames.shape[1:]
    anchors = np.unique(np.linspace(0, n - 1, min(ANCHORS, n)).round().astype(int))
    shifts, steps, peaks = [], [], []
    for j in anchors:
        dist = np.hypot(*(positions - positions[j]).T)
        dist[j] = np.inf
        for k in np.argsort(dist)[:NEIGHBOURS]:
            if not np.isfinite(dist[k]) or power[j] == 0 or power[k] == 0:
                continue
            c = np.fft.irfft2(spectrum(j) * np.conj(spectrum(k)), s=(h, w)) / (power[j] * power[k])
            py, px = np.unravel_index(int(np.argmax(c)), c.shape)
            shifts.append(((py + h // 2) % h - h // 2, (px + w // 2) % w - w // 2))
            steps.append(positions[j] - positions[k])
            peaks.append(c[py, px])
    if len(shifts) < 3:
        return NearFieldEvidence(float("nan"), float("nan"), float("nan"), len(shifts))
    s, d = np.asarray(shifts, float), np.asarray(steps, float)
    fit, *_ = np.linalg.lstsq(d, s, rcond=None)
    spread = ((s - s.mean(axis=0)) ** 2).sum()
    r2 = 1.0 - ((s - d @ fit) ** 2).sum() / spread if spread > 0 else 0.0
    return NearFieldEvidence(float(r2), float(np.median(peaks)),
                             float(np.median(np.hypot(*s.T))), len(shifts))


def _sample(data):
    """A contiguous run of at most SAMPLE_FRAMES frames from the middle of the scan."""
    n = data.n_patterns
    start = max(0, (n - SAMPLE_FRAMES) // 2)
    stop = min(n, start + SAMPLE_FRAMES)
    frames = np.asarray(data.intensities[start:stop].compute(scheduler="threads"))
    frames = frames.astype(np.float32)
    if data.mask is not None:
        frames *= np.asarray(data.mask, dtype=np.float32)
    b = -(-max(frames.shape[1:]) // MAX_SIDE)            # bin factor, ceil
    if b > 1:
        h, w = (s // b * b for s in frames.shape[1:])
        frames = frames[:, :h, :w].reshape(len(frames), h // b, b, w // b, b).mean(axis=(2, 4))
    return frames, np.asarray(data.positions[start:stop])


def near_field_hint(data) -> str | None:
    """One line when a store recorded as far field looks like a near-field scan, else None.

    ``data``: an opened data set (:class:`daskpty.io.store.PtychoData`). Stores already marked
    ``detector="near_field"`` and electron data are never flagged.
    """
    meta = data.metadata
    if meta.get("detector") == "near_field":
        return None
    wavelength = meta.get("wavelength_m")
    if isinstance(wavelength, (int, float)) and wavelength < ELECTRON_WAVELENGTH_M:
        return None
    frames, positions = _sample(data)
    ev = near_field_evidence(frames, positions)
    if not ev.looks_near_field:
        return None
    return (f"these patterns look like near-field holograms, not far-field diffraction: "
            f"neighbouring frames match each other shifted by {ev.shift_px:.0f} px, and the "
            f"shifts follow the scan positions (R² {ev.r2:.2f} over {ev.n_pairs} pairs; a far-field "
            f"scan with a strongly defocused probe can do this too). If it is a near-field scan, "
            f"import it again with --focus-to-sample Z1 (divergent beam: the focus-to-sample "
            f"distance in m) or --near-field (plane wave), without --crop; far-field "
            f"reconstruction of holograms gives noisy tiles")


__all__ = ["NearFieldEvidence", "near_field_evidence", "near_field_hint"]
