"""Checkpoints of a running reconstruction: every K epochs, at the end, and on Ctrl-C / SIGTERM / SIGHUP.

The checkpoint is a reconstruction store (:mod:`.results`), so io owns the writer too. It knows
the driver's epoch-state handle only as the :class:`~.epoch_handle.EpochHandle` protocol and the divergence
check only as the ``check`` it is given (``daskpty.execution.watchdog.check_finite_result`` in
:func:`daskpty.reconstruct`): io never imports execution.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import signal
import threading
from typing import Callable

from .epoch_handle import EpochHandle, StateLost
from .results import Reconstruction

logger = logging.getLogger(__name__)


class Checkpointer:
    """Epoch callback that keeps the history, remembers the last epoch's state and writes it
    every ``every`` epochs (and on :meth:`write`, e.g. after an interrupt).

    ``make_result(state, history)`` turns a state into a :class:`Reconstruction`. It takes the
    driver's :class:`EpochHandle` handles, so a state is fetched from the workers only for an
    epoch that is written; without a path nothing is kept. ``check(object, probe, epoch)``
    raises for a result that must not replace the stored one (a diverged state).
    """

    takes_epoch_state = True

    def __init__(self, path, make_result, every: int = 10, history=None, check: Callable | None = None):
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every}")
        self.path = path
        self.make_result = make_result
        self.every = every
        self.history = list(history or [])
        self.snapshot = None
        self.written_epoch = None
        self.check = check

    def __call__(self, epoch, state, metrics):
        self.history.append(metrics)
        if self.path is None:
            return
        self.snapshot = (state if isinstance(state, EpochHandle) else copy.copy(state), list(self.history))
        if epoch % self.every == 0:
            try:
                self.write()
            except StateLost as exc:  # the last written checkpoint stays; the next one comes
                logger.warning("daskpty: checkpoint of epoch %d skipped (%s)", epoch, exc)
                self.snapshot = None

    def write(self) -> Reconstruction | None:
        """Write the last complete epoch's state (no-op when nothing ran, there is no path, or it
        is already written)."""
        if self.snapshot is None:
            return None
        state, history = self.snapshot
        if self.written_epoch == state.epoch:
            return None
        if isinstance(state, EpochHandle):  # fetch the state from the workers now
            state = state.get()
        rec = self.make_result(state, history)
        if self.check is not None:  # a diverged state never replaces a good one
            self.check(rec.object, rec.probe, state.epoch)
        rec.to_zarr(self.path, overwrite=True)
        self.written_epoch = state.epoch
        return rec


#: Signals that end a run like Ctrl-C: SIGTERM (a batch system's wall time), SIGHUP (the
#: terminal or ssh session closed).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block, SIGTERM and SIGHUP raise KeyboardInterrupt (main thread only), so a job
    killed by a batch system's wall-time limit, or whose terminal closed, writes its checkpoint
    like Ctrl-C does (SIGHUP would otherwise end the run with no stop checkpoint). A signal that
    is ignored (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {}
    for number in STOP_SIGNALS:
        if signal.getsignal(number) is not signal.SIG_IGN:
            previous[number] = signal.signal(number, handler)
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
