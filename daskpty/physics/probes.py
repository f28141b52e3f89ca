"""Initial probes from the physics of the illumination: X-ray optics and electron condensers.

Every probe is returned as (1, n, n) complex64 (one mode), centred in the window (pixel n/2),
sampled at the object pixel size, with power Σ|P|² = ``power`` — pass the mean total counts per
pattern, as :func:`daskpty.engines.initial.probe_from_mean_pattern` does, so that Σŷ ≈ Σy for an
object of unit amplitude.

Sign conventions (the same for X-rays and electrons)
----------------------------------------------------
* ``defocus_m`` = z_sample − z_focus along the beam. **Positive defocus: the sample lies downstream
  of the focus** (the beam diverges at the sample); the probe is then the focused probe propagated
  by +defocus with :func:`daskpty.physics.propagation.angular_spectrum_kernel` (which uses
  H ≈ exp(−iπλz|u|²) for z > 0). Negative: the focus lies behind the sample (converging beam).
* Electron aberrations (Krivanek notation, θ = λ|u| the scattering angle, φ its azimuth measured
  from +x (axis 1) towards +y (axis 0)): P = F⁻¹[A(θ) exp(−iχ)] with
  χ(θ, φ) = (2π/λ) [½ C1 θ² + ¼ C3 θ⁴ + ½ A1 θ² cos 2(φ − φ_A1)], C1 = ``defocus_m``,
  C3 = ``c3_m`` (spherical aberration, > 0 for an uncorrected round lens), A1 = ``astigmatism_m``,
  φ_A1 = ``astigmatism_angle_rad``. So C1 > 0 is *overfocus*; Kirkland's and abTEM's defocus
  Δf = −C1 has the opposite sign (their Scherzer Δf = +1.2 √(C3 λ) is ``defocus_m = −1.2 √(C3 λ)``
  here). Positive A1 moves the focus along φ_A1 by +A1 and across it by −A1.
"""
from __future__ import annotations

import numpy as np

from .propagation import angular_spectrum_kernel


def _frequencies(n: int, pixel_size_m: float):
    u = np.fft.fftfreq(n, d=pixel_size_m)
    return u[:, None], u[None, :]


def _disc(radius, r, step):
    """Disc of ``radius`` with a one-sample linear edge (anti-aliased), on radii ``r``."""
    return np.clip((radius - r) / step + 0.5, 0.0, 1.0)


def _finish(spectrum, power: float):
    """Centred (1, n, n) complex64 probe with Σ|P|² = power from its spectrum (DC at index 0)."""
    if not power > 0:
        raise ValueError(f"power must be positive, got {power!r}")
    p = np.fft.fftshift(np.fft.ifft2(spectrum))
    p *= np.sqrt(power / max(float((np.abs(p) ** 2).sum()), 1e-300))
    return p[None].astype(np.complex64)


def _check_sampling(n: int, pixel_size_m: float, wavelength_m: float, semiangle: float, extent_m: float):
    if not (pixel_size_m > 0 and wavelength_m > 0):
        raise ValueError(f"pixel_size_m and wavelength_m must be positive, got {pixel_size_m!r}, {wavelength_m!r}")
    nyquist = 0.5 / pixel_size_m
    if semiangle / wavelength_m > nyquist:
        raise ValueError(
            f"under-sampled probe: the aperture semi-angle {semiangle:.4g} rad reaches spatial frequency "
            f"{semiangle / wavelength_m:.4g} /m, beyond the Nyquist frequency {nyquist:.4g} /m of the "
            f"{pixel_size_m:.4g} m object pixel; use a smaller object pixel (more detector pixels)")
    if extent_m > n * pixel_size_m:
        raise ValueError(
            f"the probe (about {extent_m:.4g} m across) does not fit the {n * pixel_size_m:.4g} m window "
            f"({n} pixels); reduce the defocus or use larger patterns")


