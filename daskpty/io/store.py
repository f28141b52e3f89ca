"""The daskpty data-set store: a Zarr v3 group holding diffraction patterns and scan positions.

Layout (see docs/data-format.md)::

    X.zarr/                 group, attrs: daskpty format marker, geometry, units, provenance
      intensities           (N, H, W) uint16|uint32|float32, sharded along N (1 shard = 1 dask chunk)
      positions             (N, 2) float64, (y, x) in object pixels
      mask                  (H, W) bool, optional (True = valid pixel)
      probe                 (M, H, W) complex64, optional initial guess
      truth/                optional ground truth: object (complex64 2-D, or (K, H, W) slices), probe, positions

Writing is streamed shard by shard into ``X.zarr.partial-<random>`` and renamed into place at the
end, so a failure never leaves a half-written store at the target path.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import math
import os
import secrets
import shutil
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import dask
import dask.array as da
import numpy as np
import zarr
from zarr.codecs import BloscCodec

from .lock import StoreLock, check_unlocked
from .progress import TextProgress
from .safety import (clean_stale, store_bytes, intact_note, interrupted_copy, is_daskpty_store, remove_own,
                     write_error)
from .validate import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GEOMETRY_KEYS,
    PHYSICS_KEYS,
    DataError,
    ValueReport,
    check_format_attrs,
    check_geometry,
    check_intensity_layout,
    check_mask,
    check_positions,
    check_probe,
    check_values,
    fail,
)

MiB = 2**20
#: default target size of one shard (= one dask chunk) of ``intensities``
DEFAULT_SHARD_BYTES = 64 * MiB
#: default target size of one inner (compression) chunk inside a shard
DEFAULT_INNER_BYTES = 2 * MiB
#: small data sets are split into at least this many shards (see shard_layout) ...
DEFAULT_MIN_SHARDS = 8
#: ... unless that would make shards smaller than this
MIN_SHARD_BYTES = 1 * MiB

DEFAULT_UNITS = {
    "intensities": "photon counts",
    "positions": "object pixels (y, x)",
    "wavelength_m": "m",
    "detector_distance_m": "m",
    "detector_pixel_size_m": "m",
    "object_pixel_size_m": "m",
}
#: units of the optional geometry keys, listed in ``units`` when the key is present
PHYSICS_UNITS = {"focus_to_sample_m": "m", "electron_voltage_v": "V", "reciprocal_pixel_rad": "rad",
                 "convergence_semiangle_rad": "rad"}
RESERVED_KEYS = ("daskpty", *GEOMETRY_KEYS, *PHYSICS_KEYS, "detector", "units", "provenance")

_MARKER = ".daskpty-writing"
_TOKEN_PREFIX = ".daskpty-w-"


class WriteCancelled(RuntimeError):
    """A shard write found its store being discarded (another shard failed)."""


# --------------------------------------------------------------------------- layout helpers

def shard_layout(shape, dtype, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 inner_bytes: int = DEFAULT_INNER_BYTES, min_shards: int = DEFAULT_MIN_SHARDS,
                 min_shard_bytes: int = MIN_SHARD_BYTES) -> tuple[int, int]:
    """Patterns per shard and per inner chunk for intensities of ``shape`` (N, H, W).

    Shard length: ``shard_bytes`` worth of patterns, but small data sets are cut into at least
    ``min_shards`` shards (so a cluster has work to spread) as long as a shard stays above
    ``min_shard_bytes``; an explicit ``shard_bytes`` below that floor is obeyed. The inner
    (compression) chunk holds ``inner_bytes`` worth of patterns, at most a shard, at least one,
    and the shard is a whole number of inner chunks. When all N patterns fit in one shard, N is
    split evenly into inner chunks, so the single shard is N long (or a few patterns longer when
    N has no convenient divisor).
    """
    if shard_bytes is None or shard_bytes <= 0 or inner_bytes <= 0:
        raise ValueError(f"shard_bytes and inner_bytes must be positive, got {shard_bytes}, "
                         f"{inner_bytes}")
    n, h, w = (int(s) for s in shape)
    n = max(n, 1)
    pattern = max(1, h * w * np.dtype(dtype).itemsize)
    target = max(1, shard_bytes // pattern)
    spread = math.ceil(n / max(1, min_shards))
    floor = math.ceil(min_shard_bytes / pattern)
    length = min(target, max(spread, floor))
    inner = int(max(1, min(length, n, inner_bytes // pattern)))
    if length >= n:  # one shard: split N evenly into inner chunks
        k = math.ceil(n / inner)
        inner = math.ceil(n / k)
        return int(inner * k), int(inner)
    return int(max(1, length // inner) * inner), inner


def _compressor(dtype):
    dtype = np.dtype(dtype)
    shuffle = "bitshuffle" if dtype.kind in "iu" else "shuffle"
    return BloscCodec(cname="zstd", clevel=3, shuffle=shuffle)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None  # JSON has no NaN / Inf
    return obj


def make_metadata(*, pattern_size: int | None = None, wavelength_m=None, detector_distance_m=None,
                  detector_pixel_size_m=None, object_pixel_size_m=None, units=None,
                  provenance: str = "", extra: dict | None = None, electron_voltage_v=None,
                  reciprocal_pixel_rad=None, convergence_semiangle_rad=None, focus_to_sample_m=None,
                  detector: str | None = None, geometry=None) -> dict:
    """Root attributes of a data-set store.

    ``object_pixel_size_m``, when not given, is derived: far field, wavelength·distance /
    (n·detector pixel); electrons with ``reciprocal_pixel_rad`` (Δθ), λ / (n Δθ); near field
    (``detector="near_field"``), detector pixel / M with M = (z1 + z2) / z1, z1 =
    ``focus_to_sample_m`` (None: plane wave, M = 1), z2 = ``detector_distance_m``. The wavelength
    follows from ``electron_voltage_v`` (relativistic) when not given. ``geometry``: an
    ``XrayGeometry`` / ``ElectronGeometry`` / ``NearFieldGeometry`` of
    :mod:`daskpty.physics.geometry` (its ``metadata()``; explicit arguments win). ``extra`` adds
    further (JSON) keys that must not clash with the reserved ones.
    """
    meta = {"daskpty": {"format": FORMAT_NAME, "version": FORMAT_VERSION}}
    given = dict(wavelength_m=wavelength_m, detector_distance_m=detector_distance_m,
                 detector_pixel_size_m=detector_pixel_size_m, object_pixel_size_m=object_pixel_size_m,
                 electron_voltage_v=electron_voltage_v, reciprocal_pixel_rad=reciprocal_pixel_rad,
                 convergence_semiangle_rad=convergence_semiangle_rad, focus_to_sample_m=focus_to_sample_m,
                 detector=detector)
    if geometry is not None:
        given = {**geometry.metadata(), **{k: v for k, v in given.items() if v is not None}}
    check_geometry(given)
    for key in (*GEOMETRY_KEYS, *PHYSICS_KEYS):
        value = given.get(key)
        meta[key] = None if value is None else float(value)
    meta["detector"] = given.get("detector") or "far_field"
    _derive_geometry(meta, pattern_size)
    for key in (*PHYSICS_KEYS, "detector"):  # absent = not known (detector: far field)
        if meta[key] is None or (key == "detector" and given.get("detector") is None):
            del meta[key]
    meta["units"] = {**DEFAULT_UNITS, **{k: u for k, u in PHYSICS_UNITS.items() if k in meta}, **(units or {})}
    meta["provenance"] = str(provenance or "")
    for key, value in (extra or {}).items():
        if key in RESERVED_KEYS:
            raise ValueError(f"metadata key {key!r} is reserved; pass it as its own argument")
        meta[key] = value
    return _jsonable(meta)


def _derive_geometry(meta: dict, pattern_size) -> None:
    """Fill in the wavelength (from an electron voltage) and the object pixel size (in place)."""
    volts = meta["electron_voltage_v"]
    if volts is not None:
        from .importers.geometry import wavelength_from_energy

        lam = wavelength_from_energy(volts, "electron")
        if meta["wavelength_m"] is None:
            meta["wavelength_m"] = lam
        elif not math.isclose(meta["wavelength_m"], lam, rel_tol=1e-3):
            fail(f"wavelength_m={meta['wavelength_m']:g} disagrees with the {volts:g} V electron "
                 f"wavelength {lam:.6g} m; give one of them")
    if meta["object_pixel_size_m"] is not None:
        return
    lam, z, p = meta["wavelength_m"], meta["detector_distance_m"], meta["detector_pixel_size_m"]
    if meta["detector"] == "near_field":
        if p is not None and z is not None:
            z1 = meta["focus_to_sample_m"]
            meta["object_pixel_size_m"] = p if z1 is None else p * z1 / (z1 + z)
    elif meta["reciprocal_pixel_rad"] is not None and lam is not None and pattern_size:
        meta["object_pixel_size_m"] = lam / (int(pattern_size) * meta["reciprocal_pixel_rad"])
    elif pattern_size and None not in (lam, z, p):
        meta["object_pixel_size_m"] = lam * z / (int(pattern_size) * p)


# --------------------------------------------------------------------------- ground truth

class Truth:
    """Ground truth of a simulated data set: ``.object``, ``.probe``, ``.positions`` (NumPy).

    Arrays come from memory or, lazily on first access, from a store's ``truth/`` group.
    A missing array reads as None.
    """

    NAMES = ("object", "probe", "positions")

    def __init__(self, *, object=None, probe=None, positions=None, group=None):
        self._cache = {k: v for k, v in (("object", object), ("probe", probe),
                                         ("positions", positions)) if v is not None}
        self._group = group

    def _get(self, name):
        if name not in self._cache and self._group is not None and name in self._group:
            self._cache[name] = self._group[name][...]
        return self._cache.get(name)

    object = property(lambda self: self._get("object"), doc="complex64 (H, W) object, or (K, H, W) slices")
    probe = property(lambda self: self._get("probe"), doc="complex64 (M, n, n) probe modes")
    positions = property(lambda self: self._get("positions"), doc="float64 (N, 2) true positions")

    def shapes(self) -> dict:
        """{name: (shape, dtype string)} of the available arrays, without loading them."""
        out = {}
        for name in self.NAMES:
            if name in self._cache:
                a = self._cache[name]
                out[name] = (tuple(a.shape), str(a.dtype))
            elif self._group is not None and name in self._group:
                a = self._group[name]
                out[name] = (tuple(a.shape), str(a.dtype))
        return out

    def __repr__(self):
        inner = ", ".join(f"{k}={s}{d}" for k, (s, d) in self.shapes().items())
        return f"Truth({inner})"


def _check_truth(truth, pattern_shape) -> Truth | None:
    if truth is None:
        return None
    if isinstance(truth, Truth):
        arrays = {k: truth._get(k) for k in Truth.NAMES}
    elif isinstance(truth, dict):
        unknown = set(truth) - set(Truth.NAMES)
        if unknown:
            raise ValueError(f"unknown truth entries {sorted(unknown)}; expected {Truth.NAMES}")
        arrays = dict(truth)
    else:
        raise TypeError("truth must be a dict with 'object', 'probe', 'positions' or a Truth")
    obj = arrays.get("object")
    if obj is not None:
        obj = np.asarray(obj)
        if obj.ndim not in (2, 3) or obj.dtype.kind not in "fc":
            fail(f"truth object has shape {obj.shape} and dtype {obj.dtype}; expected a 2-D "
                 f"complex64 array (or (K, H, W) slices of a multislice object)")
        obj = obj.astype(np.complex64, copy=False)
    probe = check_probe(arrays.get("probe"), pattern_shape, what="truth probe")
    pos = arrays.get("positions")
    if pos is not None:
        pos = np.asarray(pos)
        pos = check_positions(pos, len(pos) if pos.ndim >= 1 else -1)
    return Truth(object=obj, probe=probe, positions=pos)


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

    def intensities_in_chunks(self, length: int) -> da.Array:
        """The intensities as a dask array of ``length``-pattern chunks read straight from the
        store (each task reads only the inner chunks it needs, not whole shards); in-memory data
        sets are rechunked."""
        if self.path is not None:
            try:
                arr = zarr.open_group(self.path, mode="r")["intensities"]
                if arr.shape == self.intensities.shape:
                    return da.from_zarr(arr, chunks=(int(length), *arr.shape[1:]))
            except Exception:  # fall back to rechunking the opened array
                pass
        return self.intensities.rechunk((int(length), -1, -1))

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

    intensities (N, H, W) uint16/uint32/float32, DC at the pattern centre; positions (N, 2) (y, x)
    object pixels; mask (H, W) bool (True = valid); probe (M, H, W) or (H, W) complex initial guess;
    geometry in metres (electrons: ``electron_voltage_v``, ``reciprocal_pixel_rad``,
    ``convergence_semiangle_rad``; near field: ``detector="near_field"``, ``focus_to_sample_m``;
    or a ``geometry`` object of :mod:`daskpty.physics.geometry`; see :func:`make_metadata`);
    ``truth`` an optional dict with ``object``, ``probe``, ``positions``;
    ``metadata`` extra JSON attributes. A NumPy ``intensities`` is wrapped in a dask array chunked
    like the shards ``to_zarr`` would write.
    """
    if isinstance(intensities, da.Array):
        x = intensities
    else:
        arr = np.asarray(intensities)
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
                      truth=_check_truth(truth, pattern_shape), path=None)


