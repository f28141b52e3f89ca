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

import copy
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass

import numpy as np

from ..engines import lsqml
from .epoch_graph import EpochCarry, EpochGraph, StaleRoundState
from .rounds import ChunkedData, default_split_every, map_reduce


@dataclass
class LSQMLPayload:
    object: np.ndarray
    probe: np.ndarray
    options: lsqml.LSQMLOptions
    update_probe: bool
    valid: np.ndarray | None


def lsqml_chunk(intensities, positions, payload: LSQMLPayload):
    return lsqml.chunk_step(payload.object, payload.probe, intensities, positions,
                            options=payload.options, update_probe=payload.update_probe,
                            valid=payload.valid)


def forward_sums_chunk(intensities, positions, payload: LSQMLPayload):
    return lsqml.forward_sums(payload.object, payload.probe, intensities, positions, valid=payload.valid)


class LSQMLAdapter:
    """Binds :mod:`daskpty.engines.lsqml` to the round loop."""

    name = "lsqml"
    chunk_function = staticmethod(lsqml_chunk)

    def __init__(self, options: lsqml.LSQMLOptions, valid: np.ndarray | None = None):
        self.options = options
        self.valid = valid

    def payload(self, state: lsqml.LSQMLState) -> LSQMLPayload:
        return LSQMLPayload(state.object, state.probe, self.options, state.update_probe(self.options), self.valid)

    def apply(self, state, total):
        return lsqml.apply(state, total, self.options)

    @staticmethod
    def copy_state(state):
        """``lsqml.apply`` only rebinds the state's arrays, so a shallow copy protects the original."""
        return copy.copy(state)

    def begin_epoch(self, state):
        return lsqml.begin_epoch(state, self.options)

    def end_epoch(self, state):
        return lsqml.end_epoch(state, self.options)

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        """A state from an object, a probe and (when resuming) the saved engine arrays."""
        engine_state = engine_state or {}
        return lsqml.LSQMLState(object=obj, probe=probe, epoch=epoch, velocity=engine_state.get("velocity"))

    def engine_state(self, state) -> dict:
        """Arrays beyond object and probe needed to continue exactly (for checkpoints)."""
        return {} if state.velocity is None else {"velocity": state.velocity}

    def initialise(self, client, data: ChunkedData, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy."""
        sums = map_reduce(client, data, forward_sums_chunk, self.payload(state), split_every=split_every)
        return lsqml.rescale_probe(state, sums)


def _run_rounds(client, data: ChunkedData, adapter, state, rounds: int, split_every: int):
    """One epoch round by round from the client: returns ``(state, summed scalars)``."""
    scalars: dict[str, float] = {}
    for r in range(rounds):
        if hasattr(adapter, "run_round"):  # engines that need extra evaluations (line searches)
            state, total = adapter.run_round(client, data, state, round_index=r, rounds=rounds,
                                             split_every=split_every)
        else:
            total = map_reduce(client, data, adapter.chunk_function, adapter.payload(state),
                               round_index=r, rounds=rounds, split_every=split_every)
            state = adapter.apply(state, total)
        if total is not None:
            for k, v in total.scalars.items():
                scalars[k] = scalars.get(k, 0.0) + v
    return state, scalars


def _metrics(state, scalars: dict, seconds: float, n_total: int, rounds: int) -> dict:
    n = max(scalars.get("n", 0.0), 1.0)
    return {
        "epoch": state.epoch,
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
    }


def _client_epochs(client, data, adapter, state, epochs, rounds, split_every):
    """Epochs run round by round from the client; yields ``(state, scalars, seconds)``."""
    for _ in range(epochs):
        start = time.perf_counter()
        state = adapter.begin_epoch(state)
        state, scalars = _run_rounds(client, data, adapter, state, rounds, split_every)
        state = adapter.end_epoch(state)
        yield state, scalars, time.perf_counter() - start


MAX_EPOCH_RESTARTS = 3


def _graph_epochs(client, data, adapter, state, epochs, rounds, split_every):
    """Epochs as graphs on the workers, each submitted before the previous one is gathered, so the
    client's work between epochs (gather, callbacks, checkpoints) overlaps the next epoch.
    Yields ``(state, scalars, seconds)``; ``seconds`` is the time between two epochs' results
    (the first: from the submission).

    A worker that dies takes data dask cannot recompute (the scattered start state, or the
    previous epoch's result once that graph is forgotten, or the state a fused round task keeps
    in its worker); dask then cancels the epoch or a round task raises
    :class:`~.epoch_graph.StaleRoundState`, and the epoch is restarted from the client's copy of
    its start state (at most ``MAX_EPOCH_RESTARTS`` times; after a stale state, with the state
    kept as task results). Recomputation is deterministic, so the result equals an undisturbed run.
    """
    graph = EpochGraph(client, data, adapter, rounds=rounds, split_every=split_every)
    base = state  # the state the pending epoch starts from, on the client

    def release(*epochs):
        # Release, never cancel: cancelling a key whose dependents nobody holds (the next
        # epoch's tasks) trips an assertion in distributed's scheduler (stimulus_cancel), which
        # then drops this client and every key it holds, the persisted data included.
        for futures in epochs:
            for future in futures or ():
                future.release()

    start = time.perf_counter()
    pending = graph.submit(client.scatter(EpochCarry(base), hash=False))
    following = None
    done = restarts = 0
    try:
        while done < epochs:
            if following is None and done + 1 < epochs:
                following = graph.submit(pending)
            try:
                out = pending[0].result()
            except (CancelledError, StaleRoundState) as exc:
                restarts += 1
                if restarts > MAX_EPOCH_RESTARTS:
                    raise
                if isinstance(exc, StaleRoundState):  # a round task moved: keep states in the graph
                    graph.close()
                    graph.fused = False
                release(pending, following)
                following = None
                pending = graph.submit(client.scatter(EpochCarry(base), hash=False))
                continue
            for future in pending:
                future.release()
            now = time.perf_counter()
            yield out.state, out.scalars, now - start
            start, base, done = now, out.state, done + 1
            pending, following = following, None
    finally:  # stopped early (a callback, an interrupt): drop the epoch submitted in advance
        release(pending, following)
        graph.close()


def run_epochs(client, data: ChunkedData, adapter, state, *, epochs: int, rounds_per_epoch: int = 1,
               split_every: int | None = None, callbacks=(), initialise: bool = True):
    """Run ``epochs`` epochs of ``rounds_per_epoch`` rounds each. Returns ``(state, history)``.

    Each callback is called as ``callback(epoch, state, metrics)`` after every epoch; a callback
    returning ``False`` stops the loop after that epoch.
    """
    history = []
    n_total = int(sum(data.chunk_lengths))
    if split_every is None:
        split_every = default_split_every(data.n_chunks)
    if initialise and state.epoch == 0:
        state = adapter.initialise(client, data, state, split_every=split_every)
    if epochs <= 0:
        return state, history
    if data.persisted and not getattr(adapter, "needs_evaluations", False):
        epochs_iter = _graph_epochs(client, data, adapter, state, epochs, rounds_per_epoch, split_every)
    else:
        epochs_iter = _client_epochs(client, data, adapter, state, epochs, rounds_per_epoch, split_every)
    try:
        for state, scalars, seconds in epochs_iter:
            metrics = _metrics(state, scalars, seconds, n_total, rounds_per_epoch)
            history.append(metrics)
            stop = False
            for cb in callbacks:
                if cb(state.epoch, state, metrics) is False:
                    stop = True
            if stop:
                break
    finally:
        epochs_iter.close()
    return state, history
