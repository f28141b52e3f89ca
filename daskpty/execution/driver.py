"""The epoch loop: rounds of map + tree reduce + apply, for any engine adapter.

An *adapter* binds an engine's pure functions to this loop:

* ``chunk_function(intensities, positions, payload) -> Partial`` (module-level, picklable)
* ``payload(state) -> object`` broadcast once per round
* ``apply(state, total) -> state``, ``begin_epoch(state)``, ``end_epoch(state)``; ``begin_epoch``
  must leave ``payload(state)`` unchanged (an epoch graph applies it after the first round's
  chunk steps, which read the payload of the state before it)
* optionally ``copy_state(state)``: a copy that ``apply`` may change (default ``copy.deepcopy``)

With persisted data each epoch runs as one graph on the workers (:class:`~.epoch_graph.EpochGraph`:
``apply`` on every worker's copy of the state; the next epoch is submitted before this one is
gathered); otherwise round by round (``map_reduce`` on the cluster, ``apply`` on the client). Both
give the same result.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import CancelledError

import numpy as np

from ..io.epoch_handle import StateLost
from .cluster import live_workers, result_unless_paused, wait_for_workers
from .device_state import fetch_host_state
from .fetch import BLOCK_BYTES, fetch_state
from .engine_protocol import RunsOwnRounds, UpdatesInPlace
from .epoch_graph import EpochCarry, EpochGraph, StaleRoundState
from .local_state import initial_locals, with_local
from .placement import run_stuck_loose_tasks, running_workers
from .rounds import ChunkedData, default_split_every, map_reduce
from .scatter import scatter_retrying
from .tile_epochs import tiled_epochs
from .tile_graph import check_tiles_supported
from .watchdog import (MAX_EPOCH_RESTARTS, ReconstructionStalled, Watchdog, check_loss, quiet_handled_losses,
                       stall_seconds)


def _carry_of(state) -> EpochCarry:
    """The start carry of an epoch graph: the state, its chunks' per-pattern state beside it."""
    local = getattr(state, "chunk_local", None)
    if local is None:
        return EpochCarry(state)
    return EpochCarry(with_local(state, None), local=local)


#: A round sum at least this large is followed by a cyclic garbage collection (see _run_rounds).
COLLECT_AFTER_BYTES = 64 * 2**20


def _run_rounds(client, data: ChunkedData, adapter, state, rounds: int, split_every: int, local=None,
                watchdog: Watchdog | None = None, in_place: bool = False):
    """One epoch round by round from the client: returns ``(state, summed scalars, local)``.
    ``watchdog`` bounds each round's wait by the slowest round so far (see :mod:`.watchdog`);
    ``in_place``: the update writes into the state (begun with ``begin_epoch_owned``)."""
    scalars: dict[str, float] = {}
    for r in range(rounds):
        start = time.perf_counter()
        if isinstance(adapter, RunsOwnRounds):  # engines that need extra evaluations (line searches)
            state, total = adapter.run_round(client, data, state, round_index=r, rounds=rounds,
                                             split_every=split_every, local=local)
        else:
            total = map_reduce(client, data, adapter.chunk_function, adapter.payload(state),
                               round_index=r, rounds=rounds, split_every=split_every, local=local,
                               timeout=None if watchdog is None else watchdog.bound())
            state = (adapter.apply_in_place if in_place else adapter.apply)(state, total)
        if watchdog is not None:
            watchdog.observe(time.perf_counter() - start)
        if total is not None:
            if total.local:
                local = {**local, **total.local}
            for k, v in total.scalars.items():
                scalars[k] = scalars.get(k, 0.0) + v
        large = total is not None and total.nbytes >= COLLECT_AFTER_BYTES
        total = None  # (before the next round's sum arrives: one object-sized sum at a time)
        if large:
            # A received sum is also kept by a reference cycle (from its deserialisation) until
            # the cyclic collector runs, which it rarely does: traced on a 7,615² object, every
            # round's 650 MB sum stayed until then and the client grew by one per round.
            gc.collect()
    return state, scalars, local


