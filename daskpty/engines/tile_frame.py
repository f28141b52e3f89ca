"""Where a tile of the object lies in the whole object, for the parts that need to know.

A worker that holds a row tile of the object (the execution layer's tiles) runs the
same chunk steps as one that holds all of it, with positions moved into the tile's frame by
whole rows (the sub-pixel fractions stay the same bits). Position refinement is the exception:
its per-pattern positions, the affine fit's normal equations and the window correction's centre
are in the whole object's frame, windows must stay inside the whole object, and the window
correction's resampling depends on where a pixel is. :class:`TileFrame` tells those parts where
the tile is; with no frame (None) the state holds the whole object.

The frame rides in the state's ``extra`` dict (:func:`frame_of`, :func:`with_frame`), so every
engine's state carries it without a field of its own. No dask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..faults import PositionsLeftTile  # noqa: F401 (also named here)
from ..physics.shifts import split_positions

_KEY = "tile_frame"


@dataclass(frozen=True)
class TileFrame:
    """A tile whose first row is row ``origin`` of an object of ``shape`` (H, W)."""

    origin: int
    shape: tuple

    def to_tile(self, positions, n: int, held_rows: int) -> np.ndarray:
        """Object-frame positions (B, 2) moved into the tile's frame (by whole rows: the same
        sub-pixel fractions); raises :class:`PositionsLeftTile` (one line) when a window would
        reach beyond the ``held_rows`` rows the tile holds."""
        moved = np.asarray(positions, np.float64) - np.array([self.origin, 0.0])
        corners, _ = split_positions(moved, n)
        rows = corners[:, 0]
        outside = (rows < 0) | (rows + n > held_rows)
        if outside.any():
            far = int(max(-rows.min(), rows.max() + n - held_rows))
            raise PositionsLeftTile(
                f"position refinement moved {int(outside.sum())} window(s) up to {far} rows beyond the "
                f"halo of their worker's tile (rows {self.origin}..{self.origin + held_rows}); raise "
                "max_displacement (it widens the halo), lower window_gain, or run with tiles=False")
        return moved

    def sums_to_object(self, part) -> None:
        """A chunk step's partial on the tile, its position sums moved back to the object's
        frame (the window correction's Σ positions; the rest does not depend on the frame)."""
        if "window_positions" in part.arrays:
            sums = np.array(part.arrays["window_positions"], np.float64)
            sums[0] += self.origin * sums[2]
            part.arrays["window_positions"] = sums


def frame_of(state) -> TileFrame | None:
    """The tile frame of a state (None: it holds the whole object)."""
    extra = getattr(state, "extra", None)
    return extra.get(_KEY) if isinstance(extra, dict) else None


def with_frame(state, frame: TileFrame | None) -> None:
    """Set (or, with None, clear) a state's tile frame (a new ``extra`` dict: copies share it)."""
    extra = {k: v for k, v in (getattr(state, "extra", None) or {}).items() if k != _KEY}
    if frame is not None:
        extra[_KEY] = frame
    state.extra = extra


def whole_shape(obj, frame: TileFrame | None) -> tuple:
    """The whole object's (H, W): the frame's, or ``obj``'s own."""
    return tuple(frame.shape) if frame is not None else tuple(obj.shape[-2:])


def step_positions(refined, frame: TileFrame | None, n: int, obj) -> np.ndarray:
    """The positions a chunk step on ``obj`` takes: ``refined`` (object frame) as they are, or
    moved into the tile's frame (see :meth:`TileFrame.to_tile`)."""
    return refined if frame is None else frame.to_tile(refined, n, int(obj.shape[-2]))


__all__ = ["PositionsLeftTile", "TileFrame", "frame_of", "step_positions", "whole_shape", "with_frame"]
