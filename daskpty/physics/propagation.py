"""Propagators and their adjoints: far field (Fraunhofer), angular spectrum (Fresnel), near field.

Orthonormal FFT with the zero frequency at index 0 (engine convention); recorded far-field
patterns have DC at the centre and are ``ifftshift``-ed once when loaded.
"""
from __future__ import annotations

import numpy as np

from .backend import fft2, get_xp, ifft2
from .geometry import fresnel_scaling


def far_field(exit_waves):
    """Propagate exit waves (..., n, n) to the detector: orthonormal 2-D FFT."""
    return fft2(exit_waves)


def far_field_adjoint(far):
    """Adjoint (= inverse, the FFT being unitary) of :func:`far_field`."""
    return ifft2(far)


# --------------------------------------------------------------------------------------------------
# Angular-spectrum (Fresnel) propagation and the near-field detector operator.
#
# Sign convention: waves exp(i(k·r − ωt)); propagating a distance z > 0 downstream multiplies the
# angular spectrum by H(u) = exp(2πi z (√(1/λ² − |u|²) − 1/λ)) ≈ exp(−iπ λ z |u|²) (the constant
# exp(2πi z/λ) is dropped). u in cycles per metre, zero frequency at index 0 (np.fft.fftfreq order).


def _pixel_pair(pixel_size_m):
    p = np.broadcast_to(np.asarray(pixel_size_m, dtype=np.float64), (2,))
    if not (np.all(p > 0) and np.all(np.isfinite(p))):
        raise ValueError(f"pixel size must be positive, got {pixel_size_m!r}")
    return float(p[0]), float(p[1])


def angular_spectrum_kernel(shape, pixel_size_m, wavelength_m: float, distance_m: float, *,
                            band_limit: bool = True, xp=np, dtype=np.complex64):
    """Transfer function H (ny, nx) of free-space propagation over ``distance_m`` (may be < 0).

    ``shape``: (ny, nx) or n; ``pixel_size_m``: Δx or (Δy, Δx). Evanescent components
    (|u| ≥ 1/λ) are set to zero. ``band_limit`` (Matsushima & Shimobaba, Opt. Express 17, 19662,
    2009, for a periodic window of width L = n Δx): keep only |u_x| ≤ 1/(λ √((2z/L_x)² + 1)) (and
    likewise in y), the frequencies whose rays move less than half the window over z, so the
    kernel's chirp is sampled without aliasing. The phase is computed in float64 as
    −2π z λ u² / (1 + √(1 − λ²u²)) (no cancellation for small angles).
    """
    ny, nx = (shape, shape) if np.ndim(shape) == 0 else tuple(int(s) for s in shape[-2:])
    dy, dx = _pixel_pair(pixel_size_m)
    lam, z = float(wavelength_m), float(distance_m)
    if not (lam > 0 and np.isfinite(lam)):
        raise ValueError(f"wavelength must be positive, got {wavelength_m!r}")
    if not np.isfinite(z):
        raise ValueError(f"propagation distance must be finite, got {distance_m!r}")
    uy = np.fft.fftfreq(ny, d=dy)[:, None]
    ux = np.fft.fftfreq(nx, d=dx)[None, :]
    s = (lam * uy) ** 2 + (lam * ux) ** 2
    keep = s < 1.0
    root = np.sqrt(np.where(keep, 1.0 - s, 1.0))
    phase = -2.0 * np.pi * z * lam * (uy**2 + ux**2) / (1.0 + root)
    if band_limit and z != 0:
        for u, width in ((uy, ny * dy), (ux, nx * dx)):
            keep = keep & (np.abs(u) <= 1.0 / (lam * np.sqrt((2.0 * z / width) ** 2 + 1.0)))
    h = np.where(keep, np.exp(1j * phase), 0.0).astype(dtype)
    return xp.asarray(h)


def angular_spectrum(waves, kernel):
    """Propagate waves (..., ny, nx) with a transfer function ``kernel``: F⁻¹[H · F ψ] (a new
    array; ``waves`` is left alone)."""
    spectra = fft2(waves)
    spectra *= kernel
    return ifft2(spectra, overwrite=True)


def angular_spectrum_adjoint(waves, kernel):
    """Adjoint of :func:`angular_spectrum`: F⁻¹[conj(H) · F ψ] (= the inverse where |H| = 1)."""
    spectra = fft2(waves)
    spectra *= get_xp(waves, kernel).conj(kernel)
    return ifft2(spectra, overwrite=True)


def near_field_kernel(shape, detector_pixel_size_m, wavelength_m: float, sample_to_detector_m: float,
                      focus_to_sample_m: float | None = None, *, band_limit: bool = True, xp=np,
                      dtype=np.complex64):
    """Transfer function of the near-field detector operator for a divergent (point-source) beam.

    Fresnel scaling: with the focus z1 = ``focus_to_sample_m`` upstream of the sample and the
    detector z2 downstream, the recorded hologram is the plane-wave propagation over
    z_eff = z1 z2 / (z1 + z2) of the exit wave sampled at Δx = p / M, M = (z1 + z2) / z1 (the
    probe then holds no curvature of the divergent beam; intensities scale by 1/M², a constant the
    probe's power absorbs). ``focus_to_sample_m=None``: plane wave, z_eff = z2, Δx = p.
    """
    z_eff, magnification = fresnel_scaling(focus_to_sample_m, sample_to_detector_m)
    pixel = np.asarray(detector_pixel_size_m, dtype=np.float64) / magnification
    return angular_spectrum_kernel(shape, pixel, wavelength_m, z_eff, band_limit=band_limit, xp=xp,
                                   dtype=dtype)


def near_field(exit_waves, kernel):
    """Near-field detector operator D ψ = F⁻¹[H F ψ] with H from :func:`near_field_kernel`.

    Its output is the detector-plane field in real-space pixel order (no fftshift: a hologram is an
    image, its data are loaded as recorded).
    """
    return angular_spectrum(exit_waves, kernel)


def near_field_adjoint(detector_waves, kernel):
    """Adjoint Dᴴ of :func:`near_field`."""
    return angular_spectrum_adjoint(detector_waves, kernel)
