"""Patch extraction from the object and its adjoint, the scatter-add of patches.

Each is one vectorised call per batch, no per-pattern Python loop: the gather indexes a strided
view of all n × n windows (CPU) or a flat index (GPU); the scatter-add is ``np.add.at`` on the
CPU (unbuffered, so overlapping windows accumulate, in index order: deterministic) and
``cupyx.scatter_add`` on the GPU, both driven by a flat index built once per batch.
"""
from __future__ import annotations

import numpy as np

from .backend import get_xp


def _flat_indices(corners, n: int, shape, xp):
    """Flat indices (B, n, n) of the windows' pixels in an array of ``shape`` (int32 when it fits)."""
    itype = np.int32 if shape[-2] * shape[-1] < 2**31 else np.int64
    c = xp.asarray(corners).astype(itype)
    ar = xp.arange(n, dtype=itype)
    rows = c[:, 0, None] + ar[None, :]  # (B, n)
    cols = c[:, 1, None] + ar[None, :]
    return (rows * itype(shape[-1]))[:, :, None] + cols[:, None, :]


def check_windows_inside(corners, n: int, shape) -> None:
    """Raise ValueError when a probe window leaves an array of ``shape`` (H, W)."""
    corners = np.asarray(corners)
    if corners.size == 0:
        return
    lo = corners.min(axis=0)
    hi = corners.max(axis=0) + n
    if lo[0] < 0 or lo[1] < 0 or hi[0] > shape[-2] or hi[1] > shape[-1]:
        raise ValueError(
            f"probe windows span rows {lo[0]}..{hi[0]} and columns {lo[1]}..{hi[1]}, outside the "
            f"object of shape {tuple(shape[-2:])}; enlarge the object or shift the positions"
        )


class PatchIndex:
    """Windows at ``corners`` (B, 2) of size n in arrays of shape ``shape``.

    Build once per batch and reuse for every gather and scatter on arrays of that shape (the flat
    index, B·n² integers, is built on first use). ``batch`` (a slice of the patterns) restricts a
    call to a sub-batch.
    """

    def __init__(self, corners, n: int, shape, xp=np):
        self.n = n
        self.shape = tuple(shape[-2:])
        self.xp = xp
        self.corners = np.asarray(_host(corners), dtype=np.int64).reshape(-1, 2)
        self._flat = None
        c = self.corners
        # The window view needs windows inside the array (a flat index wraps into the next row).
        self._inside = c.size == 0 or bool(c.min() >= 0 and c[:, 0].max() + n <= self.shape[0]
                                           and c[:, 1].max() + n <= self.shape[1])

    @property
    def flat(self):
        """Flat indices (B, n, n) of every window pixel."""
        if self._flat is None:
            self._flat = _flat_indices(self.xp.asarray(self.corners), self.n, self.shape, self.xp)
        return self._flat

    def extract(self, obj, batch: slice = slice(None), out=None):
        """Gather the windows of ``obj`` (H, W) → (b, n, n).

        ``out``: a buffer the flat-index gather writes into (GPU, or windows leaving the array);
        the window-view gather on the CPU returns a new array. Always use the returned array.
        """
        if self.xp is np and self._inside:
            c = self.corners[batch]
            return np.lib.stride_tricks.sliding_window_view(obj, (self.n, self.n))[c[:, 0], c[:, 1]]
        if out is not None and out.dtype == obj.dtype:
            return self.xp.take(obj.reshape(-1), self.flat[batch], out=out)
        return obj.reshape(-1)[self.flat[batch]]

    def scatter_add(self, target, patches, batch: slice = slice(None)) -> None:
        """Add patches (b, n, n) into ``target`` (H, W) in place (adjoint of :meth:`extract`).
        A target on the CPU takes one slice-add per window, in order: the same additions
        as ``np.add.at`` in the same order (the same bits), 1.5–1.6× faster."""
        if self.xp is np and self._inside and target.dtype.kind in "fc" and patches.ndim == 3:
            n = self.n
            values = patches.astype(target.dtype, copy=False)
            for (r, c), window in zip(self.corners[batch].tolist(), values):
                target[r:r + n, c:c + n] += window
            return
        _scatter_add_flat(target, self.flat[batch].reshape(-1), patches.reshape(-1))


def _host(a):
    return a.get() if hasattr(a, "get") else a


def extract_patches(obj, corners, n: int):
    """Gather windows ``obj[r:r+n, c:c+n]`` for corners (B, 2) → (B, n, n)."""
    return PatchIndex(corners, n, obj.shape, get_xp(obj)).extract(obj)


def scatter_add_patches(target, corners, patches) -> None:
    """Adjoint of :func:`extract_patches`: add patches (B, n, n) into ``target`` in place.

    Overlapping windows accumulate. Works for real and complex targets.
    """
    PatchIndex(corners, patches.shape[-1], target.shape, get_xp(target, patches)).scatter_add(target, patches)


def _scatter_add_flat(target, idx, vals) -> None:
    xp = get_xp(target, vals)
    size = target.size
    if xp is np:
        np.add.at(target.reshape(-1), idx, vals.astype(target.dtype, copy=False))
    else:  # CuPy: one atomic scatter kernel per real component
        import cupyx  # lazy: optional GPU dependency

        if xp.iscomplexobj(target):
            real_dtype = xp.float32 if target.dtype == xp.complex64 else xp.float64
            acc = xp.zeros(2 * size, dtype=real_dtype)
            cupyx.scatter_add(acc, 2 * idx, vals.real.astype(real_dtype))
            cupyx.scatter_add(acc, 2 * idx + 1, vals.imag.astype(real_dtype))
            target += acc.view(target.dtype).reshape(target.shape)
        else:
            acc = xp.zeros(size, dtype=target.dtype)
            cupyx.scatter_add(acc, idx, vals.astype(target.dtype))
            target += acc.reshape(target.shape)
