"""Stream a :class:`~.source.Source` into a data-set store, one shard at a time.

Reuses the store's own writers: :func:`~daskpty.io.writing.shard_layout` for the layout,
:func:`~daskpty.io.writing.atomic_store` so nothing half-written is ever left at the target,
:func:`~daskpty.io.writing.create_store` and :func:`~daskpty.io.writing.guarded_write` for the
arrays and :func:`~daskpty.io.metadata.make_metadata` for geometry and provenance. Frames are read
in pieces of at most :data:`PIECE_BYTES` and one shard is compressed and written in a
background thread while the next is read, so memory stays at a few shards.
"""
from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zarr

from ..progress import TextProgress
from ..metadata import make_metadata
from ..store import open_data
from ..writing import DEFAULT_SHARD_BYTES, atomic_store, create_store, guarded_write, shard_layout
from ..validate import fail
from ...physics.probes import electron_probe
from .geometry import Geometry, positions_to_pixels
from .preprocess import Plan, Preprocess, center_of_mass
from .source import check_frames

#: raw bytes read from the source at a time (as float64 while preprocessed)
PIECE_BYTES = 16 * 2**20


@dataclasses.dataclass
class Scan:
    """Positions as read from a file, before conversion: ``values`` (N, 2|3), their ``units``,
    ``motion`` ("probe" or "sample"), ``columns`` ("yx" or "xy"), detector ``basis``."""

    values: np.ndarray
    units: str | None
    motion: str = "probe"
    columns: str = "yx"
    basis: np.ndarray | None = None
    origin: str = ""


def _pieces(start, stop, per_piece):
    for a in range(start, stop, per_piece):
        yield a, min(stop, a + per_piece)