_VALIDATE = (None, "metadata", "full")


def open_data(path, validate: str | None = "metadata", client=None) -> PtychoData:
    """Open a data-set store lazily.

    ``validate``: ``"metadata"`` (default) checks format, shapes, dtypes and positions;
    ``"full"`` also reads every intensity once (NaN / infinite / negative values, on ``client``
    or the current client or local threads); ``None`` checks only the format marker.
    Problems raise :class:`DataError`.
    """
    if validate not in _VALIDATE:
        raise ValueError(f"validate must be one of {_VALIDATE}, got {validate!r}")
    where = os.fspath(path)
    if not os.path.exists(where):
        fail(f"{where}: no such data set (the path does not exist); check the path or create it "
             f"with 'daskpty simulate'")
    try:
        group = zarr.open_group(os.path.abspath(where), mode="r")
    except zarr.errors.ContainsArrayError:
        fail(f"{where} is a single Zarr array, not a daskpty data set group; pass the store's "
             f"root directory")
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        fail(f"{where} is not a Zarr store ({type(exc).__name__}); pass a daskpty data set "
             f"(a .zarr directory made by daskpty)")
    check_format_attrs(group.attrs, where)
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
    if validate is not None:
        check_intensity_layout(inten.shape, inten.dtype)
        stored, expected = inten.nchunks_initialized, inten.nchunks
        if stored < expected:  # a missing shard would silently read as zeros
            fail(f"{where}: {expected - stored} of {expected} shards of 'intensities' are missing; the "
                 f"store is incomplete (interrupted copy?) — re-copy or re-create it")
    chunks = inten.shards or inten.chunks
    x = da.from_zarr(inten, chunks=chunks)
    if len(x.chunks[1]) > 1 or len(x.chunks[2]) > 1:
        x = x.rechunk({1: -1, 2: -1})
    positions = arrays["positions"][...]
    mask = group["mask"][...] if isinstance(group.get("mask"), zarr.Array) else None
    probe = group["probe"][...] if isinstance(group.get("probe"), zarr.Array) else None
    truth_group = group.get("truth")
    truth = Truth(group=truth_group) if isinstance(truth_group, zarr.Group) else None
    pattern_shape = tuple(int(s) for s in inten.shape[1:])
    if validate is not None:
        positions = check_positions(positions, inten.shape[0])
        mask = check_mask(mask, pattern_shape)
        probe = check_probe(probe, pattern_shape)
        check_geometry(dict(group.attrs))
        if truth is not None:
            _check_truth_shapes(truth, pattern_shape, where)
    else:
        positions = np.asarray(positions, dtype=np.float64)
    metadata = copy.deepcopy(dict(group.attrs))
    data = PtychoData(intensities=x, positions=positions, mask=mask, probe=probe,
                      metadata=metadata, truth=truth, path=os.path.abspath(where))
    if validate == "full":
        check_values(data, client=client).raise_if_bad()
    return data


