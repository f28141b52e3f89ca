"""Rounds on the cluster: chunk steps over the data chunks + a fixed-order tree reduce.

The pieces every graph of daskpty is made of (the chunk task, the combine, the fixed-shape tree),
and :func:`map_reduce`, one round as one graph: a ``blockwise`` map over the (persisted or
Zarr-backed) data chunks with one broadcast payload, tree-reduced and gathered to the client. It
serves out-of-core epochs, the first-epoch probe rescale and the AD line search. Whole epochs on
persisted data are built by :mod:`daskpty.execution.epoch_graph` from the same pieces.

Every graph is fresh and small, so no lineage accumulates, and the reduction tree depends only on
the chunks, never on the cluster.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np
from distributed import KilledWorker
from distributed.comm.core import CommClosedError

from ..engines.partials import Partial, sum_partials
from .placement import chunk_annotations
from .scatter import scatter_within
from .tuning import release_memory, tune_allocator
from .watchdog import ReconstructionStalled, install_loss_filter


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


def hilbert_index(positions, bits: int = 16) -> np.ndarray:
    """Each (y, x) position's index along a Hilbert curve over the positions' bounding square
    (``bits`` per axis). Positions shifted by whole rows give the same indices."""
    p = np.asarray(positions, np.float64)
    side = 1 << bits
    if len(p) == 0:
        return np.zeros(0, np.int64)
    lo, span = p.min(axis=0), float(np.ptp(p, axis=0).max())
    q = (np.zeros(p.shape, np.int64) if span <= 0
         else np.minimum(((p - lo) * ((side - 1) / span)).astype(np.int64), side - 1))
    y, x = q[:, 0].copy(), q[:, 1].copy()
    d = np.zeros(len(p), np.int64)
    s = side >> 1
    while s > 0:
        rx, ry = (x & s) > 0, (y & s) > 0
        d += s * s * ((3 * rx) ^ ry)
        turn = ~ry  # rotate the quadrant so the curve stays continuous
        flip = turn & rx
        x, y = np.where(flip, s - 1 - x, x), np.where(flip, s - 1 - y, y)
        x, y = np.where(turn, y, x), np.where(turn, x, y)
        s >>= 1
    return d


def round_rows(positions, round_index: int, rounds: int) -> np.ndarray:
    """The rows of a chunk (its scan ``positions``, (L, 2)) that round ``round_index`` of
    ``rounds`` steps through, in the chunk's order: every ``rounds``-th pattern along a Hilbert
    curve through the chunk's positions, so each round takes one pattern of every run of
    ``rounds`` neighbours along the curve — spread evenly over the chunk's area, for any scan.
    The subsets' sizes are those of ``round_index::rounds``; the same positions give the same
    subsets on every worker and in every epoch.

    Not the plain stride ``round_index::rounds`` in scan order: on a raster whose rows hold a
    multiple of ``rounds`` positions, and chunks whose length is one too, a stride takes the same
    columns of every row in a round — minibatches of separate stripes. Measured, LSQML, NRMSE:
    4,096 × 64², 16 rounds, 5 epochs: chunks of 512 0.156 with the stride, 0.094 with random
    subsets, 0.093 with these; chunks of 100 0.091, 0.092 and 0.090. The 576 × 64² set of
    ``bench_vs_ptychi.py`` (3 rounds; 10 / 30 / 100 epochs): stride 0.352 / 0.113 / 0.034,
    random 0.362 / 0.135 / 0.051, these 0.350 / 0.115 / 0.043; AD 0.398 / 0.088 / 0.019 (stride:
    0.398 / 0.098 / 0.020)."""
    return np.sort(_curve_order(positions)[round_index::rounds])


#: the curve order of each chunk's positions seen by this process, by their bytes' digest: the
#: same chunk is cut R times an epoch (~2 ms for 6,000 positions, a chunk step's scale on a GPU)
_CURVE_ORDERS: dict = {}
_MOST_CURVE_ORDERS = 4096


def _curve_order(positions) -> np.ndarray:
    p = np.ascontiguousarray(positions, dtype=np.float64)
    key = (p.shape, hashlib.blake2b(p.tobytes(), digest_size=16).digest())
    order = _CURVE_ORDERS.get(key)
    if order is None:
        if len(_CURVE_ORDERS) >= _MOST_CURVE_ORDERS:
            _CURVE_ORDERS.clear()
        order = _CURVE_ORDERS[key] = np.argsort(hilbert_index(p), kind="stable").astype(np.int32)
    return order


def run_chunk(block, positions, payload, func, round_index, rounds, local=None, chunk_index=None):
    """The chunk task: ``func(intensities, positions, payload) -> Partial`` on the rows
    :func:`round_rows` gives round ``round_index`` of one chunk, with the worker's allocator
    tuned around it.

    ``local``: the chunk's per-pattern state (``{name: (B, ...) array}`` over the whole chunk, see
    :mod:`.local_state`), or None when the engine keeps none. It is sliced like the data and passed
    as ``func(..., local=slice)``; the arrays the step returns in ``Partial.local`` are written
    into a copy of ``local`` (never into it: a task may run again), returned as
    ``part.local = {chunk_index: new_local}``. A step that updates nothing returns no local.
    """
    tune_allocator()
    sliced = local
    rows = slice(None)
    if rounds > 1:
        rows = round_rows(positions, round_index, rounds)
        block = block[rows]
        positions = positions[rows]
        if local is not None:
            sliced = {k: v[rows] for k, v in local.items()}
    try:
        part = func(block, positions, payload) if local is None else func(block, positions, payload,
                                                                          local=sliced)
    finally:
        release_memory()
    if part is not None:
        part.scalars["reduced_bytes"] = float(part.nbytes)
        if part.local:
            updated = {k: v.copy() for k, v in local.items()}
            for k, v in part.local.items():
                updated[k][rows] = v
            part.local = {chunk_index: updated}
    return part  # the block of an object-dtype array: dask passes it through untouched


def combine(*parts):
    """Sum of partials in the given order; counts the bytes it produced in ``reduced_bytes``."""
    total = sum_partials(*parts)
    if total is not None:
        count_reduced(total, len(parts))
    return total


def count_reduced(total, children: int) -> None:
    """Add a sum's bytes to its ``reduced_bytes`` scalar when it summed more than one child."""
    if children > 1:
        total.scalars["reduced_bytes"] = total.scalars.get("reduced_bytes", 0.0) + float(total.nbytes)


