"""Progress or a clear end: the bound on how long the driver waits for an epoch.

The driver waits for each epoch's summary at most :meth:`Watchdog.bound` seconds: a multiple of
the slowest epoch seen so far, but never less than a floor (default 300 s, or the environment
variable ``DASKPTY_STALL_SECONDS``) that covers start-up, the first epoch and a nanny restarting
a worker. A wait that runs out is handled like a lost worker: the epoch restarts from the newest
surviving state or the client's copy, a bounded number of times, and then the run stops with
:class:`ReconstructionStalled` — one line, instead of a batch job burning its wall time.

Likewise a run whose updates diverge stops with :class:`ReconstructionDiverged`: an epoch whose
data loss is NaN or infinite (:func:`check_loss`, before any callback or checkpoint sees it), or
an object or probe that is no longer finite when it would be written or returned
(:func:`check_finite_result`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os

import numpy as np

from ..faults import ReconstructionDiverged, ReconstructionStalled  # noqa: F401 (also named here)

#: The floor of the wait for one epoch, seconds (``DASKPTY_STALL_SECONDS`` overrides it).
DEFAULT_STALL_SECONDS = 300.0
#: The bound is this multiple of the slowest epoch so far, when that is above the floor.
EPOCH_FACTOR = 20.0
#: How often one epoch is restarted after lost workers or a missed bound before the run stops.
MAX_EPOCH_RESTARTS = 3


def check_finite_result(obj, probe, epoch: int) -> None:
    """Raise :class:`ReconstructionDiverged` when the object or probe holds NaN or infinity."""
    if not (np.isfinite(obj).all() and np.isfinite(probe).all()):
        raise ReconstructionDiverged(f"the object or probe of epoch {epoch} is not finite: the updates "
                                     "diverged; lower the step (LSQML beta, AD lr)")


def check_loss(epoch: int, scalars: dict, rounds: int) -> None:
    """Raise :class:`ReconstructionDiverged` when an epoch's summed loss is not finite (before
    any callback sees the epoch, so no checkpoint keeps the diverged state)."""
    loss = scalars.get("loss")
    if loss is not None and not math.isfinite(float(loss)):
        hint = ("lower the step (LSQML beta, AD lr)" +
                (f" or take one update per epoch (rounds_per_epoch=1 instead of {rounds})" if rounds > 1 else ""))
        raise ReconstructionDiverged(f"the data loss became {float(loss)} in epoch {epoch}: the object or probe "
                                     f"updates diverged; {hint}")


def seconds_from_env(name: str, default: float, *, zero_allowed: bool = False, unit: str = "seconds") -> float:
    """A number of ``unit`` (seconds, bytes, ...) from the environment variable ``name``
    (``default`` when unset or empty); one-line ValueError for a value that is not a number,
    negative, or zero where ``zero_allowed`` is False."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {text!r}") from None
    if not (value >= 0 if zero_allowed else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if zero_allowed else 'positive'}, got {text!r}")
    return value


def stall_seconds() -> float:
    """The floor of the watchdog's bound (``DASKPTY_STALL_SECONDS`` or the default)."""
    return seconds_from_env("DASKPTY_STALL_SECONDS", DEFAULT_STALL_SECONDS)


#: Until the first epoch (or round) has finished, the bound also allows reading the data at this
#: pessimistic rate (bytes/s): the first epoch waits for the chunks to be loaded.
FIRST_READ_BYTES_PER_S = 20e6


class Watchdog:
    """How long to wait for the next epoch: ``max(floor, EPOCH_FACTOR × slowest epoch)``; before
    any epoch has finished, ``floor + data_bytes / FIRST_READ_BYTES_PER_S`` (the first one reads
    the data: 256 GB at 20 MB/s is 3.6 h)."""

    def __init__(self, floor: float | None = None, data_bytes: int = 0):
        self.floor = stall_seconds() if floor is None else float(floor)
        self.first = self.floor + float(data_bytes) / FIRST_READ_BYTES_PER_S
        self.slowest = 0.0

    def observe(self, seconds: float) -> None:
        if seconds == seconds and seconds > self.slowest:  # NaN-safe
            self.slowest = float(seconds)

    def bound(self) -> float:
        if self.slowest == 0.0:
            return self.first
        return max(self.floor, EPOCH_FACTOR * self.slowest)


# --- distributed's noise about a loss daskpty handles ------------------------------------------

