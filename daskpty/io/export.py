"""Export a reconstruction for other tools: CXI / HDF5 (object, probe, positions, geometry),
TIFF (amplitude and phase pages) and PNG (an image of the object).

CXI layout written (SI units, each scalar with a ``units`` attribute; read back by
:func:`daskpty.io.importers.import_cxi` conventions; docs/data-format.md)::

    cxi_version                                  160
    entry_1/data_1/data                          soft link to /entry_1/image_1/data (the main data)
    entry_1/data_1/translation                   soft link to the sample translation (when known)
    entry_1/image_1/data                         object (H, W) complex64, data_type "object",
                                                 data_space "real", {x,y}_pixel_size, image_size
    entry_1/image_1/illumination                 Σ|probe|² over the scan, float32
    entry_1/image_1/process_1/                   positions_px (N, 2) (y, x) object frame,
                                                 origin (2,), loss (epochs,), note (JSON)
    entry_1/image_2/data                         probe modes (M, n, n) complex64, data_type "probe"
    entry_1/instrument_1/source_1/{wavelength, energy}          m, J
    entry_1/instrument_1/detector_1/{distance, x_pixel_size, y_pixel_size, basis_vectors}
    entry_1/instrument_1/detector_1/propagation  "far_field" or "near_field"
    entry_1/instrument_1/detector_1/{focus_to_sample_distance, magnification,
                                     effective_distance}         near field (Fresnel scaling)
    entry_1/sample_1/geometry_1/translation      (N, 3) m, where the sample moved (x, y, 0)

Every file is built in memory, its size checked against the free space of the target's disk,
then written beside the target and renamed into place: a full disk or a read-only directory
ends in one :class:`~daskpty.io.safety.StoreWriteError` line and leaves nothing (HDF5 itself
never writes to the disk, so its failures on a full disk cannot crash the process).
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import uuid

import numpy as np

from .safety import StoreWriteError, check_writable
from .validate import fail

FORMATS = {".cxi": "cxi", ".h5": "hdf5", ".hdf5": "hdf5", ".tif": "tiff", ".tiff": "tiff",
           ".png": "png"}
WHAT = ("object", "probe", "phase", "amplitude")
HC_J_M = 6.62607015e-34 * 299792458.0
#: metadata keys of a data set carried into CXI / HDF5 / TIFF exports
GEOMETRY_KEYS = ("wavelength_m", "detector_distance_m", "detector_pixel_size_m",
                 "object_pixel_size_m", "focus_to_sample_m", "electron_voltage_v",
                 "reciprocal_pixel_rad", "convergence_semiangle_rad")
#: bytes written per call (a full disk then fails within one piece)
WRITE_PIECE = 8 * 2**20


def _fail(msg):
    fail(msg)


def _reconstruction(recon):
    from .results import Reconstruction  # lazy: io.results loads zarr, kept out of the CLI's start

    if isinstance(recon, Reconstruction):
        return recon
    return Reconstruction.from_zarr(os.fspath(recon))


def geometry_of(data, rec=None) -> dict:
    """Geometry of a data set (store path or PtychoData): :data:`GEOMETRY_KEYS` that are numbers
    and ``detector`` ("far_field" / "near_field"); without ``data``, the geometry the
    reconstruction stored (:attr:`~daskpty.io.results.Reconstruction.geometry`), else what its
    options recorded (wavelength, object pixel, detector of its sample options)."""
    if data is None:
        if rec is not None and rec.geometry:
            return geometry_from_metadata(rec.geometry)
        sample = ((rec.options or {}).get("sample") or {}) if rec is not None else {}
        meta = {k: sample.get(k) for k in ("wavelength_m", "object_pixel_size_m", "detector")}
        return geometry_from_metadata(meta, infer_detector=False)
    if isinstance(data, (str, os.PathLike)):
        from .store import open_data  # lazy: dask, zarr stay out of the CLI's start

        data = open_data(data, validate="metadata")
    return geometry_from_metadata(data.metadata)


def geometry_from_metadata(meta, *, infer_detector: bool = True) -> dict:
    """:data:`GEOMETRY_KEYS` of a data set's ``meta`` that are numbers, ``detector`` (given, or
    with ``infer_detector`` near field when a focus-to-sample distance is known) and the near
    field's ``magnification``; {} without metadata."""
    if not meta:
        return {}
    out = {k: float(meta[k]) for k in GEOMETRY_KEYS
           if isinstance(meta.get(k), (int, float)) and not isinstance(meta.get(k), bool)}
    if meta.get("detector") in ("far_field", "near_field"):
        out["detector"] = meta["detector"]
    elif infer_detector:
        out["detector"] = "near_field" if "focus_to_sample_m" in out else "far_field"
    if out.get("detector") == "near_field" and "focus_to_sample_m" in out \
            and "detector_distance_m" in out:
        z1, z2 = out["focus_to_sample_m"], out["detector_distance_m"]
        out["magnification"] = (z1 + z2) / z1
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _target(path, overwrite) -> str:
    """The absolute output path, after the checks that need no writing; then a probe file in
    its directory, so a read-only or unwritable place is refused before any work."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give a file name")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; choose another output or pass --overwrite")
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(f"output directory {os.path.dirname(path)} does not exist")
    check_writable(path)
    return path


def write_file(path, payload, *, overwrite: bool = False, check_space: bool = True) -> str:
    """Write ``payload`` (bytes-like) to ``path`` through a partial file renamed into place.

    Refuses up front when the target's disk has less free space than the payload (plus a small
    margin); any OSError while writing (disk full, read-only, permissions) removes the partial
    file and raises one :class:`~daskpty.io.safety.StoreWriteError` line.
    """
    path = _target(path, overwrite)
    view = memoryview(payload).cast("B")
    size = view.nbytes
    folder = os.path.dirname(path)
    if check_space:
        free = shutil.disk_usage(folder).free
        if free < size + max(64 * 2**10, size // 100):
            raise StoreWriteError(errno.ENOSPC, f"not enough free space for {path}: the file is "
                                                f"{_mib(size)}, {_mib(free)} free on that disk; "
                                                f"free some space or choose another output "
                                                f"(nothing was written)")
    root, ext = os.path.splitext(path)
    tmp = f"{root}.partial-{uuid.uuid4().hex[:8]}{ext}"
    try:
        with open(tmp, "xb") as fh:
            for start in range(0, size, WRITE_PIECE):
                fh.write(view[start:start + WRITE_PIECE])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise StoreWriteError(exc.errno or errno.EIO, f"writing {path} failed: "
                                                      f"{exc.strerror or exc} after "
                                                      f"{_mib(_size(tmp))} of {_mib(size)}; "
                                                      f"free some space or choose another "
                                                      f"output (no partial file was left)") from None
    finally:
        if os.path.lexists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass
    return path


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _phase_referenced(rec) -> np.ndarray:
    """Object with its mean phase over the illuminated region removed."""
    obj = np.asarray(rec.object)
    lit = rec.illuminated()
    mean = obj[lit].mean() if lit.any() else obj.mean()
    return obj * (np.conj(mean) / abs(mean)) if abs(mean) > 0 else obj


def _h5():
    try:
        import h5py  # lazy: optional dependency (daskpty[hdf5])
    except ImportError:
        _fail("writing CXI / HDF5 needs h5py: pip install 'daskpty[hdf5]'")
    return h5py


def _h5_bytes(build) -> io.BytesIO:
    """An HDF5 file built in memory by ``build(file)`` (HDF5 never touches the disk)."""
    h5py = _h5()
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        build(f)
    return buf


def _scalar(group, name, value, units, description=None):
    group[name] = value
    group[name].attrs["units"] = units
    if description:
        group[name].attrs["description"] = description


def _note(rec, geo) -> str:
    return json.dumps({"program": "daskpty", "epochs": rec.epochs, "geometry": geo,
                       "options": rec.options}, default=str)


def _axes(obj) -> str:
    return "slice:y:x" if np.ndim(obj) == 3 else "y:x"


def _cxi_instrument(f, geo) -> None:
    src = f.create_group("entry_1/instrument_1/source_1")
    det = f.create_group("entry_1/instrument_1/detector_1")
    if "wavelength_m" in geo:
        _scalar(src, "wavelength", geo["wavelength_m"], "m")
        _scalar(src, "energy", HC_J_M / geo["wavelength_m"], "J")
    if "detector_distance_m" in geo:
        _scalar(det, "distance", geo["detector_distance_m"], "m", "sample to detector")
    if "detector_pixel_size_m" in geo:
        p = geo["detector_pixel_size_m"]
        for axis in ("x", "y"):
            _scalar(det, f"{axis}_pixel_size", p, "m")
        det["basis_vectors"] = np.array([[0.0, p], [p, 0.0], [0.0, 0.0]])  # rows +y, cols +x
    if "detector" in geo:
        det["propagation"] = geo["detector"]
        det["propagation"].attrs["description"] = (
            "how the exit wave reaches the detector: far_field (Fraunhofer) or near_field "
            "(Fresnel, holograms)")
    if "focus_to_sample_m" in geo:
        _scalar(det, "focus_to_sample_distance", geo["focus_to_sample_m"], "m",
                "near field, divergent beam: distance z1 from the focus to the sample; "
                "'distance' is z2, sample to detector")
    if "magnification" in geo:
        m = geo["magnification"]
        _scalar(det, "magnification", m, "1", "Fresnel scaling M = (z1 + z2) / z1")
        _scalar(det, "effective_distance", geo["detector_distance_m"] / m, "m",
                "z2 / M: the plane-wave distance equivalent to this divergent-beam geometry")


def export_cxi(recon, path, *, data=None, overwrite: bool = False) -> str:
    """Write the reconstruction (and the geometry of ``data``, a data-set store) as CXI; the
    layout is in this module's docstring and docs/data-format.md."""
    h5py, rec = _h5(), _reconstruction(recon)
    geo = geometry_of(data, rec)
    target = _target(path, overwrite)
    dx = geo.get("object_pixel_size_m")

    def build(f):
        f["cxi_version"] = 160
        f["number_of_entries"] = 1
        _cxi_instrument(f, geo)
        img = f.create_group("entry_1/image_1")
        obj = img.create_dataset("data", data=rec.object.astype(np.complex64), compression="gzip")
        obj.attrs["axes"] = _axes(rec.object)
        obj.attrs["description"] = "complex transmission of the object (reconstructed)"
        img["data_type"] = "object"
        img["data_space"] = "real"
        img["source_1"] = h5py.SoftLink("/entry_1/instrument_1/source_1")
        img["detector_1"] = h5py.SoftLink("/entry_1/instrument_1/detector_1")
        if dx:
            for axis in ("x", "y"):
                _scalar(img, f"{axis}_pixel_size", dx, "m", "object pixel")
            h, w = rec.object.shape[-2:]
            _scalar(img, "image_size", np.array([w * dx, h * dx, 0.0]), "m")
        if rec.illumination is not None:
            ill = img.create_dataset("illumination", data=rec.illumination.astype(np.float32),
                                     compression="gzip")
            ill.attrs["description"] = "sum of |probe|^2 over the scan positions, per object pixel"
        proc = img.create_group("process_1")
        proc["positions_px"] = np.asarray(rec.positions, np.float64)
        proc["positions_px"].attrs["description"] = "scan positions (y, x), object pixels"
        proc["origin"] = np.asarray(rec.origin, np.float64)
        proc["loss"] = np.asarray([h.get("loss", np.nan) for h in rec.history], np.float64)
        proc["note"] = _note(rec, geo)
        probe = f.create_group("entry_1/image_2")
        probe["data"] = rec.probe.astype(np.complex64)
        probe["data"].attrs["axes"] = "mode:y:x"
        probe["data_type"] = "probe"
        probe["data_space"] = "real"
        if dx:
            for axis in ("x", "y"):
                _scalar(probe, f"{axis}_pixel_size", dx, "m", "object pixel")
        d1 = f.create_group("entry_1/data_1")
        d1["data"] = h5py.SoftLink("/entry_1/image_1/data")
        if dx:
            yx = np.asarray(rec.positions, np.float64) * dx
            translation = np.zeros((len(yx), 3))
            translation[:, 0], translation[:, 1] = -yx[:, 1], -yx[:, 0]  # the sample moves
            _scalar(f.require_group("entry_1/sample_1/geometry_1"), "translation", translation,
                    "m", "where the sample moved (x, y, z); the probe moved the opposite way")
            d1["translation"] = h5py.SoftLink("/entry_1/sample_1/geometry_1/translation")

    write_file(target, _h5_bytes(build).getbuffer(), overwrite=overwrite)
    return os.fspath(path)


