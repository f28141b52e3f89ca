"""Writing a data-set store: the shard layout, the atomic ``X.partial-*`` → ``X`` write, the
group's arrays and the shard-by-shard writers (local threads or a distributed client).

Writing is streamed shard by shard into ``X.zarr.partial-<random>`` and renamed into place at the
end, so a failure never leaves a half-written store at the target path.
"""
from __future__ import annotations

import contextlib
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

from ..faults import WriteCancelled  # noqa: F401 (also named here)
from .dask_client import current_client
from .lock import StoreLock, check_unlocked
from .pending_writes import despite_interrupts
from .integrity import EVERY_CHUNK, WRITE_ALL
from .metadata import Truth, jsonable
from .progress import TextProgress
from .safety import (check_not_link, check_replaceable, clean_stale, intact_note, interrupted_copy, is_daskpty_store,
                     remove_own, write_error)

MiB = 2**20
#: default target size of one shard (= one dask chunk) of ``intensities``
DEFAULT_SHARD_BYTES = 64 * MiB
#: default target size of one inner (compression) chunk inside a shard
DEFAULT_INNER_BYTES = 2 * MiB
#: small data sets are split into at least this many shards (see shard_layout) ...
DEFAULT_MIN_SHARDS = 8
#: ... unless that would make shards smaller than this
MIN_SHARD_BYTES = 1 * MiB

_MARKER = ".daskpty-writing"
_TOKEN_PREFIX = ".daskpty-w-"


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


# --------------------------------------------------------------------------- writing

def check_target(path: str, overwrite: bool) -> None:
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
    check_not_link(path, "the target")  # not "not a daskpty store": it may link to one
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return
    if not is_daskpty_store(path):
        raise FileExistsError(f"{path} exists and is not a Zarr store daskpty wrote (no daskpty "
                              f"marker); refusing to replace it: remove it yourself or choose "
                              f"another path")
    check_replaceable(path, "the target")  # nor a store of a newer format


def _remove_tree(path: str) -> None:
    """Delete a store or leftover daskpty wrote (never anything else, see io/safety.py)."""
    with contextlib.suppress(FileExistsError):
        remove_own(path)


#: How long a discarded temporary store must stay gone before :func:`_discard` returns.
DISCARD_SETTLE_S = 0.3


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
    # A failed shard write can leave chunk writes of its own running (zarr gathers them and
    # returns at the first error, e.g. a full disk): one of them may recreate the directory
    # after the removal. Remove it again until it has stayed gone for DISCARD_SETTLE_S.
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < DISCARD_SETTLE_S and time.monotonic() < deadline:
        time.sleep(0.05)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            quiet_since = time.monotonic()


@contextlib.contextmanager
def atomic_store(path, overwrite: bool = False):
    """Yield a fresh temporary directory next to ``path``; on success rename it to ``path``.

    On any exception the temporary directory is removed (after shard writes in flight finish) and
    ``path`` is untouched. With ``overwrite=True`` an existing Zarr store at ``path`` is replaced
    only once the new one is complete; anything else at ``path`` is never deleted.
    """
    path = os.path.abspath(os.fspath(path))
    check_target(path, overwrite)
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
            record_every_chunk(tmp)
            os.remove(os.path.join(tmp, _MARKER))
            if os.path.lexists(path):
                check_target(path, overwrite)
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
            despite_interrupts(lambda: _discard(tmp))
            err = write_error(exc, "writing", path, intact_note(path)) \
                if isinstance(exc, OSError) else None
            if err is not None:
                raise err from None
            raise


def record_every_chunk(root: str) -> None:
    """Record, last, in the ``daskpty`` attribute of the store being written at ``root`` that every
    chunk is on disk (:func:`create_store` writes all-zero chunks too), so a reader can tell a
    deleted shard from an all-zero one (:mod:`.integrity`)."""
    group = zarr.open_group(root, mode="r+")
    marker = group.attrs.get("daskpty")
    if isinstance(marker, dict):
        group.attrs["daskpty"] = {**marker, EVERY_CHUNK: True}


def create_store(root: str, *, shape, dtype, shard_len: int, inner_len: int, positions,
                 mask=None, probe=None, metadata: dict, truth: Truth | None = None):
    """Create the data-set group in the (existing, empty) directory ``root``; write everything but
    the intensities, and return the empty, sharded ``intensities`` zarr array. All-zero chunks
    are written as files too (``write_empty_chunks``: a zero shard costs a few hundred bytes),
    so every chunk the grid calls for is on disk."""
    n, h, w = (int(s) for s in shape)
    group = zarr.create_group(store=root, zarr_format=3)
    group.attrs.update(jsonable(metadata))
    arr = group.create_array(
        "intensities", shape=(n, h, w), dtype=np.dtype(dtype), chunks=(inner_len, h, w),
        shards=(shard_len, h, w), compressors=_compressor(dtype), fill_value=0,
        dimension_names=("pattern", "y", "x"), config=WRITE_ALL)
    pos = np.asarray(positions, dtype=np.float64)
    group.create_array("positions", data=pos, chunks=pos.shape,
                       dimension_names=("pattern", "axis"), config=WRITE_ALL)
    if mask is not None:
        group.create_array("mask", data=np.asarray(mask, dtype=bool), dimension_names=("y", "x"), config=WRITE_ALL)
    if probe is not None:
        group.create_array("probe", data=np.asarray(probe, dtype=np.complex64),
                           dimension_names=("mode", "y", "x"), config=WRITE_ALL)
    if truth is not None:
        tg = group.create_group("truth")
        obj = truth.object
        if obj is not None:
            obj = np.asarray(obj, dtype=np.complex64)
            tg.create_array("object", data=obj, chunks=tuple(min(s, 1024) for s in obj.shape),
                            dimension_names=("slice", "y", "x")[-obj.ndim:], config=WRITE_ALL)
        if truth.probe is not None:
            tg.create_array("probe", data=np.asarray(truth.probe, dtype=np.complex64),
                            dimension_names=("mode", "y", "x"), config=WRITE_ALL)
        if truth.positions is not None:
            tp = np.asarray(truth.positions, dtype=np.float64)
            tg.create_array("positions", data=tp, chunks=tp.shape,
                            dimension_names=("pattern", "axis"), config=WRITE_ALL)
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
    offsets = np.concatenate([[0], np.cumsum(x.chunks[0])[:-1]]).astype(int)
    bar = TextProgress(len(offsets), label, enabled=progress)
    if client is None:
        client = current_client()
    if client is not None:
        from distributed import as_completed  # lazy: io imports distributed only when a client is used

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


__all__ = ["DEFAULT_INNER_BYTES", "DEFAULT_MIN_SHARDS", "DEFAULT_SHARD_BYTES", "MIN_SHARD_BYTES",
           "WriteCancelled", "atomic_store", "check_target", "create_store", "guarded_write", "shard_layout",
           "write_blocks"]
