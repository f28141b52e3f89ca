"""Patch extraction from the object and its adjoint, the scatter-add of patches.

Both are single vectorised gathers/scatters per batch (no per-pattern Python loop).
"""
from __future__ import annotations

import numpy as np

from .backend import get_xp


def _flat_indices(corners, n: int, width: int, xp):
    c = xp.asarray(corners)
    ar = xp.arange(n)
    rows = c[:, 0, None] + ar[None, :]  # (B, n)
    cols = c[:, 1, None] + ar[None, :]
    return rows[:, :, None] * width + cols[:, None, :]  # (B, n, n)


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
    """Flat indices of the windows at ``corners`` (B, 2) of size n in arrays of shape ``shape``.

    Build once per batch and reuse for every gather and scatter on arrays of that shape (an
    index array of B·n² integers is as large as a batch of patches).
    """

    def __init__(self, corners, n: int, shape, xp=np):
        self.n = n
        self.shape = tuple(shape[-2:])
        self.flat = _flat_indices(corners, n, self.shape[-1], xp)  # (B, n, n)

    def extract(self, obj):
        """Gather the windows of ``obj`` (H, W) → (B, n, n)."""
        return obj.reshape(-1)[self.flat]

    def scatter_add(self, target, patches) -> None:
        """Add patches (B, n, n) into ``target`` (H, W) in place (adjoint of :meth:`extract`)."""
        _scatter_add_flat(target, self.flat.reshape(-1), patches.reshape(-1))


def extract_patches(obj, corners, n: int):
    """Gather windows ``obj[r:r+n, c:c+n]`` for corners (B, 2) → (B, n, n)."""
    xp = get_xp(obj)
    idx = _flat_indices(corners, n, obj.shape[-1], xp)
    return obj.reshape(-1)[idx]


def scatter_add_patches(target, corners, patches) -> None:
    """Adjoint of :func:`extract_patches`: add patches (B, n, n) into ``target`` in place.

    Overlapping windows accumulate. Works for real and complex targets.
    """
    xp = get_xp(target, patches)
    n = patches.shape[-1]
    idx = _flat_indices(corners, n, target.shape[-1], xp).reshape(-1)
    _scatter_add_flat(target, idx, patches.reshape(-1))


def _scatter_add_flat(target, idx, vals) -> None:
    xp = get_xp(target, vals)
    size = target.size
    if xp is np:
        if np.iscomplexobj(target):  # .real / .imag are writable views of the complex target
            target.real += np.bincount(idx, weights=vals.real, minlength=size).reshape(target.shape)
            target.imag += np.bincount(idx, weights=vals.imag, minlength=size).reshape(target.shape)
        else:
            target += np.bincount(idx, weights=vals, minlength=size).reshape(target.shape)
    else:  # CuPy: one atomic scatter kernel per real component
        import cupyx

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