class EpochState:
    """The engine state after one epoch; on the workers until :meth:`get` fetches it (once).

    ``epoch`` (the state's epoch counter) is known at once. Callbacks that set
    ``takes_epoch_state = True`` receive this handle and call :meth:`get` only when they need the
    state (a checkpoint to write, an image to draw); others receive the state itself. An epoch
    whose state nobody asks for never travels to the client (epoch graphs only; round by round
    the state is on the client anyway).
    """

    def __init__(self, epoch: int, state=None, future=None, local_futures=(), on_device: bool = False,
                 object_bytes: int = 0):
        self.epoch = int(epoch)
        self._on_device = on_device  # then fetched as a host copy made on its worker
        self._in_blocks = object_bytes > BLOCK_BYTES  # fetch the large arrays in row blocks
        self._state = state
        self._future = None
        self._local = []
        if future is not None:  # own references: the driver releases its futures as it goes
            from distributed import Future

            self._future = Future(future.key, future.client)
            self._local = [Future(f.key, f.client) for f in local_futures]

    @property
    def fetched(self) -> bool:
        return self._state is not None

    def get(self):
        """The state (gathered from the workers on the first call); with per-pattern state, its
        ``chunk_local`` holds every chunk's, gathered from the workers that keep them."""
        if self._state is None:
            try:
                self._state = self._fetch_once_more_if_cancelled()
            except OSError:  # the comm closed under the fetch: a lost scheduler is one line
                live_workers(self._future.client)
                raise
            self._future.release()
            self._future, self._local = None, []
        return self._state

    def _fetch_once_more_if_cancelled(self):
        """:meth:`_fetch`, again once if its wait was cancelled: the stop checkpoint of a run
        interrupted by a signal fetches right after the signal broke off the client's last wait,
        and distributed's ``sync`` can then lose the fetch's coroutine (an UnboundLocalError from
        its result, or CancelledError); the future itself is still good."""
        try:
            return self._fetch()
        except (UnboundLocalError, CancelledError):
            pass
        try:
            return self._fetch()
        except CancelledError:  # cancelled twice: the state died with its worker
            # no worker left: the watchdog's wait for one, then ClusterUnavailable's one line
            wait_for_workers(self._future.client, timeout=stall_seconds(), lost=True)
            raise StateLost(f"the state of epoch {self.epoch} was lost with the worker that held it; continue "
                            "with --resume (API: resume=)") from None

    def _fetch(self):
        # large arrays in row blocks: no transient copies of the object on the client
        if self._on_device:
            state = fetch_host_state(self._future)
        else:
            state = fetch_state(self._future) if self._in_blocks else self._future.result().state
        if self._local:
            local = {}
            for future in self._local:
                local.update(future.result())
                future.release()
            state = with_local(state, local)
        return state


def _metrics(epoch: int, scalars: dict, seconds: float, n_total: int, rounds: int) -> dict:
    n = max(scalars.get("n", 0.0), 1.0)
    return {
        "epoch": epoch,
        "loss": scalars.get("loss", float("nan")) / n,
        "seconds": seconds,
        "patterns_per_second": n_total / seconds if seconds > 0 else float("nan"),
        "alpha_object": scalars.get("alpha_object", 0.0) / n,
        "alpha_probe": scalars.get("alpha_probe", 0.0) / n,
        "reduced_bytes_per_round": scalars.get("reduced_bytes", 0.0) / rounds,
        # bytes of partial sums one worker (the first copy of the state) received from the others
        # per round; epoch graphs only (round by round, the client gathers each round's root)
        "exchanged_bytes_per_round": scalars["exchanged_bytes"] / rounds if "exchanged_bytes" in scalars
        else None,
        "loss_evaluations": scalars.get("loss_evaluations", 0.0),
        "rounds": rounds,
        **_position_metrics(scalars),
        **_probe_model_metrics(scalars),
    }