def mean_pattern(source, *, progress=False, bad=None, label="centre") -> np.ndarray:
    """Mean frame of the whole detector, streamed (first pass of an auto-centred crop)."""
    n, h, w = source.shape
    per = max(1, PIECE_BYTES // (h * w * 8))
    total = np.zeros((h, w))
    bar = TextProgress(-(-n // per), label, unit="pieces", enabled=progress)
    try:
        for a, b in _pieces(0, n, per):
            block = np.asarray(source.read(a, b), dtype=np.float64)
            total += np.nan_to_num(block, nan=0.0, posinf=0.0, neginf=0.0).sum(axis=0)
            bar.update(1, b - a)
    finally:
        bar.close()
    return total / n


def _meta_geometry(geometry: Geometry, pre: Preprocess) -> dict:
    """make_metadata's geometry arguments; the detector pixel grows with the binning."""
    px = geometry.pixel_size_m
    out = dict(wavelength_m=geometry.wavelength, detector_distance_m=geometry.distance_m,
               detector_pixel_size_m=None if px is None else px * pre.bin,
               object_pixel_size_m=geometry.object_pixel_size_m)
    if geometry.near_field:  # holograms: the object pixel is the detector's / magnification
        out.update(detector="near_field", focus_to_sample_m=geometry.focus_to_sample_m)
    if geometry.radiation == "electron" and geometry.energy_ev is not None and geometry.wavelength_m is None:
        out["electron_voltage_v"] = geometry.energy_ev
    if geometry.convergence_semiangle_mrad is not None:
        out["convergence_semiangle_rad"] = geometry.convergence_semiangle_mrad * 1e-3
    return out


def _optics(geometry: Geometry, meta: dict, size: int):
    """``(extra metadata, start probe or None)`` of an electron probe's optics: the defocus as
    ``defocus_m`` and, when the convergence semi-angle is known, the aperture's probe (unit power
    until the data's mean counts are known) — checked before anything is written."""
    extra = {} if geometry.defocus_m is None else {"defocus_m": float(geometry.defocus_m)}
    alpha = meta.get("convergence_semiangle_rad")
    if alpha is None:
        return extra, None
    if meta.get("electron_voltage_v") is None:
        fail("an electron probe needs the beam energy: give --energy EV (the accelerating voltage, "
             "e.g. 300e3) rather than --wavelength")
    if meta.get("object_pixel_size_m") is None:
        fail("an electron probe needs the object pixel size: give --distance and --pixel-size "
             "(camera length and detector pixel) or --object-pixel-size")
    try:
        probe = electron_probe(size, meta["object_pixel_size_m"], meta["wavelength_m"], alpha,
                               defocus_m=geometry.defocus_m or 0.0)
    except ValueError as exc:
        fail(f"the probe of --convergence-semiangle and --defocus: {exc}")
    extra["probe_plane"] = "entrance"  # made at the sample's entrance surface, where the defocus is measured
    return extra, probe


def import_source(source, output, *, scan: Scan, geometry: Geometry,
                  preprocess: Preprocess | None = None, file_bad=None, fmt: str = "",
                  overwrite: bool = False, progress: bool = False,
                  shard_bytes: int = DEFAULT_SHARD_BYTES, details: dict | None = None):
    """Check everything, then write ``source`` into a new store at ``output``; return it opened.

    ``file_bad``: (H, W) bool, True = bad detector pixel. ``details``: extra JSON facts about the
    source for the provenance. Every check runs before the first byte is written; a failure while
    streaming leaves nothing at ``output``.
    """
    pre = preprocess or Preprocess()
    n_frames, h, w = source.shape
    check_frames(source.shape, source.name)
    output = os.fspath(output)
    if os.path.lexists(output) and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite (Python: overwrite=True) "
                              f"to replace it, or choose another path")
    values = np.asarray(scan.values)
    if values.ndim != 2 or len(values) != n_frames:
        count = values.shape[0] if values.ndim >= 1 else 0
        fail(f"{source.name} has {n_frames} patterns but {scan.origin or 'the positions'} "
             f"hold{'s' if count == 1 else ''} {count} positions; give exactly one position per "
             f"pattern")
    if file_bad is not None and np.shape(file_bad) != (h, w):
        fail(f"the mask has shape {np.shape(file_bad)} but the detector is {h} x {w}")
    center = pre.center
    if pre.crop is not None and pre.crop > min(h, w):
        Plan(pre, (h, w), center, file_bad, source.dtype)  # fails with the crop message
    tentative = make_metadata(pattern_size=min(h, w), **_meta_geometry(geometry, pre))
    positions_to_pixels(values, units=scan.units, object_pixel_size_m=tentative[
        "object_pixel_size_m"], motion=scan.motion, columns=scan.columns,
        pattern_size=min(h, w), basis=scan.basis)  # units, scale, geometry: before the centre pass
    if pre.needs_center((h, w)):
        center = center_of_mass(mean_pattern(source, progress=progress, bad=file_bad), file_bad)
    plan = Plan(pre, (h, w), center, file_bad, source.dtype)
    size = plan.size
    meta_geometry = _meta_geometry(geometry, pre)
    probe_meta = make_metadata(pattern_size=size, **meta_geometry)
    optics, probe = _optics(geometry, probe_meta, size)
    positions = positions_to_pixels(values, units=scan.units,
                                    object_pixel_size_m=probe_meta["object_pixel_size_m"],
                                    motion=scan.motion, columns=scan.columns,
                                    pattern_size=size, basis=scan.basis)
    shape = (n_frames, size, size)
    shard, inner = shard_layout(shape, plan.dtype, shard_bytes)
    y0, y1, x0, x1 = plan.window
    per = max(1, PIECE_BYTES // ((y1 - y0) * (x1 - x0) * 8))
    with atomic_store(output, overwrite=overwrite) as tmp:
        arr = create_store(tmp, shape=shape, dtype=plan.dtype, shard_len=shard, inner_len=inner,
                           positions=positions, mask=np.ones((size, size), bool), probe=probe,
                           metadata=make_metadata(pattern_size=size, **meta_geometry))
        bar = TextProgress(-(-n_frames // shard), "import", enabled=progress)
        pending, total = None, 0.0
        with ThreadPoolExecutor(1) as pool:
            try:
                for s0 in range(0, n_frames, shard):
                    s1 = min(n_frames, s0 + shard)
                    block = np.empty((s1 - s0, size, size), plan.dtype)
                    for a, b in _pieces(s0, s1, per):
                        block[a - s0:b - s0] = plan.apply(source.read(a, b, plan.window))
                    total += float(block.sum(dtype=np.float64))
                    if pending is not None:
                        bar.update(1, pending.result())
                    pending = pool.submit(guarded_write, arr, tmp, s0, block)
                    del block
                if pending is not None:
                    bar.update(1, pending.result())
            finally:
                bar.close()
        mask = plan.mask()
        record = plan.record()
        group = zarr.open_group(tmp, mode="r+")
        group["mask"][...] = mask
        if probe is not None and total > 0:  # the start probe's power: the mean counts per pattern
            group["probe"][...] = probe * np.float32(np.sqrt(total / n_frames))
        summary = (f"imported from {os.path.abspath(source.name)} ({fmt}): {plan.summary()}; "
                   f"positions from {scan.origin or 'the file'} ({scan.units}, {scan.motion} "
                   f"motion)")
        group.attrs.update(make_metadata(
            pattern_size=size, **meta_geometry, provenance=summary,
            extra={"import": {"source": os.path.abspath(source.name), "format": fmt,
                              "detector_shape": [h, w], "source_dtype": str(source.dtype),
                              "positions": {"origin": scan.origin, "units": scan.units,
                                            "motion": scan.motion, "columns": scan.columns,
                                            "basis_applied": scan.basis is not None},
                              "preprocess": record, **(details or {})}, **optics}))
    return open_data(output)
