"""Generic HDF5 / NeXus import: dataset paths from the caller, geometry from NeXus fields or flags.

Compressed detector data (bitshuffle/LZ4 as Dectris Eiger writes, Blosc, ...) read through the
filters ``hdf5plugin`` registers.
"""
from __future__ import annotations

import numpy as np

from ..validate import fail
from .cxi import import_cxi
from .geometry import Geometry, attr_units, unit_scale
from .h5util import h5py_module, open_hdf5, require
from .positions import scan_from_hdf5
from .preprocess import Preprocess
from .source import ArraySource
from .writer import import_source

#: NeXus fields looked up (relative to the data's entry) when no flag gives the value
NEXUS_FIELDS = {
    "wavelength_m": ("instrument/beam/incident_wavelength", "instrument/monochromator/wavelength",
                     "sample/beam/incident_wavelength"),
    "energy_ev": ("instrument/beam/incident_energy", "instrument/monochromator/energy",
                  "instrument/source/energy"),
    "distance_m": ("instrument/detector/distance", "instrument/detector/detector_distance"),
    "pixel_size_m": ("instrument/detector/x_pixel_size",),
}
_ENERGY_UNITS = {"ev": 1.0, "kev": 1e3, "mev": 1e6, "j": 1 / 1.602176634e-19}


def _with_units(f, path, kind):
    """Value of ``path`` converted by its units attribute to SI (m / eV); None when absent."""
    ds = f.get(path)
    h5py = h5py_module()
    if not isinstance(ds, h5py.Dataset) or ds.size == 0:
        return None
    value = float(np.asarray(ds[()]).ravel()[0])
    units = attr_units(ds)
    if kind == "energy_ev":
        scale = _ENERGY_UNITS.get((units or "ev").strip().lower())
        return None if scale is None else value * scale
    try:
        scale = unit_scale(units or "m", path)
    except ValueError:
        return None
    return value * scale if scale is not None else None


def nexus_geometry(f, data_path: str) -> Geometry:
    """Geometry from standard NeXus fields under the entry holding ``data_path``."""
    entry = "/" + data_path.strip("/").split("/")[0]
    found = {}
    for key, candidates in NEXUS_FIELDS.items():
        for rel in candidates:
            value = _with_units(f, f"{entry}/{rel}", key)
            if value is not None and value > 0:
                found[key] = value
                break
    return Geometry(**found)


def import_hdf5(src, output, *, data: str | None = None, positions: str | None = None,
                units: str | None = None, motion: str = "probe", columns: str = "yx",
                geometry: Geometry | None = None, preprocess: Preprocess | None = None,
                mask=None, overwrite: bool = False, progress: bool = False, **kw):
    """Import the (N, H, W) dataset ``data`` of an HDF5 / NeXus file into a store at ``output``.

    positions: dataset path (N, 2) in ``columns`` order, ``"YPATH,XPATH"``, or a separate file
    (``pos.npy``, ``pos.csv``, ``other.h5::/path``); ``units`` (m|mm|um|nm|A|px) default to the
    dataset's ``units`` attribute; ``motion="sample"`` when they record the sample's motion.
    ``geometry`` overrides NeXus fields found in the file; ``mask``: (H, W) True = bad pixel.
    Returns the opened :class:`~daskpty.io.store.PtychoData`. A CXI file without ``data`` is
    read as CXI.
    """
    with open_hdf5(src) as f:
        if data is None:
            if isinstance(f.get("entry_1/data_1/data"), h5py_module().Dataset):
                f.close()
                return import_cxi(src, output, positions=positions, units=units,
                                  geometry=geometry, preprocess=preprocess, mask=mask,
                                  overwrite=overwrite, progress=progress, **kw)
            fail(f"{src}: name the detector dataset with --data /path (Python: data=...)")
        ds = require(f, data, "detector dataset")
        scan = scan_from_hdf5(f, positions, units=units, motion=motion, columns=columns)
        geo = (geometry or Geometry()).over(nexus_geometry(f, data))
        return import_source(ArraySource(ds, str(src)), output, scan=scan, geometry=geo,
                             preprocess=preprocess, file_bad=mask, fmt="hdf5",
                             overwrite=overwrite, progress=progress,
                             details={"data": data}, **kw)
