"""Ctrl-C always ends a ``daskpty`` command, even one whose main thread is stuck.

Python runs signal handlers in the main thread only, between two bytecodes. A main thread that
sits in a C call which the signal does not interrupt (a hung file system, a lock, a wait whose
signal the kernel delivered to another thread) therefore never sees Ctrl-C, and the run would
ignore every later one too. :class:`InterruptGuard` learns of each SIGINT, SIGTERM and SIGHUP from the
byte that Python's C-level handler writes to :func:`signal.set_wakeup_fd`, on a thread of its
own, so it knows of them whatever the main thread does:

* after the first one, the run stops by itself (the stop checkpoint, closing the cluster); if it
  is still going after ``still_stopping_s`` seconds, the guard says so and how to stop at once;
* after the second one, the main thread has ``insist_s`` seconds to finish (it normally exits
  within about a second); after a third one, or once those seconds are up, the guard ends the
  process itself: it says why and what is kept (``exit_note``), kills the worker processes this
  command started, and exits with 130.

Checkpoint writes are atomic (written aside, then renamed), so ending the process in the middle
of one keeps the checkpoint before it. The guard also makes ``kill -USR1 <pid>`` print every
thread's stack to stderr (:mod:`faulthandler`): the first thing to look at when a run seems stuck.
"""
from __future__ import annotations

import faulthandler
import os
import select
import signal
import threading
import time
from typing import Callable

#: exit code of an interrupted command (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130

#: the signals the guard counts: Ctrl-C, SIGTERM and SIGHUP (handled like SIGTERM)
_INTERRUPTS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

_HANGUP = getattr(signal, "SIGHUP", None)

_STOP = 0  # the byte that ends the guard's thread (no signal has number 0)

_exit_note: Callable[[], str | None] | None = None


def set_exit_note(note: Callable[[], str | None] | None) -> None:
    """Tell the guard what to report as kept when it ends the process (a callable returning one
    line, or None). It runs on the guard's thread while the main thread may be stuck: it must
    not wait for the main thread, take its locks or use zarr's event loop (plain file reads)."""
    global _exit_note
    _exit_note = note


class InterruptGuard:
    """Context manager that installs the guard for the duration of a command (main thread only;
    elsewhere, or where the platform lacks the signals, it does nothing)."""

    def __init__(self, insist_s: float = 5.0, still_stopping_s: float = 30.0):
        self.insist_s = insist_s
        self.still_stopping_s = still_stopping_s
        self._fds = None
        self._thread = None
        self._previous_fd = -1

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._fds = (read_fd, write_fd)
        self._terminals = [fd for fd in (1, 2) if _isatty(fd)]
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="daskpty-interrupt-guard",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._fds is None:
            return
        read_fd, write_fd = self._fds
        signal.set_wakeup_fd(self._previous_fd)
        faulthandler.unregister(signal.SIGUSR1)
        os.write(write_fd, bytes([_STOP]))
        self._thread.join(timeout=1.0)
        os.close(write_fd)
        if not self._thread.is_alive():
            os.close(read_fd)
        self._fds = None

    def _watch(self, read_fd: int) -> None:
        interrupts = 0
        deadline = None  # when the process is ended (set by the second interrupt)
        reminder = None  # when to say that the run is still stopping (set by the first)
        while True:
            wake = min((t for t in (deadline, reminder) if t is not None), default=None)
            timeout = None if wake is None else max(wake - time.monotonic(), 0.0)
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if ready:
                data = os.read(read_fd, 64)
                if not data or _STOP in data:
                    return
                for number in data:
                    if number == _HANGUP:
                        _quiet_hung_up_terminal(self._terminals)
                    if number in _INTERRUPTS:
                        interrupts += 1
                        if interrupts == 1:
                            reminder = time.monotonic() + self.still_stopping_s
                        elif interrupts == 2:
                            deadline, reminder = time.monotonic() + self.insist_s, None
                if interrupts >= 3:
                    self._end("interrupted three times")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._end(f"the run did not stop within {self.insist_s:g} s of the second interrupt", stacks=True)
            if reminder is not None and now >= reminder:
                reminder = None
                _say(f"daskpty: still stopping after {self.still_stopping_s:g} s (writing the checkpoint, "
                     "closing the cluster); press Ctrl-C again to exit now, keeping the last complete checkpoint")

    def _end(self, why: str, stacks: bool = False) -> None:
        """Say why and what is kept, kill the worker processes, exit. With ``stacks`` (the main
        thread did not react), every thread's stack goes to stderr first: a stuck run is a bug."""
        note = None
        try:
            note = _exit_note() if _exit_note is not None else None
        except Exception:  # the note is a courtesy: never let it stop the exit
            pass
        if stacks:
            _say(f"daskpty: {why}: exiting now; the stacks of its threads follow (please report them)")
            faulthandler.dump_traceback(all_threads=True)
        else:
            _say(f"daskpty: {why}: exiting now")
        _say(f"daskpty: interrupted; {note}" if note else "daskpty: interrupted")
        _kill_children()
        os._exit(INTERRUPTED)


def forget_handled_interrupt() -> None:
    """After the command handled an interrupt (exit 130): clear CPython's note of an unhandled one.

    CPython notes a KeyboardInterrupt that leaves code run through its ``PyRun_*`` calls
    (``_Py_UnhandledKeyboardInterrupt``) and, at exit, ends the process with SIGINT (exit −2)
    whenever that note is set, even when an outer frame caught the interrupt. A SIGTERM during the
    cluster's start-up hit such a call in about 1 run of 8
    (``test_sigterm_before_the_first_epoch_is_one_line``). The command caught the interrupt and
    has said what is kept, so it exits 130 as a shell expects. Where the flag is not reachable
    (another Python), this does nothing."""
    try:
        import ctypes

        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (AttributeError, ValueError, OSError):
        pass


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _quiet_hung_up_terminal(terminals: list[int]) -> None:
    """After SIGHUP: point stdout / stderr at /dev/null where they were a terminal that has hung
    up (closed: no longer a terminal, and every write to it fails with EIO), so that the stop
    checkpoint is written and the command exits 130 as it does with a terminal still open,
    instead of failing on its last line of output."""
    gone = [fd for fd in terminals if not _isatty(fd)]
    if not gone:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in gone:
            os.dup2(null, fd)
    finally:
        os.close(null)


def _say(line: str) -> None:
    """One line on stderr without Python's file objects (whose lock a stuck thread may hold)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _kill_children() -> None:
    """Kill the processes this one started (the local cluster's nannies and workers), which an
    exit that skips the interpreter's clean-up would otherwise leave behind."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:
        pass


__all__ = ["INTERRUPTED", "InterruptGuard", "forget_handled_interrupt", "set_exit_note"]
