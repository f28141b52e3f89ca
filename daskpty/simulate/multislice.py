"""A small multislice simulator: weak-phase slices, an electron probe, far-field patterns (NumPy).

For tests and examples (in memory; :func:`daskpty.simulate.simulate` writes single-slice stores). Defaults:
300 kV electrons (λ = 1.97 pm), 0.25 Å pixels, slices 2 nm apart — Fresnel number λΔz/Δx² ≈ 6,
so the propagation between slices shifts the phase at the probe's band edge by ~2 rad and no
single projected slice fits the data.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..physics.geometry import electron_wavelength_m
from ..physics.multislice import SliceGeometry, multislice_intensities
from ..physics.probes import electron_probe


def weak_phase_slices(shape, n_slices: int, rng, *, phase: float = 0.4, absorption: float = 0.05,
                      band=(0.12, 0.4)) -> np.ndarray:
    """Independent weak-phase slices (K, H, W) complex64: exp((i − absorption) φ_k), φ_k a random
    field band-passed to ``band`` (cycles per pixel), scaled to a range of ``phase`` rad and shifted
    to be ≥ 0 (so |O| ≤ 1).

    The band keeps the slices' structure where propagation tells them apart: the low spatial
    frequencies barely change over Δz, so no data set fixes how they split between slices.
    """
    uy = np.fft.fftfreq(shape[0])[:, None]
    ux = np.fft.fftfreq(shape[1])[None, :]
    r = np.hypot(uy, ux)
    window = (r >= band[0]) & (r <= band[1])
    out = np.empty((n_slices,) + tuple(shape), np.complex64)
    for k in range(n_slices):
        f = np.fft.ifft2(np.fft.fft2(rng.standard_normal(shape)) * window).real
        f = phase * (f - f.min()) / (f.max() - f.min())
        out[k] = np.exp((1j - absorption) * f)
    return out


def simulate_multislice(*, n: int = 32, n_slices: int = 2, grid: int | tuple[int, int] = 10, step: float = 3.0,
                        voltage_v: float = 300e3, pixel_size_m: float = 0.25e-10,
                        spacing_m: float = 2e-9, convergence_semiangle_rad: float = 25e-3,
                        defocus_m: float = 6e-9, photons: float = 1e6, noise: bool = False,
                        jitter: float = 0.5, seed: int = 0) -> SimpleNamespace:
    """Simulate a raster scan (``grid`` × ``grid`` positions, or ``(rows, cols)``) over a K-slice object.

    Returns a namespace: ``intensities`` (N, n, n) float32 with DC at the centre (as recorded),
    ``positions`` (N, 2) object pixels, ``geometry`` (:class:`SliceGeometry`), ``kernel`` (n, n),
    ``wavelength_m``, and ``truth`` (``slices`` (K, H, W), ``probe`` (1, n, n), ``object`` = the
    product of the slices, the projection a single-slice model would try to fit). ``defocus_m`` is
    measured at the sample's entrance surface; ``truth.probe`` is the probe at the first slice,
    half a slice spacing in for K > 1 (the probe a K-slice reconstruction estimates; see
    :attr:`daskpty.engines.sample_options.ResolvedSample.first_screen_m`).
    """
    rng = np.random.default_rng(seed)
    lam = electron_wavelength_m(voltage_v)
    geometry = SliceGeometry(n_slices, spacing_m, lam, pixel_size_m)
    first_screen = 0.5 * spacing_m if n_slices > 1 else 0.0
    probe = electron_probe(n, pixel_size_m, lam, convergence_semiangle_rad, defocus_m=defocus_m + first_screen,
                           power=photons)
    margin = 4
    rows, cols = (grid, grid) if np.ndim(grid) == 0 else grid
    shape = tuple(int(np.ceil((g - 1) * step)) + n + 2 * margin for g in (rows, cols))
    slices = weak_phase_slices(shape, n_slices, rng)
    gy, gx = np.arange(rows) * step, np.arange(cols) * step
    positions = np.stack(np.meshgrid(gy, gx, indexing="ij"), -1).reshape(-1, 2) + n / 2 + margin
    positions = positions + rng.uniform(-jitter, jitter, positions.shape)
    kernel = geometry.kernel(n)
    clean = multislice_intensities(slices, probe, positions, kernel)
    data = rng.poisson(clean).astype(np.float32) if noise else clean
    return SimpleNamespace(
        intensities=np.fft.fftshift(data, axes=(-2, -1)), positions=positions, geometry=geometry,
        kernel=kernel, wavelength_m=lam,
        truth=SimpleNamespace(slices=slices, probe=probe, object=np.prod(slices, axis=0), positions=positions))
