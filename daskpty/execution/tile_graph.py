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

**Fused rounds** (the default where every tile's worker is known): the same work as two
tasks per worker and round (:mod:`.tile_round_tasks`) — round r − 1's update with round r's
chunk steps, then round r's total with its shares — each keeping what stays on its worker (its
own pieces, the total, the tile) in the worker's memory for the next; a round is two scheduler
hops and its two exchanges, where split rounds (every step a task result) take five. A task that
does not find what it continues raises :class:`~daskpty.faults.StaleRoundState` and the epoch
loop starts the epoch again on split rounds, the same bits.

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
import operator
import time
import uuid

import numpy as np

from ..faults import TileWorkerLost, TilesUnsupported  # noqa: F401 (also named here)
from ..engines.tile_frame import TileFrame, with_frame
from .device_state import has_device_arrays, to_host
from .engine_protocol import RunsOnTiles
from .epoch_graph import EpochCarry
from .placement import GraphInputs, run_stuck_loose_tasks
from .rounds import ChunkedData, FixedTree, default_split_every
from .scatter import scatter_within
from . import tile_halo
from . import tile_round_tasks as rt
from .tiles import TileLayout


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
    next epoch's update and end work on arrays of their own, :func:`.tile_round_tasks.round_apply`), and copies
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


# -- the graph ---------------------------------------------------------------------------------


#: Bytes of pieces meant for other workers a worker may receive to save a round a hop: ~4 ms,
#: what one graph level costs with worker processes (docs/benchmarks.md), at ~1 GB/s through host
#: memory (GPU workers sharing a device, docs/gpu.md).
DIRECT_BYTES = 4 << 20


