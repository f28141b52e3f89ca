"""The daskpty data-set store: a Zarr v3 group holding diffraction patterns and scan positions.

Layout (see docs/data-format.md)::

    X.zarr/                 group, attrs: daskpty format marker, geometry, units, provenance
      intensities           (N, H, W) uint16|uint32|float32, sharded along N (1 shard = 1 dask chunk)
      positions             (N, 2) float64, (y, x) in object pixels
      mask                  (H, W) bool, optional (True = valid pixel)
      probe                 (M, H, W) complex64, optional initial guess
      truth/                optional ground truth: object (complex64 2-D, or (K, H, W) slices), probe, positions

Writing (streamed shard by shard into ``X.zarr.partial-<random>``, renamed into place at the end)
lives in :mod:`.writing`; the root attributes and ``truth/`` in :mod:`.metadata`.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import dask.array as da
from dask.base import tokenize
import numpy as np
import zarr

from .integrity import (EVERY_CHUNK, NamedReader, check_json_files, check_present, check_shards,
                        chunk_files, missing_files)
from .gather import gathered
from .live_format import check_committed_files, committed_length, committed_reader, live_view
from .metadata import Truth, check_truth, check_truth_shapes, make_metadata
from .safety import interrupted_copy, store_bytes
from .validate import (FORMAT_NAME, FORMAT_VERSION, DataError, ValueReport, check_format_attrs,
                       check_geometry, check_intensity_layout, check_mask, check_positions, check_probe,
                       check_values, fail)
from .writing import (DEFAULT_INNER_BYTES, DEFAULT_MIN_SHARDS, DEFAULT_SHARD_BYTES, atomic_store,
                      create_store, shard_layout, write_blocks)


# --------------------------------------------------------------------------- the data set

@dataclasses.dataclass(eq=False, repr=False)
class PtychoData:
    """A ptychographic data set: lazily loaded patterns plus small in-memory arrays.

    ``intensities`` is a dask array (N, H, W) whose chunks are the store's shards (full patterns),
    ``positions`` a NumPy (N, 2) float64 array of (y, x) object pixels, ``mask`` (H, W) bool or None,
    ``probe`` (M, H, W) complex64 or None, ``metadata`` the store's root attributes, ``truth`` a
    :class:`Truth` or None, ``path`` the store path (None for in-memory data).
    """

    intensities: da.Array
    positions: np.ndarray
    mask: np.ndarray | None = None
    probe: np.ndarray | None = None
    metadata: dict = dataclasses.field(default_factory=dict)
    truth: Truth | None = None
    path: str | None = None

    @property
    def n_patterns(self) -> int:
        return int(self.intensities.shape[0])

    def intensities_in_chunks(self, length: int, order=None) -> da.Array:
        """The intensities taken in ``order`` (None: as stored) as a dask array of
        ``length``-pattern chunks read straight from the store: each chunk's task reads only the
        inner chunks holding its patterns (:func:`~.gather.gathered`), not whole shards. In-memory
        data sets are indexed and rechunked."""
        arr = None
        if self.path is not None:
            try:
                arr = zarr.open_group(self.path, mode="r")["intensities"]
            except Exception:  # (moved or replaced since it was opened) index the opened array
                arr = None
        if arr is not None and arr.shape == self.intensities.shape:
            return gathered(NamedReader(arr, self.path), order, length)
        x = self.intensities if order is None else self.intensities[np.asarray(order)]
        return x.rechunk((int(length), -1, -1))

    @property
    def pattern_shape(self) -> tuple[int, int]:
        return tuple(int(s) for s in self.intensities.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.intensities.dtype

    @property
    def chunk_length(self) -> int:
        """Patterns per dask chunk (= per shard for data read from a store)."""
        return int(self.intensities.chunks[0][0])

    def check_values(self, client=None) -> ValueReport:
        """One pass over the intensities: NaN / infinite / negative counts, min, max, sum."""
        return check_values(self, client=client)

    def to_zarr(self, path, *, overwrite: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
                inner_bytes: int = DEFAULT_INNER_BYTES, min_shards: int = DEFAULT_MIN_SHARDS,
                progress: bool = False, client=None) -> PtychoData:
        """Write the data set to a new Zarr v3 store at ``path`` and return it opened from there.

        Shard and inner-chunk lengths follow :func:`shard_layout` (``shard_bytes``,
        ``inner_bytes``, ``min_shards``). Streams one shard at a time (each dask chunk, re-chunked
        to the shard length, is computed and written as exactly one shard), so data sets bigger
        than memory can be written. Runs on
        ``client``, else the current distributed client, else local threads. Writes to
        ``path.partial-<random>`` and renames at the end; an existing ``path`` is refused unless
        ``overwrite=True``.
        """
        shape = (self.n_patterns, *self.pattern_shape)
        shard, inner = shard_layout(shape, self.dtype, shard_bytes, inner_bytes, min_shards)
        x = self.intensities.rechunk((shard, -1, -1))
        meta = copy.deepcopy(self.metadata)
        meta["daskpty"] = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
        with atomic_store(path, overwrite=overwrite) as tmp:
            arr = create_store(tmp, shape=shape, dtype=self.dtype, shard_len=shard, inner_len=inner,
                               positions=self.positions, mask=self.mask, probe=self.probe,
                               metadata=meta, truth=self.truth)
            write_blocks(x, arr, tmp, client=client, progress=progress)
        return open_data(path)

    def __repr__(self):
        n, (h, w) = self.n_patterns, self.pattern_shape
        where = f", path={self.path!r}" if self.path else ""
        truth = ", truth" if self.truth is not None else ""
        return (f"PtychoData({n} patterns of {h}x{w} {self.dtype}, chunks of {self.chunk_length}"
                f"{', mask' if self.mask is not None else ''}"
                f"{', probe' if self.probe is not None else ''}{truth}{where})")


# --------------------------------------------------------------------------- build / open

def from_arrays(intensities, positions, *, mask=None, probe=None, wavelength_m=None,
                detector_distance_m=None, detector_pixel_size_m=None, object_pixel_size_m=None,
                units=None, provenance: str = "", truth=None, metadata: dict | None = None,
                shard_bytes: int = DEFAULT_SHARD_BYTES, electron_voltage_v=None,
                reciprocal_pixel_rad=None, convergence_semiangle_rad=None, focus_to_sample_m=None,
                detector: str | None = None, geometry=None) -> PtychoData:
    """Build a :class:`PtychoData` from NumPy or dask arrays (structural checks included).

    intensities (N, H, W) uint16/uint32/float32 (float64 and float16 are converted to float32 with
    a warning), DC at the pattern centre; positions (N, 2) (y, x)
    object pixels; mask (H, W) bool (True = valid); probe (M, H, W) or (H, W) complex initial guess;
    geometry in metres (electrons: ``electron_voltage_v``, ``reciprocal_pixel_rad``,
    ``convergence_semiangle_rad``; near field: ``detector="near_field"``, ``focus_to_sample_m``;
    or a ``geometry`` object of :mod:`daskpty.physics.geometry`; see :func:`make_metadata`);
    ``truth`` an optional dict with ``object``, ``probe``, ``positions``;
    ``metadata`` extra JSON attributes. A NumPy ``intensities`` is wrapped in a dask array chunked
    like the shards ``to_zarr`` would write.
    """
    if isinstance(intensities, da.Array):
        x = _stored_dtype(intensities)
    else:
        arr = _stored_dtype(np.asarray(intensities))
        check_intensity_layout(arr.shape, arr.dtype)
        shard, _ = shard_layout(arr.shape, arr.dtype, shard_bytes)
        x = da.from_array(arr, chunks=(shard, -1, -1))
    check_intensity_layout(x.shape, x.dtype)
    if len(x.chunks[1]) > 1 or len(x.chunks[2]) > 1:
        x = x.rechunk({1: -1, 2: -1})
    if isinstance(positions, da.Array):
        positions = positions.compute()
    positions = check_positions(positions, x.shape[0])
    pattern_shape = tuple(int(s) for s in x.shape[1:])
    mask = check_mask(mask, pattern_shape)
    probe = check_probe(probe, pattern_shape)
    meta = make_metadata(pattern_size=pattern_shape[-1], wavelength_m=wavelength_m,
                         detector_distance_m=detector_distance_m,
                         detector_pixel_size_m=detector_pixel_size_m,
                         object_pixel_size_m=object_pixel_size_m, units=units,
                         provenance=provenance, extra=metadata, electron_voltage_v=electron_voltage_v,
                         reciprocal_pixel_rad=reciprocal_pixel_rad,
                         convergence_semiangle_rad=convergence_semiangle_rad,
                         focus_to_sample_m=focus_to_sample_m, detector=detector, geometry=geometry)
    return PtychoData(intensities=x, positions=positions, mask=mask, probe=probe, metadata=meta,
                      truth=check_truth(truth, pattern_shape), path=None)


def _stored_dtype(x):
    """float64 / float16 intensities as float32, with a warning (exact for counts below 2**24;
    negative or non-finite values are refused by the value check, as for float32 data). Other
    dtypes are left for check_intensity_layout to judge."""
    if np.dtype(x.dtype) not in (np.float64, np.float16) or x.ndim != 3:
        return x
    warnings.warn(f"intensities are {np.dtype(x.dtype)}; converted to float32, the dtype the store "
                  f"holds", UserWarning, stacklevel=3)
    return x.astype(np.float32)


_VALIDATE = (None, "metadata", "full")


def open_data(path, validate: str | None = "metadata", client=None, frames: str = "all") -> PtychoData:
    """Open a data-set store lazily.

    ``validate``: ``"metadata"`` (default) checks format, shapes, dtypes, positions, and that
    every shard file of the intensities is on disk with a sound index (:mod:`.integrity`);
    ``"full"`` also reads every intensity once (NaN / infinite / negative values, on ``client``
    or the current client or local threads); ``None`` checks only the format marker.
    Problems raise :class:`DataError`.

    ``frames``: a live store still being written (:mod:`.live`) is refused with ``"all"``;
    ``"committed"`` reads the frames its writer has committed so far (all frames of any other
    store).
    """
    if validate not in _VALIDATE:
        raise ValueError(f"validate must be one of {_VALIDATE}, got {validate!r}")
    where = os.fspath(path)
    if not os.path.exists(where):
        fail(missing_data_message(where))
    if os.path.isdir(where):
        check_json_files(where)  # a truncated zarr.json is named, not a bare JSON message
    try:
        group = zarr.open_group(os.path.abspath(where), mode="r")
    except zarr.errors.ContainsArrayError:
        fail(f"{where} is a single Zarr array, not a daskpty data set group; pass the store's "
             f"root directory")
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        fail(f"{where} is not a Zarr store ({type(exc).__name__}); pass a daskpty data set "
             f"(a .zarr directory made by daskpty)")
    check_format_attrs(group.attrs, where)
    live = live_view(group.attrs, where, frames)  # before the arrays: they are at least this long
    if group.metadata.zarr_format != 3:
        fail(f"{where} is a Zarr v{group.metadata.zarr_format} store; daskpty data sets are "
             f"Zarr v3, rewrite it with daskpty.from_arrays(...).to_zarr(path)")
    arrays = {}
    for name, shape_hint in (("intensities", "(N, H, W)"), ("positions", "(N, 2)")):
        node = group.get(name)
        if not isinstance(node, zarr.Array):
            fail(f"{where} has no '{name}' array {shape_hint}; the store is incomplete, "
                 f"re-create it with daskpty.from_arrays(...).to_zarr(path)")
        arrays[name] = node
    inten = arrays["intensities"]
    n_live = committed_length(where, live, inten.shape[0])  # None: every frame
    if n_live is None:
        if validate is not None:
            check_intensity_layout(inten.shape, inten.dtype)
            _check_shards(group, inten, where)
        x = _dask_array(inten, where, inten.shards or inten.chunks)
        positions = arrays["positions"][...]
    else:
        if validate is not None:
            check_intensity_layout((n_live, *inten.shape[1:]), inten.dtype)
            for arr in arrays.values():
                check_committed_files(arr, where, n_live)
        x = _dask_array(committed_reader(inten, where, n_live), where, inten.chunks)
        positions = arrays["positions"][:n_live]
    if len(x.chunks[1]) > 1 or len(x.chunks[2]) > 1:
        x = x.rechunk({1: -1, 2: -1})
    mask = group["mask"][...] if isinstance(group.get("mask"), zarr.Array) else None
    probe = group["probe"][...] if isinstance(group.get("probe"), zarr.Array) else None
    truth_group = group.get("truth")
    truth = Truth(group=truth_group) if isinstance(truth_group, zarr.Group) else None
    pattern_shape = tuple(int(s) for s in inten.shape[1:])
    if validate is not None:
        positions = check_positions(positions, int(x.shape[0]))
        mask = check_mask(mask, pattern_shape)
        probe = check_probe(probe, pattern_shape)
        check_geometry(dict(group.attrs))
        if truth is not None:
            check_truth_shapes(truth, pattern_shape, where)
    else:
        positions = np.asarray(positions, dtype=np.float64)
    metadata = copy.deepcopy(dict(group.attrs))
    data = PtychoData(intensities=x, positions=positions, mask=mask, probe=probe,
                      metadata=metadata, truth=truth, path=os.path.abspath(where))
    if validate == "full":
        check_values(data, client=client).raise_if_bad()
    return data



def missing_data_message(where: str) -> str:
    """'no such data set', naming the only copy an interrupted write left (``X.previous`` or
    ``X.old-*``) and how to restore it."""
    where = os.fspath(where).rstrip("/") or where
    copy = interrupted_copy(where)
    if copy is not None:
        return (f"{where}: no such data set, but {copy} holds one (a write was interrupted between "
                f"its two renames): rename it back (mv {copy} {where}) and run again")
    return (f"{where}: no such data set (the path does not exist); check the path or create it "
            f"with 'daskpty simulate'")


def _check_shards(group, inten, where: str) -> None:
    """Every shard file of ``intensities`` on disk and its index sound, else one line naming the
    files. A store without the writer's every-chunk record (older daskpty skipped all-zero
    shards) is judged by the files present, as before."""
    marker = group.attrs.get("daskpty") or {}
    missing = missing_files(inten, where)
    if missing and not marker.get(EVERY_CHUNK):
        total = len(chunk_files(inten))
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        fail(f"{where}: {len(missing)} of {total} shards of 'intensities' are missing ({shown}); the "
             f"store is incomplete (interrupted copy?) — re-copy or re-create it (daskpty before "
             f"the every-chunk record also left all-zero shards out: re-importing such data "
             f"fixes it)")
    check_present(inten, where, "intensities")
    check_shards(inten, where, "intensities")


def _dask_array(arr, where: str, chunks) -> da.Array:
    """``da.from_zarr`` whose read errors name the damaged shard file (:class:`NamedReader`)."""
    return da.from_array(NamedReader(arr, where), chunks=chunks,
                         name="from-zarr-" + tokenize(arr, chunks),
                         meta=np.empty((0,) * arr.ndim, dtype=arr.dtype))


store_size_bytes = store_bytes  # bytes on disk under a path (kept under its old name)


__all__ = ["DataError", "PtychoData", "from_arrays", "open_data", "store_size_bytes"]