def _probe_model_metrics(scalars: dict) -> dict:
    """History entries of a varying probe's epoch that fitted eigen-probe weights (relative to
    the mean probe's weight): their rms over the patterns and eigen-probes, and the rms of the
    part neighbouring patterns share (√ of their mean product; :mod:`.round_switch`)."""
    terms = scalars.get("opr_eigen_terms", 0.0)
    out = {"opr_eigen_rms": float(np.sqrt(scalars["opr_eigen_sq"] / terms))} if terms > 0 else {}
    lag = scalars.get("opr_eigen_lag_terms", 0.0)
    if lag > 0:
        out["opr_eigen_shared_rms"] = float(np.sqrt(max(scalars["opr_eigen_lag"], 0.0) / lag))
    if scalars.get("opr_eigen_dropped"):   # (probe_model.EIGEN_SUPPORT_RMS)
        out["opr_eigen_dropped"] = True
    return out


def _position_metrics(scalars: dict) -> dict:
    """History entries of position refinement: rms update per refined pattern, the affine fit and
    (``start_epoch="auto"``) the start epoch it decided."""
    out = {k: scalars[k] for k in ("position_start_epoch",) if k in scalars}
    if "position_refined" not in scalars:
        return out
    refined = scalars["position_refined"]
    out["position_rms_update"] = (float(np.sqrt(scalars.get("position_update_sq", 0.0) / refined))
                                  if refined > 0 else 0.0)
    out.update({k: v for k, v in scalars.items() if k.startswith("affine_")})
    return out


def _client_epochs(client, data, adapter, state, epochs, rounds, split_every):
    """Epochs run round by round from the client; yields ``(EpochState, scalars, seconds)``."""
    local = getattr(state, "chunk_local", None)
    watchdog = Watchdog(data_bytes=data.intensities.nbytes)
    in_place = isinstance(adapter, UpdatesInPlace) and not isinstance(adapter, RunsOwnRounds)
    # persisted chunks lost with their workers wait in no-worker for a round that waits for them
    unsticker = _Unsticker(client) if data.persisted else None
    try:
        for _ in range(epochs):
            start = time.perf_counter()
            state = adapter.begin_epoch_owned(state) if in_place else adapter.begin_epoch(state)
            state, scalars, local = _run_rounds(client, data, adapter, state, rounds, split_every, local, watchdog,
                                                in_place)
            state = adapter.end_epoch_owned(state) if in_place else adapter.end_epoch(state)
            scalars.update(adapter.epoch_scalars(state))
            # a shallow copy: the next epoch rebinds this state's arrays (it never writes into them)
            yield EpochState(state.epoch, state=with_local(state, local)), scalars, time.perf_counter() - start
    finally:
        if unsticker is not None:
            unsticker.stop()


logger = logging.getLogger("daskpty")


def _state_of_any(epoch):
    """The state after a finished epoch (a :class:`~.epoch_graph.SubmittedEpoch`) from the first
    of its copies still on a live worker; with per-pattern state, only when every worker's share
    of it survived too (else None: restart from the client's copy)."""
    if epoch is None:
        return None
    local = None
    if epoch.locals:
        try:
            local = {}
            for future in epoch.locals:
                local.update(future.result(timeout=60))
        except Exception:  # a worker's chunks' state is lost with it
            return None
    for future in epoch.ends:
        if future.status != "finished":
            continue
        try:
            state = (fetch_host_state(future, timeout=60) if epoch.on_device
                     else future.result(timeout=60).state)
        except Exception:  # its worker died meanwhile: try the next copy
            continue
        return state if local is None else with_local(state, local)
    return None


def _workers(client) -> set:
    return set(live_workers(client))  # SchedulerLost when the scheduler is gone


def _replica_lost(client, graph) -> bool:
    """True when a worker the epoch graph keeps a state copy on has left the cluster (after all
    workers died, their nannies' new workers have new addresses)."""
    alive = _workers(client)
    return any(worker is not None and worker not in alive for worker in graph.replicas)


#: After a loss, how long a restart waits for as many running workers as the run started with
#: once one runs (nannies restart a killed worker within about 2 s): an epoch graph built
#: earlier would keep the state and all chunks on the first worker back for the rest of the run.
REJOIN_SECONDS = 10.0


