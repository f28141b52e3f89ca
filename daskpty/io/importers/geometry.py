"""Experiment geometry for importers: units, photon/electron wavelength, positions to pixels."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..units import LENGTH_UNITS, length_unit
from ..validate import ELECTRON_VOLTAGE_RANGE_V, check_position_scale, fail

#: Planck constant (J s), speed of light (m/s), electron rest mass (kg), elementary charge (C)
H_J_S = 6.62607015e-34
C_M_S = 299792458.0
M_E_KG = 9.1093837015e-31
E_C = 1.602176634e-19

RADIATIONS = ("xray", "electron")


def unit_scale(units: str | None, what: str = "positions") -> float | None:
    """Metres per ``units`` (None for object pixels); DataError for unknown or missing units."""
    if units is None or str(units).strip() == "":
        fail(f"the units of the {what} are unknown (the file does not say); pass --units "
             f"m|mm|um|nm|A|px (Python: units=...)")
    key = length_unit(str(units))
    if key is None:
        fail(f"unknown units {units!r} for the {what}; use one of m, mm, um, nm, A, px")
    return LENGTH_UNITS[key]


def attr_units(dataset) -> str | None:
    """The ``units`` attribute of an HDF5 dataset as text, or None."""
    value = dataset.attrs.get("units") if hasattr(dataset, "attrs") else None
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        value = value.ravel()[0]
        value = value.decode() if isinstance(value, bytes) else str(value)
    return str(value)


def wavelength_from_energy(energy_ev: float, radiation: str = "xray") -> float:
    """Wavelength (m) of a photon or (relativistic) electron of kinetic energy ``energy_ev``."""
    if radiation not in RADIATIONS:
        fail(f"radiation must be one of {RADIATIONS}, got {radiation!r}")
    if not (isinstance(energy_ev, (int, float)) and math.isfinite(energy_ev) and energy_ev > 0):
        fail(f"the beam energy must be a positive number of eV, got {energy_ev!r}")
    joules = energy_ev * E_C
    if radiation == "xray":
        return H_J_S * C_M_S / joules
    return H_J_S / math.sqrt(2 * M_E_KG * joules * (1 + joules / (2 * M_E_KG * C_M_S ** 2)))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Beam and detector geometry in SI units; any field may be None (unknown).

    ``energy_ev`` is converted with ``radiation`` when no ``wavelength_m`` is given; the
    detector pixel size is the raw (unbinned) one; ``object_pixel_size_m`` overrides the value
    derived as wavelength·distance / (n·binned pixel). ``near_field`` (implied by
    ``focus_to_sample_m``, the divergent beam's focus-to-sample distance z1): a near-field
    (holographic) scan, ``distance_m`` the sample-to-detector distance z2; the object pixel size
    is then the binned pixel / M, M = (z1 + z2) / z1 (Fresnel scaling; M = 1 without z1).
    Electrons: ``convergence_semiangle_mrad`` (the condenser aperture's semi-angle α, stored in
    radians as ``convergence_semiangle_rad``) and ``defocus_m`` (the probe's defocus, any sign)
    describe the probe that ``reconstruct(probe="aperture")`` and the store's start probe follow.
    """

    wavelength_m: float | None = None
    energy_ev: float | None = None
    distance_m: float | None = None
    pixel_size_m: float | None = None
    object_pixel_size_m: float | None = None
    radiation: str = "xray"
    focus_to_sample_m: float | None = None
    near_field: bool = False
    convergence_semiangle_mrad: float | None = None
    defocus_m: float | None = None

    def __post_init__(self):
        if self.radiation not in RADIATIONS:
            fail(f"radiation must be one of {RADIATIONS}, got {self.radiation!r}")
        if self.radiation == "xray" and (self.convergence_semiangle_mrad, self.defocus_m) != (None, None):
            fail("--convergence-semiangle and --defocus describe an electron probe; import with "
                 "--radiation electron (Python: Geometry(radiation='electron'))")
        if self.defocus_m is not None and not (isinstance(self.defocus_m, (int, float, np.floating, np.integer))
                                               and math.isfinite(float(self.defocus_m))):
            fail(f"the defocus must be a finite number of metres, got {self.defocus_m!r}")
        if self.focus_to_sample_m is not None:
            object.__setattr__(self, "near_field", True)
        for name in ("wavelength_m", "energy_ev", "distance_m", "pixel_size_m",
                     "object_pixel_size_m", "focus_to_sample_m", "convergence_semiangle_mrad"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float, np.floating, np.integer))
                                      and math.isfinite(float(v)) and float(v) > 0):
                fail(f"geometry {name} must be a positive number, got {v!r}")
        lo, hi = ELECTRON_VOLTAGE_RANGE_V
        if self.radiation == "electron" and self.energy_ev is not None and not lo <= self.energy_ev <= hi:
            hint = f" (give eV: {self.energy_ev:g} keV is {self.energy_ev * 1e3:g})" if self.energy_ev < lo else ""
            fail(f"electron energy {self.energy_ev:g} eV is outside {lo:g} ... {hi:g} eV{hint}")

    def over(self, base: "Geometry") -> "Geometry":
        """These values where given, else ``base``'s (flags override the file)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("radiation", "near_field") and getattr(self, f.name) is not None}
        if "wavelength_m" not in given and "energy_ev" in given:
            given["wavelength_m"] = None  # an energy flag beats a wavelength read from the file
        return dataclasses.replace(base, **given, radiation=self.radiation,
                                   near_field=self.near_field or base.near_field)

    @property
    def wavelength(self) -> float | None:
        if self.wavelength_m is not None:
            return float(self.wavelength_m)
        if self.energy_ev is not None:
            return wavelength_from_energy(float(self.energy_ev), self.radiation)
        return None


def positions_to_pixels(raw, *, units: str | None, object_pixel_size_m: float | None,
                        motion: str = "probe", columns: str = "yx", pattern_size: int,
                        basis=None) -> np.ndarray:
    """Scan positions as recorded → (N, 2) float64 (y, x) object pixels, smallest at n/2.

    raw: (N, 2) in ``columns`` order, or (N, 3) CXI translations (x, y, z). ``motion="sample"``
    means the values say where the sample moved (the probe moved the opposite way over it).
    ``basis``: optional (2, 2) unit vectors of the detector's row and column axes in the lab
    (x, y) plane; positions are projected onto them so the object frame matches the patterns.
    A scale that says the units are wrong (a scan far below one ``pattern_size`` probe width,
    steps of many widths) is refused: :func:`~daskpty.io.validate.check_position_scale`.
    """
    pos = np.asarray(raw, dtype=np.float64)
    if pos.ndim != 2 or pos.shape[1] not in (2, 3):
        fail(f"positions have shape {pos.shape}; expected (N, 2) or CXI (N, 3) translations")
    if motion not in ("probe", "sample"):
        fail(f"motion must be 'probe' or 'sample', got {motion!r}")
    if pos.shape[1] == 3:
        xy = pos[:, :2]
    elif columns == "yx":
        xy = pos[:, ::-1]
    elif columns == "xy":
        xy = pos
    else:
        fail(f"columns must be 'yx' or 'xy', got {columns!r}")
    if not np.isfinite(xy).all():
        bad = int(np.flatnonzero(~np.isfinite(xy).all(axis=1))[0])
        fail(f"position {bad} is NaN or infinite; fix or drop that pattern")
    if motion == "sample":
        xy = -xy
    scale = unit_scale(units)
    if scale is not None:
        if object_pixel_size_m is None:
            fail(f"positions are in {units} but the object pixel size is unknown: give the "
                 f"wavelength (--energy or --wavelength), --distance and --pixel-size, or "
                 f"--object-pixel-size, or positions in px")
        xy = xy * (scale / float(object_pixel_size_m))
    if basis is not None:
        b = np.asarray(basis, dtype=np.float64)
        yx = xy @ b.T  # row axis, column axis components
    else:
        yx = xy[:, ::-1]
    check_position_scale(yx, pattern_size, units=units, pixel_m=None if scale is None else
                         float(object_pixel_size_m))
    return yx - yx.min(axis=0) + pattern_size / 2.0


def raster_positions(rows: int, cols: int, step: float) -> np.ndarray:
    """(rows·cols, 2) (y, x) raster in row-major frame order, ``step`` apart."""
    iy, ix = np.divmod(np.arange(rows * cols), cols)
    return np.stack([iy, ix], axis=1).astype(np.float64) * float(step)
