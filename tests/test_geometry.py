"""Physical geometry (X-ray, electron, near field), slice geometry and physics-based probes."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.physics.geometry import (
    ElectronGeometry,
    NearFieldGeometry,
    XrayGeometry,
    electron_wavelength_m,
    fresnel_scaling,
    xray_energy_ev,
    xray_wavelength_m,
)
from daskpty.physics.multislice import SliceGeometry
from daskpty.physics.probes import aberration_phase, electron_probe, probe_from_geometry, xray_probe
from daskpty.physics.propagation import angular_spectrum, angular_spectrum_kernel


# ------------------------------------------------------------------------------------ wavelengths

@pytest.mark.parametrize("kv,pm", [(300, 1.9687), (200, 2.5079), (100, 3.7014), (80, 4.1757)])
def test_electron_wavelength_matches_tabulated_values(kv, pm):
    assert electron_wavelength_m(kv * 1e3) * 1e12 == pytest.approx(pm, abs=1e-4)


def test_xray_energy_and_wavelength_are_inverse_and_match_12_398_kev_angstrom():
    assert xray_wavelength_m(12398.42) == pytest.approx(1e-10, rel=1e-5)
    assert xray_energy_ev(xray_wavelength_m(8000.0)) == pytest.approx(8000.0, rel=1e-12)


# ------------------------------------------------------------------------------------ pixel sizes

def test_xray_object_pixel_size_is_lambda_z_over_n_p():
    g = XrayGeometry(pattern_size=256, detector_distance_m=5.0, detector_pixel_size_m=75e-6, energy_ev=8000.0)
    lam = xray_wavelength_m(8000.0)
    assert g.wavelength_m == pytest.approx(lam)
    assert g.object_pixel_size_m == pytest.approx(lam * 5.0 / (256 * 75e-6))
    assert g.metadata()["object_pixel_size_m"] == pytest.approx(g.object_pixel_size_m)
    g2 = XrayGeometry(256, 5.0, 75e-6, wavelength_m=lam)
    assert g2.energy_ev == pytest.approx(8000.0)


def test_electron_pixel_size_from_mrad_and_inverse_angstrom_agree():
    lam = electron_wavelength_m(300e3)
    a = ElectronGeometry(300e3, 128, reciprocal_pixel_mrad=0.5, convergence_semiangle_mrad=20)
    # Δk = Δθ/λ in 1/Å
    b = ElectronGeometry(300e3, 128, reciprocal_pixel_inv_angstrom=0.5e-3 / (lam * 1e10))
    assert a.object_pixel_size_m == pytest.approx(lam / (128 * 0.5e-3))
    assert b.object_pixel_size_m == pytest.approx(a.object_pixel_size_m, rel=1e-12)
    assert a.convergence_semiangle_rad == pytest.approx(0.02)
    # 1/(n Δk): 0.01 1/Å per pixel, 100 pixels -> 1 Å
    assert ElectronGeometry(200e3, 100, reciprocal_pixel_inv_angstrom=0.01).object_pixel_size_m == pytest.approx(1e-10)


def test_near_field_fresnel_scaling():
    z_eff, m = fresnel_scaling(3.65e-3, 1.12)
    assert m == pytest.approx(1123.65 / 3.65)
    assert z_eff == pytest.approx(3.65e-3 * 1.12 / 1123.65e-3)
    assert fresnel_scaling(None, 1.12) == (1.12, 1.0)
    g = NearFieldGeometry(100, 1.12, 55e-6, 3.65e-3, wavelength_m=0.9795e-10)
    assert g.object_pixel_size_m == pytest.approx(55e-6 / m)
    assert g.fresnel_number == pytest.approx(g.object_pixel_size_m**2 / (0.9795e-10 * z_eff))


# ------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(voltage_v=300, pattern_size=64, reciprocal_pixel_mrad=1.0), "300 kV is 300000"),
    (dict(voltage_v=5e7, pattern_size=64, reciprocal_pixel_mrad=1.0), "outside"),
    (dict(voltage_v=-1.0, pattern_size=64, reciprocal_pixel_mrad=1.0), "voltage_v must be positive"),
    (dict(voltage_v=300e3, pattern_size=64), "exactly one of"),
    (dict(voltage_v=300e3, pattern_size=64, reciprocal_pixel_mrad=1.0, reciprocal_pixel_inv_angstrom=0.1),
     "exactly one of"),
    (dict(voltage_v=300e3, pattern_size=64, reciprocal_pixel_mrad=0.0), "reciprocal_pixel_mrad must be positive"),
    (dict(voltage_v=300e3, pattern_size=64, reciprocal_pixel_mrad=0.5, convergence_semiangle_mrad=20),
     "under-sampled probe"),
    (dict(voltage_v=300e3, pattern_size=1, reciprocal_pixel_mrad=0.5), "pattern_size"),
])
def test_electron_geometry_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ElectronGeometry(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(detector_distance_m=0.0, detector_pixel_size_m=75e-6, energy_ev=8e3), "detector_distance_m must be positive"),
    (dict(detector_distance_m=5.0, detector_pixel_size_m=-75e-6, energy_ev=8e3), "detector_pixel_size_m must be positive"),
    (dict(detector_distance_m=5.0, detector_pixel_size_m=75e-6), "energy_ev or wavelength_m"),
    (dict(detector_distance_m=5.0, detector_pixel_size_m=75e-6, energy_ev=8.0), "give electron-volts"),
    (dict(detector_distance_m=5.0, detector_pixel_size_m=75e-6, energy_ev=8e3, wavelength_m=1e-10), "disagree"),
    (dict(detector_distance_m=5.0, detector_pixel_size_m=75e-6, energy_ev=8e3, probe_diameter_m=20e-6),
     "under-sampled probe"),
])
def test_xray_geometry_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        XrayGeometry(pattern_size=128, **kwargs)


def test_xray_probe_that_fits_passes_the_sampling_check():
    g = XrayGeometry(128, 5.0, 75e-6, energy_ev=8e3)  # window λz/p ≈ 10.3 µm
    XrayGeometry(128, 5.0, 75e-6, energy_ev=8e3, probe_diameter_m=0.5 * g.window_m)


def test_near_field_geometry_errors():
    with pytest.raises(ValueError, match="focus_to_sample_m must be positive"):
        NearFieldGeometry(100, 1.12, 55e-6, -1e-3, energy_ev=12.66e3)
    with pytest.raises(ValueError, match="sample_to_detector_m must be positive"):
        NearFieldGeometry(100, 0.0, 55e-6, 3e-3, energy_ev=12.66e3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_slices=2, spacing_m=1e-9, pixel_size_m=1e-10), "needs the wavelength"),
    (dict(n_slices=2, spacing_m=1e-9, wavelength_m=2e-12), "needs the object pixel size"),
    (dict(n_slices=2, wavelength_m=2e-12, pixel_size_m=1e-10), "slice spacing"),
    (dict(n_slices=2, spacing_m=0.0, wavelength_m=2e-12, pixel_size_m=1e-10), "slice spacing must be positive"),
    (dict(n_slices=3, spacing_m=-1e-9, wavelength_m=2e-12, pixel_size_m=1e-10), "slice spacing must be positive"),
    (dict(n_slices=0), "slices must be an integer"),
])
def test_slice_geometry_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SliceGeometry(**kwargs)


def test_single_slice_needs_no_geometry():
    assert SliceGeometry(1).kernel(32) is None


# ------------------------------------------------------------------------------------ probes

LAM_E = electron_wavelength_m(300e3)
DX_E = 0.25e-10


def _power(p):
    return float((np.abs(p.astype(np.complex128)) ** 2).sum())


def _centroid(p):
    w = np.abs(p[0]) ** 2
    i = np.arange(w.shape[0])
    return (w.sum(1) @ i / w.sum(), w.sum(0) @ i / w.sum())


def test_electron_probe_power_centre_and_aperture():
    n = 64
    alpha = 20e-3
    p = electron_probe(n, DX_E, LAM_E, alpha, defocus_m=3e-9, power=1234.0)
    assert p.shape == (1, n, n) and p.dtype == np.complex64
    assert _power(p) == pytest.approx(1234.0, rel=1e-5)
    assert _centroid(p) == pytest.approx((n / 2, n / 2), abs=0.05)
    spectrum = np.abs(np.fft.fft2(np.fft.ifftshift(p[0]))) ** 2
    u = np.fft.fftfreq(n, d=DX_E)
    r = np.hypot(u[:, None], u[None, :])
    edge = alpha / LAM_E
    assert spectrum[r > edge + 1.5 / (n * DX_E)].sum() < 1e-8 * spectrum.sum()
    assert spectrum[r < edge - 1.5 / (n * DX_E)].min() > 0.5 * spectrum.max()


def test_positive_defocus_is_propagation_past_the_focus_and_diverges():
    """defocus_m > 0: the focused probe propagated +defocus (paraxially, as χ is) and a phase that
    grows outward from the axis (a diverging wave exp(+iπr²/λz))."""
    n, alpha, dz = 64, 20e-3, 8e-9
    focus = electron_probe(n, DX_E, LAM_E, alpha)
    defocused = electron_probe(n, DX_E, LAM_E, alpha, defocus_m=dz)
    propagated = angular_spectrum(focus.astype(np.complex128), angular_spectrum_kernel(
        n, DX_E, LAM_E, dz, band_limit=False, dtype=np.complex128))
    err = np.linalg.norm(propagated - defocused) / np.linalg.norm(defocused)
    assert err < 2e-3  # exact (non-paraxial) propagator vs paraxial χ at 20 mrad
    row = defocused[0, n // 2, n // 2:n // 2 + 8]
    assert np.angle(np.conj(row[:-1]) * row[1:]).mean() > 0.05
    converging = electron_probe(n, DX_E, LAM_E, alpha, defocus_m=-dz)[0, n // 2, n // 2:n // 2 + 8]
    assert np.angle(np.conj(converging[:-1]) * converging[1:]).mean() < -0.05


def test_aberration_phase_terms():
    n = 32
    u = np.fft.fftfreq(n, d=DX_E)
    theta2 = LAM_E**2 * (u[:, None] ** 2 + u[None, :] ** 2)
    c3 = aberration_phase(n, DX_E, LAM_E, c3_m=1e-3)
    np.testing.assert_allclose(c3, 2 * np.pi / LAM_E * 0.25 * 1e-3 * theta2**2)
    a1 = aberration_phase(n, DX_E, LAM_E, astigmatism_m=5e-9, astigmatism_angle_rad=0.0)
    # along +x (axis 1) astigmatism adds +A1 of defocus, along y it removes it
    c1 = aberration_phase(n, DX_E, LAM_E, defocus_m=5e-9)
    np.testing.assert_allclose(a1[0, :], c1[0, :], rtol=1e-12)
    np.testing.assert_allclose(a1[:, 0], -c1[:, 0], rtol=1e-12)


def test_xray_zone_plate_defocus_equals_propagation_and_pinhole():
    n, dx, lam = 64, 20e-9, xray_wavelength_m(8e3)
    kw = dict(diameter_m=150e-6, focal_length_m=0.1, central_stop=0.3)  # α = 0.75 mrad
    focus = xray_probe(n, dx, lam, **kw)
    defocused = xray_probe(n, dx, lam, defocus_m=0.5e-3, power=10.0, **kw)
    assert _power(defocused) == pytest.approx(10.0, rel=1e-5)
    propagated = angular_spectrum(focus.astype(np.complex128), angular_spectrum_kernel(
        n, dx, lam, 0.5e-3, band_limit=False, dtype=np.complex128))
    propagated *= np.sqrt(10.0 / _power(propagated))
    assert np.linalg.norm(propagated - defocused) / np.linalg.norm(defocused) < 1e-5
    pinhole = xray_probe(n, dx, lam, diameter_m=0.4e-6, defocus_m=0.0)
    assert np.abs(pinhole[0, 0, 0]) < 1e-6 * np.abs(pinhole[0, n // 2, n // 2])  # a 20-pixel disc
    assert _centroid(pinhole) == pytest.approx((n / 2, n / 2), abs=0.05)


@pytest.mark.parametrize("call,match", [
    (lambda: electron_probe(32, DX_E, LAM_E, 50e-3), "under-sampled probe"),            # α/λ > Nyquist
    (lambda: electron_probe(32, DX_E, LAM_E, 20e-3, defocus_m=50e-9), "does not fit"),  # 2 Δf α ≫ window
    (lambda: electron_probe(32, DX_E, LAM_E, 0.0), "convergence_semiangle_rad must be positive"),
    (lambda: xray_probe(32, 20e-9, 1.5e-10, diameter_m=150e-6, focal_length_m=0.1, defocus_m=1e-2), "does not fit"),
    (lambda: xray_probe(32, 20e-9, 1.5e-10, diameter_m=150e-6, focal_length_m=0.1, central_stop=1.2), "central_stop"),
    (lambda: xray_probe(32, 20e-9, 1.5e-10, diameter_m=0.0), "diameter_m must be positive"),
])
def test_probe_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_probe_from_geometry_uses_the_geometry_sampling():
    g = ElectronGeometry(300e3, 48, reciprocal_pixel_mrad=1.2, convergence_semiangle_mrad=18)
    p = probe_from_geometry(g, power=5.0, defocus_m=2e-9)
    ref = electron_probe(48, g.object_pixel_size_m, g.wavelength_m, 18e-3, defocus_m=2e-9, power=5.0)
    np.testing.assert_array_equal(p, ref)
    with pytest.raises(ValueError, match="convergence_semiangle_mrad"):
        probe_from_geometry(ElectronGeometry(300e3, 48, reciprocal_pixel_mrad=1.2))
