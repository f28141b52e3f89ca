"""Position refinement's sums through K slices and to a near-field detector (no dask).

Every sum here is linear in the exit wave's change d when the windows move on the object while
the beam stays: every slice's window moves together, so d = Σ_k T_k(δO_k · φ_k), δO_k the change
of slice k's window, φ_k its incident waves and T_k the remaining slices
(:func:`daskpty.physics.multislice.transmit`), followed by the detector. Two kinds of move:

* a shift along axis a: δO_k = ∂_a O_k (:func:`position_sums`' shift terms, per pattern);
* the windows' deformation L (2 × 2), sampling the object at u + L u (u the pixel's offset from the
  window centre): δO_k = Σ_ab L_ab u_b ∂_a O_k (the normal equations of
  :class:`~.window_deformation.WindowDeformation`, summed over the chunk).

The right-hand sides Re⟨d, χ⟩ = Σ_k Re⟨δO_k, g_k⟩ come from the slices' gradients g_k (the
adjoint chain the engine ran already), the norms ‖d‖² are formed at the detector, carried
through the slices (with one slice in the far field they reduce to the single-slice forms).
"""
from __future__ import annotations

import numpy as np

from ..physics.backend import real_dots, to_numpy
from ..physics.multislice import detector_forward
from ..physics.propagation import angular_spectrum
from .window_deformation import GRAM_STRIDE, WindowDeformation

#: (a, b) of L_ab in the order of the normal equations' unknowns (row-major L).
_PAIRS = ((0, 0), (0, 1), (1, 0), (1, 1))


def _carried(c, moves, incident, pick=slice(None)):
    """The detected change d = D Σ_k T_k(δO_k · φ_k) of the patterns ``pick`` (b, M, n, n) for
    the windows' changes ``moves`` (K arrays (b, n, n)), carried forward slice by slice."""
    change = moves[0][:, None] * incident[0][pick]
    for k in range(1, c.n_slices):
        change = angular_spectrum(change, c.kernel) * c.patches[k][pick][:, None]
        change += moves[k][:, None] * incident[k][pick]
    if c.detector is not None:
        change = detector_forward(change, c.detector[pick])
    return change


def position_sums(c, grads, incident, *, scattered=None, positions=None, gram_stride: int = GRAM_STRIDE):
    """The LSQML position shift's terms of every pattern and, with ``scattered``, the windows'
    deformation sums of the chunk.

    ``c`` a :class:`~.multislice.SliceChunk`; ``grads`` (K, B, n, n) the slices' gradients
    g_k = Σ_m conj(φ_km) T_k†χ; ``incident`` (K, B, M, n, n). Returns ``(shift_terms, window)``:
    shift_terms the numerator Re⟨d_a, χ⟩ and denominator ‖d_a‖² ((B, 2) float64 each, on the
    host; :func:`~.positions.lsqml_shift`); window None, or the sums of
    :meth:`WindowDeformation.sums` (``scattered`` (K, h, w): the g_k scattered on the box, not
    yet scaled; ``positions`` (B, 2) the chunk's): b_ab = Σ_k Re Σ_j Σ_u u_b conj(∂_a O_kj) g_kj on
    the box (:meth:`WindowDeformation.add_first`, slice by slice) and the normal matrix
    G_(ab),(cd) = Σ_j Re⟨d_ab, d_cd⟩ on every ``gram_stride``-th pattern (scaled to all), d_ab
    the detected change of the move u_b ∂_a O_k carried through the slices — exact where the
    single slice's box form (Σ_k |S_f P_k|² per pixel) holds only for one slice in the far field.

    Moving the probe over the windows instead differs by a translation of the exit wave, to
    which far-field intensities are blind but whose norm would swamp ‖d_a‖²."""
    xp, n_slices = c.xp, c.n_slices
    box_d = c.box_gradients()
    windows = [[c.index.extract(xp.ascontiguousarray(box_d[k][a])) for k in range(n_slices)] for a in range(2)]
    per_slice = [xp.stack([real_dots(windows[a][k], grads[k]) for a in range(2)], axis=1) for k in range(n_slices)]
    num = to_numpy(sum(per_slice))
    den = np.stack([to_numpy(real_dots(d, d)) for d in (_carried(c, windows[a], incident) for a in range(2))], axis=1)
    if scattered is None:
        return (num, den), None
    deform = WindowDeformation(c.n, xp, None, gram_stride)
    for k in range(n_slices):
        deform.add_first(scattered[k], c.index.corners, per_slice[k], box_d=box_d[k])
    return (num, den), deform.sums(positions, gram=window_gram(c, windows, incident, gram_stride))


def window_gram(c, windows, incident, gram_stride: int = GRAM_STRIDE) -> np.ndarray:
    """G_(ab),(cd) = Σ_j Re⟨d_ab, d_cd⟩ (4, 4) float64 on every ``gram_stride``-th pattern, times
    ``gram_stride`` (the single slice's sampling), d_ab the detected change of the windows' move
    u_b ∂_a O_k (``windows[a][k]``: the (B, n, n) windows of ∂_a O_k)."""
    xp, n = c.xp, c.n
    pick = slice(0, None, max(1, int(gram_stride)))
    u = xp.asarray(np.arange(n) - (n - 1) / 2.0, dtype=windows[0][0].real.dtype)
    offsets = (u[:, None], u[None, :])
    changes = []
    for a, b in _PAIRS:
        moved = [offsets[b] * windows[a][k][pick] for k in range(c.n_slices)]
        change = _carried(c, moved, incident, pick)
        changes.append(change.reshape(change.shape[0], -1))
    gram = np.empty((4, 4))
    for i in range(4):
        for j in range(i, 4):
            gram[i, j] = gram[j, i] = float(to_numpy(real_dots(changes[i], changes[j])).sum())
    return gram * max(1, int(gram_stride))