def export_hdf5(recon, path, *, data=None, overwrite: bool = False) -> str:
    """Plain HDF5: /object, /probe, /positions (px, object frame), /origin, /illumination,
    /loss, each with a description; geometry (daskpty's metadata keys, ``detector``,
    ``magnification`` in near field), epochs and options as root attributes."""
    rec = _reconstruction(recon)
    geo = geometry_of(data, rec)
    target = _target(path, overwrite)
    dx = geo.get("object_pixel_size_m")
    pixel = f", object pixel {dx:.6g} m" if dx else ""

    def build(f):
        f.attrs["format"] = "daskpty-export"
        f.create_dataset("object", data=rec.object.astype(np.complex64), compression="gzip")
        f["object"].attrs["description"] = f"complex transmission ({_axes(rec.object)}){pixel}"
        f["probe"] = rec.probe.astype(np.complex64)
        f["probe"].attrs["description"] = f"probe modes (mode:y:x), strongest first{pixel}"
        f["positions"] = np.asarray(rec.positions, np.float64)
        f["positions"].attrs["units"] = "object pixels (y, x)"
        f["origin"] = np.asarray(rec.origin, np.float64)
        f["origin"].attrs["description"] = "(y, x) object pixel of scan position (0, 0)"
        if rec.illumination is not None:
            f.create_dataset("illumination", data=rec.illumination.astype(np.float32),
                             compression="gzip")
            f["illumination"].attrs["description"] = "sum of |probe|^2 over the scan positions"
        f["loss"] = np.asarray([h.get("loss", np.nan) for h in rec.history], np.float64)
        f["loss"].attrs["description"] = "data loss per epoch"
        for key, value in geo.items():
            f.attrs[key] = value
        f.attrs["epochs"] = rec.epochs
        f.attrs["options"] = json.dumps(rec.options, default=str)

    write_file(target, _h5_bytes(build).getbuffer(), overwrite=overwrite)
    return os.fspath(path)


