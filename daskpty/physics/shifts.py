"""Sub-pixel positioning: integer windows plus a Fourier shift of the probe.

Convention (design.md): position ``p`` (y, x) places the probe window's top-left
corner at ``t = p - n/2``. The integer corner is ``r = round(t)`` and the fractional
part ``f = t - r`` lies in [-0.5, 0.5]. The probe seen by object pixel ``r + i`` is
``P(i - f)``, i.e. the probe shifted by ``+f``: ``S_f P = F^-1[ F[P] * exp(-2πi k·f) ]``.
``S_f`` is unitary, so its adjoint is ``S_{-f}``.
"""
from __future__ import annotations

import numpy as np

from .backend import fft2, get_xp, ifft2


def split_positions(positions, n: int):
    """Split positions (N, 2) into integer window corners (N, 2) int64 and fractions (N, 2) float32."""
    positions = np.asarray(positions, dtype=np.float64)
    top_left = positions - n / 2.0
    corners = np.floor(top_left + 0.5).astype(np.int64)
    fractions = (top_left - corners).astype(np.float32)
    return corners, fractions


def shift_ramp_factors(fractions, n: int, xp=np, dtype=np.complex64):
    """The separable factors of :func:`shift_ramps`: exp(-2πi ky fy) and exp(-2πi kx fx), each
    (B, n), in ``dtype`` (complex64, or complex128 for float64 work)."""
    real = np.float64 if np.dtype(dtype) == np.complex128 else np.float32
    f = xp.asarray(fractions, dtype=real)
    k = xp.asarray(np.fft.fftfreq(n), dtype=real)
    factors = []
    for axis in (0, 1):
        phase = (real(-2 * np.pi) * f[:, axis, None]) * k[None, :]
        r = xp.empty(phase.shape, dtype)
        parts = r.view(real).reshape(phase.shape + (2,))
        parts[..., 0] = xp.cos(phase)
        parts[..., 1] = xp.sin(phase)
        factors.append(r)
    return tuple(factors)


def outer_ramps(ry, rx, out=None):
    """Ramps ry[:, :, None] · rx[:, None, :] (B, n, n) complex64 from factors (B, n) complex64.

    Computed as one batched real matrix product: with u = (rx.re, rx.im) and v = (−rx.im, rx.re)
    interleaved (the float32 views of rx and i·rx), the float32 view of row ky is
    ry.re[ky]·u + ry.im[ky]·v. About 2.5× faster on the CPU than a broadcast complex multiply.
    """
    xp = get_xp(ry, rx)
    b, n = ry.shape[0], rx.shape[-1]
    left = xp.stack([ry.real, ry.imag], axis=-1).astype(np.float32, copy=False)          # (B, n, 2)
    right = xp.stack([rx, 1j * rx], axis=1).astype(np.complex64).view(np.float32)       # (B, 2, 2n)
    if out is None:
        out = xp.empty((b, ry.shape[-1], n), np.complex64)
    xp.matmul(left, right, out=out.view(np.float32).reshape(b, ry.shape[-1], 2 * n))
    return out


def shift_ramps(fractions, n: int, xp=np):
    """Phase ramps exp(-2πi (ky fy + kx fx)) for fractions (B, 2) → (B, n, n) complex64."""
    ry, rx = shift_ramp_factors(fractions, n, xp)
    return outer_ramps(ry, rx)


def shift_probe(probe, ramps):
    """Shifted probes S_f P: probe (M, n, n), ramps (B, n, n) → (B, M, n, n)."""
    probe_ft = fft2(probe)
    return ifft2(ramps[:, None] * probe_ft[None], overwrite=True).astype(np.complex64, copy=False)


def shift_probe_adjoint(waves, ramps, overwrite: bool = False):
    """Adjoint of :func:`shift_probe` summed over the batch: (B, M, n, n) → (M, n, n).

    ``overwrite=True`` lets it reuse ``waves``' memory (pass temporaries only).
    """
    xp = get_xp(waves, ramps)
    spectra = fft2(waves, overwrite=overwrite)
    spectra *= xp.conj(ramps)[:, None]
    return ifft2(spectra.sum(axis=0)).astype(np.complex64, copy=False)


def shift_images(images, fractions):
    """Apply S_f to a batch of images (B, ..., n, n) with fractions (B, 2) (for tests and the simulator)."""
    xp = get_xp(images)
    n = images.shape[-1]
    ramps = shift_ramps(fractions, n, xp)
    extra = (slice(None),) + (None,) * (images.ndim - 3)
    return ifft2(fft2(images) * ramps[extra]).astype(np.complex64, copy=False)