def default_split_every(n_chunks: int) -> int:
    """Inputs per node of the reduction tree for ``n_chunks`` chunks: 4 up to 16 chunks, else 8.

    A worker sums the complete subtrees among the chunks it holds before sending. With few chunks
    and 8 inputs per node there is only the root, so every chunk's partial travels: 4 gives a
    level a worker can pre-sum (1,600 × 128², 8 chunks, 2 workers: 0.55 → 0.52 s/epoch). With many
    chunks 8 already gives such subtrees, with fewer levels of growing boxes (147,456 × 128² out
    of core, 1,446 chunks: 60.2 s/epoch with 8, 62.6 with 4 — within this machine's noise).
    Depends only on the chunk count, so results stay independent of the cluster.
    """
    return 4 if n_chunks <= 16 else 8


ROUND_PREFIX = "daskpty-round"
"""Key prefix of a round's task: the root of :func:`map_reduce`, or in an epoch graph
``(f"{ROUND_PREFIX}-{round}-{token}", replica)`` — the fused round task (previous round's end +
this round's chunk steps) or, in the split graph, the round's end. The dashboard counts rounds by
these keys (replica 0) reaching memory and follows the fused ones for its progress bar."""
CHUNK_PREFIX = "daskpty-chunk"
"""Key prefix of a split epoch graph's chunk tasks (keys ``(f"{CHUNK_PREFIX}-{round}-{token}",
replica)``, one per replica and round, so that each round's chunk tasks form one task group)."""


