"""The data do not change under a run: a fingerprint of a data-set store, checked every epoch.

A reconstruction reads its data store for as long as it runs (out of core: every round). Should
someone replace the store meanwhile (``daskpty simulate X --overwrite``, a re-import), the run
would silently mix two data sets. :func:`store_fingerprint` records the store's identity from
file metadata only — name, size and modification time of every file of its ``intensities``,
``positions`` and ``mask`` arrays, and the store's own ``zarr.json`` — without reading any data;
:class:`DataWatch` compares it after every epoch and stops the run with :class:`DataChanged`.
"""
from __future__ import annotations

import os

WATCHED = ("zarr.json", "intensities", "positions", "mask")


class DataChanged(ValueError):
    """The data-set store was modified or replaced while a reconstruction was reading it."""


def store_fingerprint(path) -> tuple:
    """``(relative path, size, mtime_ns, inode)`` of every watched file of the store, sorted."""
    root = os.fspath(path)
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
            entries.append((os.path.relpath(f, root), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(entries))


class DataWatch:
    """Epoch callback: raise :class:`DataChanged` when the store's fingerprint differs from the
    one taken at the start. A stat of each shard file per epoch (no data read)."""

    takes_epoch_state = True  # never fetches the state

    def __init__(self, path):
        self.path = os.fspath(path)
        self.fingerprint = store_fingerprint(self.path)

    def __call__(self, epoch, state, metrics):
        now = store_fingerprint(self.path)
        if now != self.fingerprint:
            before, after = set(self.fingerprint), set(now)
            changed = sorted({e[0] for e in before ^ after})
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise DataChanged(f"the data store {self.path} changed during the reconstruction "
                              f"(after epoch {epoch}: {shown}); results would mix two data sets. "
                              "Reconstruct from an unchanged copy")