def _pages(rec, what) -> list[tuple[np.ndarray, dict]]:
    """(float32 page, description) for each TIFF page."""
    if what in ("object", "phase", "amplitude"):
        obj = _phase_referenced(rec)
        planes = obj if obj.ndim == 3 else obj[None]
        kinds = {"object": ("amplitude", "phase"), "amplitude": ("amplitude",),
                 "phase": ("phase",)}[what]
        array, index_key = "object", ("slice" if obj.ndim == 3 else None)
    else:
        planes, kinds, array, index_key = rec.probe, ("amplitude", "phase"), "probe", "mode"
    pages = []
    for index, plane in enumerate(planes):
        for kind in kinds:
            units = ("rad" if kind == "phase" else "1 (transmission)" if array == "object"
                     else "sqrt(photons) per pixel")
            desc = {"daskpty": what, "array": array, "quantity": kind, "units": units}
            if index_key:
                desc[index_key] = index
            if kind == "phase" and array == "object":
                desc["note"] = "mean phase over the illuminated region set to 0"
            value = np.abs(plane) if kind == "amplitude" else np.angle(plane)
            pages.append((value.astype(np.float32), desc))
    return pages


def export_tiff(recon, path, *, what: str = "object", data=None, overwrite: bool = False) -> str:
    """Float32 TIFF pages: object amplitude and phase (``what="object"``), one of them
    (``"amplitude"``, ``"phase"``), or amplitude and phase of each probe mode (``"probe"``).
    Every page carries a JSON description (array, quantity, units, page number and the object
    pixel size from ``data``, also as the resolution tags, when given)."""
    if what not in WHAT:
        _fail(f"what must be one of {', '.join(WHAT)}, got {what!r}")
    try:
        import tifffile  # lazy: optional dependency (daskpty[hdf5])
    except ImportError:
        _fail("writing TIFF needs tifffile: pip install 'daskpty[hdf5]'")
    rec = _reconstruction(recon)
    dx = geometry_of(data, rec).get("object_pixel_size_m")
    target = _target(path, overwrite)
    pages = _pages(rec, what)
    extra = {"resolution": (1e-2 / dx, 1e-2 / dx), "resolutionunit": "CENTIMETER"} if dx else {}
    buf = io.BytesIO()
    with tifffile.TiffWriter(buf) as tif:
        for i, (page, desc) in enumerate(pages):
            desc.update(page=i, pages=len(pages), pixel_size_m=dx)
            tif.write(page, photometric="minisblack", description=json.dumps(desc),
                      metadata=None, **extra)
    write_file(target, buf.getbuffer(), overwrite=overwrite)
    return os.fspath(path)


def export_png(recon, path, *, what: str = "phase", overwrite: bool = False,
               crop: bool = True) -> str:
    """An 8-bit grey PNG of the object phase (default) or amplitude, or of probe mode 0's
    amplitude (``"probe"``); ``crop`` keeps the illuminated region only."""
    if what not in WHAT:
        _fail(f"what must be one of {', '.join(WHAT)}, got {what!r}")
    try:
        from matplotlib import image  # lazy: optional dependency (daskpty[plot])
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
    target = _target(path, overwrite)
    lo, hi = np.percentile(img, [0.5, 99.5])
    buf = io.BytesIO()
    image.imsave(buf, img, cmap="gray", vmin=lo, vmax=hi if hi > lo else lo + 1, format="png")
    write_file(target, buf.getbuffer(), overwrite=overwrite)
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
    if fmt == "tiff":
        return export_tiff(recon, path, what=what or "object", data=data, overwrite=overwrite)
    if data is not None:
        _fail("--data (geometry) applies to CXI, HDF5 and TIFF exports")
    return export_png(recon, path, what=what or "phase", overwrite=overwrite)