def _check_truth_shapes(truth: Truth, pattern_shape, where) -> None:
    for name, (shape, dtype) in truth.shapes().items():
        ok = {"object": len(shape) in (2, 3) and dtype.startswith("complex"),
              "probe": len(shape) == 3 and shape[1:] == tuple(pattern_shape),
              "positions": len(shape) == 2 and shape[1] == 2}[name]
        if not ok:
            fail(f"{where}: truth/{name} has shape {shape} and dtype {dtype}, which does not fit "
                 f"the data set; re-create the store")


# --------------------------------------------------------------------------- writing

def _check_target(path: str, overwrite: bool) -> None:
    """Refuse a target another run is writing, an existing one without ``overwrite``, and
    (even with it) anything that is not a daskpty store or an empty directory."""
    check_unlocked(path)
    if not os.path.lexists(path):
        copy = interrupted_copy(path)
        if copy is not None and not overwrite:
            raise FileExistsError(f"{path} exists only as {copy} (a write was interrupted "
                                  f"between its two renames); rename it back to {path}, or pass "
                                  f"overwrite=True (CLI: --overwrite) to replace it")
        return
    if not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True (CLI: --overwrite) to "
                              f"replace it, or choose another path")
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return
    if not is_daskpty_store(path):
        raise FileExistsError(f"{path} exists and is not a Zarr store daskpty wrote (no daskpty "
                              f"marker); refusing to replace it: remove it yourself or choose "
                              f"another path")


