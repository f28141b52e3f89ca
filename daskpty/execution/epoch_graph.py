"""An epoch as one graph on the workers, with the state replicated on every worker that holds data.

For persisted data. :class:`EpochGraph` chains ``rounds`` rounds (chunk tasks, fixed-shape tree
of partial sums, ``adapter.apply``) and the epoch's begin and end into one graph that starts
from the previous epoch's result, so the client submits once per epoch and the state stays on the
workers. Each worker holding chunks keeps its own bit-identical copy of the state; one task per
worker and round ends the previous round on that copy and runs the round's chunk steps, so a
round is one level of the graph: one exchange of partial sums and nothing else.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field


from ..faults import StaleRoundState  # noqa: F401 (also named here)
from .device_state import follow_partials, has_device_arrays, resident
from .placement import GraphInputs
from .rounds import (
    CHUNK_PREFIX,
    ROUND_PREFIX,
    ChunkedData,
    FixedTree,
    default_split_every,
    run_chunk,
)


@dataclass
class EpochCarry:
    """What one round hands to the next inside an epoch graph: the engine state and the sums of
    the rounds' scalars so far; after the epoch's end also when (``time.time()`` on the worker)
    it ended. ``local``: the per-pattern state of the chunks this copy's worker holds
    (``{chunk: {name: array}}``; empty for engines without one, or before a chunk's first step:
    it then starts from ``adapter.initial_local``). Unlike ``state`` it differs between copies:
    each worker keeps its own chunks'."""

    state: object
    scalars: dict = field(default_factory=dict)
    ended_at: float | None = None
    local: dict = field(default_factory=dict)


def _chunks_of_round(blocks, positions, carry: EpochCarry, adapter, round_index, rounds,
                     indices, tree: FixedTree) -> tuple[dict, dict, EpochCarry]:
    """The chunk steps of one round for the chunks one worker holds (``indices``), summed over
    the complete subtrees of the fixed tree among them: ``({(level, index): partial}, local,
    carry)``, ``local`` the chunks' updated per-pattern state (empty without one), kept out of the
    sums; ``carry`` the one the steps read, its state moved to the device when the chunks are
    there (see :mod:`.device_state`)."""
    state = resident(carry.state, adapter, blocks)
    if state is not carry.state:
        carry = EpochCarry(state, carry.scalars, carry.ended_at, carry.local)
    payload = adapter.payload(carry.state)
    keeps_local = adapter.local_state
    parts, local = {}, {}
    for i, b, p in zip(indices, blocks, positions):
        own = None
        if keeps_local:
            own = carry.local.get(i)
            if own is None:
                own = adapter.initial_local(p)
        part = run_chunk(b, p, payload, adapter.chunk_function, round_index, rounds, own, i)
        if part is not None and part.local:
            local.update(part.local)
            part.local = {}
        parts[(0, i)] = part
        parts = tree.reduce(parts)  # as soon as a group is complete: few chunk partials held at once
    return parts, local, carry


def _split_chunk_task(*args) -> dict:
    """:func:`_chunks_of_round` as a task of the split graph: the local state rides in the result
    under ``"local"`` (only the own replica's round end keeps it)."""
    nodes, local, _ = _chunks_of_round(*args)
    nodes["local"] = local
    return nodes


def copy_state(adapter, state):
    """A copy of ``state`` that ``adapter.apply`` may change without touching the original
    (the protocol's ``copy_state``: cheap where ``apply`` only rebinds attributes)."""
    return adapter.copy_state(state)


def _finish_round(carry: EpochCarry, adapter, first: bool, tree: FixedTree, own: int, *groups) -> EpochCarry:
    """Finish the fixed tree over a round's partial sums (``groups``: each replica's chunk-task
    nodes; ``groups[own]`` came from this worker), ``apply`` the total to a copy of the state, add the
    scalars to the epoch's sums, and the bytes received from the other workers to
    ``exchanged_bytes``."""
    nodes = {}
    received = 0
    local = carry.local
    for i, group in enumerate(groups):
        group = dict(group)
        updated = group.pop("local", None)
        if i == own and updated:
            local = {**local, **updated}
        nodes.update(group)
        if i != own:
            received += sum(p.nbytes for p in group.values() if p is not None)
    total = tree.reduce(nodes)[tree.root]
    # The input carry may be read again (a recomputation after a lost worker, or the client's own
    # object on an in-process cluster), so the update goes to a copy.
    state = follow_partials(copy_state(adapter, carry.state), adapter, total)
    scalars = {} if first else dict(carry.scalars)
    if first:  # the epoch's first round starts it (its chunk tasks read only the payload)
        state = adapter.begin_epoch(state)
    state = adapter.apply(state, total)
    if total is not None:
        for k, v in total.scalars.items():
            scalars[k] = scalars.get(k, 0.0) + v
    scalars["exchanged_bytes"] = scalars.get("exchanged_bytes", 0.0) + float(received)
    return EpochCarry(state, scalars, local=local)


