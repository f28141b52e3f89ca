"""Root attributes and ground truth of a data-set store: :func:`make_metadata` (format marker,
geometry, units, provenance) and :class:`Truth` (``truth/``: object, probe, positions)."""
from __future__ import annotations

import math

import numpy as np

from .importers.geometry import wavelength_from_energy
from .validate import (FORMAT_NAME, FORMAT_VERSION, GEOMETRY_KEYS, PHYSICS_KEYS, check_geometry,
                       check_positions, check_probe, fail)

DEFAULT_UNITS = {
    "intensities": "photon counts",
    "positions": "object pixels (y, x)",
    "wavelength_m": "m",
    "detector_distance_m": "m",
    "detector_pixel_size_m": "m",
    "object_pixel_size_m": "m",
}
#: units of the optional geometry keys, listed in ``units`` when the key is present
PHYSICS_UNITS = {"focus_to_sample_m": "m", "electron_voltage_v": "V", "reciprocal_pixel_rad": "rad",
                 "convergence_semiangle_rad": "rad"}
RESERVED_KEYS = ("daskpty", *GEOMETRY_KEYS, *PHYSICS_KEYS, "detector", "units", "provenance")


def jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None  # JSON has no NaN / Inf
    return obj

def make_metadata(*, pattern_size: int | None = None, wavelength_m=None, detector_distance_m=None,
                  detector_pixel_size_m=None, object_pixel_size_m=None, units=None,
                  provenance: str = "", extra: dict | None = None, electron_voltage_v=None,
                  reciprocal_pixel_rad=None, convergence_semiangle_rad=None, focus_to_sample_m=None,
                  detector: str | None = None, geometry=None) -> dict:
    """Root attributes of a data-set store.

    ``object_pixel_size_m``, when not given, is derived: far field, wavelength·distance /
    (n·detector pixel); electrons with ``reciprocal_pixel_rad`` (Δθ), λ / (n Δθ); near field
    (``detector="near_field"``), detector pixel / M with M = (z1 + z2) / z1, z1 =
    ``focus_to_sample_m`` (None: plane wave, M = 1), z2 = ``detector_distance_m``. The wavelength
    follows from ``electron_voltage_v`` (relativistic) when not given. ``geometry``: an
    ``XrayGeometry`` / ``ElectronGeometry`` / ``NearFieldGeometry`` of
    :mod:`daskpty.physics.geometry` (its ``metadata()``; explicit arguments win). ``extra`` adds
    further (JSON) keys that must not clash with the reserved ones.
    """
    meta = {"daskpty": {"format": FORMAT_NAME, "version": FORMAT_VERSION}}
    given = dict(wavelength_m=wavelength_m, detector_distance_m=detector_distance_m,
                 detector_pixel_size_m=detector_pixel_size_m, object_pixel_size_m=object_pixel_size_m,
                 electron_voltage_v=electron_voltage_v, reciprocal_pixel_rad=reciprocal_pixel_rad,
                 convergence_semiangle_rad=convergence_semiangle_rad, focus_to_sample_m=focus_to_sample_m,
                 detector=detector)
    if geometry is not None:
        given = {**geometry.metadata(), **{k: v for k, v in given.items() if v is not None}}
    check_geometry(given)
    for key in (*GEOMETRY_KEYS, *PHYSICS_KEYS):
        value = given.get(key)
        meta[key] = None if value is None else float(value)
    meta["detector"] = given.get("detector") or "far_field"
    _derive_geometry(meta, pattern_size)
    for key in (*PHYSICS_KEYS, "detector"):  # absent = not known (detector: far field)
        if meta[key] is None or (key == "detector" and given.get("detector") is None):
            del meta[key]
    meta["units"] = {**DEFAULT_UNITS, **{k: u for k, u in PHYSICS_UNITS.items() if k in meta}, **(units or {})}
    meta["provenance"] = str(provenance or "")
    for key, value in (extra or {}).items():
        if key in RESERVED_KEYS:
            raise ValueError(f"metadata key {key!r} is reserved; pass it as its own argument")
        meta[key] = value
    return jsonable(meta)


