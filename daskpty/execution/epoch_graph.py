"""An epoch as one graph on the workers, with the state replicated on every worker that holds data.

For persisted data. :class:`EpochGraph` chains ``rounds`` rounds (chunk tasks, fixed-shape tree
of partial sums, ``adapter.apply``) and the epoch's begin and end into one graph that starts
from the previous epoch's result, so the client submits once per epoch and the state stays on the
workers. Each worker holding chunks keeps its own bit-identical copy of the state and ends every
round itself, so a round costs one exchange of partials and nothing else.
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field

import dask
import numpy as np

from .rounds import (
    CHUNK_PREFIX,
    ROUND_PREFIX,
    ChunkedData,
    combine,
    reduce_levels,
    run_chunk,
)


@dataclass
class EpochCarry:
    """What one round hands to the next inside an epoch graph: the engine state and the sums of
    the rounds' scalars so far."""

    state: object
    scalars: dict = field(default_factory=dict)


def _chunk_of_round(block, positions, carry: EpochCarry, adapter, round_index, rounds):
    return run_chunk(block, positions, adapter.payload(carry.state), adapter.chunk_function,
                      round_index, rounds)


def copy_state(adapter, state):
    """A copy of ``state`` that ``adapter.apply`` may change without touching the original
    (adapters whose ``apply`` only rebinds attributes offer a cheap ``copy_state``)."""
    own = getattr(adapter, "copy_state", None)
    return own(state) if own is not None else copy.deepcopy(state)


def _finish_round(carry: EpochCarry, adapter, first: bool, *parts) -> EpochCarry:
    total = combine(*parts)
    # The input carry may be read again (a recomputation after a lost worker, or the client's own
    # object on an in-process cluster), so the update goes to a copy.
    state = copy_state(adapter, carry.state)
    scalars = {} if first else dict(carry.scalars)
    if first:  # the epoch's first round starts it (its chunk tasks read only the payload)
        state = adapter.begin_epoch(state)
    state = adapter.apply(state, total)
    if total is not None:
        for k, v in total.scalars.items():
            scalars[k] = scalars.get(k, 0.0) + v
    return EpochCarry(state, scalars)


def _holders(client, array, blocks) -> dict:
    """``dask.annotate`` arguments that keep each chunk task on the worker holding its data chunk.

    Otherwise the scheduler weighs the chunk (on its holder) against the payload (on the worker
    that ran the previous round's end) and work stealing moves tasks: measured 5 : 3 chunks per
    worker instead of 4 : 4. The restriction is loose, so a lost worker does not stall the round.
    """
    from distributed import futures_of

    futures = futures_of(array)
    if not futures:
        return {}
    who_has = client.who_has(futures)
    out = {}
    for b in blocks:
        workers = list(who_has.get(b.key, ()))
        if workers:
            out[b.key] = {"workers": workers[:1], "allow_other_workers": True}
    return out


def _end_epoch(carry: EpochCarry, adapter) -> EpochCarry:
    return EpochCarry(adapter.end_epoch(copy_state(adapter, carry.state)), carry.scalars)


class EpochGraph:
    """Builds one epoch (``begin_epoch``, ``rounds`` rounds of map + tree reduce + ``apply``,
    ``end_epoch``) as one graph and submits it; an epoch starts from the previous epoch's future,
    so the state stays on the workers between epochs and the client only gathers copies.

    **Replicated apply.** Every worker that holds data chunks keeps its own copy of the state: the
    end of a round (sum of the top-level partials + ``adapter.apply``) runs once per such worker,
    on that worker, and its chunk tasks read the local copy. A round is then one exchange of
    partials between workers and no broadcast of the new state afterwards (one scheduler hop and
    one transfer less per round). ``begin_epoch`` (folded into the first round's end: adapters
    must not change their payload in ``begin_epoch``) and ``end_epoch`` run on every copy too, so
    the next epoch starts from local copies and the state never moves between workers. The copies
    are bit-identical: same inputs, same order, same code.

    The result of :meth:`submit` is one future per copy of an :class:`EpochCarry` (the state
    after the epoch, the epoch's summed scalars). It equals running :func:`map_reduce` + ``adapter.apply`` round by
    round on the client. For persisted data only (a Zarr-backed chunk read once for several rounds
    would stay in memory between them).
    """

    def __init__(self, client, data: ChunkedData, adapter, *, rounds: int = 1, split_every: int = 8):
        self.client = client
        self.rounds = int(rounds)
        self.split_every = max(2, int(split_every))
        self.token = uuid.uuid4().hex
        self.blocks = list(data.intensities.to_delayed().ravel())
        holders = _holders(client, data.intensities, self.blocks)
        self.annotations = [holders.get(b.key, {}) for b in self.blocks]
        # The workers that keep a copy of the state (None: let the scheduler place one copy).
        self.replicas = sorted({a["workers"][0] for a in self.annotations if a}) or [None]
        self.replica_of = [self.replicas.index(a["workers"][0]) if a else 0 for a in self.annotations]
        self.adapter = dask.delayed(adapter, name=f"daskpty-adapter-{self.token}", traverse=False)
        # Positions travel inside the graph (a few KiB per chunk, one key each, kept next to the
        # chunk): a persisted positions block may sit on another worker than its intensities.
        bounds = np.cumsum((0,) + tuple(data.chunk_lengths))
        self.positions = []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            with dask.annotate(**self.annotations[i]):
                self.positions.append(dask.delayed(data.positions_host[a:b], traverse=False,
                                                   name=f"daskpty-positions-{i}-{self.token}"))
        self.count = 0

    def _on_replica(self, w: int) -> dict:
        worker = self.replicas[w]
        return {} if worker is None else {"workers": [worker], "allow_other_workers": True}

    def submit(self, start) -> list:
        """Submit one epoch. ``start``: the state to start from — one future or delayed
        :class:`EpochCarry` for every state copy, or the list returned by the previous
        :meth:`submit`. Returns one future per state copy (all equal; gather the first)."""
        tag = f"{self.count}-{self.token}"
        self.count += 1
        adapter = self.adapter
        copies = len(self.replicas)
        if not isinstance(start, (list, tuple)):
            start = [start] * copies
        carries = list(start)
        for r in range(self.rounds):
            parts = []
            for i, (b, p) in enumerate(zip(self.blocks, self.positions)):
                with dask.annotate(**self.annotations[i]):
                    parts.append(dask.delayed(_chunk_of_round)(
                        b, p, carries[self.replica_of[i]], adapter, r, self.rounds,
                        dask_key_name=(f"{CHUNK_PREFIX}-{r}-{tag}", i)))
            level = reduce_levels(parts, self.split_every)
            new = []
            for w in range(copies):
                with dask.annotate(**self._on_replica(w)):
                    new.append(dask.delayed(_finish_round)(carries[w], adapter, r == 0, *level,
                                                           dask_key_name=(f"{ROUND_PREFIX}-{r}-{tag}", w)))
            carries = new
        ends = []
        for w in range(copies):
            with dask.annotate(**self._on_replica(w)):
                ends.append(dask.delayed(_end_epoch)(carries[w], adapter, dask_key_name=(f"daskpty-end-{tag}", w)))
        return self.client.compute(ends, optimize_graph=False)
