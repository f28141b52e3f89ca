"""NumPy import: ``.npy`` (memory-mapped) and ``.npz`` (members memory-mapped when stored
uncompressed, streamed in order otherwise)."""
from __future__ import annotations

import os
import zipfile

import numpy as np

from ..validate import fail, npy_dtype, refuse_objects
from .geometry import Geometry
from .positions import is_file_spec, read_positions_file
from .preprocess import Preprocess
from .source import ArraySource, Source
from .writer import Scan, import_source

#: where the imported array comes from, as the command line names it
SOURCE_OPTION = "SRC"
MEMBER_OPTION = "SRC, the member chosen by --data"
#: member names tried, in order, when no ``data`` key is given
DATA_KEYS = ("intensities", "data", "patterns", "diffraction")


def _header(fh):
    """(shape, fortran_order, dtype) of the .npy header at the file position."""
    version = np.lib.format.read_magic(fh)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    return read(fh)


class _StreamedMember(Source):
    """A compressed ``.npz`` member read front to back (reopened when a read goes backwards)."""

    def __init__(self, path, member, name):
        self.path, self.member, self.name = path, member, name
        self._open()
        self.shape, self.dtype = self._shape, self._dtype

    def _open(self):
        self._zip = zipfile.ZipFile(self.path)
        self._fh = self._zip.open(self.member)
        shape, fortran, dtype = _header(self._fh)
        refuse_objects(dtype, self.name, MEMBER_OPTION)
        if fortran or len(shape) != 3:
            fail(f"{self.name} must be a C-ordered (N, H, W) array, got shape {shape}")
        self._shape, self._dtype, self._pos = tuple(shape), np.dtype(dtype), 0

    def read(self, start, stop, window=None):
        if start < self._pos:
            self.close()
            self._open()
        frame = int(np.prod(self._shape[1:])) * self._dtype.itemsize
        if start > self._pos:
            self._fh.read((start - self._pos) * frame)
        raw = self._fh.read((stop - start) * frame)
        self._pos = stop
        block = np.frombuffer(raw, self._dtype).reshape(stop - start, *self._shape[1:])
        y0, y1, x0, x1 = window or (0, self._shape[1], 0, self._shape[2])
        return block[:, y0:y1, x0:x1]

    def close(self):
        self._fh.close()
        self._zip.close()


def _member_offset(path, info) -> int:
    """Byte offset of a stored (uncompressed) zip member's data."""
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        return info.header_offset + 30 + name_len + extra_len


def _npz_member(path, key) -> Source:
    with zipfile.ZipFile(path) as zf:
        names = {n[:-4]: n for n in zf.namelist() if n.endswith(".npy")}
        if key is None:
            key = next((k for k in DATA_KEYS if k in names), None)
            if key is None and len(names) == 1:
                key = next(iter(names))
        if key not in names:
            fail(f"{path}: no array {key!r}; it holds {', '.join(sorted(names))} (choose one with "
                 f"--data KEY)")
        info = zf.getinfo(names[key])
    name = f"{path}::{key}"
    if info.compress_type != zipfile.ZIP_STORED:
        return _StreamedMember(path, names[key], name)
    offset = _member_offset(path, info)
    with open(path, "rb") as fh:
        fh.seek(offset)
        shape, fortran, dtype = _header(fh)
        start = fh.tell()
    refuse_objects(dtype, name, MEMBER_OPTION)
    if fortran:
        fail(f"{name} is Fortran-ordered; save it C-ordered (numpy.ascontiguousarray)")
    return ArraySource(np.memmap(path, dtype=dtype, mode="r", offset=start, shape=shape),
                       name)


def numpy_source(path, key=None) -> Source:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    if path.lower().endswith(".npz"):
        return _npz_member(path, key)
    refuse_objects(npy_dtype(path) or np.float32, path, SOURCE_OPTION)
    try:
        arr = np.load(path, mmap_mode="r")
    except ValueError as exc:
        fail(f"{path} is not a NumPy .npy file ({' '.join(str(exc).split())[:160]})")
    return ArraySource(arr, path)


def import_numpy(src, output, *, data: str | None = None, positions: str | None = None,
                 units: str | None = None, motion: str = "probe", columns: str = "yx",
                 geometry: Geometry | None = None, preprocess: Preprocess | None = None,
                 mask=None, overwrite: bool = False, progress: bool = False, **kw):
    """Import an (N, H, W) ``.npy`` file, or member ``data`` of an ``.npz``, without loading it.

    positions: a key of the same ``.npz`` or a separate file (``pos.npy``, ``pos.csv``,
    ``other.h5::/path``); ``units`` must be given (NumPy files carry none). ``mask``: (H, W)
    True = bad pixel.
    """
    source = numpy_source(src, data)
    try:
        if positions is None:
            fail(f"{src}: no scan positions given; pass --positions (a .npz key or a file)")
        if is_file_spec(positions):
            values, file_units = read_positions_file(positions)
        else:
            if not str(src).lower().endswith(".npz"):
                raise FileNotFoundError(f"{positions}: no such positions file")
            values, file_units = read_positions_file(f"{src}::{positions}")
        scan = Scan(values, units or file_units, motion, columns, origin=positions)
        return import_source(source, output, scan=scan, geometry=geometry or Geometry(),
                             preprocess=preprocess, file_bad=mask, fmt="numpy",
                             overwrite=overwrite, progress=progress, **kw)
    finally:
        source.close()
