"""Scan positions from a separate file (``.npy``, ``.npz::KEY``, text/CSV, ``FILE.h5::/path``) or from
datasets of the HDF5 file being imported (:func:`scan_from_hdf5`, for the HDF5 and CXI importers)."""
from __future__ import annotations

import os

import numpy as np

from ..validate import fail, npy_dtype, refuse_objects
from .geometry import attr_units
from .h5util import open_hdf5, require
from .writer import Scan

TEXT_SUFFIXES = (".txt", ".csv", ".dat", ".tsv")
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".nxs", ".cxi", ".nx5")


def is_file_spec(spec: str) -> bool:
    """True when ``spec`` names another file (``FILE`` or ``FILE::DATASET``)."""
    return "::" in spec or os.path.isfile(spec)


def read_positions_file(spec: str) -> tuple[np.ndarray, str | None]:
    """(values, units or None) from ``FILE`` or ``FILE::DATASET``."""
    path, _, key = spec.partition("::")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such positions file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        refuse_objects(npy_dtype(path) or np.float64, path, "--positions")
        return np.load(path), None
    if suffix == ".npz":
        with np.load(path) as z:
            if not key:
                if len(z.files) != 1:
                    fail(f"{path} holds {', '.join(z.files)}; name one: {path}::KEY")
                key = z.files[0]
            if key not in z.files:
                fail(f"{path} has no array {key!r}; it holds {', '.join(z.files)}")
            refuse_objects(npy_dtype(path, f"{key}.npy") or np.float64, f"{path}::{key}", "--positions")
            return z[key], None
    if suffix in HDF5_SUFFIXES:
        if not key:
            fail(f"name the positions dataset inside {path}: {path}::/path/to/positions")
        with open_hdf5(path) as f:
            ds = require(f, key, "positions dataset")
            return ds[...], attr_units(ds)
    if suffix in TEXT_SUFFIXES:
        return _read_text(path), None
    fail(f"{path}: unknown positions file type {suffix or '(no suffix)'}; use .npy, .npz, "
         f".txt/.csv or an HDF5 file with ::/dataset")


def _read_text(path: str) -> np.ndarray:
    with open(path) as fh:
        lines = [ln for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
    delimiter = "," if lines and "," in lines[0] else None
    try:
        float(lines[0].replace(",", " ").split()[0]) if lines else None
    except ValueError:
        lines = lines[1:]  # a header line
    try:
        values = np.loadtxt(lines, delimiter=delimiter, ndmin=2)
    except ValueError as exc:
        fail(f"{path}: could not read the positions as numbers ({' '.join(str(exc).split())})")
    return values


def scan_from_hdf5(f, spec, *, units=None, motion="probe", columns="yx", in_file=True) -> Scan:
    """Positions from a dataset of ``f`` (``PATH`` or ``YPATH,XPATH``) or a separate file."""
    if spec is None:
        fail(f"{f.filename}: no scan positions given; pass --positions /path/in/file (or a "
             f"separate file: pos.npy, pos.csv, other.h5::/path)")
    if is_file_spec(spec):
        values, file_units = read_positions_file(spec)
        return Scan(values, units or file_units, motion, columns, origin=spec)
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) == 2:
        ys, xs = (require(f, p, "positions dataset") for p in parts)
        y, x = np.asarray(ys[...], float).ravel(), np.asarray(xs[...], float).ravel()
        if len(y) != len(x):
            fail(f"{parts[0]} holds {len(y)} values but {parts[1]} holds {len(x)}")
        found = units or attr_units(ys) or attr_units(xs)
        return Scan(np.stack([y, x], axis=1), found, motion, "yx", origin=spec)
    ds = require(f, spec, "positions dataset")
    return Scan(np.asarray(ds[...]), units or attr_units(ds), motion, columns, origin=spec)
