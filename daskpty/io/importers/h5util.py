"""Small HDF5 helpers for importers: open with a clear error, find datasets, read scalars."""
from __future__ import annotations

import os

import numpy as np

from ..validate import fail

#: datasets listed at most when a path is missing
MAX_LISTED = 12


def h5py_module():
    try:
        import h5py  # lazy: optional dependency (daskpty[hdf5])
        try:
            import hdf5plugin  # noqa: F401  (registers bitshuffle/LZ4, Blosc, ... filters)
        except ImportError:
            pass
    except ImportError:
        fail("reading HDF5 / CXI files needs h5py: pip install 'daskpty[hdf5]'")
    return h5py


def open_hdf5(path):
    """Open ``path`` read-only; DataError when it is missing or not an HDF5 file."""
    h5py = h5py_module()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        fail(f"{path} is not an HDF5 file (no HDF5 signature); give a CXI / HDF5 / NeXus file "
             f"or choose --format npy|tiff|empad")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        fail(f"{path} could not be opened as HDF5 ({' '.join(str(exc).split())[:200]})")


def datasets(f, min_ndim: int = 0) -> list[tuple[str, tuple]]:
    """(path, shape) of every dataset (each once, under its own name), most dimensions first."""
    h5py = h5py_module()
    found = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.ndim >= min_ndim:
            found.setdefault(obj.name, ("/" + name, tuple(obj.shape)))

    f.visititems(visit)
    return sorted(found.values(), key=lambda t: (-len(t[1]), t[0]))


def require(f, path: str, what: str, min_ndim: int = 1):
    """The dataset at ``path``; DataError naming the datasets that do exist."""
    h5py = h5py_module()
    node = f.get(path)
    if isinstance(node, h5py.Dataset):
        return node
    have = datasets(f, min_ndim)
    listed = ", ".join(f"{p} {list(s)}" for p, s in have[:MAX_LISTED])
    more = f" and {len(have) - MAX_LISTED} more" if len(have) > MAX_LISTED else ""
    kind = "a group, not a dataset" if isinstance(node, h5py.Group) else "not in the file"
    fail(f"{f.filename}: {what} {path} is {kind}; datasets there: {listed or 'none'}{more}")


def scalar(f, path: str):
    """Float value of a scalar (or first element of a small) dataset, None when absent."""
    h5py = h5py_module()
    node = f.get(path)
    if not isinstance(node, h5py.Dataset) or node.size == 0:
        return None
    value = float(np.asarray(node[()]).ravel()[0])
    return value if np.isfinite(value) and value > 0 else None
