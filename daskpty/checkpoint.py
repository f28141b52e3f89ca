"""Checkpoints of a running reconstruction: every K epochs, at the end, and on Ctrl-C / SIGTERM."""
from __future__ import annotations

import contextlib
import signal
import threading

from .results import Reconstruction


class Checkpointer:
    """Epoch callback that snapshots the state after every epoch and writes every ``every`` epochs.

    ``make_result(state, history)`` turns a state into a :class:`Reconstruction`. The snapshot holds
    references only (engines never modify arrays in place), so it costs nothing per epoch.
    """

    def __init__(self, path, make_result, every: int = 10, history=None):
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every}")
        self.path = path
        self.make_result = make_result
        self.every = every
        self.history = list(history or [])
        self.snapshot = None
        self.written_epoch = None

    def __call__(self, epoch, state, metrics):
        self.history.append(metrics)
        self.snapshot = (self._copy_state(state), list(self.history))
        if self.path is not None and epoch % self.every == 0:
            self.write()

    @staticmethod
    def _copy_state(state):
        import copy

        return copy.copy(state)  # shallow: arrays are replaced, never modified, by the engines

    def write(self) -> Reconstruction | None:
        """Write the last complete epoch's state (no-op when nothing ran or it is already written)."""
        if self.snapshot is None:
            return None
        state, history = self.snapshot
        if self.written_epoch == state.epoch:
            return None
        rec = self.make_result(state, history)
        if self.path is not None:
            rec.to_zarr(self.path, overwrite=True)
        self.written_epoch = state.epoch
        return rec


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block, SIGTERM raises KeyboardInterrupt (main thread only), so a job killed by a
    batch system's wall-time limit writes its checkpoint like Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
