"""Position refinement on tiles: the epoch end's resampling, and the halo rows it makes stale.

A round updates a tile's halo redundantly (every tile receives the pieces of the sums that
touch the rows it holds), so a tile needs nothing from its neighbours between rounds. The
window correction at an epoch's end (:func:`daskpty.engines.positions.finish_epoch`) is
different: it resamples the object, and a resampled pixel needs its neighbours. Each tile
resamples what it holds (:func:`finish_positions`; its own rows come out as the same bits as the
whole object's, since it holds a halo beyond them), and then takes the rows of its halo from
their owners (:func:`halo_rows` on the owner, :func:`refreshed` on the tile): a few rows of the
warped fields, and only in an epoch that resampled.

The tasks of :class:`~.tile_graph.TileGraph`; state fields are arrays (..., rows, W) or holders
that cut themselves (``crop_rows`` / ``paste_rows``: an optimiser's memory).
"""
from __future__ import annotations

import copy

from .epoch_graph import EpochCarry

#: Rows a tile holds beyond its own on each side with a neighbour there, whatever its chunks'
#: windows reach, when the object may be resampled: the first-order resampling's central
#: differences need one (see :func:`daskpty.engines.window_deformation.warp_object`).
WARP_MARGIN = 2


def refines_positions(adapter) -> bool:
    """Whether ``adapter`` refines positions (its positions part moves the windows)."""
    return adapter.positions.refines


def reach(adapter, n: int) -> float:
    """Rows beyond its chunks' nominal windows that a tile must hold for ``adapter``: the largest
    displacement position refinement allows (0 without refinement)."""
    return adapter.positions.reach(n)


def margin(adapter) -> int:
    """Rows a tile holds beyond its own on each inner side (:data:`WARP_MARGIN` when refining)."""
    return WARP_MARGIN if refines_positions(adapter) else 0


def finish_positions(carry: EpochCarry, adapter) -> EpochCarry:
    """Task on a tile: the refinement's epoch end (window fit, the resampling, affine fit) on a
    copy of its state (``adapter.tile_finish_positions``)."""
    state = adapter.copy_state(carry.state)
    adapter.tile_finish_positions(state)
    return EpochCarry(state, carry.scalars, carry.ended_at, carry.local)


def _resampled(state) -> bool:
    """Whether the epoch end just resampled the object (the window correction's map is set then)."""
    return getattr(state, "window_map", None) is not None


def _rows(value, start: int, stop: int):
    return value.crop_rows(start, stop) if hasattr(value, "crop_rows") else value[..., start:stop, :].copy()


def _paste(value, start: int, rows):
    """``value`` with ``rows`` written from row ``start`` on (a copy: the old arrays may be shared)."""
    if hasattr(value, "paste_rows"):
        out = copy.deepcopy(value)
        out.paste_rows(start, rows)
        return out
    out = value.copy()
    out[..., start:start + rows.shape[-2], :] = rows
    return out


def halo_rows(carry: EpochCarry, fields: tuple, held_start: int, rows: tuple) -> dict | None:
    """Task on a tile's worker after :func:`finish_positions`: its ``fields`` in the object's rows
    ``rows`` (its own rows that another tile holds as halo; ``held_start``: this tile's first
    row), or None when the epoch did not resample."""
    state = carry.state
    if not _resampled(state):
        return None
    a, b = rows[0] - held_start, rows[1] - held_start
    return {"start": rows[0],
            "fields": {name: _rows(getattr(state, name), a, b) for name in fields
                       if getattr(state, name, None) is not None}}


def _nbytes(value) -> int:
    return sum(int(v.nbytes) for v in value.arrays.values()) if hasattr(value, "arrays") else int(value.nbytes)


def refreshed(carry: EpochCarry, held_start: int, *pieces) -> EpochCarry:
    """Task on a tile: its state with the halo rows from their owners (``pieces``, each from
    :func:`halo_rows`); the bytes received are added to the epoch's ``exchanged_bytes``."""
    pieces = [p for p in pieces if p is not None]
    if not pieces:
        return carry
    state = copy.copy(carry.state)
    received = 0
    for piece in pieces:
        for name, rows in piece["fields"].items():
            setattr(state, name, _paste(getattr(state, name), piece["start"] - held_start, rows))
            received += _nbytes(rows)
    scalars = {**carry.scalars, "exchanged_bytes": carry.scalars.get("exchanged_bytes", 0.0) + float(received)}
    return EpochCarry(state, scalars, carry.ended_at, carry.local)


def halo_sources(layout) -> dict:
    """``{(u, v): (start, stop)}``: the object rows tile ``u`` owns that tile ``v`` holds as halo."""
    out = {}
    for v in layout.tiles:
        for u in layout.tiles:
            if u.worker == v.worker:
                continue
            a, b = max(u.start, v.held_start), min(u.stop, v.held_stop)
            if a < b:
                out[u.worker, v.worker] = (a, b)
    return out


__all__ = ["WARP_MARGIN", "finish_positions", "halo_rows", "halo_sources", "margin", "reach", "refines_positions",
           "refreshed"]