def _end_epoch(carry: EpochCarry, adapter) -> EpochCarry:
    state = adapter.end_epoch(copy_state(adapter, carry.state))
    scalars = carry.scalars
    scalars = {**scalars, **adapter.epoch_scalars(state)}
    return EpochCarry(state, scalars, time.time(), local=carry.local)


def _own_local(carry: EpochCarry, indices) -> dict:
    """The per-pattern state of one worker's chunks after an epoch (a copy started from the
    client's state holds every chunk's; only its own ones are current)."""
    return {i: carry.local[i] for i in indices if i in carry.local}


def _summary(carry: EpochCarry) -> tuple:
    """What the client needs after every epoch: the state's epoch counter, the epoch's summed
    scalars, when it ended and whether the state is in device memory (then the client fetches a
    host copy: :func:`~.device_state.fetch_host_state`). A few hundred bytes; the state itself
    is gathered only when asked for.
    The summary task often runs a round after the end (see the driver), hence the time stamp."""
    return carry.state.epoch, carry.scalars, carry.ended_at, has_device_arrays(carry.state)


@dataclass
class SubmittedEpoch:
    """One submitted epoch: ``ends``, one future per state copy of the :class:`EpochCarry` after
    the epoch (all equal), and ``summary``, a future of :func:`_summary`'s tuple.
    A fused epoch also holds ``last_round`` (its last round tasks' futures, one per replica) and
    its ``tag``: the next epoch's first round tasks start from them, not from ``ends``."""

    ends: list
    summary: object
    tag: str = ""
    last_round: list = field(default_factory=list)
    locals: list = field(default_factory=list)  # per replica: its chunks' per-pattern state
    on_device: bool = False  # the state is in device memory (known once the summary is in)

    def release(self) -> None:
        """Release (never cancel: see the driver) this epoch's futures."""
        for future in (*self.ends, self.summary, *self.last_round, *self.locals):
            future.release()

    def release_last_round(self) -> None:
        """Release the last round's futures once the next epoch, which reads them, is submitted."""
        for future in self.last_round:
            future.release()


class _HandledStaleRounds(logging.Filter):
    """Drop distributed's ERROR "Compute Failed" report of a :class:`StaleRoundState`: the driver
    handles it (restarts the epoch) and logs one WARNING line for it instead of a traceback."""

    def filter(self, record) -> bool:
        return not (str(record.msg).startswith("Compute Failed")
                    and any("StaleRoundState" in str(a) for a in (record.args or ())))


class _CancelledAtClose(logging.Filter):
    """Drop distributed's WARNING that a task running while its worker closes "ended with
    CancelledError": it only happens in ``Worker.close()`` (a run that stops, by an error or
    Ctrl-C, closes its cluster mid-epoch) and would add a line to the one-line message."""

    def filter(self, record) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Async instruction for") and msg.endswith("ended with CancelledError"))


# Installed wherever this module is imported: the workers import it with the first round task.
for _name, _filter in (("distributed.worker", _HandledStaleRounds), ("distributed.worker.state_machine", _CancelledAtClose)):
    if not any(isinstance(f, _filter) for f in logging.getLogger(_name).filters):
        logging.getLogger(_name).addFilter(_filter())


#: The state each fused round task hands to the next one on the same worker, by (graph token,
#: replica): ``(epoch tag, round, EpochCarry)``. One entry per replica, replaced by each round.
#: Module-level, so several workers of one process (threads) share it by key.
_ROUND_STATES: dict = {}

