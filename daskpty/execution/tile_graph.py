"""Epochs on tiles: each worker holds a row tile of the object, and only borders and small sums travel.

The replicated epoch graph (:mod:`.epoch_graph`) keeps the whole state on every worker that
holds chunks, and every round each of them receives every other worker's partial sums whole.
Here the state's object-frame arrays (the adapter's ``tile_fields``: object,
momentum, illumination) are cut into the row tiles of a :class:`~.tiles.TileLayout`: worker w
holds rows [``held_start``, ``held_stop``) — its own strip and a halo its chunks' windows reach —
in a frame that starts at ``held_start``. A round is then:

1. **chunk steps** on each worker's tile (the positions moved into the tile's frame: whole
   rows, so the sub-pixel fractions are the same bits), summed over the complete subtrees of the
   fixed tree (:class:`~.rounds.FixedTree`) among its chunks, moved back to the object's frame
   and cut into the *pieces* each worker holds rows of (``"halo"`` strategy of
   :mod:`.tiles`: a worker receives what touches its strip *or* its halo, and updates its halo
   redundantly — nothing to refresh afterwards);
2. **the sum** of a worker's pieces in the fixed tree's order (a pixel's sum is the same bits
   as with one worker: a piece is a crop, and adding a zero changes nothing), and its share of
   the whole-object numbers ``apply`` needs (:mod:`.tile_numbers`: e.g. the largest
   illumination over its own rows);
3. **the apply** on each tile with every tile's share (a few numbers per worker, in worker order).

The epoch's end does the same with ``tile_end_sums`` / ``tile_end_epoch``. The probe, the
scalars and the probe-frame sums travel whole (they are small). Per round, a worker receives the
pieces of the others' partial sums that touch its tile: the exchange grows with a tile's border,
not with the object's area (``exchanged_bytes``: the most any worker received, per round).

The state after an epoch stays on the workers, one tile each; :meth:`TileGraph.fetch` gathers
each worker's own rows and stitches them when the client asks (a checkpoint, the result). The
epoch loop is :mod:`.tile_epochs`.
"""
from __future__ import annotations

import copy
import functools
import weakref
import operator
import time
import uuid

import numpy as np

from ..faults import TileWorkerLost, TilesUnsupported  # noqa: F401 (also named here)
from ..engines.partials import BoxedArray, Partial, covers, sum_partials_into, sum_partials_releasing
from ..engines.tile_frame import TileFrame, with_frame
from .device_state import follow_partials, has_device_arrays, resident, to_host
from .engine_protocol import RunsOnTiles
from .epoch_graph import EpochCarry
from .placement import GraphInputs, read_chunk, run_stuck_loose_tasks
from .rounds import ChunkedData, FixedTree, count_reduced, default_split_every, run_chunk
from . import tile_halo
from .tiles import TileLayout
from .tuning import release_memory


def check_tiles_supported(adapter) -> None:
    """Raise :class:`TilesUnsupported` naming what stands in the way of tiles for this run's
    engine and parts."""
    if not isinstance(adapter, RunsOnTiles):
        raise TilesUnsupported(f"the {adapter.name} engine cannot run on tiles yet; use tiles=False "
                               "(every worker then holds the whole object)")
    reason = adapter.tiles_unsupported()
    if reason is not None:
        raise TilesUnsupported(f"tiles do not support {reason} yet; use tiles=False (every worker then "
                               "holds the whole object) or leave that part off")


# -- the state cut into tiles and stitched back ------------------------------------------------


def crop_state(state, fields: tuple, start: int, stop: int, views: bool = False):
    """A copy of ``state`` with its object-frame ``fields`` cut to rows [start, stop): arrays
    (..., H, W), or holders of such arrays that cut themselves (``crop_rows`` / ``stitch_rows``,
    e.g. an optimiser's memory). ``views``: the arrays' rows as views, not copies (for a state
    nothing writes into any more)."""
    out = copy.copy(state)
    for name in fields:
        value = getattr(state, name, None)
        if value is not None:
            rows = None if hasattr(value, "crop_rows") else value[..., start:stop, :]
            setattr(out, name, value.crop_rows(start, stop) if rows is None else rows if views else rows.copy())
    return out


