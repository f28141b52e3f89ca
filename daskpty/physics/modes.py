"""Incoherent probe modes: orthogonalisation and power fractions."""
from __future__ import annotations

import numpy as np

from .backend import get_xp


def orthogonalize_modes(probe):
    """Orthogonalise probe modes (M, n, n) by SVD, strongest first.

    The mutual intensity Σ_k P_k P_kᴴ (and so every model intensity) is unchanged.
    """
    xp = get_xp(probe)
    m = probe.shape[0]
    if m == 1:
        return probe
    a = probe.reshape(m, -1).astype(np.complex128)
    _, s, vh = xp.linalg.svd(a, full_matrices=False)
    return (s[:, None] * vh).reshape(probe.shape).astype(probe.dtype)


def mode_powers(probe):
    """Fraction of the total power in each mode (M,)."""
    xp = get_xp(probe)
    p = (xp.abs(probe.astype(np.complex128)) ** 2).sum(axis=(-2, -1))
    return p / p.sum()
