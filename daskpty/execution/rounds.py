"""Rounds on the cluster: chunk steps over the data chunks + a fixed-order tree reduce.

This is the only module that turns engine functions into dask graphs. Two ways to run rounds:

* :func:`map_reduce` — one round: a ``blockwise`` map over the (persisted or Zarr-backed) data
  chunks with one broadcast payload, tree-reduced and gathered to the client.
* :func:`run_epoch_graph` — all rounds of one epoch as one graph: round ``r``'s chunk tasks take
  the state produced by round ``r − 1``'s root task, which reduces that round and applies the
  update on a worker. The client submits once per epoch and gathers only the final state, so the
  rounds are not separated by client round trips (for persisted data only: a Zarr-backed chunk
  read once for several rounds would stay in memory between them).

Either way every graph is fresh and small, so no lineage accumulates between epochs, and the
reduction tree depends only on the chunks, never on the cluster.
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field

import dask
import dask.array as da
import numpy as np

from ..engines.partials import Partial, sum_partials
from .tuning import release_memory, tune_allocator


@dataclass
class ChunkedData:
    """Diffraction data on the cluster, in the engine's layout.

    intensities: dask array (N, n, n), zero frequency at index 0, chunks along N only.
    positions: dask array (N, 2) float64 with the same chunks along N.
    positions_host: the same positions as a NumPy array on the client.
    order: permutation applied to the user's pattern order (None = unchanged).
    """

    intensities: da.Array
    positions: da.Array
    positions_host: np.ndarray
    order: np.ndarray | None
    persisted: bool

    @property
    def n_chunks(self) -> int:
        return len(self.intensities.chunks[0])

    @property
    def chunk_lengths(self) -> tuple[int, ...]:
        return self.intensities.chunks[0]


def _run_chunk(block, positions, payload, func, round_index, rounds):
    tune_allocator()
    if rounds > 1:
        block = block[round_index::rounds]
        positions = positions[round_index::rounds]
    try:
        part = func(block, positions, payload)
    finally:
        release_memory()
    if part is not None:
        part.scalars["reduced_bytes"] = float(part.nbytes)
    return part  # the block of an object-dtype array: dask passes it through untouched


def _combine(*parts):
    total = sum_partials(*parts)
    if total is not None and len(parts) > 1:
        total.scalars["reduced_bytes"] = total.scalars.get("reduced_bytes", 0.0) + float(total.nbytes)
    return total


ROUND_PREFIX = "daskpty-round"
"""Key prefix of the task that ends a round (its reduced partial, or the state after the round;
with replicated state the keys are ``(f"{ROUND_PREFIX}-{round}-{token}", copy)``); the dashboard
counts rounds by these keys (copy 0) reaching memory."""
CHUNK_PREFIX = "daskpty-chunk"
"""Key prefix of an epoch graph's chunk tasks (keys ``(f"{CHUNK_PREFIX}-{round}-{token}", chunk)``,
so that each round's chunk tasks form one task group)."""


def _reduce_levels(blocks, split_every: int) -> list:
    """Combine delayed partials level by level (left to right) until at most ``split_every`` remain."""
    level = list(blocks)
    while len(level) > split_every:
        level = [dask.delayed(_combine)(*level[i:i + split_every])
                 for i in range(0, len(level), split_every)]
    return level


def tree_reduce(blocks, split_every: int, name: str | None = None):
    """Fixed-shape tree of ``_combine`` over a list of delayed partials (left to right).

    ``name`` is the key of the root task (default: dask's).
    """
    level = _reduce_levels(blocks, split_every)
    kwargs = {} if name is None else {"dask_key_name": name}
    return dask.delayed(_combine)(*level, **kwargs)


def map_reduce(client, data: ChunkedData, func, payload, *, round_index: int = 0, rounds: int = 1,
               split_every: int = 8) -> Partial:
    """Run ``func(intensities_chunk, positions_chunk, payload) -> Partial`` on every chunk
    (or on slice ``round_index::rounds`` of every chunk) and return the tree-reduced sum.

    ``payload`` is broadcast once to every worker for this round.
    """
    payload_future = client.scatter(payload, broadcast=True, hash=False)
    parts = da.blockwise(
        _run_chunk, "i",
        data.intensities, "ijk",
        data.positions, "il",
        payload_future, None, func, None, round_index, None, rounds, None,
        concatenate=True, dtype=object, adjust_chunks={"i": 1},
        meta=np.empty((0,), dtype=object),
    )
    root = tree_reduce(list(parts.to_delayed().ravel()), max(2, int(split_every)),
                       name=f"{ROUND_PREFIX}-{uuid.uuid4().hex}")
    future = client.compute(root, optimize_graph=False)
    try:
        return future.result()
    finally:
        future.release()
        payload_future.release()


@dataclass
class EpochCarry:
    """What one round hands to the next inside an epoch graph: the engine state and the sums of
    the rounds' scalars so far."""

    state: object
    scalars: dict = field(default_factory=dict)


def _chunk_of_round(block, positions, carry: EpochCarry, adapter, round_index, rounds):
    return _run_chunk(block, positions, adapter.payload(carry.state), adapter.chunk_function,
                      round_index, rounds)


def copy_state(adapter, state):
    """A copy of ``state`` that ``adapter.apply`` may change without touching the original
    (adapters whose ``apply`` only rebinds attributes offer a cheap ``copy_state``)."""
    own = getattr(adapter, "copy_state", None)
    return own(state) if own is not None else copy.deepcopy(state)


def _finish_round(carry: EpochCarry, adapter, first: bool, *parts) -> EpochCarry:
    total = _combine(*parts)
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
            level = _reduce_levels(parts, self.split_every)
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