def own_rows_on_host(carry: EpochCarry, fields: tuple, own: tuple, chunks) -> tuple:
    """Task on a tile's worker: its state on the host with the object-frame fields cut to its own
    rows (what the client stitches), and its chunks' per-pattern state.

    On the host the rows are views of the epoch's end: nothing writes into an epoch's end (the
    next epoch's update and end work on arrays of their own, :func:`_tile_apply`), and copies
    held while a checkpoint is written took another 20 B per pixel of the tile on every worker."""
    state = carry.state
    return (to_host(crop_state(state, fields, *own, views=not has_device_arrays(state))),
            {i: carry.local[i] for i in chunks if i in carry.local})


def stitch_states(parts: list, fields: tuple):
    """One state from every tile's own rows (``parts``, in row order): the object-frame fields
    concatenated, everything else from the first."""
    out = copy.copy(parts[0])
    for name in fields:
        values = [getattr(p, name, None) for p in parts]
        if values[0] is None:
            setattr(out, name, None)
        elif hasattr(values[0], "stitch_rows"):
            setattr(out, name, values[0].stitch_rows(values))
        else:
            setattr(out, name, np.concatenate(values, axis=-2))
    if isinstance(getattr(out, "extra", None), dict):
        out.extra = {k: v for k, v in out.extra.items() if k != "illumination_max"}
        with_frame(out, None)
    return out


# -- the tasks of one round --------------------------------------------------------------------


def _trims(task):
    """``task``, then the freed heap handed back to the system (:func:`.tuning.release_memory`,
    when the worker is past half its memory limit). The chunk steps do it after each step; the
    sums, updates and epoch ends free a tile's worth of temporaries, which otherwise stay in
    the allocator until the next chunk step and count against the worker's pause threshold."""
    @functools.wraps(task)
    def run(*args):
        out = task(*args)
        release_memory()
        return out
    return run


def _piece(part: Partial | None, origin: int, tile, detach: bool = False) -> Partial | None:
    """``part`` (boxes in the frame of a tile that starts at row ``origin``) as the piece ``tile``
    receives: its boxes cut to the rows it holds, in its frame; probe-frame sums and scalars whole."""
    if part is None:
        return None
    boxes = {}
    for name, box in part.boxes.items():
        y0 = box.offset[0] + origin
        a, b = max(tile.held_start, y0), min(tile.held_stop, y0 + box.data.shape[-2])
        if a < b:
            rows = box.data[..., a - y0:b - y0, :]
            # a copy when it leaves: a view would keep the whole sum alive here until it arrived
            boxes[name] = BoxedArray((a - tile.held_start, box.offset[1]), rows.copy() if detach else rows)
    return Partial(boxes, dict(part.arrays), dict(part.scalars))


def _read_with_payload(carry: EpochCarry, adapter, indices, blocks, positions):
    """``(i, chunk, positions, payload)`` for a worker's chunks in turn: each chunk read when its
    turn comes (data not persisted: one held at a time, :func:`~.placement.read_chunk`), the
    payload made once, on the first chunk's device (:func:`~.device_state.resident`)."""
    payload = None
    for i, b, p in zip(indices, blocks, positions):
        b = read_chunk(b)
        if payload is None:
            payload = adapter.payload(resident(carry.state, adapter, [b]))
        yield i, b, p, payload


def _tile_chunks(carry: EpochCarry, adapter, layout: TileLayout, w: int, round_index: int, rounds: int,
                 tree: FixedTree, blocks, positions, indices) -> dict:
    """Round ``round_index``'s chunk steps on worker ``w``'s tile; returns ``{v: {node: piece}}``,
    the pieces of its subtree sums for every worker ``v``, and under ``"local"`` its chunks'
    updated per-pattern state (it stays on this worker)."""
    tile = layout.tiles[w]
    # refined positions stay in the object's frame (the payload's tile frame moves the windows)
    shift = np.array([0.0 if tile_halo.refines_positions(adapter) else tile.held_start, 0.0])
    parts, local = {}, {}
    for i, b, p, payload in _read_with_payload(carry, adapter, indices, blocks, positions):
        own = None
        if adapter.local_state:
            own = carry.local.get(i)
            if own is None:
                own = adapter.initial_local(p)
        part = run_chunk(b, np.asarray(p, np.float64) - shift, payload, adapter.chunk_function,
                         round_index, rounds, own, i)
        if part is not None and part.local:
            local.update(part.local)
            part.local = {}
        parts[(0, i)] = part
        parts = tree.reduce(parts)  # as soon as a group is complete: few chunk partials held at once
    nodes = parts
    out = {v.worker: {k: _piece(part, tile.held_start, v, detach=v.worker != w) for k, part in nodes.items()}
           for v in layout.tiles}
    out["local"] = local
    return out


