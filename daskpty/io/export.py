"""Export a reconstruction for other tools: CXI / HDF5 (object, probe, positions, geometry),
TIFF (amplitude and phase pages) and PNG (an image of the object).

CXI layout written (SI units; read back by :func:`daskpty.io.importers.import_cxi` conventions)::

    cxi_version                                  160
    entry_1/image_1/data                         object (H, W) complex64, data_type "object"
    entry_1/image_1/{x,y}_pixel_size             object pixel size, m (when known)
    entry_1/image_1/illumination                 Σ|probe|² over the scan, float32
    entry_1/image_1/process_1/                   positions_px (N, 2) (y, x) object frame,
                                                 origin (2,), loss (epochs,), note (JSON)
    entry_1/image_2/data                         probe modes (M, n, n) complex64, data_type "probe"
    entry_1/instrument_1/source_1/{wavelength, energy}          m, J
    entry_1/instrument_1/detector_1/{distance, x_pixel_size, y_pixel_size, basis_vectors}
    entry_1/sample_1/geometry_1/translation      (N, 3) m, where the sample moved (x, y, 0)

Every file is written beside its target and renamed into place, so a failure leaves nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid

import numpy as np

FORMATS = {".cxi": "cxi", ".h5": "hdf5", ".hdf5": "hdf5", ".tif": "tiff", ".tiff": "tiff",
           ".png": "png"}
WHAT = ("object", "probe", "phase", "amplitude")
HC_J_M = 6.62607015e-34 * 299792458.0


def _fail(msg):
    from .validate import fail

    fail(msg)


def _reconstruction(recon):
    from daskpty.results import Reconstruction

    if isinstance(recon, Reconstruction):
        return recon
    return Reconstruction.from_zarr(os.fspath(recon))


def geometry_of(data) -> dict:
    """Geometry keys of a data set (store path or PtychoData); empty for None."""
    if data is None:
        return {}
    if isinstance(data, (str, os.PathLike)):
        from .store import open_data

        data = open_data(data, validate="metadata")
    meta = data.metadata
    keys = ("wavelength_m", "detector_distance_m", "detector_pixel_size_m", "object_pixel_size_m")
    return {k: float(meta[k]) for k in keys if isinstance(meta.get(k), (int, float))}


@contextlib.contextmanager
def _atomic_file(path, overwrite):
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give a file name")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; choose another output or pass --overwrite")
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(f"output directory {os.path.dirname(path)} does not exist")
    root, ext = os.path.splitext(path)
    tmp = f"{root}.partial-{uuid.uuid4().hex[:8]}{ext}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _phase_referenced(rec) -> np.ndarray:
    """Object with its mean phase over the illuminated region removed."""
    obj = np.asarray(rec.object)
    lit = rec.illuminated()
    mean = obj[lit].mean() if lit.any() else obj.mean()
    return obj * (np.conj(mean) / abs(mean)) if abs(mean) > 0 else obj


def _h5():
    try:
        import h5py
    except ImportError:
        _fail("writing CXI / HDF5 needs h5py: pip install 'daskpty[hdf5]'")
    return h5py


def export_cxi(recon, path, *, data=None, overwrite: bool = False) -> str:
    """Write the reconstruction (and the geometry of ``data``, a data-set store) as CXI."""
    h5py, rec, geo = _h5(), _reconstruction(recon), geometry_of(data)
    dx = geo.get("object_pixel_size_m")
    with _atomic_file(path, overwrite) as tmp, h5py.File(tmp, "w") as f:
        f["cxi_version"] = 160
        f["number_of_entries"] = 1
        img = f.create_group("entry_1/image_1")
        img.create_dataset("data", data=rec.object.astype(np.complex64), compression="gzip")
        img["data_type"] = "object"
        if dx:
            img["x_pixel_size"] = img["y_pixel_size"] = dx
        if rec.illumination is not None:
            img.create_dataset("illumination", data=rec.illumination.astype(np.float32),
                               compression="gzip")
        proc = img.create_group("process_1")
        proc["positions_px"] = np.asarray(rec.positions, np.float64)
        proc["origin"] = np.asarray(rec.origin, np.float64)
        proc["loss"] = np.asarray([h.get("loss", np.nan) for h in rec.history], np.float64)
        proc["note"] = json.dumps({"program": "daskpty", "epochs": rec.epochs,
                                   "options": rec.options}, default=str)
        probe = f.create_group("entry_1/image_2")
        probe["data"] = rec.probe.astype(np.complex64)
        probe["data_type"] = "probe"
        src = f.create_group("entry_1/instrument_1/source_1")
        det = f.create_group("entry_1/instrument_1/detector_1")
        if "wavelength_m" in geo:
            src["wavelength"] = geo["wavelength_m"]
            src["energy"] = HC_J_M / geo["wavelength_m"]
        if "detector_distance_m" in geo:
            det["distance"] = geo["detector_distance_m"]
        if "detector_pixel_size_m" in geo:
            p = geo["detector_pixel_size_m"]
            det["x_pixel_size"] = det["y_pixel_size"] = p
            det["basis_vectors"] = np.array([[0.0, p], [p, 0.0], [0.0, 0.0]])  # rows +y, cols +x
        if dx:
            yx = np.asarray(rec.positions, np.float64) * dx
            translation = np.zeros((len(yx), 3))
            translation[:, 0], translation[:, 1] = -yx[:, 1], -yx[:, 0]  # the sample moves
            f["entry_1/sample_1/geometry_1/translation"] = translation
            f["entry_1/data_1/translation"] = h5py.SoftLink("/entry_1/sample_1/geometry_1/translation")
    return os.fspath(path)


def export_hdf5(recon, path, *, data=None, overwrite: bool = False) -> str:
    """Plain HDF5: /object, /probe, /positions (px, object frame), /origin, /illumination,
    /loss; geometry, epochs and options as root attributes."""
    h5py, rec, geo = _h5(), _reconstruction(recon), geometry_of(data)
    with _atomic_file(path, overwrite) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("object", data=rec.object.astype(np.complex64), compression="gzip")
        f["probe"] = rec.probe.astype(np.complex64)
        f["positions"] = np.asarray(rec.positions, np.float64)
        f["positions"].attrs["units"] = "object pixels (y, x)"
        f["origin"] = np.asarray(rec.origin, np.float64)
        if rec.illumination is not None:
            f.create_dataset("illumination", data=rec.illumination.astype(np.float32),
                             compression="gzip")
        f["loss"] = np.asarray([h.get("loss", np.nan) for h in rec.history], np.float64)
        for key, value in geo.items():
            f.attrs[key] = value
        f.attrs["epochs"] = rec.epochs
        f.attrs["options"] = json.dumps(rec.options, default=str)
    return os.fspath(path)


def _pages(rec, what) -> np.ndarray:
    if what in ("object", "phase", "amplitude"):
        obj = _phase_referenced(rec)
        pages = {"object": [np.abs(obj), np.angle(obj)], "amplitude": [np.abs(obj)],
                 "phase": [np.angle(obj)]}[what]
    else:
        pages = [f(mode) for mode in rec.probe for f in (np.abs, np.angle)]
    return np.stack(pages).astype(np.float32)


def export_tiff(recon, path, *, what: str = "object", overwrite: bool = False) -> str:
    """Float32 TIFF pages: object amplitude and phase (``what="object"``), one of them
    (``"amplitude"``, ``"phase"``), or amplitude and phase of each probe mode (``"probe"``)."""
    if what not in WHAT:
        _fail(f"what must be one of {', '.join(WHAT)}, got {what!r}")
    try:
        import tifffile
    except ImportError:
        _fail("writing TIFF needs tifffile: pip install 'daskpty[hdf5]'")
    pages = _pages(_reconstruction(recon), what)
    with _atomic_file(path, overwrite) as tmp:
        tifffile.imwrite(tmp, pages, photometric="minisblack",
                         description=json.dumps({"daskpty": what}))
    return os.fspath(path)


def export_png(recon, path, *, what: str = "phase", overwrite: bool = False,
               crop: bool = True) -> str:
    """An 8-bit grey PNG of the object phase (default) or amplitude, or of probe mode 0's
    amplitude (``"probe"``); ``crop`` keeps the illuminated region only."""
    if what not in WHAT:
        _fail(f"what must be one of {', '.join(WHAT)}, got {what!r}")
    try:
        from matplotlib import image
    except ImportError:
        _fail("writing PNG needs matplotlib: pip install 'daskpty[plot]'")
    rec = _reconstruction(recon)
    if what == "probe":
        img = np.abs(rec.probe[0])
    else:
        obj = _phase_referenced(rec)
        img = np.abs(obj) if what == "amplitude" else np.angle(obj)
        if crop and rec.illumination is not None:
            rows, cols = np.nonzero(rec.illuminated())
            if rows.size:
                img = img[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    lo, hi = np.percentile(img, [0.5, 99.5])
    with _atomic_file(path, overwrite) as tmp:
        image.imsave(tmp, img, cmap="gray", vmin=lo, vmax=hi if hi > lo else lo + 1, format="png")
    return os.fspath(path)


def export(recon, path, *, data=None, what: str | None = None, overwrite: bool = False) -> str:
    """Export by the suffix of ``path``: .cxi, .h5/.hdf5, .tif/.tiff or .png."""
    fmt = FORMATS.get(os.path.splitext(os.fspath(path))[1].lower())
    if fmt is None:
        _fail(f"{path}: unsupported export type; use one of {', '.join(FORMATS)}")
    if fmt in ("cxi", "hdf5"):
        if what not in (None, "object"):
            _fail(f"--what applies to TIFF and PNG exports; {fmt} files hold everything")
        func = export_cxi if fmt == "cxi" else export_hdf5
        return func(recon, path, data=data, overwrite=overwrite)
    if data is not None:
        _fail("--data (geometry) applies to CXI and HDF5 exports")
    if fmt == "tiff":
        return export_tiff(recon, path, what=what or "object", overwrite=overwrite)
    return export_png(recon, path, what=what or "phase", overwrite=overwrite)
