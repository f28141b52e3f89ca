"""One writer per store: a lock file ``X.lock`` beside the store ``X``.

The lock sits beside the store, not inside it, because daskpty replaces a store by renames.
It appears already filled in (hard-linked from a file of the taking process; created
exclusively, ``O_CREAT | O_EXCL``, where there are no hard links) and names its owner in JSON:
host, pid, the process's start time and the time the lock was taken. A lock whose owner ran on this host and is
gone (no such pid, or a pid reused by a later process) is stale and taken over; a lock from
another host cannot be checked and is reported with the hint to remove it if that run is over.

Re-entrant within a process: nested ``StoreLock(X)`` blocks share one lock file.

    with StoreLock("scan.zarr"):
        ...  # write scan.zarr
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import socket
import sys
import threading
import time

from ..faults import StoreLocked  # noqa: F401 (also named here)
from .write_errors import write_error

LOCK_SUFFIX = ".lock"
#: a lock file without readable content older than this is a writer that died while creating it
UNREADABLE_STALE_S = 10.0

_held: dict[str, int] = {}
_guard = threading.Lock()


def lock_path(path) -> str:
    return os.path.abspath(os.fspath(path)).rstrip(os.sep) + LOCK_SUFFIX


def _process_start(pid: int) -> float | None:
    try:
        import psutil  # lazy: comes with distributed, not a dependency of daskpty's own

        return float(psutil.Process(pid).create_time())
    except Exception:  # no such process (or psutil missing)
        return None


def _owner(lock_file: str, wait: float = 0.0) -> dict | None:
    """The lock's owner; waits up to ``wait`` seconds for a lock being created to be filled in."""
    deadline = time.monotonic() + wait
    while True:
        owner = _read(lock_file)
        if owner is not None or time.monotonic() >= deadline or not os.path.lexists(lock_file):
            return owner
        time.sleep(0.02)


def _read(lock_file: str) -> dict | None:
    try:
        with open(lock_file, encoding="utf-8") as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) and "pid" in owner else None
    except (OSError, ValueError):
        return None


def _is_stale(owner: dict | None, lock_file: str) -> bool:
    if owner is None:  # being created right now, or its writer died mid-way
        try:
            return time.time() - os.path.getmtime(lock_file) > UNREADABLE_STALE_S
        except OSError:
            return True
    if owner.get("host") != socket.gethostname():
        return False
    started = _process_start(int(owner["pid"]))
    if started is None:
        return True
    recorded = owner.get("started")
    return isinstance(recorded, (int, float)) and abs(started - recorded) > 1.0


