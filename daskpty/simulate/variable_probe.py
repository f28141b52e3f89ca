"""A small in-memory scan whose probe varies along the scan (for OPR tests and benchmarks).

The probe of pattern j is a defocused disc whose defocus drifts linearly with the pattern's
place in the scan (``defocus_drift``: the extra quadratic pupil phase, radians at the pupil
edge, from −drift/2 at the first pattern to +drift/2 at the last), and whose flux varies
randomly by ±``flux_jitter`` (uniform intensity factor 1 ± jitter). ``constant=True`` gives
the same scan with one probe (the mean defocus, unit flux) for comparison.

NumPy only; the result is a namespace that ``daskpty.reconstruct`` accepts (``intensities``,
``positions``, ``mask``, ``probe``) plus ``truth`` (object, positions, per-pattern probes,
``defocus``, ``flux``).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..physics import model_intensities


def _smooth(shape, rng, sigma: float) -> np.ndarray:
    k = [np.fft.fftfreq(s) for s in shape]
    ky, kx = np.meshgrid(*k, indexing="ij")
    kernel = np.exp(-2 * (np.pi * sigma) ** 2 * (ky**2 + kx**2))
    field = np.fft.ifft2(np.fft.fft2(rng.normal(size=shape)) * kernel).real
    return field / np.abs(field).max()


def _object(size: int, rng) -> np.ndarray:
    phase = 0.8 * _smooth((size, size), rng, 2.5)
    amp = 0.8 + 0.2 * _smooth((size, size), rng, 2.5)
    return (amp * np.exp(1j * phase)).astype(np.complex64)


def disc_probe(n: int, defocus: float) -> np.ndarray:
    """A defocused disc: pupil of radius 0.22 (cycles/px) with phase ``defocus``·(k/0.22)²."""
    k = np.fft.fftshift(np.fft.fftfreq(n))
    ky, kx = np.meshgrid(k, k, indexing="ij")
    rho2 = (ky**2 + kx**2) / 0.22**2
    pupil = (rho2 < 1) * np.exp(1j * defocus * rho2)
    return np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(pupil), norm="ortho")).astype(np.complex64)


def simulate_variable_probe(n: int = 32, grid: int = 14, step: float = 4.0, photons: float = 1e6,
                            defocus: float = 1.9, defocus_drift: float = 2.0, flux_jitter: float = 0.2,
                            constant: bool = False, noise: bool = True, seed: int = 0) -> SimpleNamespace:
    """A jittered raster scan (grid × grid positions, ``step`` px apart, probe size ``n``)."""
    rng = np.random.default_rng(seed)
    size = int(np.ceil((grid - 1) * step + n + 8))
    obj = _object(size, rng)
    g = np.arange(grid) * step
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 4
    pos = pos + rng.uniform(-0.8, 0.8, pos.shape)
    count = len(pos)
    ramp = np.linspace(-0.5, 0.5, count)
    flux_draw = rng.uniform(-1, 1, count)
    if constant:
        defoci, flux = np.full(count, defocus), np.ones(count)
    else:
        defoci, flux = defocus + defocus_drift * ramp, 1 + flux_jitter * flux_draw
    base = disc_probe(n, defocus)
    norm = np.sqrt(photons / (np.abs(base) ** 2).sum())
    probes = np.stack([disc_probe(n, d) for d in defoci]) * (norm * np.sqrt(flux))[:, None, None]
    clean = np.empty((count, n, n), np.float32)
    for j in range(count):
        clean[j] = model_intensities(obj, probes[j][None], pos[j:j + 1])[0]
    clean = np.fft.fftshift(clean, axes=(-2, -1))
    intensities = rng.poisson(clean).astype(np.float32) if noise else clean
    truth = SimpleNamespace(object=obj, positions=pos, probes=probes.astype(np.complex64), defocus=defoci,
                            flux=flux, probe=(base * norm)[None].astype(np.complex64))
    return SimpleNamespace(intensities=intensities, positions=pos, mask=None, probe=None, truth=truth)
