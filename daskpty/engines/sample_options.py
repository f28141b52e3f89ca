"""Thick samples and detector geometry for :func:`daskpty.reconstruct`: :class:`SampleOptions`.

One small frozen dataclass groups the options of the sample model — the number of slices K, their
spacing Δz, the detector operator — validated in ``__post_init__`` (one ``ValueError`` line per
mistake). :meth:`SampleOptions.resolve` combines them with the data set's metadata (wavelength,
object pixel size, ``detector`` = ``far_field`` | ``near_field``, ``focus_to_sample_m``,
``detector_distance_m``, ``detector_pixel_size_m``; docs/data-format.md) into a
:class:`ResolvedSample`: the slice-to-slice kernel ``SliceGeometry(K, Δz, λ, Δx).kernel(n)`` and
the near-field detector kernel, or None for the far field.

K = 1 in the far field needs nothing from the metadata and keeps the single-slice engines' code
path (``ResolvedSample.multislice`` is False); K > 1 or the near field use the multislice parts
(:mod:`daskpty.engines.sample_model`). :func:`aperture_probe` is the probe the geometry implies
(``probe="aperture"``); the start probe that reads the data is chosen in :mod:`daskpty.api`.

An option group of :func:`daskpty.reconstruct` (:mod:`daskpty.options`), beside the other parts'
options (``position_options``, ``probe_model``); plain NumPy and physics, no dask.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from ..physics.multislice import SliceGeometry
from ..physics.probes import probe_from_geometry
from ..physics.propagation import near_field_kernel
from .initial import probe_diameter_from_scan

DETECTORS = ("far_field", "near_field")
#: most object slices taken: an epoch's cost grows faster than K (25 patterns of 32²: 100
#: slices 0.8 s, 200 slices 4.3 s, 400 slices 35 s per epoch on one CPU core), and thick
#: samples are cut into tens of slices, not thousands
MAX_SLICES = 256
#: least Fresnel phase, radians, that the propagation over one slice spacing gives the highest
#: spatial frequency of the object grid (π λ Δz / (4 Δx²)): below it neighbouring slices are
#: indistinguishable in the data (e.g. 10 nm spacings at a 129 nm X-ray pixel: 7e-5 rad) and the
#: spacing is most likely in the wrong unit
MIN_SLICE_PHASE = 1e-3


def _positive_or_none(name: str, value, unit: str = "m"):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name} must be a positive number of {unit}, got {value!r}")


@dataclass(frozen=True)
class SampleOptions:
    """Sample model and detector geometry of a reconstruction.

    slices: K object slices (1: a thin sample). slice_spacing_m: Δz between neighbouring slices
        (required for K > 1, > 0).
    detector: None (the data's ``detector`` metadata; absent = far field), ``"far_field"`` or
        ``"near_field"``.
    wavelength_m, object_pixel_size_m: override the data's metadata (None: take them from it).
    aperture: keyword arguments of :func:`daskpty.physics.probes.probe_from_geometry` for
        ``probe="aperture"`` (X-ray: ``diameter_m`` (default: from the scan's step),
        ``focal_length_m``, ``defocus_m``, ``central_stop``; electrons: ``defocus_m``, ``c3_m``,
        ``astigmatism_m``, ``astigmatism_angle_rad``; ``convergence_semiangle_rad`` overrides the
        metadata's).
    """

    slices: int = 1
    slice_spacing_m: float | None = None
    detector: str | None = None
    wavelength_m: float | None = None
    object_pixel_size_m: float | None = None
    aperture: dict = field(default_factory=dict)

    def __post_init__(self):
        k = self.slices
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"slices must be an integer >= 1, got {k!r}")
        if k > MAX_SLICES:
            raise ValueError(f"slices={k} (CLI: --slices) is more than the {MAX_SLICES} daskpty takes: an "
                             f"epoch's cost grows faster than the number of slices; cut the sample into "
                             f"fewer, thicker slices")
        if self.slice_spacing_m is not None:
            v = self.slice_spacing_m
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(float(v)) or float(v) <= 0:
                raise ValueError(f"the slice spacing must be positive and finite (metres), got {v!r}")
        if k > 1 and self.slice_spacing_m is None:
            raise ValueError(f"multislice (slices={k}) needs the slice spacing: give slice_spacing_m "
                             "(CLI: --slice-spacing METRES)")
        if self.detector is not None and self.detector not in DETECTORS:
            raise ValueError(f"detector must be one of {DETECTORS} or None, got {self.detector!r}")
        _positive_or_none("wavelength_m", self.wavelength_m)
        _positive_or_none("object_pixel_size_m", self.object_pixel_size_m)
        if not isinstance(self.aperture, dict):
            raise ValueError(f"aperture must be a dict of probe settings, got {self.aperture!r}")

    def detector_of(self, metadata: dict) -> str:
        return self.detector or (metadata or {}).get("detector") or "far_field"

    def resolve(self, metadata: dict | None, n: int) -> "ResolvedSample":
        """The kernels for ``n``-pixel patterns, from these options and the data's metadata."""
        meta = metadata or {}
        detector = self.detector_of(meta)
        lam = self.wavelength_m if self.wavelength_m is not None else meta.get("wavelength_m")
        dx = self.object_pixel_size_m if self.object_pixel_size_m is not None else meta.get("object_pixel_size_m")
        if self.slices > 1 and lam is not None and dx is not None:
            check_slice_spacing(self.slice_spacing_m, float(lam), float(dx))
        geometry = SliceGeometry(int(self.slices), self.slice_spacing_m, lam, dx)
        near = None
        if detector == "near_field":
            z2, p = meta.get("detector_distance_m"), meta.get("detector_pixel_size_m")
            missing = [name for name, v in (("wavelength_m", lam), ("detector_distance_m", z2),
                                            ("detector_pixel_size_m", p)) if v is None]
            if missing:
                raise ValueError(f"a near-field data set needs {', '.join(missing)} in its metadata "
                                 "(daskpty import --distance/--pixel-size/--wavelength, or from_arrays)")
            near = near_field_kernel(n, p, lam, z2, meta.get("focus_to_sample_m"))
        return ResolvedSample(geometry, geometry.kernel(n), near, detector)

    def run_options(self) -> dict:
        """The JSON record of these options for a reconstruction store."""
        return {"slices": int(self.slices), "slice_spacing_m": self.slice_spacing_m,
                "detector": self.detector, "wavelength_m": self.wavelength_m,
                "object_pixel_size_m": self.object_pixel_size_m, "aperture": dict(self.aperture)}


def check_slice_spacing(spacing: float, wavelength: float, pixel: float) -> None:
    """Refuse a slice spacing so small against the data's depth resolution (about 4 Δx² / λ for
    the object pixel Δx) that the propagation between slices is below :data:`MIN_SLICE_PHASE`
    at every frequency: the slices could not be told apart, and the run would only be slower."""
    phase = math.pi * wavelength * spacing / (4.0 * pixel ** 2)
    if phase < MIN_SLICE_PHASE:
        least = MIN_SLICE_PHASE * 4.0 * pixel ** 2 / (math.pi * wavelength)
        depth = 4.0 * pixel ** 2 / wavelength
        raise ValueError(f"slice spacing {spacing:g} m (CLI: --slice-spacing) is far below the data's depth "
                         f"resolution (about 4·dx²/λ = {depth:.3g} m for dx = {pixel:.3g} m, λ = "
                         f"{wavelength:.3g} m): the slices could not be told apart; give the spacing in "
                         f"metres, at least {least:.2g} m, or use fewer, thicker slices")


@dataclass(frozen=True)
class ResolvedSample:
    """Slices and detector operator of one run (see :meth:`SampleOptions.resolve`)."""

    geometry: SliceGeometry
    kernel: np.ndarray | None          # slice-to-slice transfer function (n, n), None for K = 1
    detector_kernel: np.ndarray | None  # near-field transfer function (n, n), None: far field
    detector: str = "far_field"

    @property
    def n_slices(self) -> int:
        return int(self.geometry.n_slices)

    @property
    def first_screen_m(self) -> float:
        """Distance from the sample's entrance surface (where a defocus is measured) to the first
        object screen: Δz/2 for K > 1 slices (a slab's mass acts about at its middle), 0 for K = 1
        (one projected screen, whose geometry holds no thickness)."""
        return 0.5 * float(self.geometry.spacing_m) if self.n_slices > 1 else 0.0

    @property
    def near_field(self) -> bool:
        return self.detector_kernel is not None

    @property
    def multislice(self) -> bool:
        """True when the multislice engines run (K > 1 or the near field); False: the 2-D path."""
        return self.n_slices > 1 or self.near_field

    @property
    def working_factor(self) -> float:
        """Working set of a chunk step relative to the single-slice engine's: ~(2K + 4) / 3 exit
        waves through K slices (engines/forward_model.py), 1 for the 2-D path."""
        return (2.0 * self.n_slices + 4.0) / 3.0 if self.multislice else 1.0

    def object_like(self, obj2d: np.ndarray) -> np.ndarray:
        """The initial (K, H, W) object from a 2-D one (entrance slice; ones behind it) for the
        multislice engines; the 2-D object itself otherwise."""
        if not self.multislice:
            return obj2d
        out = np.ones((self.n_slices,) + obj2d.shape[-2:], np.complex64)
        out[0] = obj2d
        return out

    def check_resumed(self, obj) -> None:
        """A resumed object must have this run's slices."""
        k = np.shape(obj)[0] if np.ndim(obj) == 3 else 1
        if k != self.n_slices:
            raise ValueError(f"the resume store holds {k} object slice(s) but this run asks for "
                             f"{self.n_slices}; resume with the same slices")

    def public(self, array):
        """Result view: the multislice engines' (1, H, W) arrays become (H, W) for K = 1."""
        if array is not None and self.multislice and self.n_slices == 1 and np.ndim(array) == 3:
            return array[0]
        return array


def aperture_probe(metadata: dict, n: int, *, power: float, positions=None, aperture: dict | None = None,
                   first_screen_m: float = 0.0):
    """``probe="aperture"``: :func:`daskpty.physics.probes.probe_from_geometry` from the data's
    geometry (electrons when the metadata hold ``electron_voltage_v``, with the stored
    ``defocus_m`` unless ``aperture`` names one; else X-rays). The defocus is measured at the
    sample's entrance surface; the probe returned lives ``first_screen_m`` further downstream
    (:attr:`ResolvedSample.first_screen_m`), at the model's first screen."""
    meta = metadata or {}
    kwargs = dict(aperture or {})
    lam, dx = meta.get("wavelength_m"), meta.get("object_pixel_size_m")
    if lam is None or dx is None:
        raise ValueError("probe='aperture' needs the wavelength and the object pixel size in the data's "
                         "metadata (from_arrays(..., wavelength_m=, object_pixel_size_m=) or the electron "
                         "equivalents)")
    geometry = SimpleNamespace(pattern_size=int(n), wavelength_m=float(lam), object_pixel_size_m=float(dx))
    if meta.get("electron_voltage_v") is not None:
        geometry.voltage_v = meta["electron_voltage_v"]
        geometry.convergence_semiangle_rad = kwargs.pop("convergence_semiangle_rad",
                                                        meta.get("convergence_semiangle_rad"))
        if meta.get("defocus_m") is not None:  # the scan's own defocus (import --defocus)
            kwargs.setdefault("defocus_m", float(meta["defocus_m"]))
    elif "diameter_m" not in kwargs:
        kwargs["diameter_m"] = probe_diameter_from_scan(positions, n) * float(dx)
    if first_screen_m:  # defocus_m = z_sample - z_focus: a screen further downstream adds to it
        kwargs["defocus_m"] = float(kwargs.get("defocus_m", 0.0)) + float(first_screen_m)
    return probe_from_geometry(geometry, power=power, **kwargs)