class FixedTree:
    """The fixed-shape sum tree over ``n`` chunk partials (every reduction of daskpty uses it).

    Level 0 holds the chunks; node ``(L + 1, j)`` sums nodes ``(L, j·s) … (L, j·s + s − 1)``
    (``s = split_every``), left to right, until one level has at most ``s`` nodes; the root sums
    that level. Node ``(L, j)`` thus covers chunks ``j·s^L … (j + 1)·s^L − 1``.
    :meth:`reduce` evaluates every node whose inputs are at hand, so a worker can sum the complete
    subtrees of the chunks it holds and send one partial for each; the receiving side finishes the
    same tree. The sums are the same, in the same order, wherever they run.
    """

    def __init__(self, n: int, split_every: int):
        self.split_every = s = max(2, int(split_every))
        self.counts = [int(n)]
        while self.counts[-1] > s:
            self.counts.append(-(-self.counts[-1] // s))
        self.counts.append(1)  # the root

    @property
    def root(self) -> tuple:
        return (len(self.counts) - 1, 0)

    def reduce(self, nodes: dict, combine_fn=None, root_fn=None, consume: bool = False,
               takes_list: bool = False) -> dict:
        """Replace complete groups of children in ``nodes`` (``{(level, index): partial}``) by
        their parent, bottom up; returns the nodes left (the root alone once all are there).

        ``combine_fn`` sums children (default :func:`combine`; a ``dask.delayed`` one builds the
        tree as tasks), ``root_fn`` the root's children (default ``combine_fn``). ``consume``:
        work in ``nodes`` itself, so a child summed is let go at once (not a copy of the dict);
        ``takes_list``: the functions get the children as one list, theirs to empty."""
        combine_fn = combine if combine_fn is None else combine_fn
        nodes = nodes if consume else dict(nodes)
        s = self.split_every
        for level in range(1, len(self.counts)):
            below = self.counts[level - 1]
            fn = root_fn if root_fn is not None and level == len(self.counts) - 1 else combine_fn
            for j in range(self.counts[level]):
                kids = [(level - 1, k) for k in range(j * s, min((j + 1) * s, below))]
                if all(k in nodes for k in kids):
                    taken = [nodes.pop(k) for k in kids]
                    nodes[(level, j)] = fn(taken) if takes_list else fn(*taken)
                    taken = None
        return nodes


def tree_reduce(blocks, split_every: int, name: str | None = None):
    """The :class:`FixedTree` of ``combine`` tasks over a list of delayed partials.

    ``name`` is the key of the root task (default: dask's).
    """
    tree = FixedTree(len(blocks), split_every)
    node = dask.delayed(combine)
    root = None if name is None else (lambda *kids: node(*kids, dask_key_name=name))
    return tree.reduce({(0, i): b for i, b in enumerate(blocks)}, node, root)[tree.root]


# Worker processes import this module with their first chunk task: a surviving worker's reports
# of a lost peer (``failed during get data``, ...) go to INFO there, as the client's do during a run.
if "Dask Worker" in multiprocessing.current_process().name:
    install_loss_filter()

#: Restarts of one round after its workers were lost (or it timed out) before the run stops.
MAX_ROUND_RESTARTS = 3
logger = logging.getLogger("daskpty")


def map_reduce(client, data: ChunkedData, func, payload, *, round_index: int = 0, rounds: int = 1,
               split_every: int | None = None, local: dict | None = None,
               timeout: float | None = None) -> Partial:
    """Run ``func(intensities_chunk, positions_chunk, payload) -> Partial`` on every chunk
    (or on subset ``round_index`` of every chunk, :func:`round_rows`) and return the tree-reduced sum.

    ``payload`` goes to one worker, and from there once to each worker that runs a chunk this
    round. ``local``: the per-pattern
    state of every chunk (``{chunk: {name: array}}``, see :func:`run_chunk`); the chunks' updates
    come back in the sum's ``local``. Round by round the chunks have no home worker that could keep
    it (out of core, any worker reads a chunk), so it travels with the tasks: 16–48 bytes per
    pattern, against the pattern itself read from the store. ``timeout``: seconds to wait for
    the round (None: no limit).

    A round whose workers die (all of them, say: ``kill -9``, a lost node) or that does not finish
    within ``timeout`` is run again, once a worker is there (:func:`~.cluster.wait_for_workers`),
    from the same payload: the sum is the same, so the run stays bit-identical. After
    :data:`MAX_ROUND_RESTARTS` restarts it stops with :class:`~.watchdog.ReconstructionStalled`
    (one line; "workers paused at their memory limit" when that is why); a scheduler that is
    gone ends it with :class:`~.cluster.SchedulerLost`.
    """
    from .cluster import paused_workers, wait_for_workers

    restarts = 0
    while True:
        try:
            wait_for_workers(client, timeout=timeout, lost=restarts > 0)  # (a scatter to paused workers waits 30 s)
            return _map_reduce_once(client, data, func, payload, round_index=round_index, rounds=rounds,
                                    split_every=split_every, local=local, timeout=timeout)
        except (CancelledError, KilledWorker, CommClosedError, _ClusterError, _RoundTimedOut) as exc:
            # (not any OSError: one raised by a chunk task, a damaged store, is the user's to see)
            # workers there and not all paused (else SchedulerLost / WorkersPaused / a bounded wait)
            wait_for_workers(client, timeout=timeout, lost=True)
            paused = paused_workers(client)
            reason = str(exc) if isinstance(exc, _ClusterError) else " ".join(
                f"{type(exc).__name__}: {exc}".rstrip(": ").split())
            if isinstance(exc, _RoundTimedOut) and paused:
                raise ReconstructionStalled(
                    f"a round did not finish within {timeout:.0f} s: {len(paused)} worker(s) paused at their "
                    "memory limit; give each worker more memory (memory_limit=, fewer workers per machine), "
                    "a shorter chunk_length or persist=False") from None
            restarts += 1
            if restarts > MAX_ROUND_RESTARTS:
                raise ReconstructionStalled(f"a round made no progress after {MAX_ROUND_RESTARTS} restarts "
                                            f"(last: {reason}); data held only in worker memory die with "
                                            "the workers") from None
            logger.warning("daskpty: restarting round %d (%s)", round_index + 1, reason)
            wait_for_workers(client, timeout=timeout, lost=True)
            _unstick(client, timeout)


class _RoundTimedOut(Exception):
    pass


class _ClusterError(Exception):
    """The scatter of a round's payload failed: the cluster's doing, never a task's."""


def _unstick(client, timeout: float | None) -> None:
    """Run the tasks stuck on workers that are gone (persisted chunks) once a worker runs tasks:
    one that has only registered takes none, and they stayed stuck until the round's timeout."""
    import time

    from .placement import run_stuck_loose_tasks, running_workers

    deadline = time.monotonic() + (60.0 if timeout is None else timeout)
    try:
        while not running_workers(client) and time.monotonic() < deadline:
            time.sleep(0.1)
        run_stuck_loose_tasks(client)
    except OSError:  # the scheduler went away meanwhile: the next try says so
        pass


def _map_reduce_once(client, data: ChunkedData, func, payload, *, round_index: int, rounds: int,
                     split_every: int | None, local: dict | None, timeout: float | None) -> Partial:
    from .cluster import result_unless_paused

    # To one worker, not broadcast: each worker fetches it with its first task (the same copies),
    # while the scheduler's replication of a broadcast, hit by a worker's death, raised KeyError
    # or waited on the dead worker (30 s and more) instead of failing at once. A bounded wait:
    # a scatter to a worker killed as it was picked waits out the connect timeout (30 s).
    try:
        payload_future = scatter_within(client, payload, hash=False)
    except OSError as exc:  # the comm closed under it, or no worker took it in time (TimeoutError)
        raise _ClusterError(" ".join(f"{type(exc).__name__}: {exc}".split())) from None
    if data.persisted or local is not None:  # one task per chunk (persisted: on its chunk's worker)
        blocks = list(data.intensities.to_delayed().ravel())
        pinned = chunk_annotations(client, data.intensities, blocks) if data.persisted else {}
        parts = []
        for i, (block, positions) in enumerate(zip(blocks, data.positions.to_delayed().ravel())):
            extra = () if local is None else (local[i], i)
            with dask.annotate(**pinned.get(block.key, {})):
                parts.append(dask.delayed(run_chunk, pure=False)(block, positions, payload_future, func,
                                                                 round_index, rounds, *extra))
    else:  # read from the store by whichever worker is free
        parts = list(da.blockwise(
            run_chunk, "i",
            data.intensities, "ijk",
            data.positions, "il",
            payload_future, None, func, None, round_index, None, rounds, None,
            concatenate=True, dtype=object, adjust_chunks={"i": 1},
            meta=np.empty((0,), dtype=object),
        ).to_delayed().ravel())
    if split_every is None:
        split_every = default_split_every(data.n_chunks)
    root = tree_reduce(parts, max(2, int(split_every)), name=f"{ROUND_PREFIX}-{uuid.uuid4().hex}")
    future = client.compute(root, optimize_graph=False)
    try:
        try:
            return result_unless_paused(client, future, timeout)
        except TimeoutError:
            raise _RoundTimedOut(f"it did not finish within {timeout:.0f} s (see DASKPTY_STALL_SECONDS)") from None
    finally:
        future.release()
        payload_future.release()
