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
import sys
import threading
from typing import Callable

import numpy as np

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


#: engine-state names of per-pattern arrays (one row per pattern, ``daskpty.execution.local_state``)
PER_PATTERN_PREFIXES = ("position_", "pattern_")


def extended_to(rec: Reconstruction, positions: np.ndarray, path) -> Reconstruction:
    """``rec`` (a snapshot of the first M frames of a scan) for the frames ``positions`` (N ≥ M,
    data frame) of the same scan grown: the new frames' positions appended (object frame) and
    their per-pattern state rows NaN, i.e. "start from the initial value where they join"
    (:func:`daskpty.execution.local_state.initial_locals`). One line when the stored frames are
    not the first frames of these data."""
    nominal = rec.positions if rec.nominal_positions is None else rec.nominal_positions
    m, n = len(nominal), len(positions)
    if m > n or not np.allclose(np.asarray(nominal) - rec.origin, positions[:m], atol=1e-6):
        raise ValueError(f"the resume store {path} holds {m:,} frames that are not the first frames "
                         f"of these data ({n:,} frames); follow the data set it was made from, or "
                         f"start afresh without resuming")
    if m == n:
        return rec
    new = positions[m:] + rec.origin
    out = copy.copy(rec)
    out.positions = np.concatenate([rec.positions, new])
    if rec.nominal_positions is not None:
        out.nominal_positions = np.concatenate([rec.nominal_positions, new])
    if rec.probe_weights is not None:
        out.probe_weights = _nan_rows(rec.probe_weights, n - m)
    out.engine_state = {k: _nan_rows(v, n - m) if k.startswith(PER_PATTERN_PREFIXES) and np.ndim(v) >= 1
                        and len(v) == m else v for k, v in rec.engine_state.items()}
    return out


def grown_canvas(rec: Reconstruction, shape, origin) -> Reconstruction:
    """``rec`` on an object canvas covering its own and the frame ``(shape, origin)`` (where
    position (0, 0) lies): the old canvas shifted by whole pixels, new pixels of the object one
    (its initial value), of the illumination and of object-sized engine state (momenta,
    optimiser moments) zero, the positions moved with the origin. ``rec`` itself when its
    canvas already covers the frame."""
    obj = np.asarray(rec.object)
    h, w = obj.shape[-2:]
    old = np.asarray(rec.origin, dtype=np.float64)
    shift = np.maximum(np.ceil(np.asarray(origin, dtype=np.float64) - old), 0).astype(int)
    far = np.maximum(np.ceil(np.asarray(shape) - np.asarray(origin) + old + shift), (h + shift[0], w + shift[1]))
    size = far.astype(int)
    if not shift.any() and tuple(size) == (h, w):
        return rec
    pad = ((int(shift[0]), int(size[0] - h - shift[0])), (int(shift[1]), int(size[1] - w - shift[1])))

    def grown(arr, value):
        arr = np.asarray(arr)
        return np.pad(arr, ((0, 0),) * (arr.ndim - 2) + pad, constant_values=value)

    out = copy.copy(rec)
    out.object = grown(obj, 1)
    if rec.illumination is not None:
        out.illumination = grown(rec.illumination, 0)
    out.engine_state = {k: grown(v, 0) if np.ndim(v) >= 2 and np.shape(v)[-2:] == (h, w) else v
                        for k, v in rec.engine_state.items()}  # (momenta, optimiser moments)
    out.origin = old + shift
    out.positions = np.asarray(rec.positions) + shift
    if rec.nominal_positions is not None:
        out.nominal_positions = np.asarray(rec.nominal_positions) + shift
    return out


def _nan_rows(arr, k: int) -> np.ndarray:
    arr = np.asarray(arr)
    dtype = np.result_type(arr.dtype, np.float32)
    return np.concatenate([arr.astype(dtype, copy=False), np.full((k, *arr.shape[1:]), np.nan, dtype)])


#: Signals that end a run like Ctrl-C: SIGTERM (a batch system's wall time), SIGHUP (the
#: terminal or ssh session closed).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


#: Stop signals received whose KeyboardInterrupt has not ended the block yet (see
#: :func:`raise_if_stopped`).
_RECEIVED: list[int] = []


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block, SIGTERM and SIGHUP raise KeyboardInterrupt (main thread only), so a job
    killed by a batch system's wall-time limit, or whose terminal closed, writes its checkpoint
    like Ctrl-C does (SIGHUP would otherwise end the run with no stop checkpoint). A signal that
    is ignored (``nohup``) stays ignored. Python drops an exception raised where it cannot
    propagate (a signal that lands in an import lock's or a weakref's callback prints "Exception
    ignored in" and the run goes on), so the signal is also remembered until the block ends by
    an exception: :func:`raise_if_stopped` raises it again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _RECEIVED.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {}
    for number in STOP_SIGNALS:
        if signal.getsignal(number) is not signal.SIG_IGN:
            previous[number] = signal.signal(number, handler)
    hook = sys.unraisablehook

    def quiet_when_stopping(unraisable):   # the dropped interrupt is raised again, not printed
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and _RECEIVED):
            hook(unraisable)

    sys.unraisablehook = quiet_when_stopping
    try:
        yield
    except BaseException:
        _RECEIVED.clear()   # the interrupt (or another error) ends the block
        raise
    finally:
        sys.unraisablehook = hook
        for number, old in previous.items():
            signal.signal(number, old)


def raise_if_stopped(*_args) -> None:
    """KeyboardInterrupt when a stop signal arrived inside :func:`sigterm_as_interrupt` whose own
    interrupt was dropped; called at every epoch's end (any arguments are ignored, so it serves
    as an epoch callback)."""
    if _RECEIVED:
        name = signal.Signals(_RECEIVED[-1]).name
        _RECEIVED.clear()
        raise KeyboardInterrupt(name)


raise_if_stopped.takes_epoch_state = True   # (as an epoch callback it never fetches the state)