class _Owned:
    """The partials a task may change (made or taken over by it), held weakly: by identity."""

    def __init__(self):
        self._refs = {}

    def add(self, part) -> None:
        self._refs[id(part)] = weakref.ref(part)

    def __contains__(self, part) -> bool:
        ref = self._refs.get(id(part))
        return ref is not None and ref() is part


def _summing_in_place(owned: _Owned):
    """The tree's combine for :func:`_tile_total`: children summed into one that holds them all
    when that one is this task's own (``owned``), instead of into a new object-sized array; the
    same values either way."""
    def combine_fn(kids: list):
        count = len(kids)
        at = next((i for i, k in enumerate(kids) if k is not None and k in owned
                   and covers(k, [c for c in kids if c is not None])), None)
        if at is None:  # a new sum, which fills as each child is added and let go
            out = sum_partials_releasing(kids, release_memory)
        else:
            out = sum_partials_into(kids, at)
        kids.clear()
        if out is not None:
            count_reduced(out, count)
            owned.add(out)
        return out
    return combine_fn


@_trims
def _tile_total(tree: FixedTree, w: int, *pieces) -> tuple:
    """Worker ``w``'s round total from every worker's pieces for it (in worker order), and the
    bytes it received from the others. ``pieces[w]`` is this worker's chunk task's result: its
    own pieces are taken out of it (nothing else reads them), so the tree sums into them where
    they hold their siblings and frees them once summed — a tile's sums are not held twice."""
    nodes, received = {}, 0
    owned = _Owned()
    for u, group in enumerate(pieces):
        if u == w:
            group = group.pop(w)
            for p in group.values():
                if p is not None:
                    owned.add(p)
        else:
            received += sum(p.nbytes for p in group.values() if p is not None)
        nodes.update(group)
        group = None
    pieces = None  # (the reduce pops each node it sums: the last reference to an own piece)
    return tree.reduce(nodes, _summing_in_place(owned), consume=True, takes_list=True)[tree.root], received


@_trims
def _tile_round_share(summed: tuple, adapter, carry: EpochCarry, own: tuple, copies: int, *earlier) -> dict:
    """A tile's share of the round's whole-object numbers, and its received bytes (small).
    ``earlier``: every tile's shares of the earlier stages (``copies`` per stage, stage by stage),
    for numbers that need others first (a threshold at half the largest illumination)."""
    total, received = summed
    stages = [[s["sums"] for s in earlier[i:i + copies]] for i in range(0, len(earlier), copies)]
    return {"sums": adapter.tile_round_sums(carry.state, total, own, *stages), "received": received}


def _merged_shares(shares: tuple, copies: int) -> list:
    """Every tile's shares of all stages as one dict per tile (in worker order)."""
    merged = [{} for _ in range(copies)]
    for i, share in enumerate(shares):
        merged[i % copies].update(share["sums"])
    return merged


@_trims
def _tile_apply(carry: EpochCarry, adapter, first: bool, summed: tuple, local: dict, *shares) -> EpochCarry:
    """The round's update on a tile (``tile_begin_epoch`` first in the epoch's first round);
    ``local``: this worker's chunks' updated per-pattern state.

    It writes into the tile's arrays: every other task that reads ``carry`` (this round's chunk
    steps and shares) is done by now, and the epoch's first round works on arrays of its own, so
    the previous epoch's end, which the client may fetch, stays as it was."""
    total, _ = summed
    state = follow_partials(adapter.copy_state(carry.state), adapter, total)
    scalars = {} if first else dict(carry.scalars)
    if first:
        state = adapter.tile_begin_epoch(state)
    copies = len(shares) // _stages(adapter)
    state = adapter.tile_apply(state, total, _merged_shares(shares, copies))
    if total is not None:
        for k, v in total.scalars.items():
            scalars[k] = scalars.get(k, 0.0) + v
    received = max(s["received"] for s in shares[:copies])
    scalars["exchanged_bytes"] = scalars.get("exchanged_bytes", 0.0) + float(received)
    return EpochCarry(state, scalars, local={**carry.local, **local})


