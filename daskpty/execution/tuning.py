"""Process-level tuning of dask worker processes for large numerical arrays.

dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also fixes glibc's mmap
threshold: every array above 128 KiB is then a fresh ``mmap`` whose pages fault in on first
touch, and is unmapped again on free. A chunk step allocates a dozen such arrays, so page faults
cost more than the FFTs (measured: 24.5 ms → 5.5 ms per 36 × 64² LSQML chunk step). Raising both
thresholds lets freed arrays be reused from the heap within a chunk step; :func:`release_memory`
(``malloc_trim``) after each step hands the freed heap back, so workers with small memory limits
are not pushed over dask's pause threshold. The threshold is at most 1/16 of the worker's memory
limit. Set ``DASKPTY_MALLOC_TUNE=0`` to disable.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_THRESHOLD = 256 * 2**20
_done = False
_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.mallopt  # noqa: B018 - glibc only
            _libc.malloc_trim  # noqa: B018
        except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): nothing to do
            _libc = False
    return _libc


def _worker_memory_limit() -> int | None:
    try:
        from distributed import get_worker

        return get_worker().memory_manager.memory_limit or None
    except Exception:
        return None


SWITCH_INTERVAL_S = float(os.environ.get("DASKPTY_SWITCH_INTERVAL", "0.0005"))


def tune_switch_interval() -> None:
    """Let a worker's event-loop thread take the GIL sooner while a chunk step runs.

    A worker computes on one thread and talks (task-finished messages, sending the payload or a
    partial to a peer) on another. Python hands the GIL over every 5 ms by default, so a peer's
    request waits up to that long per exchange while the chunk step's Python glue holds it:
    measured 6–9 ms to send a 3 MiB payload from a busy worker. Only in worker processes.
    """
    import sys

    if SWITCH_INTERVAL_S > 0 and _in_worker_process() and sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


def _in_worker_process() -> bool:
    """True inside a dask worker that has a process of its own (not an in-process cluster)."""
    import multiprocessing

    try:
        from distributed import get_worker

        get_worker()
    except Exception:
        return False
    return multiprocessing.parent_process() is not None


def tune_allocator() -> bool:
    """Raise glibc's trim and mmap thresholds once per process; True when applied."""
    global _done
    if _done:
        return _libc not in (None, False)
    _done = True
    tune_switch_interval()
    if os.environ.get("DASKPTY_MALLOC_TUNE", "1") == "0" or not _load_libc():
        return False
    threshold = _MAX_THRESHOLD
    limit = _worker_memory_limit()
    if limit:
        threshold = int(min(threshold, limit // 16))
    ok = _libc.mallopt(_M_TRIM_THRESHOLD, threshold) == 1
    return _libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and ok


_limit = None
_process = None


def release_memory() -> None:
    """Return freed heap memory to the operating system after a chunk step, when the worker's
    resident memory exceeds half its limit (trimming always would cost the page faults the
    thresholds save: 10 → 21 ms per 72 × 64² step)."""
    global _limit, _process
    if not (_done and _libc):
        return
    if _limit is None:
        _limit = _worker_memory_limit() or 0
    if not _limit:
        return
    if _process is None:  # psutil.Process() reads /proc/<pid>/stat: once, not per chunk step
        import psutil

        _process = psutil.Process()
    if _process.memory_info().rss > _limit // 2:
        _libc.malloc_trim(0)
