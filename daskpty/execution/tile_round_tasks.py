"""The tasks of a round on tiles (:mod:`.tile_graph` builds the graph from them).

Split rounds (one task per step: chunk steps, the pieces each worker receives, the total, the
shares, the update) pass everything as task results. Fused rounds (:func:`fused_round`,
:func:`fused_total`) do the same work in two tasks per worker and round — the previous round's
update with this round's chunk steps, then the total with its shares — and keep what stays on
the worker (its own pieces, the total, the tile) in the worker's memory between them, as the
replicated graph's fused rounds do (:mod:`.epoch_graph`): a round is then two scheduler hops
and the two exchanges it needs, where the split round took five hops.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref

import numpy as np

from ..engines.partials import BoxedArray, Partial, covers, sum_partials_into, sum_partials_releasing
from ..faults import StaleRoundState
from .device_state import follow_partials, has_device_arrays, resident
from .epoch_graph import EpochCarry
from .placement import read_chunk
from .rounds import FixedTree, count_reduced, run_chunk
from . import tile_halo
from .tiles import TileLayout
from .tuning import release_memory

# -- the tasks of one round --------------------------------------------------------------------


def trims(task):
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


def piece_for(part: Partial | None, origin: int, tile, detach: bool = False) -> Partial | None:
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


def read_with_payload(carry: EpochCarry, adapter, indices, blocks, positions):
    """``(i, chunk, positions, payload)`` for a worker's chunks in turn: each chunk read when its
    turn comes (data not persisted: one held at a time, :func:`~.placement.read_chunk`), the
    payload made once, on the first chunk's device (:func:`~.device_state.resident`)."""
    payload = None
    for i, b, p in zip(indices, blocks, positions):
        b = read_chunk(b)
        if payload is None:
            payload = adapter.payload(resident(carry.state, adapter, [b]))
        yield i, b, p, payload


