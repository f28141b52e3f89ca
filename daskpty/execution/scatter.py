"""Send data to the workers: in-memory intensities once, a round's payload within a bounded wait.

``da.from_array(numpy_array)`` puts the array's chunks into the graph itself, so each graph
built on it (value check, initial probe, persist) ships the whole data set again through the
scheduler ("Sending large graph of size ..."). Scattering the chunks once and building the dask
array on the resulting futures keeps every later graph small.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import numpy as np

from .state_sizes import held_bytes

#: in-graph array bytes above which intensities are scattered instead
EMBEDDED_LIMIT = 1 * 2**20
#: the shortest wait of :func:`scatter_within`, and the slowest transfer it allows for (bytes/s)
SCATTER_FLOOR_SECONDS = 5.0
SCATTER_SLOWEST_RATE = 20e6


def scatter_within(client, data, **kwargs):
    """``client.scatter(data, **kwargs)`` that gives up with :class:`TimeoutError` after
    :data:`SCATTER_FLOOR_SECONDS` plus the time ``data`` takes at :data:`SCATTER_SLOWEST_RATE`.

    A worker killed just as the scheduler picks it for a scatter is not yet known dead: the
    scheduler's connection to it is retried for distributed's whole connect timeout (30 s by
    default, the cluster's setting, not this process's). The caller's retry goes to the workers
    that are there instead. A scatter that ends after the wait has its futures released."""
    seconds = scatter_seconds(data)
    pending = concurrent.futures.Future()

    def send():
        try:
            pending.set_result(client.scatter(data, **kwargs))
        except BaseException as exc:
            pending.set_exception(exc)

    # A daemon thread of its own: scatters waiting on a worker that does not answer hold up
    # neither the next ones (on a pool of 4 a retry queued behind them) nor the interpreter's
    # exit (a pool's threads are joined there). Starting it costs ~0.4 ms.
    threading.Thread(target=send, name="daskpty-scatter", daemon=True).start()
    try:
        return pending.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        pending.add_done_callback(_release_late)
        raise TimeoutError(f"the scatter did not end within {seconds:.0f} s") from None


def scatter_seconds(data) -> float:
    """The wait :func:`scatter_within` allows ``data``: :data:`SCATTER_FLOOR_SECONDS` plus its
    bytes at :data:`SCATTER_SLOWEST_RATE`. dask's ``sizeof`` counts an engine's payload or carry
    as a few bytes; :func:`~.state_sizes.held_bytes` counts the arrays inside."""
    from dask.sizeof import sizeof

    return SCATTER_FLOOR_SECONDS + max(sizeof(data), held_bytes(data)) / SCATTER_SLOWEST_RATE


def scatter_retrying(client, data, attempts: int = 3, **kwargs):
    """:func:`scatter_within`, tried up to ``attempts`` times: the scheduler hands each scatter to
    the next worker in turn, so a retry goes past a worker that does not answer."""
    for attempt in range(attempts):
        try:
            return scatter_within(client, data, **kwargs)
        except TimeoutError:
            if attempt == attempts - 1:
                raise


def _release_late(pending) -> None:
    if pending.cancelled() or pending.exception() is not None:
        return
    result = pending.result()
    for future in result if isinstance(result, (list, tuple)) else [result]:
        future.release()


def embedded_bytes(x) -> int:
    """Bytes of NumPy arrays held literally in the graph of dask array ``x``."""
    from dask.highlevelgraph import MaterializedLayer

    total = 0
    graph = x.__dask_graph__()
    layers = getattr(graph, "layers", {"": graph})
    for layer in layers.values():
        mapping = getattr(layer, "mapping", layer) if isinstance(layer, MaterializedLayer) \
            else (layer if isinstance(layer, dict) else None)
        for value in (mapping or {}).values():
            value = getattr(value, "value", value)  # task-spec DataNode
            if isinstance(value, np.ndarray):
                total += value.nbytes
    return total


def scatter_in_memory(client, data, intensities, chunk_length=None):
    """(data, intensities) with in-memory intensities replaced by a dask array on scattered
    chunks; store-backed (lazy) arrays are returned unchanged.

    NumPy input is cut into ``chunk_length`` (default 256) patterns per chunk; a dask array
    keeps its chunks. ``data`` (a :class:`~daskpty.io.store.PtychoData`) gets the new array too.
    """
    import dask.array as da

    if not hasattr(intensities, "dask"):
        arr = np.asarray(intensities)
        step = max(1, chunk_length or 256)
        blocks = [arr[i:i + step] for i in range(0, len(arr), step)]
    elif embedded_bytes(intensities) > EMBEDDED_LIMIT:
        x = intensities.rechunk({1: -1, 2: -1})
        blocks = [np.asarray(x.blocks[i].compute(scheduler="sync"))
                  for i in range(x.numblocks[0])]
    else:
        return data, intensities
    # Keys unique to this call: with content hashes, a run on the same array right after
    # another could re-use keys that the scheduler was still releasing, and lose them
    # (dask/distributed#8576; test_bad_input failed so 1 in ~8 full runs).
    futures = client.scatter(blocks, hash=False)
    parts = [da.from_delayed(f, shape=b.shape, dtype=b.dtype, meta=b[:0])
             for f, b in zip(futures, blocks)]
    scattered = da.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    if dataclasses.is_dataclass(data) and getattr(data, "path", "") is None \
            and hasattr(data, "intensities"):
        data = dataclasses.replace(data, intensities=scattered)
    return data, scattered
