"""Initial guesses: object frame and size, probe from the data."""
from __future__ import annotations

import math

import numpy as np

from ..physics import ifft2, orthogonalize_modes


def probe_diameter_from_scan(positions: np.ndarray, n: int, overlap_factor: float = 2.5) -> float:
    """A probe diameter (pixels) giving good overlap: ``overlap_factor`` × the median
    nearest-neighbour scan step, capped at 0.6 n (uses a KD-tree, O(N log N))."""
    from scipy.spatial import cKDTree

    p = np.asarray(positions, dtype=np.float64)
    if len(p) < 2:
        return 0.5 * n
    dist, _ = cKDTree(p).query(p, k=2)
    step = float(np.median(dist[:, 1]))
    return float(min(max(overlap_factor * step, 2.0), 0.6 * n))


def object_frame(positions: np.ndarray, n: int, margin: int | None = None):
    """Object shape and integer origin covering every probe window plus a margin.

    Returns ``(shape, origin)``: positions in the object frame are ``positions + origin``, i.e.
    ``origin`` is where position (0, 0) lies in object pixels.
    """
    if margin is None:
        margin = max(2, n // 8)
    p = np.asarray(positions, dtype=np.float64)
    top_left_min = p.min(axis=0) - n / 2.0
    origin = margin - np.floor(top_left_min)
    top_left_max = p.max(axis=0) + origin - n / 2.0
    shape = tuple(int(math.ceil(v)) + n + margin + 1 for v in top_left_max)
    return shape, origin.astype(np.float64)


def probe_from_mean_pattern(mean_pattern: np.ndarray, modes: int = 1, seed: int = 0,
                            mode_power: float = 0.05, diameter: float | None = None) -> np.ndarray:
    """Initial probe from the mean diffraction pattern (DC at the centre).

    Mode 0 has the mean pattern's amplitude in the far field. With ``diameter`` (pixels) a
    quadratic (defocus) phase spreads it to about that diameter in the object plane — this breaks
    the twin-image symmetry a flat-phase guess has and matches the scan's overlap; without it the
    phase is flat (a focused, centro-symmetric guess). Its power Σ|P|² equals the mean total
    counts per pattern (so Σŷ ≈ Σy for an object of unit amplitude). Further modes are mode 0
    times smooth seeded random phase/amplitude patterns holding ``mode_power`` of the power
    each, orthogonalised.
    """
    mean_pattern = np.clip(np.asarray(mean_pattern, dtype=np.float64), 0, None)
    n = mean_pattern.shape[-1]
    amplitude = np.sqrt(np.fft.ifftshift(mean_pattern))
    spectrum = amplitude.astype(np.complex128)
    if diameter:
        k = np.fft.fftfreq(n)
        k2 = k[:, None] ** 2 + k[None, :] ** 2
        support = amplitude > 0.1 * amplitude.max()
        k_max = max(float(np.sqrt(k2[support].max())), 1.0 / n)
        curvature = diameter / (2.0 * k_max)  # a ray at spatial frequency k lands c·k pixels off-centre
        spectrum = spectrum * np.exp(1j * np.pi * curvature * k2)
    p0 = np.fft.fftshift(ifft2(spectrum))
    total = mean_pattern.sum()
    p0 = p0 * np.sqrt(total / max((np.abs(p0) ** 2).sum(), 1e-30))
    probe = [p0]
    rng = np.random.default_rng(seed)
    yy, xx = (np.mgrid[0:n, 0:n] - n / 2) / (n / 2)
    for _ in range(1, modes):
        c = rng.normal(size=4)
        variation = c[0] * yy + c[1] * xx + 1j * (c[2] * yy * xx + c[3] * (yy**2 - xx**2))
        pk = p0 * variation
        pk *= np.sqrt(mode_power * total / max((np.abs(pk) ** 2).sum(), 1e-30))
        probe.append(pk)
    probe = np.stack(probe).astype(np.complex64)
    return orthogonalize_modes(probe) if modes > 1 else probe


def probe_from_mean_hologram(mean_hologram: np.ndarray, detector_kernel: np.ndarray, modes: int = 1,
                             seed: int = 0, mode_power: float = 0.05) -> np.ndarray:
    """Initial probe of a near-field scan: the mean hologram's amplitude carried back to the
    sample plane, Dᴴ √ȳ (D the near-field operator of ``detector_kernel``, no fftshift: holograms
    are images), i.e. the probe a flat object would show. Further modes: the first times a smooth
    random phase screen, each with ``mode_power`` of its power. Returns (modes, n, n) complex64.
    """
    amp = np.sqrt(np.clip(np.asarray(mean_hologram, dtype=np.float64), 0.0, None))
    kernel = np.asarray(detector_kernel)
    first = np.fft.ifft2(np.fft.fft2(amp, norm="ortho") * np.conj(kernel), norm="ortho")
    out = [first]
    rng = np.random.default_rng(seed)
    n = amp.shape[-1]
    low = np.hypot(*np.meshgrid(np.fft.fftfreq(n), np.fft.fftfreq(n), indexing="ij")) < 4.0 / n
    power = float((np.abs(first) ** 2).sum())
    for _ in range(1, modes):
        screen = np.fft.ifft2(np.fft.fft2(rng.standard_normal((n, n))) * low).real
        screen *= np.pi / max(float(np.abs(screen).max()), 1e-30)
        mode = first * np.exp(1j * screen)
        out.append(mode * np.sqrt(mode_power * power / max(float((np.abs(mode) ** 2).sum()), 1e-300)))
    return np.stack(out).astype(np.complex64)
