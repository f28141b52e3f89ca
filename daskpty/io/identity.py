"""The data do not change under a run: a fingerprint of a data-set store, checked every epoch.

A reconstruction reads its data store for as long as it runs (out of core: every round). Should
someone replace the store meanwhile (``daskpty simulate X --overwrite``, a re-import), the run
would silently mix two data sets. :func:`store_fingerprint` records the store's identity from
file metadata only — name, size and modification time of every file of its ``intensities``,
``positions`` and ``mask`` arrays, and the store's own ``zarr.json`` — without reading any data;
:class:`DataWatch` compares it after every epoch and stops the run with :class:`DataChanged`.
"""
from __future__ import annotations

import json
import os

from ..faults import DataChanged  # noqa: F401 (also named here)
from .live_format import LIVE_ATTR

WATCHED = ("zarr.json", "intensities", "positions", "mask")


def store_fingerprint(path, frames: int | None = None) -> tuple:
    """``(relative path, size, mtime_ns, inode)`` of every watched file of the store, sorted.
    ``frames``: a run reads only the first ``frames`` frames of a live store (one still being
    written, :mod:`.live_format`): then only the chunk files those frames fill are watched, the
    files its writer goes on changing (the chunk at the commit boundary, the arrays' and the
    root's ``zarr.json``) are not."""
    root = os.fspath(path)
    full_rows = _full_live_rows(root, frames)
    entries = []
    for name in WATCHED:
        top = os.path.join(root, name)
        if os.path.isfile(top):
            files = [top]
        else:
            files = [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for f in files:
            try:
                st = os.stat(f)
            except FileNotFoundError:  # removed between the walk and the stat: changed anyway
                continue
            rel = os.path.relpath(f, root)
            if full_rows is None or _kept_in_live(rel, full_rows):
                entries.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(entries))


def _full_live_rows(root: str, frames: int | None) -> int | None:
    """Chunks along N that ``frames`` frames fill in the live store at ``root``; None for an
    ordinary store (or ``frames`` None): every file is watched."""
    if frames is None:
        return None
    try:
        with open(os.path.join(root, "zarr.json"), encoding="utf-8") as f:
            live = json.load(f).get("attributes", {}).get(LIVE_ATTR)
    except (OSError, ValueError):
        return None
    if not isinstance(live, dict) or not live.get("chunk_frames"):
        return None
    return int(frames) // int(live["chunk_frames"])


def _kept_in_live(rel: str, full_rows: int) -> bool:
    """Whether a live store's file is watched: the mask, and chunk files of intensities and
    positions in the first ``full_rows`` rows (keys ``c.ROW.…``)."""
    parts = rel.split(os.sep)
    if parts[0] == "mask":
        return True
    key = parts[-1].split(".")
    return parts[0] in ("intensities", "positions") and len(key) > 1 and key[0] == "c" and \
        key[1].isdigit() and int(key[1]) < full_rows


class DataWatch:
    """Epoch callback: raise :class:`DataChanged` when the store's fingerprint differs from the
    one taken at the start. A stat of each shard file per epoch (no data read). ``frames``: the
    frames the run reads (see :func:`store_fingerprint`)."""

    takes_epoch_state = True  # never fetches the state

    def __init__(self, path, frames: int | None = None):
        self.path = os.fspath(path)
        self.frames = frames
        self.fingerprint = store_fingerprint(self.path, frames)

    def __call__(self, epoch, state, metrics):
        now = store_fingerprint(self.path, self.frames)
        if now != self.fingerprint:
            before, after = set(self.fingerprint), set(now)
            changed = sorted({e[0] for e in before ^ after})
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise DataChanged(f"the data store {self.path} changed during the reconstruction "
                              f"(after epoch {epoch}: {shown}); results would mix two data sets. "
                              "Reconstruct from an unchanged copy")