def xray_probe(n: int, pixel_size_m: float, wavelength_m: float, *, diameter_m: float,
               focal_length_m: float | None = None, defocus_m: float = 0.0, central_stop: float = 0.0,
               power: float = 1.0):
    """X-ray probe of a focusing optic (zone-plate-like) or of a pinhole.

    With ``focal_length_m``: a zone plate / lens of outer ``diameter_m`` and focal length f, so the
    convergence semi-angle is α = D / (2f); its pupil is a disc of radius α/λ in spatial frequency
    with a ``central_stop`` (fraction of the diameter, 0 ≤ · < 1) and the probe is its focus
    propagated by ``defocus_m`` (module docstring: > 0 means the sample is downstream of the focus).
    Without it: a pinhole of ``diameter_m`` (uniform disc) propagated ``defocus_m`` downstream.
    Raises ValueError when the pupil exceeds the Nyquist frequency of the object pixel or the
    (geometric) beam does not fit the window.
    """
    if not diameter_m > 0:
        raise ValueError(f"diameter_m must be positive, got {diameter_m!r}")
    if not 0 <= central_stop < 1:
        raise ValueError(f"central_stop must lie in [0, 1), got {central_stop!r}")
    uy, ux = _frequencies(n, pixel_size_m)
    du = 1.0 / (n * pixel_size_m)
    propagate = angular_spectrum_kernel(n, pixel_size_m, wavelength_m, defocus_m, band_limit=False,
                                        dtype=np.complex128)
    if focal_length_m is not None:
        if not focal_length_m > 0:
            raise ValueError(f"focal_length_m must be positive, got {focal_length_m!r}")
        alpha = diameter_m / (2.0 * focal_length_m)
        spot = 1.22 * wavelength_m / alpha
        _check_sampling(n, pixel_size_m, wavelength_m, alpha, 2.0 * abs(defocus_m) * alpha + spot)
        r = np.hypot(uy, ux)
        pupil = _disc(alpha / wavelength_m, r, du)
        if central_stop > 0:
            pupil = pupil * (1.0 - _disc(central_stop * alpha / wavelength_m, r, du))
        return _finish(pupil * propagate, power)
    spread = 2.0 * abs(defocus_m) * wavelength_m / diameter_m
    _check_sampling(n, pixel_size_m, wavelength_m, 0.0, diameter_m + spread)
    y = (np.arange(n) - n // 2) * pixel_size_m
    disc = _disc(0.5 * diameter_m, np.hypot(y[:, None], y[None, :]), pixel_size_m).astype(np.complex128)
    spectrum = np.fft.fft2(np.fft.ifftshift(disc)) * propagate
    return _finish(spectrum, power)


def aberration_phase(n: int, pixel_size_m: float, wavelength_m: float, *, defocus_m: float = 0.0,
                     c3_m: float = 0.0, astigmatism_m: float = 0.0, astigmatism_angle_rad: float = 0.0):
    """χ(u) (n, n) float64, zero frequency at index 0, in the module docstring's convention."""
    uy, ux = _frequencies(n, pixel_size_m)
    theta2 = (wavelength_m**2) * (uy**2 + ux**2)
    phi = np.arctan2(uy, ux)
    return (2.0 * np.pi / wavelength_m) * (0.5 * defocus_m * theta2 + 0.25 * c3_m * theta2**2
                                           + 0.5 * astigmatism_m * theta2
                                           * np.cos(2.0 * (phi - astigmatism_angle_rad)))


def electron_probe(n: int, pixel_size_m: float, wavelength_m: float, convergence_semiangle_rad: float, *,
                   defocus_m: float = 0.0, c3_m: float = 0.0, astigmatism_m: float = 0.0,
                   astigmatism_angle_rad: float = 0.0, power: float = 1.0):
    """Electron probe of a condenser aperture of semi-angle α with aberrations (module docstring).

    P = centred F⁻¹[A(θ) exp(−iχ(θ, φ))], A the aperture disc θ ≤ α (anti-aliased edge). Raises
    ValueError when α/λ exceeds the Nyquist frequency of the object pixel (the bright-field disc
    would not fit the detector) or the geometric beam 2|C1|α does not fit the window.
    """
    alpha = float(convergence_semiangle_rad)
    if not alpha > 0:
        raise ValueError(f"convergence_semiangle_rad must be positive, got {convergence_semiangle_rad!r}")
    extent = 2.0 * (abs(defocus_m) + abs(astigmatism_m)) * alpha + abs(c3_m) * alpha**3
    _check_sampling(n, pixel_size_m, wavelength_m, alpha, extent)
    uy, ux = _frequencies(n, pixel_size_m)
    aperture = _disc(alpha / wavelength_m, np.hypot(uy, ux), 1.0 / (n * pixel_size_m))
    chi = aberration_phase(n, pixel_size_m, wavelength_m, defocus_m=defocus_m, c3_m=c3_m,
                           astigmatism_m=astigmatism_m, astigmatism_angle_rad=astigmatism_angle_rad)
    return _finish(aperture * np.exp(-1j * chi), power)


def probe_from_geometry(geometry, *, power: float = 1.0, **kwargs):
    """An initial probe for a geometry of :mod:`daskpty.physics.geometry`.

    Electron: :func:`electron_probe` with the geometry's wavelength, object pixel size and
    convergence semi-angle (``kwargs``: defocus_m, c3_m, astigmatism_m, astigmatism_angle_rad).
    X-ray (far or near field): :func:`xray_probe` (``kwargs``: diameter_m, focal_length_m,
    defocus_m, central_stop).
    """
    n, dx, lam = geometry.pattern_size, geometry.object_pixel_size_m, geometry.wavelength_m
    if hasattr(geometry, "voltage_v"):
        if geometry.convergence_semiangle_rad is None:
            raise ValueError("an electron probe needs the convergence semi-angle: import the data with "
                             "--convergence-semiangle MRAD (Python: convergence_semiangle_rad= of from_arrays, "
                             "or ElectronGeometry(convergence_semiangle_mrad=))")
        return electron_probe(n, dx, lam, geometry.convergence_semiangle_rad, power=power, **kwargs)
    return xray_probe(n, dx, lam, power=power, **kwargs)