def _await_running(client, expected: int, timeout: float) -> None:
    """Wait for a worker to run tasks (one only registered does not yet: tasks given to it stay
    stuck), then up to :data:`REJOIN_SECONDS` for ``expected`` of them. :class:`ClusterUnavailable`
    when none is there within ``timeout``."""
    wait_for_workers(client, timeout=timeout, lost=True)
    deadline = time.monotonic() + timeout
    rejoin = None
    while time.monotonic() < deadline:
        running = len(running_workers(client))
        if running:
            rejoin = rejoin or time.monotonic() + REJOIN_SECONDS
            if running >= expected or time.monotonic() >= rejoin:
                return
        time.sleep(0.1)


#: How often, while epochs run, the scheduler is asked to run tasks stuck on workers that are gone.
UNSTICK_SECONDS = 1.0


class _Unsticker:
    """A thread that runs :func:`~.placement.run_stuck_loose_tasks` (``pinned``) on the scheduler
    every :data:`UNSTICK_SECONDS` while the driver waits for epochs: a task stuck on a worker that
    died (a fused round task pinned to it, chunks persisted on it) is otherwise noticed only by
    the watchdog, minutes later. Errors are left to the driver's own calls (a lost scheduler)."""

    def __init__(self, client):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client,), name="daskpty-unstick", daemon=True)
        self._thread.start()

    def _run(self, client) -> None:
        while not self._stop.wait(UNSTICK_SECONDS):
            try:
                run_stuck_loose_tasks(client, pinned=True)
            except Exception:  # the scheduler is gone or closing: the driver says so
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _graph_epochs(client, data, adapter, state, epochs, rounds, split_every):
    """Epochs as graphs on the workers, each submitted before the previous one is finished, so the
    client's work between epochs (callbacks, checkpoints) overlaps the next epoch. Yields
    ``(EpochState, scalars, seconds)``; ``seconds`` is the time between the ends of two epochs
    (the first: from the submission), by ``time.time()`` on the worker of the first state copy
    and, for the submission, here. A summary usually runs after the next epoch's first round
    task on its worker, so it arrives about a round after its epoch ended; timing the arrivals
    would add that round to the first epoch. The client receives each epoch's summary (scalars,
    a few hundred bytes); the state stays on the workers unless someone calls ``EpochState.get``.

    A worker that dies takes data dask cannot recompute (the scattered start state, an epoch's
    result once its graph is forgotten, or the state a fused round task keeps in its worker);
    dask then cancels the epoch, or a round task pinned to that worker, run elsewhere by
    :class:`_Unsticker`, raises :class:`~.epoch_graph.StaleRoundState`, and the epoch is
    restarted (at most ``MAX_EPOCH_RESTARTS`` times; after a stale state with no worker lost,
    with the state kept as task results) from the last finished epoch's state on a surviving worker
    (every worker holding chunks keeps a copy until the next epoch is finished), else from the
    last state on the client, recomputing the epochs since then. Recomputation is
    deterministic, so the result equals an undisturbed run. An epoch that does not finish within
    the :class:`~.watchdog.Watchdog`'s bound (workers all gone, restarted by their nannies, or
    paused under memory pressure) is restarted the same way; after ``MAX_EPOCH_RESTARTS`` the run
    stops with :class:`~.watchdog.ReconstructionStalled`.
    """
    graph = EpochGraph(client, data, adapter, rounds=rounds, split_every=split_every)
    base, base_done = state, 0  # the latest state on the client, and the epochs done to reach it
    finished = None  # the last finished epoch (its state copies are the first restart point)
    finished_reached = 0  # the epoch count it reached

    def release(*submitted):
        # Release, never cancel: cancelling a key whose dependents nobody holds (the next
        # epoch's tasks) trips an assertion in distributed's scheduler (stimulus_cancel), which
        # then drops this client and every key it holds, the persisted data included.
        for epoch in submitted:
            if epoch is not None:
                epoch.release()

    def start(carry_state):
        """Submit an epoch from a state on the client once a worker is there to take it."""
        _await_running(client, len(started_with), watchdog.bound())
        run_stuck_loose_tasks(client)  # chunks pinned to workers that are gone: recompute anywhere
        return graph.submit(scatter_retrying(client, _carry_of(carry_state), hash=False))

    watchdog = Watchdog(data_bytes=data.intensities.nbytes)
    started_with = _workers(client)
    last_end = time.time()  # when the last reported epoch ended (time.time() on the worker)
    pending = start(base)
    reaches = 1  # the epoch count (since the start of this run) the pending epoch reaches
    following = None
    done = restarts = 0
    unsticker = _Unsticker(client)
    try:
        while done < epochs:
            if following is None and reaches < epochs:
                following = graph.submit(pending)
                pending.release_last_round()  # the scheduler keeps them for the new graph
            try:
                epoch, scalars, ended_at, on_device = result_unless_paused(client, pending.summary,
                                                                           watchdog.bound())
                pending.on_device = on_device
                pending.summary.release()
            except (CancelledError, StaleRoundState, TimeoutError, OSError) as exc:
                # OSError: the comm to a dying worker closed (distributed's CommClosedError)
                restarts += 1
                replica_lost = _replica_lost(client, graph)
                reason = (f"no epoch finished within {watchdog.bound():.0f} s" if isinstance(exc, TimeoutError)
                          else "a worker that held its state was lost" if replica_lost and isinstance(exc, StaleRoundState)
                          else f"a worker was lost ({type(exc).__name__})" if isinstance(exc, (CancelledError, OSError))
                          else f"{type(exc).__name__}: {exc}".rstrip(": "))
                if restarts > MAX_EPOCH_RESTARTS:
                    if isinstance(exc, StaleRoundState):
                        raise
                    hint = ("; workers died and were restarted meanwhile (out of memory? see the worker "
                            "logs; give each worker more memory, use fewer workers per machine or "
                            "persist=False)" if not started_with <= _workers(client) else "")
                    raise ReconstructionStalled(f"the reconstruction made no progress after "
                                                f"{MAX_EPOCH_RESTARTS} restarts of epoch {done + 1} "
                                                f"(last: {' '.join(reason.split())}){hint}") from None
                logger.warning("daskpty: restarting epoch %d (%s)", done + 1, " ".join(reason.split()))
                survivor = _state_of_any(finished)
                if survivor is not None:
                    base, base_done = survivor, finished_reached
                release(pending, following)
                following = None
                try:
                    # the new graph is placed on the workers that are back, never on none (then
                    # unpinned: its fused tasks could run away from their state)
                    _await_running(client, len(started_with), watchdog.bound())
                    if replica_lost or _replica_lost(client, graph):  # place the state copies on the workers there are
                        graph.close()
                        graph = EpochGraph(client, data, adapter, rounds=rounds, split_every=split_every,
                                           fused=graph.fused)
                    elif isinstance(exc, StaleRoundState):  # a round task ran elsewhere: states in the graph
                        graph.close()
                        graph.fused = False
                    pending = start(base)
                except OSError as lost:  # the scatter's comm closed under us: try again next turn
                    raise ReconstructionStalled(f"could not restart epoch {done + 1}: {lost}") from None
                reaches = base_done + 1
                continue
            if reaches > done:  # (else an epoch recomputed after a restart: already reported)
                handle = EpochState(epoch, future=pending.ends[0], local_futures=pending.locals,
                                    on_device=on_device, object_bytes=int(state.object.nbytes))
                seconds, last_end = ended_at - last_end, ended_at
                watchdog.observe(seconds)
                yield handle, scalars, seconds
                done = reaches
                if done >= epochs:
                    # The last epoch: fetch it while its states are held. The finally below drops
                    # the fused rounds' states on the workers, and a replica's end task may not
                    # have run by then (run_epochs' get raised StaleRoundState, ~1 test run in 8).
                    handle.get()
                if handle.fetched:
                    base, base_done = handle.get(), done
            release(finished)
            finished, finished_reached = pending, reaches
            pending, following = following, None
            reaches += 1
    finally:  # stopped early (a callback, an interrupt): drop the epochs still held
        unsticker.stop()
        release(finished, pending, following)
        graph.close()


