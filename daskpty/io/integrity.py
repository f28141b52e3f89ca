"""Finding damaged stores before they are used, and naming the damaged file.

Zarr reads a missing chunk as the array's fill value (zeros): a deleted or un-copied chunk file
would silently turn a checkpoint's object into zeros, or a shard of patterns into dark frames.
A truncated chunk fails deep inside a codec (``Zstd decompression error``), a truncated
``zarr.json`` with a bare JSON message. Here every such case becomes one line naming the file.

Stores written by this daskpty record that *every* chunk is on disk (``"every_chunk_written":
true`` in the ``daskpty`` attribute; the arrays are written with ``write_empty_chunks``, so an
all-zero chunk is a file too): for them a missing chunk file is damage, whatever the array.
Older stores skipped all-zero chunks; for them only arrays that are never all zero are checked.
"""
from __future__ import annotations

import json
import math
import os
import posixpath
import struct

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec

from ..faults import DamagedStoreError  # noqa: F401 (also named here)
from .safety import is_daskpty_store, store_format, stored_epoch

#: key in the ``daskpty`` root attribute: the writer wrote every chunk (all-zero ones too)
EVERY_CHUNK = "every_chunk_written"
#: zarr array config that makes the writer store all-zero chunks as files
WRITE_ALL = {"write_empty_chunks": True}


def _hint(store: str) -> str:
    """What to do about a damaged store: use ``STORE.previous`` if it holds a store, else re-make."""
    previous = store.rstrip("/") + ".previous"
    if is_daskpty_store(previous):
        epoch = stored_epoch(previous)
        held = f" (epoch {epoch})" if epoch is not None else ""
        return (f"{previous} holds an earlier copy{held}: move the damaged store away and rename "
                f"{previous} to {store} to use it")
    if store_format(store) == "daskpty-reconstruction":
        return "restore it from a copy, or reconstruct again without resuming from it"
    return "re-copy or re-create the store"


def damaged(store: str, msg: str, hint: str | None = None) -> DamagedStoreError:
    return DamagedStoreError(" ".join(f"{store}: {msg}; {hint or _hint(store)}".split()))


# --------------------------------------------------------------------------- metadata files

def check_json_files(store) -> None:
    """Parse every ``zarr.json`` of the store (not descending into chunk folders ``c/``)."""
    store = os.fspath(store).rstrip("/")
    for dirpath, dirnames, files in os.walk(store):
        dirnames[:] = sorted(d for d in dirnames if d != "c")
        if "zarr.json" not in files:
            continue
        path = os.path.join(dirpath, "zarr.json")
        try:
            with open(path, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            why = f"{exc.msg}: line {exc.lineno} column {exc.colno}" \
                if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise damaged(store, f"its metadata file {path} is not valid JSON ({why}; truncated "
                                 f"or overwritten)") from None


# --------------------------------------------------------------------------- chunk files

def _outer_grid(arr) -> tuple[int, ...]:
    """Files per dimension: the shard grid of a sharded array, else the chunk grid."""
    outer = arr.metadata.chunk_grid.chunk_shape
    return tuple(math.ceil(s / c) if c else 0 for s, c in zip(arr.shape, outer))


def chunk_files(arr) -> list[tuple[tuple[int, ...], str]]:
    """(grid coordinates, path relative to the store root) of every chunk (shard) file of ``arr``."""
    return [(coords, posixpath.join(arr.path, arr.metadata.encode_chunk_key(coords)))
            for coords in np.ndindex(*_outer_grid(arr))]


def _selection(arr, coords) -> tuple[slice, ...]:
    outer = arr.metadata.chunk_grid.chunk_shape
    return tuple(slice(i * c, min(s, (i + 1) * c)) for i, c, s in zip(coords, outer, arr.shape))


def missing_files(arr, store) -> list[str]:
    """Chunk (shard) files the array's grid calls for that are not on disk."""
    store = os.fspath(store)
    return [rel for _, rel in chunk_files(arr) if not os.path.isfile(os.path.join(store, rel))]


def _listing(files: list[str], total: int, kind: str = "chunk") -> str:
    if len(files) == 1:
        return f"{kind} file {files[0]}"
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"{len(files)} of {total} {kind} files ({shown})"


def check_present(arr, store, label: str | None = None) -> None:
    """Refuse an array with a missing chunk (shard) file, naming the files."""
    missing = missing_files(arr, store)
    if missing:
        total = math.prod(_outer_grid(arr))
        kind = "shard" if _sharding(arr) is not None else "chunk"
        raise damaged(os.fspath(store), f"{_listing(missing, total, kind)} of '{label or arr.path}' "
                                        f"{'is' if len(missing) == 1 else 'are'} missing: the store "
                                        f"is damaged (a deleted or partly copied file), and zarr "
                                        f"would read the gap as zeros")


# --------------------------------------------------------------------------- decoding

def _sharding(arr):
    codecs = arr.metadata.codecs
    return codecs[0] if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec) else None


def shard_index_problem(arr, path: str) -> str | None:
    """Why the shard file ``path`` is damaged, read from its index alone (its last bytes: one
    (offset, length) pair per inner chunk and a CRC32C), or None when the index is sound. Catches
    truncated and partly copied shards without reading their data. Shards of a layout other
    than zarr's default (index at the end, checksummed) are not checked."""
    codec = _sharding(arr)
    if codec is None or str(getattr(codec.index_location, "value", codec.index_location)) != "end" \
            or [type(c) for c in codec.index_codecs] != [BytesCodec, Crc32cCodec]:
        return None
    n_inner = math.prod(math.ceil(s / c) for s, c in zip(arr.metadata.chunk_grid.chunk_shape,
                                                            codec.chunk_shape))
    index_bytes = 16 * n_inner + 4
    size = os.path.getsize(path)
    if size < index_bytes:
        return f"is {size} bytes, shorter than its {index_bytes}-byte index (truncated)"
    with open(path, "rb") as f:
        f.seek(size - index_bytes)
        tail = f.read(index_bytes)
    if struct.unpack("<I", tail[-4:])[0] != google_crc32c.value(tail[:-4]):
        return "has a damaged index (checksum mismatch: truncated or overwritten)"
    pairs = np.frombuffer(tail[:-4], dtype="<u8").reshape(-1, 2)
    used = pairs[pairs[:, 0] != np.iinfo(np.uint64).max]
    if len(used) and int((used[:, 0] + used[:, 1]).max()) > size - index_bytes:
        return "is shorter than its index says (truncated)"
    return None


