"""Where persisted chunks live and where the tasks that read them run.

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
    if not workers:
        return {}
    return {b.key: {"workers": [workers[balanced_worker(i, len(blocks), len(workers))]],
                    "allow_other_workers": True} for i, b in enumerate(blocks)}


def _run_stuck_loose_tasks(dask_scheduler=None) -> int:
    """On the scheduler: send ``no-worker`` tasks whose worker restrictions are loose but name only
    workers that are gone to any worker (returns how many).

    distributed (2025.x–2026.x) leaves such a task in ``no-worker`` for good once every worker it
    names has left: a joining worker only takes unrunnable tasks whose valid workers include it,
    and the loose flag is consulted only when a task is first scheduled. Chunks persisted on a
    worker (:func:`~.data.persist_balanced`) need exactly that recomputation after all workers
    are lost and their nannies start new ones, under new addresses.
    """
    stuck = [ts for ts in dask_scheduler.unrunnable
             if ts.loose_restrictions and dask_scheduler.workers and not dask_scheduler.valid_workers(ts)]
    if stuck:
        dask_scheduler.transitions({ts.key: "processing" for ts in stuck}, stimulus_id="daskpty-unstick")
    return len(stuck)


def run_stuck_loose_tasks(client) -> int:
    """Run :func:`_run_stuck_loose_tasks` on the scheduler of ``client``."""
    return client.run_on_scheduler(_run_stuck_loose_tasks)


class GraphInputs:
    """What every epoch graph on persisted data reads, set up once: the chunks' keys, which
    worker holds which chunks (``workers``: sorted addresses, ``[None]`` when unpinned;
    ``groups[w]``: the chunk indices worker w holds), the chunks' positions (``chunk_positions``)
    and the adapter and each chunk's positions as tasks computed once next to their chunk
    (unlike scattered data, dask can recompute them after a lost worker); ``inputs``: the
    futures a graph built on them must carry."""

    def __init__(self, client, data, adapter, token: str, prefix: str = "daskpty"):
        import dask
        import numpy as np
        from distributed import futures_of

        blocks = list(data.intensities.to_delayed().ravel())
        self.block_keys = [b.key for b in blocks]
        pinned = chunk_annotations(client, data.intensities, blocks)
        annotations = [pinned.get(k, {}) for k in self.block_keys]
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

    def on(self, w: int) -> dict:
        """The annotation that keeps a task on worker ``w`` (loosely: it may move if w is lost)."""
        worker = self.workers[w]
        return {} if worker is None else {"workers": [worker], "allow_other_workers": True}
