"""EMPAD raw import (electron pixel array detector): 128 × 130 float32 frames, row-major scan.

Each frame is 130 rows of 128 float32 pixels; the last two rows are frame metadata and are
dropped. The file is memory-mapped; the scan shape (rows × columns) must be given.
"""
from __future__ import annotations

import os

import numpy as np

from ..validate import fail
from .geometry import Geometry, raster_positions
from .positions import read_positions_file
from .preprocess import Preprocess
from .source import ArraySource
from .writer import Scan, import_source

COLS, ROWS, META_ROWS = 128, 130, 2
FRAME_BYTES = COLS * ROWS * 4


def empad_source(path, scan_shape) -> ArraySource:
    """A memory-mapped :class:`ArraySource` of the 128 × 128 detector frames of ``path``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    rows, cols = _scan_shape(scan_shape)
    size = os.path.getsize(path)
    expected = rows * cols
    n, rest = divmod(size, FRAME_BYTES)
    if rest or n < expected:
        fail(f"{path} is truncated or not EMPAD raw: {size:,} bytes hold {n} whole 128 x 130 "
             f"float32 frames{f' and {rest:,} stray bytes' if rest else ''}, but the scan shape "
             f"{rows} x {cols} needs {expected} frames ({expected * FRAME_BYTES:,} bytes)")
    if n > expected:
        fail(f"{path} holds {n} frames but the scan shape {rows} x {cols} gives {expected}; "
             f"check --scan-shape")
    mm = np.memmap(path, dtype="<f4", mode="r", shape=(n, ROWS, COLS))
    return ArraySource(mm, path, rows=ROWS - META_ROWS)


def _scan_shape(scan_shape):
    if scan_shape is None:
        fail("EMPAD raw files do not record the scan shape; pass --scan-shape ROWSxCOLS")
    try:
        rows, cols = (int(v) for v in scan_shape)
    except (TypeError, ValueError):
        fail(f"scan shape must be two integers (rows, columns), got {scan_shape!r}")
    if rows < 1 or cols < 1:
        fail(f"scan shape must be positive, got {rows} x {cols}")
    return rows, cols


def import_empad(src, output, *, scan_shape, step: float | None = None,
                 positions: str | None = None, units: str | None = None,
                 motion: str = "probe", columns: str = "yx", geometry: Geometry | None = None,
                 preprocess: Preprocess | None = None, mask=None, overwrite: bool = False,
                 progress: bool = False, **kw):
    """Import an EMPAD raw file scanned on a ``scan_shape`` = (rows, cols) raster.

    Positions: a separate file (``positions``), or the raster with ``step`` in ``units``.
    ``geometry`` defaults to electrons (give ``energy_ev``, e.g. 300e3, and the camera length as
    ``distance_m`` with ``pixel_size_m`` 150e-6, or ``object_pixel_size_m``). ``mask``: (128, 128)
    True = bad.
    """
    source = empad_source(src, scan_shape)
    rows, cols = _scan_shape(scan_shape)
    if positions is not None:
        values, file_units = read_positions_file(positions)
        scan = Scan(values, units or file_units, motion, columns, origin=positions)
    else:
        if step is None or not step > 0:
            fail("give the scan step (--step S with --units) or a positions file (--positions)")
        scan = Scan(raster_positions(rows, cols, step), units, motion, "yx",
                    origin=f"{rows} x {cols} raster, step {step:g} {units}")
    geo = geometry or Geometry(radiation="electron")
    try:
        return import_source(source, output, scan=scan, geometry=geo, preprocess=preprocess,
                             file_bad=mask, fmt="empad", overwrite=overwrite, progress=progress,
                             details={"scan_shape": [rows, cols]}, **kw)
    finally:
        source.close()
