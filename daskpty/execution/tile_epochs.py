"""The epoch loop on tiles (:mod:`.tile_graph`): submit, report, and restart after lost workers.

Like the replicated loop of :mod:`.driver`, each epoch is submitted before the previous one is
reported, so the client's work between epochs (callbacks, checkpoints) overlaps the next epoch.
No worker holds the whole state on tiles, so a lost worker (or an epoch past the watchdog's
bound) restarts from the last state the client has — the start, or the last epoch a callback
fetched (a checkpoint) — and recomputes the epochs since, on a layout made for the workers
there are then. W tiles sum in the same order as one (:mod:`.tile_graph`), so the result is the
bits of an undisturbed run. After ``MAX_EPOCH_RESTARTS`` restarts of one epoch the run stops
with :class:`~.watchdog.ReconstructionStalled`.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError

import numpy as np

from ..faults import StaleRoundState
from ..io.epoch_handle import StateLost
from .cluster import live_workers, wait_for_workers
from .placement import run_stuck_loose_tasks
from .rounds import ChunkedData
from .tile_graph import TileGraph, TileWorkerLost
from .tile_results import lazy_object_bytes, lazy_state
from .watchdog import MAX_EPOCH_RESTARTS, ReconstructionStalled, Watchdog

logger = logging.getLogger(__name__)


class TiledEpochState:
    """What a callback gets after a tiled epoch: the epoch counter at once, the whole state on
    :meth:`get` (each tile's own rows, gathered and stitched; with ``lazy``, the object-frame
    fields as dask arrays over the tiles, :func:`~.tile_results.lazy_state`); :class:`StateLost`
    when a tile died with its worker."""

    def __init__(self, epoch: int, graph: TileGraph, ends: list, lazy: bool = False):
        from distributed import Future

        self.epoch = int(epoch)
        self.lazy = bool(lazy)
        self._graph = graph
        self._ends = [Future(f.key, f.client) for f in ends]
        self._state = None

    @property
    def fetched(self) -> bool:
        return self._state is not None

    def get(self):
        if self._state is None:
            try:
                self._state = (lazy_state(self._graph, self._ends) if self.lazy
                               else self._graph.fetch(self._ends))
            except (CancelledError, OSError):
                raise StateLost(f"the tiles of epoch {self.epoch} were lost with a worker that held one; "
                                "continue with --resume (API: resume=)") from None
            self.release()
        return self._state

    def release(self) -> None:
        for f in self._ends:
            f.release()
        self._ends = []


def _release(*submitted) -> None:
    """Release (never cancel: see the driver) the futures of submitted epochs."""
    for epoch in submitted:
        if epoch is not None:
            for f in (*epoch[0], epoch[1]):
                f.release()


def tiled_epochs(client, data: ChunkedData, adapter, state, epochs: int, rounds: int, split_every,
                 initialise: bool = False):
    """Epochs on tiles; yields ``(TiledEpochState, scalars, seconds)`` like the driver's other
    epoch loops (``initialise``: the adapter's first-epoch set-up first, on the tiles). An object
    of at least :func:`~.tile_results.lazy_object_bytes` comes back lazily: the handles' states
    hold dask arrays over the tiles, and a restart after a lost worker begins at the last state
    the client holds whole (the start), not at a fetched epoch."""
    height = int(state.object.shape[-2])
    lazy = int(np.prod(state.object.shape)) * 8 >= lazy_object_bytes()

    fused = True  # until a fused round does not find its state: then split rounds (the same bits)

    # a row of a round's sums: the object's numerator and denominator (complex64 + float32) per layer
    piece_row_bytes = 12.0 * int(np.prod(state.object.shape[:-2])) * int(state.object.shape[-1])

    def layout():
        return TileGraph(client, data, adapter, height, rounds=rounds, split_every=split_every, fused=fused,
                         piece_row_bytes=piece_row_bytes)

    graph = layout()
    watchdog = Watchdog(data_bytes=data.intensities.nbytes)
    started_with = set(live_workers(client))

    def on_live_workers(action):
        """``action(graph)`` once a worker is there, on a layout for the workers there are then.
        A worker can die between the layout and the scatter of its tile (workers coming back one
        by one after all were lost): the scatter then fails (the connection closed, or the
        scheduler no longer knows the worker), and the action is tried again on the workers
        there are then, up to ``MAX_EPOCH_RESTARTS`` more times."""
        nonlocal graph, started_with
        for attempt in range(MAX_EPOCH_RESTARTS + 1):
            wait_for_workers(client, timeout=watchdog.bound(), lost=True)
            run_stuck_loose_tasks(client)  # chunks pinned to workers that are gone: recompute anywhere
            if set(live_workers(client)) != started_with or (graph.fused and not fused):  # a new layout
                graph.close()
                graph, started_with = layout(), set(live_workers(client))
            try:
                return action(graph)
            except (CancelledError, TimeoutError, OSError, KeyError) as exc:  # (CommClosedError: an OSError)
                reason = " ".join(f"{type(exc).__name__}: {exc}".split())
                logger.info("daskpty: the tiles could not be sent to their workers (%s); trying again", reason)
                started_with = set()  # a new layout next time, whatever the workers are
                time.sleep(min(0.5 * 2 ** attempt, 4.0))
        raise ReconstructionStalled(f"the tiles could not be sent to the cluster's workers after "
                                    f"{MAX_EPOCH_RESTARTS + 1} tries (last: {reason})")

    if initialise:
        state = on_live_workers(lambda g: g.initialise(state, timeout=watchdog.bound()))

    def start(from_state):
        """Submit an epoch from a state on the client."""
        return on_live_workers(lambda g: g.submit(g.scatter_tiles(from_state)))

    base, base_done = state, 0  # the latest state on the client, and the epochs done to reach it
    last_end = time.time()
    pending, following = start(base), None
    reaches = 1  # the epoch count (since the start of this run) the pending epoch reaches
    done = restarts = 0
    try:
        while done < epochs:
            if following is None and reaches < epochs:
                following = graph.submit(pending[0])
            try:
                graph.wait([pending[1]], timeout=watchdog.bound())
                epoch, scalars, ended_at, _ = pending[1].result()
            except (CancelledError, StaleRoundState, TimeoutError, OSError) as exc:
                restarts += 1
                reason = (f"no epoch finished within {watchdog.bound():.0f} s" if isinstance(exc, TimeoutError)
                          else f"a worker was lost: {exc}" if isinstance(exc, TileWorkerLost)
                          else f"{exc}" if isinstance(exc, StaleRoundState)
                          else f"a worker was lost ({type(exc).__name__})")
                if isinstance(exc, StaleRoundState):  # a round task ran away from its state: split rounds
                    fused = False
                if restarts > MAX_EPOCH_RESTARTS:
                    raise ReconstructionStalled(f"the tiled reconstruction made no progress after "
                                                f"{MAX_EPOCH_RESTARTS} restarts of epoch {done + 1} (last: {reason})"
                                                ) from None
                logger.warning("daskpty: restarting tiled epoch %d from epoch %d (%s)", done + 1, base_done,
                               reason)
                _release(pending, following)
                following = None
                pending, reaches = start(base), base_done + 1
                continue
            if reaches > done:  # (else an epoch recomputed after a restart: already reported)
                handle = TiledEpochState(epoch, graph, pending[0], lazy=lazy)
                seconds, last_end = ended_at - last_end, ended_at
                watchdog.observe(seconds)
                if reaches == epochs:
                    handle.get()  # the last epoch: fetched while its tiles are held
                yield handle, scalars, seconds
                done = reaches
                if handle.fetched and not lazy:  # a callback fetched it (a checkpoint): restarts begin here
                    base, base_done = handle.get(), done
                # (an unfetched handle keeps its tiles until dropped: a stop checkpoint may ask)
            _release(pending)
            pending, following = following, None
            reaches += 1
    finally:
        _release(pending, following)
        graph.close()


__all__ = ["TiledEpochState", "tiled_epochs"]
