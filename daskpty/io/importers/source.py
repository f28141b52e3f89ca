"""Pattern sources: a uniform way to read patterns [start, stop) of a detector window."""
from __future__ import annotations

import numpy as np

from ..validate import fail


class Source:
    """Detector frames to import: ``shape`` (N, H, W), ``dtype``, ``read(start, stop, window)``.

    ``window`` = (y0, y1, x0, x1) in detector pixels (None: the whole frame). Subclasses read only
    what is asked for, so an import never holds more than a few shards in memory.
    """

    shape: tuple[int, int, int]
    dtype: np.dtype
    name: str = "?"

    def read(self, start: int, stop: int, window=None) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class ArraySource(Source):
    """Frames from anything sliceable as (N, H, W): an h5py dataset, a NumPy memmap.

    ``rows``/``cols`` restrict every frame first (e.g. EMPAD's 128 detector rows of 130).
    """

    def __init__(self, array, name: str, *, rows: int | None = None, closer=None):
        if array.ndim not in (3, 4):
            fail(f"{name} has shape {tuple(array.shape)}; expected a stack of 2-D frames (N, H, W) "
                 f"or a raster of them (rows, cols, H, W)")
        self.array, self.name, self._closer = array, name, closer
        *lead, h, w = (int(s) for s in array.shape)
        self._cols = lead[1] if len(lead) == 2 else None  # a (rows, cols, H, W) raster
        self.shape = (int(np.prod(lead)), rows if rows is not None else h, w)
        self.dtype = np.dtype(array.dtype)

    def read(self, start, stop, window=None):
        y0, y1, x0, x1 = window or (0, self.shape[1], 0, self.shape[2])
        if self._cols is None:
            return np.asarray(self.array[start:stop, y0:y1, x0:x1])
        parts, i = [], start
        while i < stop:  # one scan row at a time
            r, c = divmod(i, self._cols)
            j = min(stop, (r + 1) * self._cols)
            parts.append(np.asarray(self.array[r, c:c + j - i, y0:y1, x0:x1]))
            i = j
        return np.concatenate(parts)

    def close(self):
        if self._closer is not None:
            self._closer()
            self._closer = None


def check_frames(shape, name: str) -> None:
    n, h, w = shape
    if n == 0:
        fail(f"{name} holds no frames")
    if h == 0 or w == 0:
        fail(f"{name} has empty {h} x {w} frames")
