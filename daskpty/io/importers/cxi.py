"""CXI import (Coherent X-ray Imaging format, HDF5).

Conventions as real CXI files use them: patterns at ``entry_1/data_1/data`` (or the detector's
``data``), ``entry_1/sample_1/geometry_1/translation`` (N, 3) metres = where the **sample** moved
(so the probe moved the opposite way over it), ``source_1/energy`` in joules (or ``wavelength``
in metres), detector ``distance`` and ``x_pixel_size`` / ``y_pixel_size`` in metres, ``mask``
non-zero = bad pixel, and ``basis_vectors`` (the detector's row and column axes in the lab
frame), onto which the probe positions are projected so the object frame matches the patterns.
"""
from __future__ import annotations

import numpy as np

from ..validate import fail
from .geometry import Geometry
from .h5util import open_hdf5, require, scalar
from .positions import scan_from_hdf5
from .preprocess import Preprocess
from .source import ArraySource
from .writer import Scan, import_source

ENTRY = "entry_1"
DATA_PATHS = ("entry_1/data_1/data", "entry_1/instrument_1/detector_1/data")
TRANSLATION_PATHS = ("entry_1/sample_1/geometry_1/translation", "entry_1/data_1/translation")
DETECTOR = "entry_1/instrument_1/detector_1"
SOURCE = "entry_1/instrument_1/source_1"
J_PER_EV = 1.602176634e-19


def _first(f, paths):
    for p in paths:
        if p in f:
            return p
    return None


def cxi_geometry(f) -> Geometry:
    """Geometry recorded in a CXI file (missing values stay None)."""
    energy_j = scalar(f, f"{SOURCE}/energy")
    px, py = scalar(f, f"{DETECTOR}/x_pixel_size"), scalar(f, f"{DETECTOR}/y_pixel_size")
    if px is not None and py is not None and not np.isclose(px, py, rtol=1e-4):
        fail(f"{f.filename}: detector pixels are {py:g} x {px:g} m; daskpty needs square pixels "
             f"(resample the patterns first)")
    return Geometry(wavelength_m=scalar(f, f"{SOURCE}/wavelength"),
                    energy_ev=None if energy_j is None else energy_j / J_PER_EV,
                    distance_m=scalar(f, f"{DETECTOR}/distance"), pixel_size_m=px or py)


def cxi_basis(f):
    """(2, 2) unit vectors (lab x, y components) of the detector's row and column axes, or None."""
    node = f.get(f"{DETECTOR}/basis_vectors")
    if node is None:
        return None
    b = np.asarray(node[...], dtype=np.float64)
    if b.shape == (3, 2):
        b = b.T
    if b.shape != (2, 3):
        return None
    xy = b[:, :2]
    norms = np.linalg.norm(xy, axis=1, keepdims=True)
    if not (norms > 0).all():
        return None
    return xy / norms


def import_cxi(src, output, *, positions: str | None = None, units: str | None = None,
               geometry: Geometry | None = None, preprocess: Preprocess | None = None,
               mask=None, use_basis: bool = True, overwrite: bool = False,
               progress: bool = False, **kw):
    """Import a CXI file into a data-set store at ``output``; return it opened.

    ``positions``/``units`` replace the file's sample translations (see :func:`import_hdf5`);
    ``geometry`` overrides the file's values field by field; ``mask`` (H, W), True = bad,
    replaces the file's mask; ``use_basis=False`` ignores the detector basis vectors.
    """
    with open_hdf5(src) as f:
        data_path = _first(f, DATA_PATHS)
        ds = require(f, data_path or DATA_PATHS[0], "CXI detector data", min_ndim=3)
        basis = cxi_basis(f) if use_basis else None
        if positions is not None:
            scan = scan_from_hdf5(f, positions, units=units)
        else:
            t_path = _first(f, TRANSLATION_PATHS)
            t = require(f, t_path or TRANSLATION_PATHS[0], "CXI sample translation")
            scan = Scan(np.asarray(t[...]), units or "m", "sample", "xy", origin=t.name)
        scan.basis = basis
        if mask is None and f"{DETECTOR}/mask" in f:
            mask = np.asarray(f[f"{DETECTOR}/mask"][...]) != 0
        geo = (geometry or Geometry()).over(cxi_geometry(f))
        return import_source(ArraySource(ds, str(src)), output, scan=scan, geometry=geo,
                             preprocess=preprocess, file_bad=mask, fmt="cxi",
                             overwrite=overwrite, progress=progress,
                             details={"data": ds.name}, **kw)
