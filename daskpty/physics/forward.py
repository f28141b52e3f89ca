"""The ptychographic forward model, assembled from the operators of this package.

ψ_jk = S_{f_j}(P_k) · O[r_j window],   Ψ_jk = F ψ_jk,   ŷ_j = Σ_k |Ψ_jk|²   (DC at index 0).
"""
from __future__ import annotations

import numpy as np

from .backend import get_xp
from .patches import check_windows_inside, extract_patches
from .propagation import far_field
from .shifts import shift_probe, shift_ramps, split_positions


def exit_waves(obj, probe, corners, ramps):
    """Exit waves for one batch.

    Returns ``(psi, shifted_probe, obj_patches)`` with shapes (B, M, n, n), (B, M, n, n), (B, n, n).
    """
    n = probe.shape[-1]
    obj_patches = extract_patches(obj, corners, n)
    shifted = shift_probe(probe, ramps)
    return shifted * obj_patches[:, None], shifted, obj_patches


def model_intensities(obj, probe, positions):
    """Model diffraction intensities (B, n, n) float32, zero frequency at index 0.

    ``obj`` (H, W) complex, ``probe`` (M, n, n) complex (or (n, n)), ``positions`` (B, 2) (y, x)
    in object pixels. Apply ``numpy.fft.fftshift(..., axes=(-2, -1))`` for the recorded, DC-centred
    layout.
    """
    xp = get_xp(obj, probe)
    probe = xp.asarray(probe, dtype=np.complex64)
    if probe.ndim == 2:
        probe = probe[None]
    n = probe.shape[-1]
    corners, fractions = split_positions(positions, n)
    check_windows_inside(corners, n, obj.shape)
    ramps = shift_ramps(fractions, n, xp)
    psi, _, _ = exit_waves(xp.asarray(obj, dtype=np.complex64), probe, corners, ramps)
    far = far_field(psi)
    return (far.real**2 + far.imag**2).sum(axis=1).astype(np.float32)