def _create_filled(lock_file: str, owner: dict) -> bool:
    """Create ``lock_file`` holding ``owner`` (JSON) if it does not exist; False if it does.

    The content is written to a file of this process's own first and hard-linked into place
    (``link`` fails if the lock exists), so the lock appears already filled in: a writer killed
    while taking it leaves no empty lock, which the next run would have to take for one being
    created (for :data:`UNREADABLE_STALE_S`; a follower resumed at once was refused). Where the
    filesystem has no hard links it is created exclusively, then filled in."""
    _remove_dead_staged(lock_file)
    staged = f"{lock_file}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(staged, "w", encoding="utf-8") as f:
            json.dump(owner, f)
        try:
            os.link(staged, lock_file)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this filesystem
            pass
    finally:
        with contextlib.suppress(OSError):
            os.remove(staged)
    try:
        fd = os.open(lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(owner, f)
    except BaseException:  # e.g. a full disk: leave no empty lock behind
        with contextlib.suppress(OSError):
            os.remove(lock_file)
        raise
    return True


def _remove_dead_staged(lock_file: str) -> None:
    """Remove the staged files of :func:`_create_filled` (``X.lock.PID.TID.tmp``) whose process
    on this host is gone (killed while taking the lock)."""
    for staged in glob.glob(glob.escape(lock_file) + ".*.tmp"):
        pid = staged[len(lock_file) + 1:].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _process_start(int(pid)) is None:
            with contextlib.suppress(OSError):
                os.remove(staged)


def describe_owner(owner: dict | None) -> str:
    if owner is None:
        return "a process that is creating its lock"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
    command = f" ({owner['command']})" if owner.get("command") else ""
    return f"pid {owner.get('pid')} on {owner.get('host')} since {since}{command}"


def check_unlocked(path) -> None:
    """Raise :class:`StoreLocked` if a live process other than this one holds ``path``'s lock."""
    file = lock_path(path)
    if file in _held or not os.path.lexists(file):
        return
    owner = _owner(file, wait=1.0)
    if owner is not None and owner.get("pid") == os.getpid() \
            and owner.get("host") == socket.gethostname():
        return
    if not _is_stale(owner, file):
        raise _locked(path, owner)


def _locked(path, owner) -> StoreLocked:
    hint = "" if owner is None or owner.get("host") == socket.gethostname() else \
        f"; if that run is over, remove {lock_path(path)}"
    return StoreLocked(f"{os.fspath(path)} is being written by another daskpty run: "
                       f"{describe_owner(owner)}; wait for it to finish or write elsewhere{hint}")


class StoreLock:
    """Context manager holding the lock of the store at ``path`` (see the module docstring)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.file = lock_path(path)
        self._mine: dict | None = None
        self._made: list[str] = []  # parent directories created for the lock (removed if empty)

    def acquire(self) -> "StoreLock":
        with _guard:
            if self.file in _held:
                _held[self.file] += 1
                return self
            try:
                self._make_parents()
                self._take()
            except BaseException as exc:
                self._remove_made()
                if isinstance(exc, OSError) and not isinstance(exc, StoreLocked):
                    err = write_error(exc, "taking the write lock of", self.path,
                                      "nothing was written")
                    if err is not None:
                        raise err from None
                raise
            _held[self.file] = 1
        return self

    def _take(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": _process_start(os.getpid()), "since": time.time(),
              "command": " ".join(os.path.basename(a) if i == 0 else a
                                  for i, a in enumerate(sys.argv))[:200]}
        for _ in range(5):
            if _create_filled(self.file, me):
                self._mine = me
                return
            owner = _owner(self.file, wait=1.0)  # a writer that just created it fills it in
            if not _is_stale(owner, self.file):
                raise _locked(self.path, owner)
            if _owner(self.file) == owner:  # still the stale one: take it over
                try:
                    os.remove(self.file)
                except FileNotFoundError:
                    pass
        raise _locked(self.path, _owner(self.file))

    def _make_parents(self) -> None:
        parent = os.path.dirname(self.file)
        missing = []
        while parent and not os.path.isdir(parent):
            if os.path.lexists(parent):
                raise NotADirectoryError(f"cannot write {self.path}: {parent} is not a directory")
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            os.mkdir(d)
            self._made.append(d)

    def _remove_made(self) -> None:
        for d in reversed(self._made):
            try:
                os.rmdir(d)  # only while empty: a store written there keeps it
            except OSError:
                break
        self._made = []

    def release(self) -> None:
        with _guard:
            count = _held.get(self.file, 0) - 1
            if count > 0:
                _held[self.file] = count
                return
            _held.pop(self.file, None)
            owner = _owner(self.file)
            if owner is not None and owner.get("pid") == os.getpid() \
                    and owner.get("host") == socket.gethostname():
                with contextlib.suppress(OSError):  # gone, or a disk turned read-only: stale
                    os.remove(self.file)
            self._remove_made()

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holding_lock_of(argument: str):
    """Decorator: hold the lock of the store passed as keyword ``argument`` (when given and not
    None) for the duration of the call."""
    def decorate(fn):
        @functools.wraps(fn)
        def locked(*args, **kwargs):
            path = kwargs.get(argument)
            if path is None:
                return fn(*args, **kwargs)
            with StoreLock(path):
                return fn(*args, **kwargs)
        return locked
    return decorate


__all__ = ["LOCK_SUFFIX", "StoreLock", "StoreLocked", "check_unlocked", "describe_owner",
           "holding_lock_of", "lock_path"]