def check_shards(arr, store, label: str | None = None) -> None:
    """Check the index of every shard file of a sharded array (cheap: a few bytes per shard)."""
    if _sharding(arr) is None:
        return
    store = os.fspath(store)
    for _, rel in chunk_files(arr):
        path = os.path.join(store, rel)
        if os.path.isfile(path):
            problem = shard_index_problem(arr, path)
            if problem is not None:
                raise damaged(store, f"shard file {rel} of '{label or arr.path}' {problem}")


def locate(arr, store, exc: BaseException, label: str | None = None) -> DamagedStoreError:
    """The error for an array whose read failed with ``exc``: the first chunk file that does not
    decode (read one by one), else the array as a whole."""
    store = os.fspath(store)
    why = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
    for coords, rel in chunk_files(arr):
        try:
            arr[_selection(arr, coords)]
        except Exception as inner:  # zarr / codec errors of every kind
            why = (str(inner).splitlines() or [type(inner).__name__])[0][:160]
            return damaged(store, f"chunk file {rel} of '{label or arr.path}' cannot be decoded "
                                  f"({type(inner).__name__}: {why}): the store is damaged")
    return damaged(store, f"'{label or arr.path}' cannot be read ({type(exc).__name__}: {why}): "
                          f"the store is damaged")


def read_checked(arr, store, *, complete: bool = True, label: str | None = None) -> np.ndarray:
    """Read ``arr`` fully; refuse a missing chunk file (when ``complete``: the writer wrote every
    chunk, or the array is never all zero) and a chunk that does not decode, naming the file."""
    if complete:
        check_present(arr, store, label)
    try:
        return arr[...]
    except Exception as exc:  # zarr / codec errors of every kind
        raise locate(arr, store, exc, label) from None


#: arrays of a reconstruction store (``daskpty.io.results``); the first three are required
RECON_ARRAYS = ("object", "probe", "positions", "illumination", "nominal_positions", "probe_weights")
#: ... and those never all zero, so a missing chunk is damage even in a store of an older daskpty
NEVER_ZERO = ("object", "probe", "positions", "nominal_positions", "probe_weights")


def read_store_arrays(root, store, *, every_chunk: bool, lazy: tuple = ()) -> dict[str, np.ndarray]:
    """Read a reconstruction store's arrays (``engine_state/NAME`` for the engine's) with
    :func:`read_checked`. ``every_chunk``: the writer recorded that every chunk is on disk.
    ``lazy``: names read as dask arrays instead (chunk by chunk when computed, read errors
    naming their files; a missing chunk then reads as zeros)."""
    out = {}
    for name in RECON_ARRAYS:
        node = root.get(name)
        if isinstance(node, zarr.Array) and name in lazy:
            import dask.array as da

            out[name] = da.from_array(NamedReader(node, store), chunks=node.chunks, asarray=False)
        elif isinstance(node, zarr.Array):
            out[name] = read_checked(node, store, complete=every_chunk or name in NEVER_ZERO, label=name)
        elif name in RECON_ARRAYS[:3]:
            raise damaged(os.fspath(store), f"its '{name}' array is missing (no {name}/zarr.json): the "
                                            f"store is damaged or incomplete")
    group = root.get("engine_state")
    if isinstance(group, zarr.Group):
        for name in sorted(group.array_keys()):
            out[f"engine_state/{name}"] = read_checked(group[name], store, complete=every_chunk,
                                                       label=f"engine_state/{name}")
    return out


class NamedReader:
    """An array-like over a zarr array for ``dask.array.from_array`` whose read errors name the
    chunk file(s) they came from (a dask task's traceback otherwise says only ``Zstd
    decompression error``)."""

    def __init__(self, arr, store: str):
        self.arr, self.store = arr, os.fspath(store)
        self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, arr.ndim

    def __getitem__(self, key):
        try:
            return self.arr[key]
        except Exception as exc:  # zarr / codec errors of every kind
            raise self._error(key, exc) from None

    def _error(self, key, exc) -> DamagedStoreError:
        outer = self.arr.metadata.chunk_grid.chunk_shape
        first = key[0] if isinstance(key, tuple) and key else key
        start, stop = (0, self.shape[0])
        if isinstance(first, slice):
            start, stop, _ = first.indices(self.shape[0])
        rows = range(start // outer[0], max(start // outer[0] + 1, math.ceil(stop / outer[0])))
        files = [rel for coords, rel in chunk_files(self.arr) if coords[0] in rows]
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        which = files[0] if len(files) == 1 else f"one of {', '.join(files[:4])}"
        return damaged(self.store, f"shard file {which} of '{self.arr.path}' cannot be read "
                                   f"({type(exc).__name__}: {why}): the store is damaged")


__all__ = ["DamagedStoreError", "EVERY_CHUNK", "NamedReader", "WRITE_ALL", "check_json_files",
           "check_present", "check_shards", "chunk_files", "damaged", "locate", "missing_files",
           "read_checked", "read_store_arrays", "shard_index_problem"]
