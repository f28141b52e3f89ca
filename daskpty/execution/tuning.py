"""Process-level tuning of dask worker processes for large numerical arrays.

dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also fixes glibc's mmap
threshold: every array above 128 KiB is then a fresh ``mmap`` whose pages fault in on first
touch, and is unmapped again on free. A chunk step allocates a dozen such arrays, so page faults
cost more than the FFTs (measured: 24.5 ms → 5.5 ms per 36 × 64² LSQML chunk step). Raising both
thresholds lets freed arrays be reused from the heap. Set ``DASKPTY_MALLOC_TUNE=0`` to disable.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 256 * 2**20
_done = False


def tune_allocator() -> bool:
    """Raise glibc's trim and mmap thresholds once per process; True when applied."""
    global _done
    if _done:
        return True
    _done = True
    if os.environ.get("DASKPTY_MALLOC_TUNE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD) == 1
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1 and ok
        return ok
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): nothing to do
        return False
