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
    delayed chunks, in order) that keep a task reading the chunk on the chunk's worker.

    Each chunk goes to the worker it was placed on (:func:`balanced_worker`), also when it lives
    elsewhere (then the first task fetches it once). With no worker list, a chunk goes to its
    least loaded holder. The restriction is loose, so a lost worker does not stall a round.
    Empty for chunks that are not persisted.
    """
    from distributed import futures_of

    futures = futures_of(array)
    if not futures:
        return {}
    who_has = client.who_has(futures)
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    load: dict = {}
    out = {}
    for i, b in enumerate(blocks):
        holders = sorted(who_has.get(b.key, ()))
        if not holders:
            continue
        planned = workers[balanced_worker(i, len(blocks), len(workers))] if workers else None
        chosen = planned if planned is not None else min(holders, key=lambda w: load.get(w, 0))
        load[chosen] = load.get(chosen, 0) + 1
        out[b.key] = {"workers": [chosen], "allow_other_workers": True}
    return out
