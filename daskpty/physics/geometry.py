"""Physical geometry of a scan: wavelength, detector sampling and the object pixel size.

Three small frozen dataclasses, SI units throughout (metres, electron-volts, volts, radians unless a
field's name says otherwise), each validated in ``__post_init__`` (one clear ``ValueError`` per
mistake) and each turning into the store's metadata keys with :meth:`metadata`:

* :class:`XrayGeometry` — far field: photon energy or wavelength, detector distance z and pixel
  size p, pattern size n: object pixel size Δx = λz / (n p).
* :class:`ElectronGeometry` — far field (4D-STEM): accelerating voltage → relativistic wavelength,
  detector sampling as a reciprocal pixel size in mrad (Δθ: Δx = λ / (n Δθ)) or in Å⁻¹
  (Δk: Δx = 1 / (n Δk)), optional convergence semi-angle α of the condenser aperture.
* :class:`NearFieldGeometry` — near field with a divergent beam (Fresnel scaling): focus-to-sample
  z1, sample-to-detector z2: magnification M = (z1 + z2) / z1, effective (plane-wave) distance
  z_eff = z1 z2 / (z1 + z2), object pixel size p / M.

Nothing here imports dask or an array library beyond the standard ``math``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: CODATA 2018 exact / recommended values.
PLANCK_J_S = 6.62607015e-34
SPEED_OF_LIGHT_M_S = 299792458.0
ELEMENTARY_CHARGE_C = 1.602176634e-19
ELECTRON_MASS_KG = 9.1093837015e-31

#: Accelerating voltages accepted for electrons (SEM ptychography to high-voltage TEM), volts.
ELECTRON_VOLTAGE_RANGE_V = (1e3, 3e6)
#: Photon energies accepted for X-rays (soft to hard), eV.
XRAY_ENERGY_RANGE_EV = (10.0, 1e6)


def xray_wavelength_m(energy_ev: float) -> float:
    """Photon wavelength λ = h c / E for an energy in eV (12.398 keV ↔ 1 Å)."""
    return PLANCK_J_S * SPEED_OF_LIGHT_M_S / (float(energy_ev) * ELEMENTARY_CHARGE_C)


def xray_energy_ev(wavelength_m: float) -> float:
    """Photon energy in eV for a wavelength in metres (inverse of :func:`xray_wavelength_m`)."""
    return PLANCK_J_S * SPEED_OF_LIGHT_M_S / (float(wavelength_m) * ELEMENTARY_CHARGE_C)


def electron_wavelength_m(voltage_v: float) -> float:
    """Relativistic de Broglie wavelength λ = h / √(2 m e V (1 + e V / (2 m c²))) for volts V.

    300 kV → 1.9687 pm, 200 kV → 2.5079 pm, 80 kV → 4.1757 pm.
    """
    ev = ELEMENTARY_CHARGE_C * float(voltage_v)
    mc2 = ELECTRON_MASS_KG * SPEED_OF_LIGHT_M_S**2
    return PLANCK_J_S / math.sqrt(2.0 * ELECTRON_MASS_KG * ev * (1.0 + ev / (2.0 * mc2)))


def _positive(name: str, value, unit: str = "") -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number{unit and ' (' + unit + ')'}, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be positive and finite{unit and ' (' + unit + ')'}, got {value!r}")
    return v


def _pattern_size(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"pattern_size must be an integer >= 2 (pixels per side), got {value!r}")
    return value


def _wavelength(energy_ev, wavelength_m, what: str = "energy_ev") -> float:
    """The wavelength from exactly one of an energy and a wavelength (both: they must agree)."""
    if energy_ev is None and wavelength_m is None:
        raise ValueError(f"give the photon {what} or wavelength_m")
    if energy_ev is not None:
        e = _positive("energy_ev", energy_ev, "eV")
        lo, hi = XRAY_ENERGY_RANGE_EV
        if not lo <= e <= hi:
            raise ValueError(f"photon energy {e:g} eV is outside {lo:g} eV ... {hi:g} eV "
                             "(give electron-volts: 8 keV is 8000)")
        lam = xray_wavelength_m(e)
        if wavelength_m is not None and not math.isclose(_positive("wavelength_m", wavelength_m, "m"), lam,
                                                         rel_tol=1e-3):
            raise ValueError(f"energy_ev={e:g} (λ = {lam:.6g} m) and wavelength_m={wavelength_m:g} disagree; "
                             "give one of them")
        return lam
    return _positive("wavelength_m", wavelength_m, "m")


def _check_probe_fits(probe_diameter_m, window_m: float) -> None:
    """The probe must fit the reconstruction window n Δx, i.e. the diffraction pattern's finest
    fringes (λz / D) must span at least one detector pixel (linear oversampling ≥ 1)."""
    if probe_diameter_m is None:
        return
    d = _positive("probe_diameter_m", probe_diameter_m, "m")
    if d > window_m:
        raise ValueError(
            f"under-sampled probe: a probe {d:.4g} m across does not fit the {window_m:.4g} m window "
            f"(n × object pixel size); oversampling {window_m / d:.2f} < 1. Use a larger pattern "
            "(more detector pixels), a longer detector distance or a smaller probe")


@dataclass(frozen=True)
class XrayGeometry:
    """Far-field X-ray geometry; give ``energy_ev`` or ``wavelength_m`` (the other is derived).

    ``probe_diameter_m`` (optional) is checked against the window n Δx (under-sampling error).
    """

    pattern_size: int
    detector_distance_m: float
    detector_pixel_size_m: float
    energy_ev: float | None = None
    wavelength_m: float | None = None
    probe_diameter_m: float | None = None

    def __post_init__(self):
        _pattern_size(self.pattern_size)
        lam = _wavelength(self.energy_ev, self.wavelength_m)
        object.__setattr__(self, "wavelength_m", lam)
        object.__setattr__(self, "energy_ev", xray_energy_ev(lam))
        _positive("detector_distance_m", self.detector_distance_m, "m")
        _positive("detector_pixel_size_m", self.detector_pixel_size_m, "m")
        _check_probe_fits(self.probe_diameter_m, self.window_m)

    @property
    def object_pixel_size_m(self) -> float:
        """Δx = λ z / (n p)."""
        return self.wavelength_m * self.detector_distance_m / (self.pattern_size * self.detector_pixel_size_m)

    @property
    def window_m(self) -> float:
        """Width of the reconstruction window n Δx = λ z / p."""
        return self.pattern_size * self.object_pixel_size_m

    def metadata(self) -> dict:
        """The data-set store's geometry keys (``io.store.make_metadata``'s arguments)."""
        return {"wavelength_m": self.wavelength_m, "detector_distance_m": self.detector_distance_m,
                "detector_pixel_size_m": self.detector_pixel_size_m,
                "object_pixel_size_m": self.object_pixel_size_m}


@dataclass(frozen=True)
class ElectronGeometry:
    """Far-field electron (4D-STEM) geometry.

    ``voltage_v``: accelerating voltage in volts (300 kV is ``300e3``). Detector sampling: exactly
    one of ``reciprocal_pixel_mrad`` (Δθ, scattering angle per detector pixel) and
    ``reciprocal_pixel_inv_angstrom`` (Δk = Δθ / λ per pixel). ``convergence_semiangle_mrad``
    (optional): the condenser aperture's semi-angle α; the bright-field disc (radius α) must fit
    the detector (α ≤ n Δθ / 2), else the probe is under-sampled by the object pixel size.
    ``probe_diameter_m`` (optional, e.g. a defocused probe ≈ 2 |Δf| α) must fit the window n Δx.
    """

    voltage_v: float
    pattern_size: int
    reciprocal_pixel_mrad: float | None = None
    reciprocal_pixel_inv_angstrom: float | None = None
    convergence_semiangle_mrad: float | None = None
    probe_diameter_m: float | None = None

    def __post_init__(self):
        v = _positive("voltage_v", self.voltage_v, "V")
        lo, hi = ELECTRON_VOLTAGE_RANGE_V
        if not lo <= v <= hi:
            hint = f" (give volts: {v:g} kV is {v * 1e3:g})" if v < lo else ""
            raise ValueError(f"accelerating voltage {v:g} V is outside {lo:g} V ... {hi:g} V{hint}")
        _pattern_size(self.pattern_size)
        if (self.reciprocal_pixel_mrad is None) == (self.reciprocal_pixel_inv_angstrom is None):
            raise ValueError("give exactly one of reciprocal_pixel_mrad and reciprocal_pixel_inv_angstrom")
        if self.reciprocal_pixel_mrad is not None:
            _positive("reciprocal_pixel_mrad", self.reciprocal_pixel_mrad, "mrad")
        else:
            _positive("reciprocal_pixel_inv_angstrom", self.reciprocal_pixel_inv_angstrom, "1/Å")
        if self.convergence_semiangle_mrad is not None:
            a = _positive("convergence_semiangle_mrad", self.convergence_semiangle_mrad, "mrad")
            edge = 0.5 * self.pattern_size * self.angle_per_pixel_rad * 1e3
            if a > edge:
                raise ValueError(
                    f"under-sampled probe: the convergence semi-angle {a:g} mrad exceeds the detector's "
                    f"half-width {edge:.4g} mrad (n × reciprocal pixel / 2), so the object pixel size "
                    f"{self.object_pixel_size_m:.4g} m cannot resolve the probe; use a finer object "
                    "pixel (more detector pixels or a larger reciprocal pixel size)")
        _check_probe_fits(self.probe_diameter_m, self.pattern_size * self.object_pixel_size_m)

    @property
    def wavelength_m(self) -> float:
        return electron_wavelength_m(self.voltage_v)

    @property
    def angle_per_pixel_rad(self) -> float:
        """Δθ in radians (from mrad, or Δk λ)."""
        if self.reciprocal_pixel_mrad is not None:
            return self.reciprocal_pixel_mrad * 1e-3
        return self.reciprocal_pixel_inv_angstrom * 1e10 * self.wavelength_m

    @property
    def object_pixel_size_m(self) -> float:
        """Δx = λ / (n Δθ) = 1 / (n Δk)."""
        return self.wavelength_m / (self.pattern_size * self.angle_per_pixel_rad)

    @property
    def convergence_semiangle_rad(self) -> float | None:
        a = self.convergence_semiangle_mrad
        return None if a is None else a * 1e-3

    def metadata(self) -> dict:
        return {"wavelength_m": self.wavelength_m, "object_pixel_size_m": self.object_pixel_size_m,
                "electron_voltage_v": float(self.voltage_v),
                "reciprocal_pixel_rad": self.angle_per_pixel_rad,
                "convergence_semiangle_rad": self.convergence_semiangle_rad}


def fresnel_scaling(focus_to_sample_m: float | None, sample_to_detector_m: float) -> tuple[float, float]:
    """(effective distance z1 z2 / (z1 + z2), magnification (z1 + z2) / z1) of a point-source beam.

    ``focus_to_sample_m=None`` (or inf) is a plane wave: (z2, 1).
    """
    z2 = _positive("sample_to_detector_m", sample_to_detector_m, "m")
    if focus_to_sample_m is None or math.isinf(focus_to_sample_m):
        return z2, 1.0
    z1 = _positive("focus_to_sample_m", focus_to_sample_m, "m")
    return z1 * z2 / (z1 + z2), (z1 + z2) / z1


@dataclass(frozen=True)
class NearFieldGeometry:
    """Near-field X-ray geometry of a divergent beam (Fresnel scaling theorem).

    The hologram of a sample z1 downstream of a point focus, recorded z2 further on with pixels p,
    equals (up to a curvature phase and 1/M² in intensity) the plane-wave hologram over z_eff of the
    sample sampled at p / M. ``focus_to_sample_m=None``: plane-wave illumination (M = 1, z_eff = z2).
    """

    pattern_size: int
    sample_to_detector_m: float
    detector_pixel_size_m: float
    focus_to_sample_m: float | None = None
    energy_ev: float | None = None
    wavelength_m: float | None = None

    def __post_init__(self):
        _pattern_size(self.pattern_size)
        lam = _wavelength(self.energy_ev, self.wavelength_m)
        object.__setattr__(self, "wavelength_m", lam)
        object.__setattr__(self, "energy_ev", xray_energy_ev(lam))
        _positive("detector_pixel_size_m", self.detector_pixel_size_m, "m")
        fresnel_scaling(self.focus_to_sample_m, self.sample_to_detector_m)

    @property
    def magnification(self) -> float:
        return fresnel_scaling(self.focus_to_sample_m, self.sample_to_detector_m)[1]

    @property
    def effective_distance_m(self) -> float:
        return fresnel_scaling(self.focus_to_sample_m, self.sample_to_detector_m)[0]

    @property
    def object_pixel_size_m(self) -> float:
        return self.detector_pixel_size_m / self.magnification

    @property
    def fresnel_number(self) -> float:
        """Pixel Fresnel number Δx² / (λ z_eff) (≪ 1: holographic regime)."""
        return self.object_pixel_size_m**2 / (self.wavelength_m * self.effective_distance_m)

    def metadata(self) -> dict:
        return {"wavelength_m": self.wavelength_m, "detector_distance_m": self.sample_to_detector_m,
                "detector_pixel_size_m": self.detector_pixel_size_m,
                "object_pixel_size_m": self.object_pixel_size_m,
                "focus_to_sample_m": self.focus_to_sample_m, "detector": "near_field"}