def _derive_geometry(meta: dict, pattern_size) -> None:
    """Fill in the wavelength (from an electron voltage) and the object pixel size (in place)."""
    volts = meta["electron_voltage_v"]
    if volts is not None:
        lam = wavelength_from_energy(volts, "electron")
        if meta["wavelength_m"] is None:
            meta["wavelength_m"] = lam
        elif not math.isclose(meta["wavelength_m"], lam, rel_tol=1e-3):
            fail(f"wavelength_m={meta['wavelength_m']:g} disagrees with the {volts:g} V electron "
                 f"wavelength {lam:.6g} m; give one of them")
    if meta["object_pixel_size_m"] is not None:
        return
    lam, z, p = meta["wavelength_m"], meta["detector_distance_m"], meta["detector_pixel_size_m"]
    if meta["detector"] == "near_field":
        if p is not None and z is not None:
            z1 = meta["focus_to_sample_m"]
            meta["object_pixel_size_m"] = p if z1 is None else p * z1 / (z1 + z)
    elif meta["reciprocal_pixel_rad"] is not None and lam is not None and pattern_size:
        meta["object_pixel_size_m"] = lam / (int(pattern_size) * meta["reciprocal_pixel_rad"])
    elif pattern_size and None not in (lam, z, p):
        meta["object_pixel_size_m"] = lam * z / (int(pattern_size) * p)


# --------------------------------------------------------------------------- ground truth

class Truth:
    """Ground truth of a simulated data set: ``.object``, ``.probe``, ``.positions`` (NumPy).

    Arrays come from memory or, lazily on first access, from a store's ``truth/`` group.
    A missing array reads as None.
    """

    NAMES = ("object", "probe", "positions")

    def __init__(self, *, object=None, probe=None, positions=None, group=None):
        self._cache = {k: v for k, v in (("object", object), ("probe", probe),
                                         ("positions", positions)) if v is not None}
        self._group = group

    def _get(self, name):
        if name not in self._cache and self._group is not None and name in self._group:
            self._cache[name] = self._group[name][...]
        return self._cache.get(name)

    object = property(lambda self: self._get("object"), doc="complex64 (H, W) object, or (K, H, W) slices")
    probe = property(lambda self: self._get("probe"), doc="complex64 (M, n, n) probe modes")
    positions = property(lambda self: self._get("positions"), doc="float64 (N, 2) true positions")

    def shapes(self) -> dict:
        """{name: (shape, dtype string)} of the available arrays, without loading them."""
        out = {}
        for name in self.NAMES:
            if name in self._cache:
                a = self._cache[name]
                out[name] = (tuple(a.shape), str(a.dtype))
            elif self._group is not None and name in self._group:
                a = self._group[name]
                out[name] = (tuple(a.shape), str(a.dtype))
        return out

    def __repr__(self):
        inner = ", ".join(f"{k}={s}{d}" for k, (s, d) in self.shapes().items())
        return f"Truth({inner})"


def check_truth(truth, pattern_shape) -> Truth | None:
    if truth is None:
        return None
    if isinstance(truth, Truth):
        arrays = {k: truth._get(k) for k in Truth.NAMES}
    elif isinstance(truth, dict):
        unknown = set(truth) - set(Truth.NAMES)
        if unknown:
            raise ValueError(f"unknown truth entries {sorted(unknown)}; expected {Truth.NAMES}")
        arrays = dict(truth)
    else:
        raise TypeError("truth must be a dict with 'object', 'probe', 'positions' or a Truth")
    obj = arrays.get("object")
    if obj is not None:
        obj = np.asarray(obj)
        if obj.ndim not in (2, 3) or obj.dtype.kind not in "fc":
            fail(f"truth object has shape {obj.shape} and dtype {obj.dtype}; expected a 2-D "
                 f"complex64 array (or (K, H, W) slices of a multislice object)")
        obj = obj.astype(np.complex64, copy=False)
    probe = check_probe(arrays.get("probe"), pattern_shape, what="truth probe")
    pos = arrays.get("positions")
    if pos is not None:
        pos = np.asarray(pos)
        pos = check_positions(pos, len(pos) if pos.ndim >= 1 else -1)
    return Truth(object=obj, probe=probe, positions=pos)



def check_truth_shapes(truth: Truth, pattern_shape, where) -> None:
    for name, (shape, dtype) in truth.shapes().items():
        ok = {"object": len(shape) in (2, 3) and dtype.startswith("complex"),
              "probe": len(shape) == 3 and shape[1:] == tuple(pattern_shape),
              "positions": len(shape) == 2 and shape[1] == 2}[name]
        if not ok:
            fail(f"{where}: truth/{name} has shape {shape} and dtype {dtype}, which does not fit "
                 f"the data set; re-create the store")



__all__ = ["DEFAULT_UNITS", "PHYSICS_UNITS", "RESERVED_KEYS", "Truth", "check_truth", "check_truth_shapes",
           "jsonable", "make_metadata"]
