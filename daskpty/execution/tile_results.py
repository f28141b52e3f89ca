"""A tiled epoch's state without assembling it: object-frame fields as dask arrays over the tiles.

:meth:`~.tile_graph.TileGraph.fetch` gathers every tile's own rows and stitches them on the
client, which must then hold the whole object (and its momentum). :func:`lazy_state` instead
leaves each tile's own rows on its worker and returns the state with its object-frame arrays
as dask arrays, one block per tile in row order, whose tasks are those futures. Writing such a
state (:meth:`daskpty.io.results.Reconstruction.to_zarr`) runs a store task per Zarr chunk row
on the workers, so the object goes from each worker's memory to the store tile by tile and the
client never holds it. Everything else (probe, scalars, per-pattern state) is small and is
gathered as usual. Fields that hold arrays in an object of their own (``crop_rows``: an
optimiser's moments) are gathered and stitched like :meth:`~.tile_graph.TileGraph.fetch` does.
"""
from __future__ import annotations

import copy

from ..engines.tile_frame import with_frame
from .tile_graph import own_rows_on_host
from .watchdog import seconds_from_env

#: An object (complex64) at least this large comes back from a tiled run as a dask array over
#: the tiles rather than as one NumPy array on the client (``DASKPTY_LAZY_OBJECT_BYTES``).
LAZY_OBJECT_BYTES = 512 * 2**20


def lazy_object_bytes() -> int:
    """:data:`LAZY_OBJECT_BYTES`, or the environment's ``DASKPTY_LAZY_OBJECT_BYTES``."""
    return int(seconds_from_env("DASKPTY_LAZY_OBJECT_BYTES", LAZY_OBJECT_BYTES, zero_allowed=True, unit="bytes"))


def _field_of(result: tuple, name: str):
    """Task on a tile's worker: one field of its own rows (an array, or None)."""
    return getattr(result[0], name, None)


def _summary_of(result: tuple, fields: tuple) -> tuple:
    """Task on a tile's worker: ``({field: (shape, dtype, holder) or None}, small state, local)``,
    the state with the object-frame fields left out."""
    specs = {}
    state = copy.copy(result[0])
    for name in fields:
        value = getattr(state, name, None)
        specs[name] = (None if value is None else (None, None, True) if hasattr(value, "crop_rows")
                       else (tuple(value.shape), str(value.dtype), False))
        setattr(state, name, None)
    return specs, state, result[1]


def lazy_state(graph, ends: list):
    """The state after a tiled epoch, its object-frame fields as dask arrays over the tiles
    (see the module docstring). ``graph``: the :class:`~.tile_graph.TileGraph`; ``ends``: each
    worker's end-of-epoch future, in worker order. The returned arrays keep their tiles' futures
    alive; they need the cluster until computed or written."""
    import dask.array as da

    client, fields = graph.client, graph.adapter.tile_fields
    by_rows = sorted(range(len(ends)), key=lambda w: graph.layout.tiles[w].start)

    def on(w):
        return {} if graph.workers[w] is None else {"workers": [graph.workers[w]]}

    parts = [client.submit(own_rows_on_host, ends[w], fields, graph.own(w), graph.groups[w], pure=False, **on(w))
             for w in range(len(ends))]
    summaries = client.gather([client.submit(_summary_of, parts[w], fields, **on(w)) for w in by_rows])
    state = summaries[0][1]
    for name in fields:
        specs = [s[0][name] for s in summaries]
        if specs[0] is None:
            setattr(state, name, None)
        elif specs[0][2]:  # a holder of arrays: gathered and stitched on the client
            holders = client.gather([client.submit(_field_of, parts[w], name, **on(w)) for w in by_rows])
            setattr(state, name, holders[0].stitch_rows(holders))
        else:
            blocks = [da.from_delayed(client.submit(_field_of, parts[w], name, **on(w)), shape=shape, dtype=dtype)
                      for w, (shape, dtype, _) in zip(by_rows, specs)]
            setattr(state, name, da.concatenate(blocks, axis=-2))
    if graph.adapter.local_state:
        state.chunk_local = {i: v for _, _, local in summaries for i, v in local.items()}
    if isinstance(getattr(state, "extra", None), dict):
        state.extra = {k: v for k, v in state.extra.items() if k != "illumination_max"}
        with_frame(state, None)
    return state


__all__ = ["LAZY_OBJECT_BYTES", "lazy_object_bytes", "lazy_state"]
