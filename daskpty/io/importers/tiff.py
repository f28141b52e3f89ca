"""TIFF import: one multi-page file (a page per pattern) or a directory / glob of single frames."""
from __future__ import annotations

import glob
import os

import numpy as np

from ..validate import fail
from .geometry import Geometry
from .positions import read_positions_file
from .preprocess import Preprocess
from .source import Source
from .writer import Scan, import_source


def _tifffile():
    try:
        import tifffile  # lazy: optional dependency (daskpty[hdf5])
    except ImportError:
        fail("reading TIFF needs tifffile: pip install 'daskpty[hdf5]'")
    return tifffile


class TiffSource(Source):
    """Frames of a TIFF stack, read page by page (a multi-page file) or file by file."""

    def __init__(self, src):
        tifffile = _tifffile()
        src = os.fspath(src)
        self.name = src
        if os.path.isdir(src):
            files = sorted(glob.glob(os.path.join(glob.escape(src), "*.tif*")))
        elif any(c in src for c in "*?["):
            files = sorted(glob.glob(src))
        elif os.path.isfile(src):
            files = [src]
        else:
            raise FileNotFoundError(f"{src}: no such file or directory")
        if not files:
            fail(f"{src}: no .tif / .tiff files found")
        try:
            self._tif = tifffile.TiffFile(files[0]) if len(files) == 1 else None
        except tifffile.TiffFileError as exc:
            fail(f"{files[0]} is not a TIFF file ({' '.join(str(exc).split())[:160]})")
        if self._tif is not None:
            pages = self._tif.pages
            first = pages[0]
            self.files = None
            self.shape = (len(pages), *first.shape[-2:])
            if len(first.shape) != 2:
                fail(f"{src}: pages of shape {first.shape}; expected one 2-D frame per page")
        else:
            first = tifffile.TiffFile(files[0]).pages[0]
            self.files = files
            self.shape = (len(files), *first.shape[-2:])
        self.dtype = np.dtype(first.dtype)

    def read(self, start, stop, window=None):
        y0, y1, x0, x1 = window or (0, self.shape[1], 0, self.shape[2])
        if self.files is None:
            frames = [self._tif.pages[i].asarray() for i in range(start, stop)]
        else:
            frames = [_tifffile().imread(p) for p in self.files[start:stop]]
        for i, fr in enumerate(frames):
            if fr.shape != self.shape[1:]:
                fail(f"{self.name}: frame {start + i} is {fr.shape}, not {self.shape[1:]}")
        return np.stack([fr[y0:y1, x0:x1] for fr in frames])

    def close(self):
        if self._tif is not None:
            self._tif.close()


def import_tiff(src, output, *, positions: str, units: str | None = None,
                motion: str = "probe", columns: str = "yx", geometry: Geometry | None = None,
                preprocess: Preprocess | None = None, mask=None, overwrite: bool = False,
                progress: bool = False, **kw):
    """Import a TIFF stack (``src``: multi-page file, directory or glob) with positions from a
    separate file (``pos.npy``, ``pos.csv``, ``other.h5::/path``) in ``units``."""
    with TiffSource(src) as source:
        if positions is None:
            fail(f"{src}: TIFF files carry no scan positions; pass --positions FILE")
        values, file_units = read_positions_file(positions)
        scan = Scan(values, units or file_units, motion, columns, origin=positions)
        return import_source(source, output, scan=scan, geometry=geometry or Geometry(),
                             preprocess=preprocess, file_bad=mask, fmt="tiff",
                             overwrite=overwrite, progress=progress, **kw)