def run_epochs(client, data: ChunkedData, adapter, state, *, epochs: int, rounds_per_epoch: int = 1,
               split_every: int | None = None, callbacks=(), initialise: bool = True, tiles: bool = False,
               one_round_when=None):
    """Run ``epochs`` epochs of ``rounds_per_epoch`` rounds each. Returns ``(state, history)``.

    Each callback is called as ``callback(epoch, state, metrics)`` after every epoch; a callback
    returning ``False`` stops the loop after that epoch. A callback with the attribute
    ``takes_epoch_state = True`` gets an :class:`EpochState` instead of the state and fetches the
    state only when it needs it: with epoch graphs, an epoch no callback fetches stays on the
    workers. ``tiles``: the object in row tiles, one per worker (:mod:`.tile_graph`).

    ``one_round_when(epoch, metrics) -> bool`` (minibatch rounds only): asked after each epoch,
    before the callbacks; once it answers True the epochs after that one run one round each
    (:mod:`.round_switch`), and the callbacks already see the epoch's metrics with
    ``"rounds_next": 1``.
    """
    history = []
    n_total = int(sum(data.chunk_lengths))
    if split_every is None:
        split_every = default_split_every(data.n_chunks)
    if adapter.local_state and getattr(state, "chunk_local", None) is None:
        state = with_local(state, initial_locals(adapter, data.positions_host, data.chunk_lengths))
    if tiles:
        check_tiles_supported(adapter)
    if initialise and state.epoch == 0 and not (tiles and epochs > 0):
        state = adapter.initialise(client, data, state, split_every=split_every)
    end = state.epoch + max(epochs, 0)
    rounds = rounds_per_epoch
    while state.epoch < end:
        state, switched = _epochs_at(client, data, adapter, state, end - state.epoch, rounds, split_every,
                                     callbacks, tiles, initialise, n_total, history,
                                     one_round_when if rounds > 1 else None)
        if not switched:
            break
        rounds = 1
    return state, history


