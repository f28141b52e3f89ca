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
    vals = patches.reshape(-1)
    size = target.size
    if xp is np:
        if np.iscomplexobj(target):
            acc = (np.bincount(idx, weights=vals.real, minlength=size)
                   + 1j * np.bincount(idx, weights=vals.imag, minlength=size))
        else:
            acc = np.bincount(idx, weights=vals, minlength=size)
        target += acc.reshape(target.shape).astype(target.dtype, copy=False)
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
