"""Importers: measured data files → daskpty data-set stores, streamed shard by shard.

One module per format (:mod:`.cxi`, :mod:`.hdf5`, :mod:`.empad`, :mod:`.npy`, :mod:`.tiff`),
detector preprocessing in :mod:`.preprocess`, geometry and units in :mod:`.geometry`, and the
common streaming writer in :mod:`.writer`. :func:`import_file` picks the format from the suffix.
"""
from __future__ import annotations

import importlib
import os

from ..validate import fail

_EXPORTS = {
    "import_cxi": ".cxi", "import_hdf5": ".hdf5", "import_empad": ".empad",
    "import_numpy": ".npy", "import_tiff": ".tiff", "Geometry": ".geometry",
    "Preprocess": ".preprocess",
}
FORMATS = ("cxi", "hdf5", "empad", "npy", "tiff")
SUFFIXES = {".cxi": "cxi", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".nxs": "hdf5",
            ".nx5": "hdf5", ".raw": "empad", ".npy": "npy", ".npz": "npy", ".tif": "tiff",
            ".tiff": "tiff"}

__all__ = sorted([*_EXPORTS, "FORMATS", "detect_format", "import_file"])


def detect_format(src) -> str:
    """Format name from the suffix of ``src`` (a directory or glob means TIFF frames)."""
    src = os.fspath(src)
    fmt = SUFFIXES.get(os.path.splitext(src)[1].lower())
    if fmt is None and (os.path.isdir(src) or any(c in src for c in "*?[")):
        fmt = "tiff"
    if fmt is None:
        fail(f"{src}: cannot tell the format from the name; pass --format "
             f"{'|'.join(FORMATS)}")
    return fmt


def import_file(src, output, *, format: str | None = None, **options):
    """Import ``src`` with the importer of ``format`` (default: from the suffix)."""
    fmt = format or detect_format(src)
    func = {"cxi": "import_cxi", "hdf5": "import_hdf5", "empad": "import_empad",
            "npy": "import_numpy", "tiff": "import_tiff"}.get(fmt)
    if func is None:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return __getattr__(func)(src, output, **options)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