def _remove_tree(path: str) -> None:
    """Delete a store or leftover daskpty wrote (never anything else, see io/safety.py)."""
    with contextlib.suppress(FileExistsError):
        remove_own(path)


def _discard(tmp: str, timeout: float = 120.0) -> None:
    """Stop shard writers from touching ``tmp`` (remove the marker), wait for writes in flight,
    then delete it."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(tmp, _MARKER))
    deadline = time.monotonic() + timeout
    while glob.glob(os.path.join(glob.escape(tmp), _TOKEN_PREFIX + "*")) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(tmp, ignore_errors=True)  # created by this atomic_store: ours by construction


@contextlib.contextmanager
def atomic_store(path, overwrite: bool = False):
    """Yield a fresh temporary directory next to ``path``; on success rename it to ``path``.

    On any exception the temporary directory is removed (after shard writes in flight finish) and
    ``path`` is untouched. With ``overwrite=True`` an existing Zarr store at ``path`` is replaced
    only once the new one is complete; anything else at ``path`` is never deleted.
    """
    path = os.path.abspath(os.fspath(path))
    _check_target(path, overwrite)
    parent = os.path.dirname(path)
    with StoreLock(path):
        clean_stale(path)  # leftovers of killed writes: nobody else writes here now
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = f"{path}.partial-{secrets.token_hex(4)}"
            os.mkdir(tmp)
            open(os.path.join(tmp, _MARKER), "x").close()
        except OSError as exc:
            err = write_error(exc, "writing", path, "nothing was written")
            if err is not None:
                raise err from None
            raise
        try:
            yield tmp
            os.remove(os.path.join(tmp, _MARKER))
            if os.path.lexists(path):
                _check_target(path, overwrite)
                old = f"{path}.old-{secrets.token_hex(4)}"
                os.rename(path, old)
                try:
                    os.rename(tmp, path)
                except BaseException:
                    os.rename(old, path)
                    raise
                _remove_tree(old)
            else:
                os.rename(tmp, path)
                for lone in (path + ".previous", *glob.glob(glob.escape(path) + ".old-*")):
                    _remove_tree(lone)  # an interrupted copy the caller chose to replace
        except BaseException as exc:
            _discard(tmp)
            err = write_error(exc, "writing", path, intact_note(path)) \
                if isinstance(exc, OSError) else None
            if err is not None:
                raise err from None
            raise


def create_store(root: str, *, shape, dtype, shard_len: int, inner_len: int, positions,
                 mask=None, probe=None, metadata: dict, truth: Truth | None = None):
    """Create the data-set group in the (existing, empty) directory ``root``; write everything but
    the intensities, and return the empty, sharded ``intensities`` zarr array."""
    n, h, w = (int(s) for s in shape)
    group = zarr.create_group(store=root, zarr_format=3)
    group.attrs.update(_jsonable(metadata))
    arr = group.create_array(
        "intensities", shape=(n, h, w), dtype=np.dtype(dtype), chunks=(inner_len, h, w),
        shards=(shard_len, h, w), compressors=_compressor(dtype), fill_value=0,
        dimension_names=("pattern", "y", "x"))
    pos = np.asarray(positions, dtype=np.float64)
    group.create_array("positions", data=pos, chunks=pos.shape,
                       dimension_names=("pattern", "axis"))
    if mask is not None:
        group.create_array("mask", data=np.asarray(mask, dtype=bool), dimension_names=("y", "x"))
    if probe is not None:
        group.create_array("probe", data=np.asarray(probe, dtype=np.complex64),
                           dimension_names=("mode", "y", "x"))
    if truth is not None:
        tg = group.create_group("truth")
        obj = truth.object
        if obj is not None:
            obj = np.asarray(obj, dtype=np.complex64)
            tg.create_array("object", data=obj, chunks=tuple(min(s, 1024) for s in obj.shape),
                            dimension_names=("slice", "y", "x")[-obj.ndim:])
        if truth.probe is not None:
            tg.create_array("probe", data=np.asarray(truth.probe, dtype=np.complex64),
                            dimension_names=("mode", "y", "x"))
        if truth.positions is not None:
            tp = np.asarray(truth.positions, dtype=np.float64)
            tg.create_array("positions", data=tp, chunks=tp.shape,
                            dimension_names=("pattern", "axis"))
    return arr


def guarded_write(arr, root: str, start: int, block) -> int:
    """Write ``block`` into ``arr[start:start+len(block)]`` unless the store is being discarded.

    A token file marks the write as in flight, so :func:`atomic_store` can wait for it before
    deleting the temporary store; a missing marker means another shard failed.
    """
    token = os.path.join(root, f"{_TOKEN_PREFIX}{uuid.uuid4().hex}")
    try:
        open(token, "x").close()
    except FileNotFoundError:
        raise WriteCancelled(f"{root} was discarded") from None
    try:
        if not os.path.exists(os.path.join(root, _MARKER)):
            raise WriteCancelled(f"{root} is being discarded")
        block = np.ascontiguousarray(block, dtype=arr.dtype)
        arr[start:start + block.shape[0]] = block
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(token)
    return int(block.shape[0])


def _compute_and_write(x, arr, root, index, start):
    block = x.blocks[index].compute(scheduler="sync")
    return guarded_write(arr, root, start, block)


def write_blocks(x: da.Array, arr, root: str, *, client=None, progress: bool = False,
                 label: str = "write") -> None:
    """Compute each chunk of ``x`` (N, H, W) and write it into the zarr array ``arr``.

    Chunks must be aligned to ``arr``'s shards (each chunk is one shard). Uses ``client`` (or the
    current distributed client) when there is one, else a small local thread pool computing one
    chunk per thread; at most a few chunks are in memory at a time.
    """
    from daskpty.execution.cluster import current_client

    offsets = np.concatenate([[0], np.cumsum(x.chunks[0])[:-1]]).astype(int)
    bar = TextProgress(len(offsets), label, enabled=progress)
    if client is None:
        client = current_client()
    if client is not None:
        from distributed import as_completed

        blocks = x.to_delayed().ravel()
        tasks = [dask.delayed(guarded_write, pure=False)(arr, root, int(o), b)
                 for o, b in zip(offsets, blocks)]
        futures = client.compute(tasks)
        try:
            for fut in as_completed(futures, loop=client.loop):
                bar.update(1, fut.result())
        except BaseException:
            client.cancel(futures)
            raise
        finally:
            bar.close()
        return
    nthreads = max(1, min(os.cpu_count() or 1, 4))
    todo = iter(enumerate(offsets))
    with ThreadPoolExecutor(nthreads) as pool:
        pending = set()
        try:
            for i, o in todo:
                pending.add(pool.submit(_compute_and_write, x, arr, root, i, int(o)))
                if len(pending) >= nthreads:
                    break
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    bar.update(1, f.result())
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending.add(pool.submit(_compute_and_write, x, arr, root, nxt[0],
                                                int(nxt[1])))
        except BaseException:
            for f in pending:
                f.cancel()
            wait(pending)
            raise
        finally:
            bar.close()


store_size_bytes = store_bytes  # bytes on disk under a path (kept under its old name)


__all__ = [
    "DEFAULT_INNER_BYTES", "DEFAULT_SHARD_BYTES", "DataError", "PtychoData", "Truth",
    "atomic_store", "create_store", "from_arrays", "guarded_write", "make_metadata", "open_data",
    "shard_layout", "store_size_bytes", "write_blocks",
]
