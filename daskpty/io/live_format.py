"""The on-disk format of a live data-set store: one being written while it is read.

A live store is an ordinary data-set store (docs/data-format.md) plus

- the root attribute ``live``: ``{"format_version": 1, "planned_frames": N or null,
  "chunk_frames": C}``, written when the store is created;
- the commit record ``live.json`` at the store's root: ``{"format_version": 1,
  "frames_committed": n, "blocks": b, "ended": bool, "planned_frames": N or null,
  "created_unix": t0, "updated_unix": t}``.

Frames ``0 .. n-1`` (``n = frames_committed``) are valid; nothing past them may be read. The
writer makes a block's chunk files durable (written, fsynced) before it replaces ``live.json``
(a temporary file, fsynced, ``os.replace``-d, the directory fsynced), so the record is the last
thing a block changes and a reader that reads the record first never sees a partial block.

``intensities`` and ``positions`` of a live store are chunked along N (``chunk_frames`` frames
per chunk) and **not sharded**: the chunk at the commit boundary is rewritten by the next block,
and zarr replaces a chunk file atomically and reads it in one piece, whereas a shard is read in
pieces (its index, then inner chunks) that a concurrent rewrite could mismatch.
"""
from __future__ import annotations

import json
import os
import time

from .validate import fail

#: version of the live layout (the ``live`` attribute and ``live.json``)
LIVE_FORMAT_VERSION = 1
#: the root attribute that marks a live store
LIVE_ATTR = "live"
#: the commit record, at the store's root
COMMIT_FILE = "live.json"
#: the ``open_data(..., frames=)`` choices
FRAMES = ("all", "committed")


def is_live(attrs) -> bool:
    """Whether a store's root attributes mark it as a live store."""
    return isinstance(attrs.get(LIVE_ATTR), dict)


def fsync_path(path: str) -> None:
    """Flush a file's or directory's contents to disk (a directory: its entries, i.e. renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(root: str, record: dict) -> None:
    """Replace ``root/live.json`` atomically and durably by ``record``."""
    final = os.path.join(root, COMMIT_FILE)
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_path(root)


def read_record(root: str) -> dict:
    """The commit record of the live store at ``root``; one line naming the problem if it is
    missing or unreadable."""
    path = os.path.join(root, COMMIT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        fail(f"{root} is marked live but has no {COMMIT_FILE} (its commit record); the store was "
             f"not created by daskpty.ScanWriter or was damaged: re-create it")
    except (OSError, ValueError) as exc:
        fail(f"{root}: the commit record {path} cannot be read ({type(exc).__name__}); the store "
             f"is damaged: re-create it")
    version = record.get("format_version") if isinstance(record, dict) else None
    if not isinstance(version, int) or not isinstance(record.get("frames_committed"), int):
        fail(f"{root}: the commit record {path} is not a daskpty live record; re-create the store")
    if version > LIVE_FORMAT_VERSION:
        fail(f"{root} was written in live format version {version}, newer than this daskpty's "
             f"{LIVE_FORMAT_VERSION}; upgrade daskpty")
    return record


def new_record(planned_frames: int | None) -> dict:
    """The record of a live store with no frames yet."""
    now = time.time()
    return {"format_version": LIVE_FORMAT_VERSION, "frames_committed": 0, "blocks": 0,
            "ended": False, "planned_frames": planned_frames, "created_unix": now,
            "updated_unix": now}


def writer_note(root: str) -> str:
    """'writer running (pid P on H)' or 'no writer holds it' for a live store not ended."""
    from .lock import _is_stale, _owner, describe_owner, lock_path

    file = lock_path(root)
    if os.path.lexists(file):
        owner = _owner(file)
        if not _is_stale(owner, file):
            return f"writer running ({describe_owner(owner)})"
    return "no writer holds it"


def of_planned(n: int, planned) -> str:
    """'1,234 of 6,400 frames' or '1,234 frames' (scan size not declared)."""
    return f"{n:,} of {planned:,} frames" if planned else f"{n:,} frames"


def live_view(attrs, root: str, frames: str) -> tuple[int, bool] | None:
    """(frames committed, ended) of the store at ``root`` whose root attributes are ``attrs``,
    None for an ordinary store. Read before the arrays' metadata, so their length is at least
    the count. An unfinished live store read with ``frames="all"`` is refused with what to do."""
    if frames not in FRAMES:
        raise ValueError(f"frames must be one of {FRAMES}, got {frames!r}")
    if not is_live(attrs):
        return None
    record = read_record(root)
    n, ended = int(record["frames_committed"]), bool(record.get("ended"))
    planned = record.get("planned_frames")
    if not ended and frames == "all":
        fail(f"{root} is a live store whose scan has not ended ({of_planned(n, planned)} committed, "
             f"{writer_note(root)}); read the frames so far with open_data(path, "
             f"frames='committed'), or end the scan first (its writer's close(), or "
             f"daskpty.ScanWriter.resume(path).close() when its writer has stopped)")
    if n == 0:
        fail(f"{root} is a live store with no committed frames yet ({of_planned(0, planned)}); "
             f"wait for the writer's first block")
    return n, ended


def committed_length(root: str, view: tuple[int, bool] | None, length: int) -> int | None:
    """The frames to read from arrays ``length`` long: None for all of them (an ordinary store,
    or a live one that has ended), else the committed count."""
    if view is None:
        return None
    n, ended = view
    if (ended and n != length) or n > length:
        fail(f"{root}: the commit record says {n:,} frames{' (ended)' if ended else ''} but the "
             f"arrays hold {length:,}; the store is damaged: re-create it")
    return None if ended else n


def check_committed_files(arr, root: str, n: int) -> None:
    """Every chunk file holding frames ``0 .. n-1`` of ``arr`` on disk, else one line naming
    them (the rest of a live store's grid is written later)."""
    import math

    from .integrity import chunk_files, damaged

    rows = math.ceil(n / arr.chunks[0])
    missing = [rel for coords, rel in chunk_files(arr)
               if coords[0] < rows and not os.path.isfile(os.path.join(root, rel))]
    if missing:
        raise damaged(root, f"chunk file(s) {', '.join(missing[:3])} of '{arr.path}' holding "
                            f"committed frames are missing: the store is damaged")


def committed_reader(arr, root: str, n: int):
    """An array-like over the first ``n`` frames of ``arr`` for ``dask.array.from_array``; its
    read errors name the chunk file."""
    from .integrity import NamedReader

    reader = NamedReader(arr, root)
    reader.shape = (int(n), *arr.shape[1:])
    return reader


__all__ = ["COMMIT_FILE", "FRAMES", "LIVE_ATTR", "LIVE_FORMAT_VERSION", "check_committed_files",
           "committed_length", "committed_reader",
           "fsync_path", "is_live", "live_view", "new_record", "of_planned", "read_record", "write_record",
           "writer_note"]