#: Log messages (parts of ``record.msg``) that distributed emits when workers or the scheduler are
#: lost: the driver handles the loss (restarts, or one line) so they are routed to INFO.
LOSS_MESSAGES = (
    "failed during get data", "Failed to communicate with scheduler during heartbeat",
    "Removing worker", "Restarting worker", "Worker process still alive", "Failed to reconnect to scheduler",
    "Connection to scheduler broken", "Unable to connect to scheduler", "Nanny failed to start",
    "Worker stream died", "Failed to connect to", "Task exception was never retrieved",
    "Scheduler for Client", "Lost connection to", "exit status was already read",
    "Async instruction for",   # a worker's task cancelled while the cluster closes (an interrupt)
    "Couldn't gather",  # a result fetched from a worker that died: the driver restarts the round
)
#: Callbacks whose failure tornado reports ("Exception in callback …") after an interrupt the driver
#: handles: distributed's ``sync`` schedules its ``cancel`` when Ctrl-C or SIGTERM reaches the
#: waiting thread, and that ``cancel`` raises NameError when the interrupt came before the awaited
#: coroutine had started (there was nothing to cancel yet).
INTERRUPT_CALLBACKS = ("sync.<locals>.cancel",)
#: Exceptions that mark a "Compute Failed" report as a consequence of the loss.
LOSS_EXCEPTIONS = ("CancelledError", "CommClosedError", "KilledWorker", "AllExit", "StreamClosedError",
                   "FutureState", "lost", "forgotten")
#: distributed's loggers that report losses
LOSS_LOGGERS = ("distributed", "distributed.worker", "distributed.core", "distributed.nanny",
                "distributed.scheduler", "distributed.client", "distributed.comm", "distributed.utils",
                "distributed.batched", "distributed.worker.memory", "distributed.worker.state_machine",
                "distributed.process", "tornado.application", "asyncio")


class HandledLossNoise(logging.Filter):
    """Route distributed's reports of lost workers or a lost scheduler (ERROR tracebacks:
    ``failed during get data``, heartbeats, ``Compute Failed`` of cancelled tasks; asyncio's
    ``Task exception was never retrieved … AllExit``) to INFO without the traceback, and drop
    the traceback of those already at INFO (``Batched Comm Closed`` with its CommClosedError
    when the scheduler dies): they show only where INFO logging is on (distributed's own
    loggers are at WARNING in daskpty's local clusters). Other records pass unchanged. On a
    handler (``handler_level``), a record demoted below that handler's level is dropped:
    handlers test the level before their filters run."""

    def __init__(self, handler_level: int = logging.NOTSET):
        super().__init__()
        self.handler_level = handler_level

    def filter(self, record) -> bool:
        msg = str(record.msg)
        text = msg if not record.args else msg + " " + " ".join(map(str, record.args if isinstance(
            record.args, tuple) else (record.args,)))
        exc = record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else None
        loss = any(m in msg for m in LOSS_MESSAGES) and not msg.startswith("Task exception")
        loss = loss or (msg.startswith("Exception in callback") and any(c in text for c in INTERRUPT_CALLBACKS))
        if msg.startswith(("Compute Failed", "Task exception")) or (exc is not None and not loss):
            names = text + ("" if exc is None else f" {type(exc).__name__} {exc}")
            loss = any(word in names for word in LOSS_EXCEPTIONS)
        if not loss:
            return True
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        if record.levelno < logging.WARNING:  # (e.g. "Batched Comm Closed" at INFO): the line stays
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        return self.handler_level <= logging.INFO and logging.getLogger(record.name).isEnabledFor(logging.INFO)


def install_loss_filter() -> list:
    """Add :class:`HandledLossNoise` to distributed's loggers (and asyncio's) and their
    handlers; returns those it was added to (for :func:`remove_loss_filter`)."""
    added = []
    targets = [logging.getLogger(name) for name in LOSS_LOGGERS]
    # a logger's filters see only records logged on it, not those of its children: filter the
    # handlers those records reach too
    targets += [h for log in targets + [logging.getLogger()] for h in log.handlers]
    for target in targets:
        if not any(isinstance(f, HandledLossNoise) for f in target.filters):
            level = target.level if isinstance(target, logging.Handler) else logging.NOTSET
            target.addFilter(HandledLossNoise(level))
            added.append(target)
    return added


def remove_loss_filter(added) -> None:
    for log in added:
        for f in [f for f in log.filters if isinstance(f, HandledLossNoise)]:
            log.removeFilter(f)


@contextlib.contextmanager
def quiet_handled_losses():
    """:class:`HandledLossNoise` on distributed's loggers for the duration of the block (a run)."""
    added = install_loss_filter()
    try:
        yield
    finally:
        remove_loss_filter(added)