class TileGraph:
    """Builds and submits epochs on tiles (see the module docstring); one tile per worker that
    holds chunks, the strips cut where the workers' chunks meet."""

    def __init__(self, client, data: ChunkedData, adapter, object_height: int, *, rounds: int = 1,
                 split_every: int | None = None, fused: bool = True, piece_row_bytes: float = float("inf")):

        self.client, self.adapter, self.rounds = client, adapter, int(rounds)
        self.split_every = max(2, int(split_every or default_split_every(data.n_chunks)))
        self.token = uuid.uuid4().hex
        placed = self._placed = GraphInputs(client, data, adapter, self.token, prefix="daskpty-tile")
        self.block_keys, self.workers, self.groups = placed.block_keys, placed.workers, placed.groups
        self.adapter_key, self.position_keys, self.inputs = placed.adapter_key, placed.position_keys, placed.inputs
        n = int(data.intensities.shape[-1])
        self.layout = TileLayout.from_chunks(placed.chunk_positions, placed.worker_of, n, object_height,
                                             reach=tile_halo.reach(adapter, n), margin=tile_halo.margin(adapter))
        # fused rounds keep state in a worker's memory: only with every tile's worker to pin them to
        self.fused = fused and None not in self.workers
        # Fused rounds: a worker receives the others' whole round results (one hop less) unless
        # that brings it more than DIRECT_BYTES of pieces meant for third workers; then its own
        # pieces, taken out on their worker (``picked``). Two workers: only the other's pieces are
        # in a result. ``piece_row_bytes``: a row of a round's summed object-frame arrays.
        others = self.layout.rows_meant_for_others()
        self.picked = others > 0 and others * float(piece_row_bytes) > DIRECT_BYTES
        self.count = 0

    def _on(self, w: int) -> dict:
        """Where worker ``w``'s tasks run: there only when rounds are fused (their tasks read what
        the previous one kept there), else loosely (:meth:`.placement.GraphInputs.on`)."""
        return self._placed.on(w, strict=self.fused)

    def close(self) -> None:
        """Forget what fused rounds of this graph left on the workers (an interrupted epoch)."""
        if self.fused:
            try:
                self.client.run(rt.drop_kept, self.token)
            except Exception:  # a worker gone meanwhile has nothing left to drop
                pass

    def own(self, w: int) -> tuple:
        """Worker ``w``'s own rows in its tile's frame."""
        t = self.layout.tiles[w]
        return (t.start - t.held_start, t.stop - t.held_start)

    def scatter_tiles(self, state) -> list:
        """The tiles of a state on the client, each scattered to its worker (one future each),
        within :func:`.scatter.scatter_within`'s bound: a worker killed or stopped just before its
        tile goes out would hold the scatter for distributed's connect timeout (30 s); the
        :class:`TimeoutError` lets the tile loop try again on the workers there are then."""
        futures = []
        every = getattr(state, "chunk_local", None) or {}
        state = copy.copy(state)
        state.chunk_local = None  # each tile carries its own chunks' per-pattern state
        for w, t in enumerate(self.layout.tiles):
            cropped = crop_state(state, self.adapter.tile_fields, t.held_start, t.held_stop)
            with_frame(cropped, TileFrame(t.held_start, tuple(state.object.shape[-2:])))
            tile = EpochCarry(cropped, local={i: every[i] for i in self.groups[w] if i in every})
            kwargs = {} if self.workers[w] is None else {"workers": [self.workers[w]]}
            futures.append(scatter_within(self.client, tile, hash=False, **kwargs))
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
        if self.fused:
            carries = self._fused_rounds(tasks, carries, tree, tag)
        else:
            carries = self._split_rounds(tasks, carries, tree, tag)
        if tile_halo.refines_positions(self.adapter):
            carries = self._finish_positions(tasks, carries, tag)
        end_shares, ends = [], []
        for v in range(copies):
            end_shares.append((f"daskpty-tile-end-share-{tag}", v))
            tasks[v][end_shares[v]] = (rt.end_share, carries[v], self.adapter_key, self.own(v))
        for v in range(copies):
            ends.append((f"daskpty-tile-end-{tag}", v))
            tasks[v][ends[v]] = (rt.end_epoch, carries[v], self.adapter_key, *end_shares)
        summary = (f"daskpty-tile-summary-{tag}", 0)
        layers = {"inputs": MaterializedLayer(inputs)}
        for w in range(copies):
            layers[f"daskpty-tile-epoch-{tag}-{w}"] = MaterializedLayer(tasks[w], annotations=self._on(w) or None)
        layers[f"daskpty-tile-summary-{tag}"] = MaterializedLayer({summary: (rt.summary, ends[0])},
                                                                  annotations=self._on(0) or None)
        graph = HighLevelGraph(layers, {name: set() for name in layers})
        futures = self.client.get(graph, [*ends, summary], sync=False)
        return futures[:copies], futures[copies]

    def _split_rounds(self, tasks: list, carries: list, tree: FixedTree, tag: str) -> list:
        """The epoch's rounds as split tasks (chunk steps, pieces, total, shares, update: five hops
        a round, everything a task result); returns the last update's keys."""
        copies = len(carries)
        for r in range(self.rounds):
            chunk_keys = []
            for w, chunks in enumerate(self.groups):
                key = (f"daskpty-tile-chunks-{r}-{tag}", w)
                tasks[w][key] = (rt.chunk_steps, carries[w], self.adapter_key, self.layout, w, r, self.rounds, tree,
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
                tasks[v][summed[v]] = (rt.round_total, tree, v, *[pieces[w, v] for w in range(copies)])
            for stage in range(rt.stages(self.adapter)):  # each stage's shares from all earlier ones
                earlier = list(shares)
                for v in range(copies):
                    shares.append((f"daskpty-tile-share{stage}-{r}-{tag}", v))
                    tasks[v][shares[-1]] = (rt.round_share, summed[v], self.adapter_key, carries[v], self.own(v),
                                            copies, *earlier)
            new = []
            for v in range(copies):
                key = (f"daskpty-tile-round-{r}-{tag}", v)
                tasks[v][key] = (rt.round_apply, carries[v], self.adapter_key, r == 0, summed[v], locals_[v], *shares)
                new.append(key)
            carries = new
        return carries

    def _fused_rounds(self, tasks: list, carries: list, tree: FixedTree, tag: str) -> list:
        """The epoch's rounds as fused tasks (:func:`.tile_round_tasks.fused_round`, ``fused_total``:
        two hops a round, what stays on a worker kept there); returns the last update's keys."""
        copies, stages = len(carries), rt.stages(self.adapter)
        picked = self.picked
        shares = []
        for r in range(self.rounds):
            rounds = []
            for w, chunks in enumerate(self.groups):
                rounds.append((f"daskpty-tile-fused-{r}-{tag}", w))
                tasks[w][rounds[w]] = (rt.fused_round, carries[w] if r == 0 else None, self.adapter_key, self.layout,
                                       w, r, self.rounds, tree, self.token, tag,
                                       [self.block_keys[i] for i in chunks], [self.position_keys[i] for i in chunks],
                                       chunks, *shares)
            groups = {}
            for w in range(copies):
                for v in range(copies):
                    groups[w, v] = rounds[w]
                    if picked and v != w:
                        groups[w, v] = (f"daskpty-tile-piece-{r}-{w}-{tag}", v)
                        tasks[w][groups[w, v]] = (operator.getitem, rounds[w], v)
            shares = []
            for v in range(copies):
                shares.append((f"daskpty-tile-fused-total-{r}-{tag}", v))
                tasks[v][shares[v]] = (rt.fused_total, self.adapter_key, tree, self.token, tag, v, r, self.own(v),
                                       copies, picked, *[groups[w, v] for w in range(copies)])
            for stage in range(1, stages):
                earlier = list(shares)
                for v in range(copies):
                    shares.append((f"daskpty-tile-fused-share{stage}-{r}-{tag}", v))
                    tasks[v][shares[-1]] = (rt.fused_share, self.adapter_key, self.token, tag, v, r, self.own(v),
                                            copies, *earlier)
        new = []
        for w in range(copies):
            new.append((f"daskpty-tile-updated-{tag}", w))
            tasks[w][new[w]] = (rt.fused_last_update, self.adapter_key, self.token, tag, w, self.rounds, *shares)
        return new

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
            rt.first_sums, starts[w].key, self.adapter_key, self.layout, w, tree,
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