#: The end of an epoch, by (graph token, replica, epoch tag), from whichever of its two users ran
#: first on the worker (the epoch's end task, the next epoch's first round task) to the other.
#: The lock keeps a worker with several threads from computing it twice (in-process clusters,
#: whose workers share this module, end their copies one after the other: tests only).
_ENDED: dict = {}
_ENDED_LOCK = threading.Lock()


def _ended(adapter, tree: FixedTree, token: str, tag: str, replica: int, rounds: int, *previous) -> EpochCarry:
    """The state after epoch ``tag`` on one replica: its last round finished (``previous``: every
    replica's last round partial sums) and ``end_epoch`` run. It is the epoch's end task and is
    called by the next epoch's first round task; computed once per worker, the first caller
    storing it for the second (the last epoch's entry stays until :meth:`EpochGraph.close`)."""
    key = (token, replica, tag)
    with _ENDED_LOCK:
        done = _ENDED.pop(key, None)
        if done is not None:
            return done
        entry = _ROUND_STATES.get((token, replica))
        if entry is None or entry[0] != tag or entry[1] != rounds - 1:
            raise StaleRoundState(f"the end of epoch graph {tag} did not find its last round's state on this worker")
        carry = _finish_round(entry[2], adapter, rounds == 1, tree, replica, *previous)
        done = _ENDED[key] = _end_epoch(carry, adapter)
        return done


def _round_task(start, adapter, tree: FixedTree, token: str, tag: str, replica: int,
                round_index: int, rounds: int, after: str | None, blocks, positions, indices,
                *previous) -> dict:
    """Fused round ``r`` on one replica: finish round ``r − 1`` (sum ``previous``, the partial
    sums of every replica's round ``r − 1`` task, and ``apply`` them to this worker's state), then
    run round ``r``'s chunk steps on the new state. Returns only the partial sums; the state stays
    in this worker's memory for the next round task. ``previous`` holds one task result per
    replica, in replica order. Round 0 starts from ``start`` (an epoch's start carry) or, when
    ``after`` names the previous epoch of this graph, ends that epoch itself (:func:`_ended`;
    ``previous``: its last round), one scheduler hop sooner than waiting for its end task."""
    key = (token, replica)
    if round_index == 0:
        carry = start if after is None else _ended(adapter, tree, token, after, replica, rounds, *previous)
    else:
        entry = _ROUND_STATES.get(key)
        if entry is None or entry[0] != tag or entry[1] != round_index - 1:
            raise StaleRoundState(f"round {round_index} of epoch graph {tag} did not find round "
                                  f"{round_index - 1}'s state on this worker")
        carry = _finish_round(entry[2], adapter, round_index == 1, tree, replica, *previous)
    nodes, local, carry = _chunks_of_round(blocks, positions, carry, adapter, round_index, rounds, indices, tree)
    if local:  # a new carry (the old one may be read again: its task recomputed), with this
        # worker's chunks only (a start carry from the client holds every chunk's)
        merged = {**carry.local, **local}
        carry = EpochCarry(carry.state, carry.scalars, carry.ended_at, {i: merged[i] for i in indices if i in merged})
    _ROUND_STATES[key] = (tag, round_index, carry)
    return nodes


def _drop_round_states(token: str) -> None:
    with _ENDED_LOCK:
        for store in (_ROUND_STATES, _ENDED):
            for key in [k for k in store if k[0] == token]:
                store.pop(key, None)


