"""Read one detector-sized frame (dark, mask) from ``.npy``, TIFF or ``FILE.h5::/path``; a
stack is averaged, streamed."""
from __future__ import annotations

import os

import numpy as np

from ..validate import fail, npy_dtype, refuse_objects
from .h5util import open_hdf5, require

#: the command-line option of each kind of frame (named in errors)
OPTIONS = {"dark frame": "--dark", "mask": "--mask"}
#: frames averaged at a time when a dark stack is given
BATCH = 64


def _mean(stack) -> np.ndarray:
    total = np.zeros(stack.shape[1:])
    for a in range(0, stack.shape[0], BATCH):
        total += np.asarray(stack[a:a + BATCH], dtype=np.float64).sum(axis=0)
    return total / stack.shape[0]


def read_frame(spec: str, what: str) -> np.ndarray:
    """The (H, W) frame named by ``spec``; an (N, H, W) stack gives its mean."""
    path, _, key = spec.partition("::")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such {what} file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        refuse_objects(npy_dtype(path) or np.float32, path, OPTIONS.get(what, what))
        arr = np.load(path, mmap_mode="r")
    elif suffix in (".tif", ".tiff"):
        import tifffile  # lazy: optional dependency (daskpty[hdf5])

        arr = tifffile.imread(path)
    elif suffix in (".h5", ".hdf5", ".hdf", ".nxs", ".cxi"):
        if not key:
            fail(f"name the {what} dataset inside {path}: {path}::/path")
        with open_hdf5(path) as f:
            ds = require(f, key, f"{what} dataset", min_ndim=2)
            return ds[...] if ds.ndim == 2 else _mean(ds)
    else:
        fail(f"{path}: unknown {what} file type {suffix or '(no suffix)'}; use .npy, .tif or "
             f"an HDF5 file with ::/dataset")
    if arr.ndim == 3:
        return _mean(arr)
    if arr.ndim != 2:
        fail(f"the {what} in {path} has shape {arr.shape}; expected (H, W) or a stack (N, H, W)")
    return np.asarray(arr)
