"""Where persisted chunks live and where the tasks that read them run.

Data read from their store every round (``persist=False``) have no home; the tiled epochs
(:mod:`.tile_graph`) still give each worker a contiguous run of chunks (the same rule) and hand
its tasks a :class:`StoredChunk` per chunk, which the task reads when it steps through it.

Chunk i of n lives on worker ⌊i·W/n⌋ of the W workers sorted by address (contiguous runs: each
worker's chunks are neighbours in the scan, so its partial sums cover a compact region and sum
into few subtrees of the fixed reduction tree). :func:`~.data.persist_balanced` places them so;
every task that reads a chunk is (loosely) pinned to that worker, by the epoch graphs and by the
round-by-round ``map_reduce`` alike. Left to itself the scheduler runs a chunk task wherever work
stealing finds a free thread, copying the chunk there; the active memory manager then drops one
of the two copies, not always the one off plan: measured 713 of 1,446 chunks off plan after the
first-epoch probe rescale, and the first epoch fetching them back took 40 s.
"""
from __future__ import annotations


def balanced_worker(chunk: int, n_chunks: int, n_workers: int) -> int:
    """The worker (index into the sorted addresses) that holds ``chunk``: contiguous runs,
    ⌊chunk · W / n⌋."""
    return chunk * n_workers // n_chunks


def chunk_annotations(client, array, blocks) -> dict:
    """``dask.annotate`` arguments per chunk key of the persisted ``array`` (``blocks``: its
    delayed chunks, in order) that keep a task reading the chunk on the chunk's worker
    (:func:`balanced_worker`), also when the chunk lives elsewhere (then the first task fetches
    it once). The restriction is loose, so a lost worker does not stall a round. Empty when the
    chunks are not persisted or no worker is connected.
    """
    from distributed import futures_of

    from .cluster import live_workers

    workers = sorted(live_workers(client)) if futures_of(array) else []
    return {b.key: a for b, a in zip(blocks, balanced_annotations(workers, len(blocks)))} if workers else {}


def balanced_annotations(workers: list, n_chunks: int) -> list:
    """For each of ``n_chunks`` chunks, the (loose) annotation that keeps its tasks on its
    worker of ``workers`` (sorted addresses) by :func:`balanced_worker`."""
    return [{"workers": [workers[balanced_worker(i, n_chunks, len(workers))]], "allow_other_workers": True}
            for i in range(n_chunks)]


#: The key names of the tasks :func:`_run_stuck_loose_tasks` may free from a strict restriction.
PINNED_PREFIX = "daskpty-"


def _run_stuck_loose_tasks(dask_scheduler=None, pinned: bool = False) -> int:
    """On the scheduler: send ``no-worker`` tasks whose worker restrictions are loose but name only
    workers that are gone to any worker (returns how many); with ``pinned`` also daskpty's tasks
    pinned strictly to workers that have all left the cluster (not merely paused).

    distributed (2025.x–2026.x) leaves such a task in ``no-worker`` for good once every worker it
    names has left: a joining worker only takes unrunnable tasks whose valid workers include it,
    and the loose flag is consulted only when a task is first scheduled. Chunks persisted on a
    worker (:func:`~.data.persist_balanced`) need exactly that recomputation after all workers
    are lost and their nannies start new ones, under new addresses. Does nothing before a worker
    is running (:func:`running_workers`).

    A task pinned strictly to a worker that has left waits for it for good: the fused round
    tasks of an epoch graph (:mod:`.epoch_graph`) whose worker died with their state. Made loose
    and run elsewhere, they raise ``StaleRoundState`` at once, so the driver restarts the epoch
    instead of waiting for its watchdog.
    """
    if not dask_scheduler.running:  # (a worker that has just registered is not running yet:
        return 0  # a task sent to processing now would stay in no-worker)
    stuck = [ts for ts in dask_scheduler.unrunnable if ts.loose_restrictions and not dask_scheduler.valid_workers(ts)]
    if pinned:
        orphans = [ts for ts in dask_scheduler.unrunnable
                   if not ts.loose_restrictions and ts.worker_restrictions
                   and str(ts.key[0] if isinstance(ts.key, tuple) else ts.key).startswith(PINNED_PREFIX)
                   and not any(w in dask_scheduler.workers for w in ts.worker_restrictions)]
        for ts in orphans:
            ts.loose_restrictions = True
        stuck += orphans
    if stuck:
        dask_scheduler.transitions({ts.key: "processing" for ts in stuck}, stimulus_id="daskpty-unstick")
    return len(stuck)