class EpochGraph:
    """Builds one epoch (``begin_epoch``, ``rounds`` rounds of map + tree reduce + ``apply``,
    ``end_epoch``) as one graph and submits it; an epoch starts from the previous epoch's future,
    so the state stays on the workers between epochs and the client only gathers copies.

    **Replicated apply.** Every worker that holds data chunks keeps its own copy of the state: the
    end of a round (the fixed-order tree sum of the chunk partials + ``adapter.apply``) runs once
    per such worker, on that worker, and its chunk tasks read the local copy. A round is then one
    exchange of partials between workers and no broadcast of the new state afterwards.
    ``begin_epoch`` (folded into the first round's end: adapters must not change their payload in
    ``begin_epoch``) and ``end_epoch`` run on every copy too, so the next epoch starts from local
    copies and the state never moves between workers. The copies are bit-identical: same inputs,
    same order, same code.

    **One task per worker and round** (``fused``, the default). Round ``r``'s task on a worker
    finishes round ``r − 1`` (sums the partial sums of every worker's round ``r − 1`` task, applies
    them to its state) and runs round ``r``'s chunk steps for all the chunks that worker holds; it
    returns only their partial sums, summed over the complete subtrees of the fixed tree it has
    (:class:`FixedTree`), and keeps the state in the worker's memory for its next round task. A
    round is then one dependency level of the graph, one scheduler hop and one exchange of partial
    sums (measured ~4 ms per level with 2 worker processes on this 2-core machine, whatever the
    work). The end of an epoch is not a level of its own either: the next epoch's first round
    tasks end it themselves from the last round's partial sums (the end tasks, which the client
    may gather, compute the same state; whichever runs first on a worker hands it to the other).
    These tasks are pinned to their worker strictly: a loosely pinned task is placed on another
    worker when it becomes ready while its own is paused at its memory limit, and dask's work
    stealing moves one queued behind a long task to an idle worker; either found no state there
    and restarted the epoch with every worker alive. A lost worker takes the state with it: the
    epoch's tasks are cancelled (their inputs cannot be recomputed) and the driver restarts the
    epoch on a new graph. Should a round task still not find its state, it raises
    :class:`StaleRoundState` and the driver restarts the epoch with ``fused=False``: chunk tasks
    and round-end tasks that pass the state as a task result (two levels per round). Both give
    the same bits; the sum does not depend on the placement. Without a worker to pin them to
    (none connected when the graph is built) the graph is not fused.

    The graph is written out as a task dictionary (no ``dask.delayed`` per task: that cost 5–13 ms
    of the client's time per epoch, time the scheduler in the same process lost). :meth:`submit`
    returns a :class:`SubmittedEpoch`: one future per copy of an :class:`EpochCarry` (the state
    after the epoch, the epoch's summed scalars) and one of a small summary (epoch counter,
    scalars), which is all the client needs after most epochs. It equals running
    :func:`map_reduce` + ``adapter.apply`` round by round on the client. For persisted data only
    (a Zarr-backed chunk read once for several rounds would stay in memory between them).
    """

    def __init__(self, client, data: ChunkedData, adapter, *, rounds: int = 1,
                 split_every: int | None = None, fused: bool = True):

        self.client = client
        self.keeps_local = bool(adapter.local_state)
        self.rounds = int(rounds)
        if split_every is None:
            split_every = default_split_every(data.n_chunks)
        self.split_every = max(2, int(split_every))
        self.token = uuid.uuid4().hex
        placed = GraphInputs(client, data, adapter, self.token)
        self.block_keys, self.groups = placed.block_keys, placed.groups
        # The workers that keep a copy of the state (None: let the scheduler place one copy);
        # every replica holds chunks: replicas are the chunks' holders.
        self.replicas = placed.workers
        self.adapter_key, self.position_keys, self.inputs = placed.adapter_key, placed.position_keys, placed.inputs
        self._placed = placed
        # fused round tasks must run where their state is kept: only with a worker to pin them to
        self.fused = fused and None not in self.replicas
        self.count = 0

    def _on_replica(self, w: int, keeps_state: bool = False) -> dict:
        """Where replica ``w``'s tasks run; ``keeps_state``: tasks that read a state kept in the
        worker's memory (fused rounds, epoch ends) run there and nowhere else (see the class)."""
        return self._placed.on(w, strict=keeps_state and self.fused)

    def submit(self, start) -> SubmittedEpoch:
        """Submit one epoch. ``start``: the state to start from — one future of an
        :class:`EpochCarry` for every state copy, or the previous :class:`SubmittedEpoch`."""
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

        tag = f"{self.count}-{self.token}"
        self.count += 1
        copies = len(self.replicas)
        inputs = dict(self.inputs)
        after = None  # the previous fused epoch of this graph, continued on the workers
        if isinstance(start, SubmittedEpoch) and self.fused and start.last_round:
            after = start
            inputs.update({f.key: f for f in start.last_round})
            carries = [None] * copies
        else:
            if isinstance(start, SubmittedEpoch):
                start = start.ends
            if not isinstance(start, (list, tuple)):
                start = [start] * copies
            inputs.update({f.key: f for f in start})
            carries = [f.key for f in start]
        tasks = [{} for _ in range(copies)]  # per replica: its tasks share one annotation
        tree = FixedTree(len(self.block_keys), self.split_every)
        if self.fused:
            ends, last_round = self._fused_tasks(tasks, carries, tree, tag, after)
        else:
            ends, last_round = self._split_tasks(tasks, carries, tree, tag), []
        summary = (f"daskpty-summary-{tag}", 0)
        layers = {"inputs": MaterializedLayer(inputs)}
        for w in range(copies):
            layers[f"daskpty-epoch-{tag}-{w}"] = MaterializedLayer(tasks[w],
                                                                  annotations=self._on_replica(w, True) or None)
        # No priority over the next epoch's first round task, which becomes ready on the same
        # worker at the same moment and so usually runs first: the summary comes a round late,
        # but that round starts ~3 ms sooner (measured with priority=1 at 576 × 64²).
        layers[f"daskpty-summary-{tag}"] = MaterializedLayer({summary: (_summary, ends[0])},
                                                             annotations=self._on_replica(0) or None)
        local_keys = []
        if self.keeps_local:  # each worker's chunks' per-pattern state, fetched with the state
            for w in range(copies):
                key = (f"daskpty-local-{tag}", w)
                layers[f"daskpty-local-{tag}-{w}"] = MaterializedLayer(
                    {key: (_own_local, ends[w], self.groups[w])}, annotations=self._on_replica(w) or None)
                local_keys.append(key)
        graph = HighLevelGraph(layers, {name: set() for name in layers})
        futures = self.client.get(graph, [*ends, summary, *local_keys, *last_round], sync=False)
        n_local = len(local_keys)
        return SubmittedEpoch(futures[:copies], futures[copies], tag, futures[copies + 1 + n_local:],
                              futures[copies + 1:copies + 1 + n_local])

    def _chunk_args(self, chunks) -> tuple:
        return [self.block_keys[i] for i in chunks], [self.position_keys[i] for i in chunks], chunks

    def _split_tasks(self, tasks, carries, tree, tag) -> list:
        """Each round as chunk tasks + round-end tasks; the state is a task result."""
        for r in range(self.rounds):
            lists = []
            for w, chunks in enumerate(self.groups):
                key = (f"{CHUNK_PREFIX}-{r}-{tag}", w)
                blocks, positions, _ = self._chunk_args(chunks)
                tasks[w][key] = (_split_chunk_task, blocks, positions, carries[w], self.adapter_key,
                                 r, self.rounds, chunks, tree)
                lists.append(key)
            new = []
            for w in range(len(tasks)):
                key = (f"{ROUND_PREFIX}-{r}-{tag}", w)
                tasks[w][key] = (_finish_round, carries[w], self.adapter_key, r == 0, tree, w, *lists)
                new.append(key)
            carries = new
        ends = []
        for w in range(len(tasks)):
            key = (f"daskpty-end-{tag}", w)
            tasks[w][key] = (_end_epoch, carries[w], self.adapter_key)
            ends.append(key)
        return ends

    def _fused_tasks(self, tasks, carries, tree, tag, after: SubmittedEpoch | None = None) -> tuple:
        """One task per replica and round (:func:`_round_task`): the end of the previous round and
        this round's chunk steps, with the state kept in the worker between them. After a fused
        epoch of this graph (``after``), the first round tasks end that epoch themselves.
        Returns the end task keys and the last round task keys."""
        previous = [f.key for f in after.last_round] if after is not None else []
        for r in range(self.rounds):
            keys = []
            for w, chunks in enumerate(self.groups):
                key = (f"{ROUND_PREFIX}-{r}-{tag}", w)
                tasks[w][key] = (_round_task, carries[w] if r == 0 else None, self.adapter_key, tree,
                                 self.token, tag, w, r, self.rounds,
                                 after.tag if r == 0 and after is not None else None,
                                 *self._chunk_args(chunks), *previous)
                keys.append(key)
            previous = keys
        ends = []
        for w in range(len(self.groups)):
            key = (f"daskpty-end-{tag}", w)
            tasks[w][key] = (_ended, self.adapter_key, tree, self.token, tag, w, self.rounds, *previous)
            ends.append(key)
        return ends, previous

    def close(self) -> None:
        """Drop the fused round tasks' states left on the workers by an interrupted epoch."""
        if self.fused:
            try:
                self.client.run(_drop_round_states, self.token)
            except Exception:  # a worker gone meanwhile has nothing left to drop
                pass
