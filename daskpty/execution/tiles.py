"""Tiles of the object: which worker owns which rows, what it holds around them, and what a
round's partial sums send where (:mod:`.tile_graph` runs epochs on them).

The chunks are spatially ordered and each worker holds a contiguous run of them
(:func:`~.placement.balanced_worker`), so the patterns of worker w cover a band of the object's
rows. :class:`TileLayout` cuts the object into one row strip per worker — the strip boundaries
halfway between neighbouring workers' bands — and gives every worker a *halo*: the rows beyond
its strip that its chunks' windows reach (the probe plus the largest position displacement
allowed). A worker then holds its strip and halo, never the whole object.

What travels in a round, per strategy (:meth:`TileLayout.received_bytes`):

* ``"replicas"`` (today): every worker receives every other worker's partial sums, whole;
* ``"owner"``: the part of a partial sum outside its worker's strip goes to the owners of those
  rows only; after the apply each worker refreshes its halo from its neighbours' strips;
* ``"halo"``: every partial sum goes to each worker whose strip *or halo* it touches, and each
  worker applies the update to its halo too (no refresh; the halo is updated redundantly).

Pure NumPy; no dask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines.partials import BoxedArray

STRATEGIES = ("replicas", "owner", "halo")


@dataclass(frozen=True)
class Tile:
    """Worker ``worker`` owns rows [``start``, ``stop``) and holds [``held_start``, ``held_stop``)."""

    worker: int
    start: int
    stop: int
    held_start: int
    held_stop: int

    @property
    def halo_rows(self) -> int:
        return (self.start - self.held_start) + (self.held_stop - self.stop)


def chunk_bands(chunk_positions, n: int, reach: float = 0.0) -> np.ndarray:
    """Rows [y0, y1) each chunk's windows can touch: (C, 2) int, from its positions (object
    frame, window centres) widened by ``reach`` px (the largest position displacement)."""
    bands = []
    for p in chunk_positions:
        p = np.asarray(p, np.float64)
        lo = np.floor(p[:, 0].min() - n / 2.0 - reach)
        hi = np.ceil(p[:, 0].max() + n / 2.0 + reach) + 1
        bands.append((int(lo), int(hi)))
    return np.asarray(bands, dtype=np.int64)


@dataclass(frozen=True)
class TileLayout:
    """Row strips of an object of ``height`` rows, one per worker (see the module docstring)."""

    height: int
    tiles: tuple

    @classmethod
    def from_chunks(cls, chunk_positions, workers_of_chunks, n: int, height: int, reach: float = 0.0,
                    margin: int = 0):
        """The layout for chunks (each an (B_c, 2) array of positions) held by workers
        ``workers_of_chunks`` (one index per chunk, 0 … W−1, every worker holding one or more);
        ``reach``: the largest position displacement, ``margin``: rows held beyond a worker's own
        in any case (inside the object)."""
        owner = np.asarray(workers_of_chunks, dtype=np.int64)
        w = int(owner.max()) + 1
        if sorted(set(owner.tolist())) != list(range(w)):
            raise ValueError(f"every worker 0..{w - 1} must hold a chunk; got workers {sorted(set(owner.tolist()))}")
        bands = np.clip(chunk_bands(chunk_positions, n, reach), 0, height)
        need = np.array([[bands[owner == k, 0].min(), bands[owner == k, 1].max()] for k in range(w)])
        centres = np.array([np.mean([p[:, 0].mean() for p, o in zip(chunk_positions, owner) if o == k])
                            for k in range(w)])
        order = np.argsort(centres, kind="stable")
        cuts = [0]
        for a, b in zip(order[:-1], order[1:]):
            cut = int(round((centres[a] + centres[b]) / 2))
            cuts.append(min(max(cut, cuts[-1]), height))
        cuts.append(height)
        tiles = [None] * w
        for i, k in enumerate(order):
            start, stop = cuts[i], cuts[i + 1]
            tiles[k] = Tile(int(k), start, stop, int(min(start, need[k, 0], max(start - margin, 0))),
                            int(max(stop, need[k, 1], min(stop + margin, height))))
        return cls(int(height), tuple(tiles))

    @property
    def n_workers(self) -> int:
        return len(self.tiles)

    def owner_of_rows(self) -> np.ndarray:
        """The owning worker of every row (height,)."""
        out = np.empty(self.height, dtype=np.int64)
        for t in self.tiles:
            out[t.start:t.stop] = t.worker
        return out

    def pieces(self, box: BoxedArray, strategy: str = "owner") -> dict:
        """``box`` cut into the pieces each worker receives: ``{worker: BoxedArray}`` — rows in a
        worker's strip (``"owner"``) or in its strip and halo (``"halo"``)."""
        if strategy not in ("owner", "halo"):
            raise ValueError(f"strategy must be 'owner' or 'halo', got {strategy!r}")
        (y0, x0), (y1, _) = box.offset, box.stop
        out = {}
        for t in self.tiles:
            lo, hi = (t.start, t.stop) if strategy == "owner" else (t.held_start, t.held_stop)
            a, b = max(lo, y0), min(hi, y1)
            if a < b:
                out[t.worker] = BoxedArray((a, x0), box.data[..., a - y0:b - y0, :])
        return out

    def rows_meant_for_others(self) -> int:
        """The most rows any worker would receive that are not its own pieces, were each worker
        sent the other workers' whole round results (every piece they cut, for every worker):
        ``Σ_w Σ_u rows held by w and by u``, over the workers ``w``, ``u`` other than it and
        each other (the rows a sender's sums can reach are the rows it holds)."""
        def overlap(a: Tile, b: Tile) -> int:
            return max(0, min(a.held_stop, b.held_stop) - max(a.held_start, b.held_start))

        return max((sum(overlap(w, u) for w in self.tiles for u in self.tiles
                        if len({w.worker, u.worker, v.worker}) == 3) for v in self.tiles), default=0)

    def received_bytes(self, boxes_by_worker: dict, bytes_per_pixel: float, strategy: str,
                       width: int | None = None, halo_bytes_per_pixel: float = 8.0) -> np.ndarray:
        """Bytes each worker receives in one round (W,) for the boxes (``(y0, x0, y1, x1)``) of
        the partial sums each worker formed (``{worker: [box, ...]}``, already summed per worker
        as the tree does) and ``bytes_per_pixel`` of the summed quantities; ``"owner"`` adds the
        halo refresh: ``width`` columns of the halo rows at ``halo_bytes_per_pixel`` (the object's
        complex64: what the next round's chunk steps read)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        w = self.n_workers
        received = np.zeros(w)
        for sender, boxes in boxes_by_worker.items():
            for (y0, x0, y1, x1) in boxes:
                cols = x1 - x0
                for t in self.tiles:
                    if t.worker == sender:
                        continue
                    if strategy == "replicas":
                        lo, hi = 0, self.height
                    elif strategy == "owner":
                        lo, hi = t.start, t.stop
                    else:
                        lo, hi = t.held_start, t.held_stop
                    rows = max(0, min(hi, y1) - max(lo, y0))
                    received[t.worker] += rows * cols * bytes_per_pixel
        if strategy == "owner" and width is not None:
            for t in self.tiles:
                received[t.worker] += t.halo_rows * width * halo_bytes_per_pixel
        return received