def running_workers(client) -> list:
    """Addresses of the scheduler's workers that run tasks: registered and neither starting nor
    paused (a worker registers before it runs, so the scheduler places nothing on it yet)."""
    from .cluster import live_workers

    return sorted(a for a, w in live_workers(client).items() if str(w.get("status", "")).endswith("running"))


def run_stuck_loose_tasks(client, pinned: bool = False) -> int:
    """Run :func:`_run_stuck_loose_tasks` on the scheduler of ``client``."""
    return client.run_on_scheduler(_run_stuck_loose_tasks, pinned=pinned)


class StoredChunk:
    """One chunk of data that are not persisted: the chunk's own (culled) graph — read from the
    store, shifted, moved to the device as :func:`~.data.prepare_data` built it — computed by the
    task that steps through it, when it gets there (:func:`read_chunk`), so a worker holds one
    chunk at a time. A few kB pickled."""

    def __init__(self, block):
        import dask

        (culled,) = dask.optimize(block)
        self.key = culled.key
        self.graph = dict(culled.__dask_graph__())

    def read(self):
        from dask.local import get_sync

        return get_sync(self.graph, self.key)


def read_chunk(block):
    """``block`` itself (a persisted chunk, handed to the task by dask), or a
    :class:`StoredChunk` read now."""
    return block.read() if isinstance(block, StoredChunk) else block


def _unpersisted_annotations(client, n_chunks: int) -> list:
    """The workers' contiguous runs of chunks (:func:`balanced_worker`) for data that live
    nowhere yet: the annotation for each chunk, or empty ones when no worker is connected."""
    from .cluster import live_workers

    workers = sorted(live_workers(client))
    return balanced_annotations(workers, n_chunks) if workers else [{}] * n_chunks


class GraphInputs:
    """What every epoch graph reads, set up once: the chunks (``block_keys``: the persisted
    chunks' keys, or a :class:`StoredChunk` each for data read from their store), which
    worker holds which chunks (``workers``: sorted addresses, ``[None]`` when unpinned;
    ``groups[w]``: the chunk indices worker w holds or reads), the chunks' positions
    (``chunk_positions``) and the adapter and each chunk's positions as tasks computed once next
    to their chunk (unlike scattered data, dask can recompute them after a lost worker);
    ``inputs``: the futures a graph built on them must carry."""

    def __init__(self, client, data, adapter, token: str, prefix: str = "daskpty"):
        import dask
        import numpy as np
        from distributed import futures_of

        blocks = list(data.intensities.to_delayed().ravel())
        if data.persisted:
            self.block_keys = [b.key for b in blocks]
            pinned = chunk_annotations(client, data.intensities, blocks)
            annotations = [pinned.get(k, {}) for k in self.block_keys]
        else:
            self.block_keys = [StoredChunk(b) for b in blocks]
            annotations = _unpersisted_annotations(client, len(blocks))
        self.workers = sorted({a["workers"][0] for a in annotations if a}) or [None]
        self.worker_of = [self.workers.index(a["workers"][0]) if a else 0 for a in annotations]
        self.groups = [[i for i, r in enumerate(self.worker_of) if r == w] for w in range(len(self.workers))]
        bounds = np.cumsum((0,) + tuple(data.chunk_lengths))
        self.chunk_positions = [data.positions_host[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        leaves = []
        with dask.annotate(**self.on(0)):
            leaves.append(dask.delayed(adapter, name=f"{prefix}-adapter-{token}", traverse=False))
        for i, p in enumerate(self.chunk_positions):
            with dask.annotate(**annotations[i]):
                leaves.append(dask.delayed(p, traverse=False, name=f"{prefix}-positions-{i}-{token}"))
        computed = client.compute(leaves, optimize_graph=False)
        self.adapter_key = computed[0].key
        self.position_keys = [f.key for f in computed[1:]]
        self.inputs = {f.key: f for f in futures_of(data.intensities) + computed}

    def on(self, w: int, strict: bool = False) -> dict:
        """The annotation that keeps a task on worker ``w``: loosely (it may move if w is lost,
        paused, or busy while another worker idles: dask's work stealing), or ``strict``ly (it
        runs on w or nowhere: a task that reads state kept in w's memory)."""
        worker = self.workers[w]
        return {} if worker is None else {"workers": [worker], "allow_other_workers": not strict}