def chunk_steps(carry: EpochCarry, adapter, layout: TileLayout, w: int, round_index: int, rounds: int,
                 tree: FixedTree, blocks, positions, indices) -> dict:
    """Round ``round_index``'s chunk steps on worker ``w``'s tile; returns ``{v: {node: piece}}``,
    the pieces of its subtree sums for every worker ``v``, and under ``"local"`` its chunks'
    updated per-pattern state (it stays on this worker)."""
    tile = layout.tiles[w]
    # refined positions stay in the object's frame (the payload's tile frame moves the windows)
    shift = np.array([0.0 if tile_halo.refines_positions(adapter) else tile.held_start, 0.0])
    parts, local = {}, {}
    for i, b, p, payload in read_with_payload(carry, adapter, indices, blocks, positions):
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
    out = {v.worker: {k: piece_for(part, tile.held_start, v, detach=v.worker != w) for k, part in nodes.items()}
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
    """The tree's combine for :func:`round_total`: children summed into one that holds them all
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


@trims
def round_total(tree: FixedTree, w: int, *pieces) -> tuple:
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


@trims
def round_share(summed: tuple, adapter, carry: EpochCarry, own: tuple, copies: int, *earlier) -> dict:
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


@trims
def round_apply(carry: EpochCarry, adapter, first: bool, summed: tuple, local: dict, *shares) -> EpochCarry:
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
    copies = len(shares) // stages(adapter)
    state = adapter.tile_apply(state, total, _merged_shares(shares, copies))
    if total is not None:
        for k, v in total.scalars.items():
            scalars[k] = scalars.get(k, 0.0) + v
    received = max(s["received"] for s in shares[:copies])
    scalars["exchanged_bytes"] = scalars.get("exchanged_bytes", 0.0) + float(received)
    return EpochCarry(state, scalars, local={**carry.local, **local})


def stages(adapter) -> int:
    """Rounds of shares a round's update needs (``RunsOnTiles.tile_round_stages``)."""
    return int(getattr(adapter, "tile_round_stages", 1))


@trims
def end_share(carry: EpochCarry, adapter, own: tuple) -> dict:
    return adapter.tile_end_sums(carry.state, own)


@trims
def end_epoch(carry: EpochCarry, adapter, *shares) -> EpochCarry:
    state = adapter.tile_end_epoch(adapter.copy_state(carry.state), list(shares))
    return EpochCarry(state, {**carry.scalars, **adapter.epoch_scalars(state)}, time.time(), carry.local)


def first_sums(carry: EpochCarry, adapter, layout: TileLayout, w: int, tree: FixedTree, blocks, positions,
               indices) -> dict:
    """The first epoch's sums (``adapter.tile_sums_function``, e.g. Σ measured and Σ model
    intensity) of worker ``w``'s chunks on its tile, summed over its complete subtrees."""
    tile = layout.tiles[w]
    shift = np.array([tile.held_start, 0.0])
    parts = {}
    for i, b, p, payload in read_with_payload(carry, adapter, indices, blocks, positions):
        parts[(0, i)] = adapter.tile_sums_function(b, np.asarray(p, np.float64) - shift, payload)
        parts = tree.reduce(parts)
    return parts


def summary(carry: EpochCarry) -> tuple:
    return carry.state.epoch, carry.scalars, carry.ended_at, has_device_arrays(carry.state)



# -- fused rounds: two tasks per worker and round, the rest kept on the worker ----------------

#: What a fused round's task leaves on its worker for the next one, by (graph token, worker):
#: ``(epoch tag, round, what, carry, held, local)`` — ``what`` "pieces" (``held``: the worker's own
#: pieces, after :func:`fused_round`) or "total" (``held``: the round's total and received bytes,
#: after :func:`fused_total`). One entry per worker, replaced by each task; module-level, so the
#: workers of one process (threads) share it by key.
_TILE_STATES: dict = {}
_TILE_STATES_LOCK = threading.Lock()


def _kept(token: str, w: int, tag: str, round_index: int, what: str) -> tuple:
    """The entry :func:`fused_round` / :func:`fused_total` left for this task, or
    :class:`StaleRoundState` (the task runs where its state is not: the tile loop restarts the
    epoch on split rounds)."""
    entry = _TILE_STATES.get((token, w))
    if entry is None or entry[:3] != (tag, round_index, what):
        raise StaleRoundState(f"tile round {round_index} of epoch graph {tag} did not find its {what} on "
                              "this worker")
    return entry


def fused_round(start, adapter, layout: TileLayout, w: int, round_index: int, rounds: int, tree: FixedTree,
                token: str, tag: str, blocks, positions, indices, *shares) -> dict:
    """Round ``round_index`` on worker ``w``'s tile: round ``r − 1``'s update first (``shares``:
    every worker's shares of it; the total kept by :func:`fused_total`), or ``start`` in round 0,
    then this round's chunk steps. Keeps its own pieces on the worker; returns the others'
    (``{v: {node: piece}}``)."""
    carry = start if round_index == 0 else _kept_update(adapter, token, tag, w, round_index - 1, shares)
    out = chunk_steps(carry, adapter, layout, w, round_index, rounds, tree, blocks, positions, indices)
    _TILE_STATES[(token, w)] = (tag, round_index, "pieces", carry, out.pop(w), out.pop("local"))
    return out


def fused_total(adapter, tree: FixedTree, token: str, tag: str, v: int, round_index: int, own: tuple,
                copies: int, picked: bool, *groups) -> dict:
    """Worker ``v``'s round total from every worker's pieces for it (``groups``, in worker order:
    :func:`fused_round` results, or with ``picked`` the pieces for ``v`` taken out of them; its
    own entry only orders this task after its round task), kept on the worker, and its share of
    the first stage's whole-object numbers (returned: it travels)."""
    _, _, _, carry, mine, local = _kept(token, v, tag, round_index, "pieces")
    pieces = [{v: mine} if u == v else group if picked else group[v] for u, group in enumerate(groups)]
    _TILE_STATES.pop((token, v), None)  # (the pieces are the total's from here: summed into, then freed)
    mine = groups = None
    summed = round_total(tree, v, *pieces)
    _TILE_STATES[(token, v)] = (tag, round_index, "total", carry, summed, local)
    return round_share(summed, adapter, carry, own, copies)


def fused_share(adapter, token: str, tag: str, v: int, round_index: int, own: tuple, copies: int, *earlier) -> dict:
    """A later stage's share (``RunsOnTiles.tile_round_stages`` > 1) from the kept total."""
    _, _, _, carry, summed, _ = _kept(token, v, tag, round_index, "total")
    return round_share(summed, adapter, carry, own, copies, *earlier)


def fused_last_update(adapter, token: str, tag: str, w: int, rounds: int, *shares) -> EpochCarry:
    """The epoch's last round's update on worker ``w``'s tile, as a task result (the epoch's end
    tasks take it from here)."""
    return _kept_update(adapter, token, tag, w, rounds - 1, shares)


def _kept_update(adapter, token: str, tag: str, w: int, round_index: int, shares: tuple) -> EpochCarry:
    """Round ``round_index``'s update on worker ``w``'s tile from the total :func:`fused_total`
    kept there; the entry is let go first, so the total goes with the update."""
    _, _, _, carry, summed, local = _kept(token, w, tag, round_index, "total")
    _TILE_STATES.pop((token, w), None)
    return round_apply(carry, adapter, round_index == 0, summed, local, *shares)


def drop_kept(token: str) -> None:
    """Forget what fused rounds of graph ``token`` left on this worker (an interrupted epoch)."""
    with _TILE_STATES_LOCK:
        for key in [k for k in _TILE_STATES if k[0] == token]:
            _TILE_STATES.pop(key, None)