def _stages(adapter) -> int:
    """Rounds of shares a round's update needs (``RunsOnTiles.tile_round_stages``)."""
    return int(getattr(adapter, "tile_round_stages", 1))


@_trims
def _tile_end_share(carry: EpochCarry, adapter, own: tuple) -> dict:
    return adapter.tile_end_sums(carry.state, own)


@_trims
def _tile_end(carry: EpochCarry, adapter, *shares) -> EpochCarry:
    state = adapter.tile_end_epoch(adapter.copy_state(carry.state), list(shares))
    return EpochCarry(state, {**carry.scalars, **adapter.epoch_scalars(state)}, time.time(), carry.local)


def _tile_sums(carry: EpochCarry, adapter, layout: TileLayout, w: int, tree: FixedTree, blocks, positions,
               indices) -> dict:
    """The first epoch's sums (``adapter.tile_sums_function``, e.g. Σ measured and Σ model
    intensity) of worker ``w``'s chunks on its tile, summed over its complete subtrees."""
    tile = layout.tiles[w]
    shift = np.array([tile.held_start, 0.0])
    parts = {}
    for i, b, p, payload in _read_with_payload(carry, adapter, indices, blocks, positions):
        parts[(0, i)] = adapter.tile_sums_function(b, np.asarray(p, np.float64) - shift, payload)
        parts = tree.reduce(parts)
    return parts


def _summary(carry: EpochCarry) -> tuple:
    return carry.state.epoch, carry.scalars, carry.ended_at, has_device_arrays(carry.state)


# -- the graph ---------------------------------------------------------------------------------