def _epochs_at(client, data, adapter, state, epochs, rounds, split_every, callbacks, tiles, initialise, n_total,
               history, one_round_when):
    """:func:`run_epochs`'s loop at ``rounds`` rounds per epoch: ``(state, switched)``, switched
    when ``one_round_when`` asked for one round per epoch from the next epoch on."""
    if tiles:  # (the first epoch's set-up runs on the tiles there)
        epochs_iter = tiled_epochs(client, data, adapter, state, epochs, rounds, split_every,
                                   initialise=initialise and state.epoch == 0)
    elif data.persisted and not (isinstance(adapter, RunsOwnRounds) and adapter.needs_evaluations):
        epochs_iter = _graph_epochs(client, data, adapter, state, epochs, rounds, split_every)
    else:
        epochs_iter = _client_epochs(client, data, adapter, state, epochs, rounds, split_every)
    last, switched = None, False
    quiet = quiet_handled_losses()  # distributed's tracebacks of a loss the driver handles
    quiet.__enter__()
    try:
        for last, scalars, seconds in epochs_iter:
            check_loss(last.epoch, scalars, rounds)
            metrics = _metrics(last.epoch, scalars, seconds, n_total, rounds)
            if one_round_when is not None and one_round_when(last.epoch, metrics):
                switched, metrics["rounds_next"] = True, 1
            history.append(metrics)
            stop = False
            for cb in callbacks:
                given = last if getattr(cb, "takes_epoch_state", False) else last.get()
                if cb(last.epoch, given, metrics) is False:
                    stop = True
            if stop or switched:
                switched = switched and not stop
                break
        if last is not None:
            state = last.get()
    finally:
        try:
            epochs_iter.close()
        finally:
            quiet.__exit__(None, None, None)
    return state, switched
