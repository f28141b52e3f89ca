"""Small synthetic data sets with known object and probe, for engine tests (NumPy only)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from scipy.ndimage import gaussian_filter

from daskpty.physics import model_intensities, orthogonalize_modes


def smooth_object(size: int, rng, sigma: float = 2.5) -> np.ndarray:
    phase = gaussian_filter(rng.normal(size=(size, size)), sigma)
    amp = gaussian_filter(rng.normal(size=(size, size)), sigma)
    phase = 0.8 * phase / np.abs(phase).max()
    amp = 0.8 + 0.2 * amp / np.abs(amp).max()
    return (amp * np.exp(1j * phase)).astype(np.complex64)


def defocused_probe(n: int, photons: float, modes: int = 1, rng=None) -> np.ndarray:
    k = np.fft.fftshift(np.fft.fftfreq(n))
    ky, kx = np.meshgrid(k, k, indexing="ij")
    pupil = (np.hypot(ky, kx) < 0.22) * np.exp(1j * 40 * (ky**2 + kx**2))
    p0 = np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(pupil), norm="ortho"))
    probe = [p0]
    yy, xx = (np.mgrid[0:n, 0:n] - n / 2) / (n / 4)
    for k in range(1, modes):
        probe.append(p0 * (yy if k % 2 else xx) * 0.6)
    probe = orthogonalize_modes(np.stack(probe).astype(np.complex64))
    probe *= np.sqrt(photons / (np.abs(probe) ** 2).sum())
    return probe.astype(np.complex64)


def make_dataset(n: int = 32, grid: int = 12, step: float = 4.0, modes: int = 1, photons: float = 1e5,
                 noise: bool = True, seed: int = 0):
    """Jittered raster scan over a smooth random object; returns a namespace with truth."""
    rng = np.random.default_rng(seed)
    size = int(np.ceil((grid - 1) * step + n + 8))
    obj = smooth_object(size, rng)
    probe = defocused_probe(n, photons, modes, rng)
    g = np.arange(grid) * step
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 4
    pos = pos + rng.uniform(-0.8, 0.8, pos.shape)
    clean = np.fft.fftshift(model_intensities(obj, probe, pos), axes=(-2, -1))
    intensities = rng.poisson(clean).astype(np.float32) if noise else clean.astype(np.float32)
    return SimpleNamespace(intensities=intensities, positions=pos, mask=None, probe=None,
                           truth=SimpleNamespace(object=obj, probe=probe, positions=pos))


def slice_model(obj, kernel=None, detector=None):
    """The forward model of ``obj`` (K, H, W) (or (H, W): one slice) through ``kernel``'s slices
    to ``detector`` (None: the far field)."""
    from daskpty.engines.forward_model import ForwardModel
    return ForwardModel(1 if np.ndim(obj) == 2 else np.shape(obj)[0], kernel, detector)


def whole_block(obj, probe, intensities, positions, kernel=None, detector=None, cdtype=np.complex64, variable=None):
    """A chunk as one forward block of :func:`slice_model` (box, windows, ramps, S_f P, the
    incident, exit and detected waves); obj (K, H, W) or (H, W)."""
    obj = obj[None] if np.ndim(obj) == 2 else obj
    c = slice_model(obj, kernel, detector).chunk(obj, probe, intensities, positions, cdtype=cdtype,
                                                 variable=variable, whole=True)
    return c.forward(c.blocks[0])