class TileGraph:
    """Builds and submits epochs on tiles (see the module docstring); one tile per worker that
    holds chunks, the strips cut where the workers' chunks meet."""

    def __init__(self, client, data: ChunkedData, adapter, object_height: int, *, rounds: int = 1,
                 split_every: int | None = None):

        self.client, self.adapter, self.rounds = client, adapter, int(rounds)
        self.split_every = max(2, int(split_every or default_split_every(data.n_chunks)))
        self.token = uuid.uuid4().hex
        placed = self._placed = GraphInputs(client, data, adapter, self.token, prefix="daskpty-tile")
        self.block_keys, self.workers, self.groups = placed.block_keys, placed.workers, placed.groups
        self.adapter_key, self.position_keys, self.inputs = placed.adapter_key, placed.position_keys, placed.inputs
        n = int(data.intensities.shape[-1])
        self.layout = TileLayout.from_chunks(placed.chunk_positions, placed.worker_of, n, object_height,
                                             reach=tile_halo.reach(adapter, n), margin=tile_halo.margin(adapter))
        self.count = 0

    def _on(self, w: int) -> dict:
        return self._placed.on(w)

    def own(self, w: int) -> tuple:
        """Worker ``w``'s own rows in its tile's frame."""
        t = self.layout.tiles[w]
        return (t.start - t.held_start, t.stop - t.held_start)

    def scatter_tiles(self, state) -> list:
        """The tiles of a state on the client, each scattered to its worker (one future each)."""
        futures = []
        every = getattr(state, "chunk_local", None) or {}
        state = copy.copy(state)
        state.chunk_local = None  # each tile carries its own chunks' per-pattern state
        for w, t in enumerate(self.layout.tiles):
            cropped = crop_state(state, self.adapter.tile_fields, t.held_start, t.held_stop)
            with_frame(cropped, TileFrame(t.held_start, tuple(state.object.shape[-2:])))
            tile = EpochCarry(cropped, local={i: every[i] for i in self.groups[w] if i in every})
            kwargs = {} if self.workers[w] is None else {"workers": [self.workers[w]]}
            futures.append(self.client.scatter(tile, hash=False, **kwargs))
        return futures

    def submit(self, starts: list) -> tuple:
        """One epoch from each tile's carry future; returns ``(end futures, summary future)``."""
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

        tag = f"{self.count}-{self.token}"
        self.count += 1
        copies = len(self.workers)
        inputs = {**self.inputs, **{f.key: f for f in starts}}
        tasks = [{} for _ in range(copies)]
        tree = FixedTree(len(self.block_keys), self.split_every)
        carries = [f.key for f in starts]
        for r in range(self.rounds):
            chunk_keys = []
            for w, chunks in enumerate(self.groups):
                key = (f"daskpty-tile-chunks-{r}-{tag}", w)
                tasks[w][key] = (_tile_chunks, carries[w], self.adapter_key, self.layout, w, r, self.rounds, tree,
                                 [self.block_keys[i] for i in chunks], [self.position_keys[i] for i in chunks],
                                 chunks)
                chunk_keys.append(key)
            pieces, locals_ = {}, []
            for w in range(copies):  # each piece a key of its own: only it travels
                for v in range(copies):
                    if v == w:  # (its own: the total takes them out of the chunk task's result)
                        pieces[w, v] = chunk_keys[w]
                        continue
                    pieces[w, v] = (f"daskpty-tile-piece-{r}-{w}-{tag}", v)
                    tasks[w][pieces[w, v]] = (operator.getitem, chunk_keys[w], v)
                # (and the per-pattern state too: the chunk task's result, all of its pieces, is
                # then freed once they are summed, not held until the update)
                locals_.append((f"daskpty-tile-local-{r}-{tag}", w))
                tasks[w][locals_[w]] = (operator.getitem, chunk_keys[w], "local")
            summed, shares = [], []
            for v in range(copies):
                summed.append((f"daskpty-tile-total-{r}-{tag}", v))
                tasks[v][summed[v]] = (_tile_total, tree, v, *[pieces[w, v] for w in range(copies)])
            for stage in range(_stages(self.adapter)):  # each stage's shares from all earlier ones
                earlier = list(shares)
                for v in range(copies):
                    shares.append((f"daskpty-tile-share{stage}-{r}-{tag}", v))
                    tasks[v][shares[-1]] = (_tile_round_share, summed[v], self.adapter_key, carries[v], self.own(v),
                                            copies, *earlier)
            new = []
            for v in range(copies):
                key = (f"daskpty-tile-round-{r}-{tag}", v)
                tasks[v][key] = (_tile_apply, carries[v], self.adapter_key, r == 0, summed[v], locals_[v], *shares)
                new.append(key)
            carries = new
        if tile_halo.refines_positions(self.adapter):
            carries = self._finish_positions(tasks, carries, tag)
        end_shares, ends = [], []
        for v in range(copies):
            end_shares.append((f"daskpty-tile-end-share-{tag}", v))
            tasks[v][end_shares[v]] = (_tile_end_share, carries[v], self.adapter_key, self.own(v))
        for v in range(copies):
            ends.append((f"daskpty-tile-end-{tag}", v))
            tasks[v][ends[v]] = (_tile_end, carries[v], self.adapter_key, *end_shares)
        summary = (f"daskpty-tile-summary-{tag}", 0)
        layers = {"inputs": MaterializedLayer(inputs)}
        for w in range(copies):
            layers[f"daskpty-tile-epoch-{tag}-{w}"] = MaterializedLayer(tasks[w], annotations=self._on(w) or None)
        layers[f"daskpty-tile-summary-{tag}"] = MaterializedLayer({summary: (_summary, ends[0])},
                                                                  annotations=self._on(0) or None)
        graph = HighLevelGraph(layers, {name: set() for name in layers})
        futures = self.client.get(graph, [*ends, summary], sync=False)
        return futures[:copies], futures[copies]

    def _finish_positions(self, tasks: list, carries: list, tag: str) -> list:
        """The refinement's epoch end on every tile, then each halo's rows from their owners
        (:mod:`.tile_halo`); returns the new carry keys."""
        copies, fields = len(carries), self.adapter.tile_warped_fields
        finished = []
        for v in range(copies):
            finished.append((f"daskpty-tile-positions-end-{tag}", v))
            tasks[v][finished[v]] = (tile_halo.finish_positions, carries[v], self.adapter_key)
        sources = tile_halo.halo_sources(self.layout)
        halos = {}
        for (u, v), rows in sources.items():
            halos[u, v] = (f"daskpty-tile-halo-{u}-{tag}", v)
            tasks[u][halos[u, v]] = (tile_halo.halo_rows, finished[u], fields, self.layout.tiles[u].held_start, rows)
        out = []
        for v in range(copies):
            out.append((f"daskpty-tile-refreshed-{tag}", v))
            tasks[v][out[v]] = (tile_halo.refreshed, finished[v], self.layout.tiles[v].held_start,
                                *[halos[u, v] for u in range(copies) if (u, v) in halos])
        return out

    def _graph(self, tasks: list, inputs: dict):
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

        layers = {"inputs": MaterializedLayer(inputs)}
        for w, own in enumerate(tasks):
            layers[f"{next(iter(own))[0]}-{w}"] = MaterializedLayer(own, annotations=self._on(w) or None)
        return HighLevelGraph(layers, {name: set() for name in layers})

    def initialise(self, state, timeout: float | None = None):
        """The adapter's first-epoch set-up (the probe's intensity rescale) from sums formed on
        the tiles, so no worker receives the whole object for it; returns the new state. Raises
        as :meth:`wait` does when a tile's worker is lost."""
        starts = self.scatter_tiles(state)
        tree = FixedTree(len(self.block_keys), self.split_every)
        tasks = [{(f"daskpty-tile-sums-{self.token}", w): (
            _tile_sums, starts[w].key, self.adapter_key, self.layout, w, tree,
            [self.block_keys[i] for i in chunks], [self.position_keys[i] for i in chunks], chunks)}
            for w, chunks in enumerate(self.groups)]
        keys = [next(iter(t)) for t in tasks]
        futures = self.client.get(self._graph(tasks, {**self.inputs, **{f.key: f for f in starts}}), keys, sync=False)
        try:
            self.wait(futures, timeout)
            nodes = {}
            for group in self.client.gather(futures):
                nodes.update(group)
        finally:
            for f in (*futures, *starts):
                f.release()
        return self.adapter.tile_initialise(state, tree.reduce(nodes)[tree.root])

    def wait(self, futures: list, timeout: float | None = None, poll_s: float = 1.0) -> None:
        """Wait for ``futures`` while checking every ``poll_s`` seconds that the workers holding
        this layout's tiles are still there. A task pinned to a worker that is gone waits for it
        forever, so a lost tile worker raises :class:`TileWorkerLost` at once rather than after
        ``timeout`` seconds (``TimeoutError``); a data chunk whose workers left as its epoch
        started is sent to the workers there are (:func:`~.placement.run_stuck_loose_tasks`)."""
        from distributed import wait

        from .cluster import live_workers

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = poll_s if deadline is None else min(poll_s, max(deadline - time.monotonic(), 0.0))
            try:
                with self.client.as_current():  # (wait uses the current client)
                    wait(futures, timeout=step)
                return
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            gone = {w for w in self.workers if w is not None} - set(live_workers(self.client))
            run_stuck_loose_tasks(self.client)  # chunks to read again once the workers they named left
            if gone:
                raise TileWorkerLost(f"the worker{'s' if len(gone) > 1 else ''} of {len(gone)} tile"
                                     f"{'s' if len(gone) > 1 else ''} left the cluster")

    def fetch(self, ends: list):
        """The whole state from the tiles of an epoch (their own rows, stitched on the client)."""
        parts = []
        for w, future in enumerate(ends):
            kwargs = {} if self.workers[w] is None else {"workers": [self.workers[w]]}
            part = self.client.submit(own_rows_on_host, future, self.adapter.tile_fields, self.own(w),
                                      self.groups[w], pure=False, **kwargs)
            parts.append(part)
        try:
            results = [p.result() for p in parts]
            by_rows = sorted(range(len(results)), key=lambda w: self.layout.tiles[w].start)  # not worker order
            state = stitch_states([results[w][0] for w in by_rows], self.adapter.tile_fields)
            if self.adapter.local_state:
                state.chunk_local = {i: v for _, local in results for i, v in local.items()}
            return state
        finally:
            for p in parts:
                p.release()


__all__ = ["TileGraph", "TileWorkerLost", "TilesUnsupported", "check_tiles_supported", "crop_state", "stitch_states"]
