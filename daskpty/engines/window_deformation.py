"""The windows' deformation sums of position refinement, shared by both engines' chunk steps.

A scan whose positions carry a global scale or rotation error reconstructs a stretched or turned
object that the per-pattern shifts cannot see; inside each window the data still see it, as one
linear deformation L (2 × 2) of the window's content. :class:`WindowDeformation` sums the normal
equations of L over a chunk's patterns (tiny, additive: they ride the tree reduce);
:func:`~daskpty.engines.positions.fit_window` solves them once per epoch. No dask in here.
"""
from __future__ import annotations

import numpy as np

from ..physics.backend import to_numpy

#: The normal matrix (the curvature, no data residual in it) takes every GRAM_STRIDE-th pattern,
#: scaled to all of them: it is a smooth average (every 1st / 2nd pattern left LSQML's three noise
#: draws at 1.10 / 1.11 / 1.01× the true-position NRMSE, every 4th at 1.08 / 1.10 / 1.02×, every
#: 8th at 1.13 / 1.12 / 1.01×; thirteenth session).
GRAM_STRIDE = 4

#: The (a, c) pairs of the normal matrix's distinct rows: yy, yx, xx.
_PAIRS = ((0, 0), (0, 1), (1, 1))


def wants_window_sums(positions) -> bool:
    """Whether a refining chunk step forms the window sums (both engines): with the window
    correction on (``window_gain`` > 0). They take every pattern's right-hand side: on every 2nd
    pattern (with ``window_scale``, twelfth and thirteenth sessions) AD from the store's probe
    reached 1.20× / 0.081 px against 1.15× / 0.070 and LSQML's three noise draws 1.30 / 1.20 /
    1.17× against 1.08 / 1.10 / 1.02× (576 × 64², 1 px + 1.5 % + 0.5°): the estimate's noise is
    applied every epoch (``window_gain``), so its global warps add up."""
    return bool(positions.window_gain)


def _real_view(a):
    """(B, n, n) complex as (B, 2n²) real, (re, im) interleaved, without a copy."""
    return a.view(a.real.dtype).reshape(a.shape[0], -1)


class WindowDeformation:
    """The normal equations of one linear deformation L (2 × 2) of every pattern's object
    window, summed over a chunk's patterns (for :func:`~.positions.fit_window`).

    Sampling the object at u + L u instead of u (u the pixel's offset from the window centre)
    changes the exit wave by Σ_ab L_ab u_b ∂_a O · S_f P, so with the products the position
    shift already forms, b_ab = Re Σ_j Σ_u u_b conj(∂_a O_j) g_j and
    G_(ab),(cd) = Σ_j Σ_u u_b u_d Re(conj(∂_a O_j) ∂_c O_j) Σ_k |S_f P_jk|².

    b needs no per-pattern product: with x = c_j + u the box pixel of window j (centre c_j),
    u_b = x_b − c_jb, so b_ab = Re Σ_x x_b conj(∂_a O(x)) Σ_j g_j(x) − Σ_j c_jb s_ja, where
    Σ_j g_j is the chunk's scattered object gradient and s_ja = Re⟨∂_a O_j, g_j⟩ the shift
    numerator (:meth:`add_first`, once per chunk on the box). G is ∂_a O_j · (w_j ∂_c O_j),
    summed over patterns first, against the fixed weights (u_y², u_y u_x, u_x²), on every
    ``gram_stride``-th pattern (:meth:`add_gram`). The sums stay where the arrays are (no host
    sync until :meth:`sums`).
    """

    def __init__(self, n: int, xp, gram_stride: int = GRAM_STRIDE):
        self.xp = xp
        self.n = n
        self.gram_stride = max(1, int(gram_stride))
        c = np.arange(n) - (n - 1) / 2.0
        uy, ux = (u.ravel() for u in np.meshgrid(c, c, indexing="ij"))
        # every weight twice: the real views interleave (re, im), and Re(conj a b) = a.re b.re + a.im b.im
        self.second_weights = xp.asarray(np.repeat(np.stack([uy * uy, uy * ux, ux * ux], 1), 2, axis=0),
                                         dtype=np.float32)                                  # (2n², 3)
        self.first = xp.zeros((2, 2))    # b_ab, float64
        self.second = xp.zeros((3, 3))   # rows (a, c) = yy, yx, xx; columns (b, d) = yy, yx, xx

    def add_first(self, box_d, scattered, corners, numerators) -> None:
        """The first moments b of a chunk, on its box: ``box_d`` (∂_y O, ∂_x O) on the box,
        ``scattered`` Σ_j g_j on the same box, ``corners`` (B, 2) the windows' corners in it and
        ``numerators`` (B, 2) every pattern's s_ja = Re⟨∂_a O_j, g_j⟩. Float64, about the box
        centre (the two terms nearly cancel)."""
        xp = self.xp
        h, w = scattered.shape[-2:]
        origin = np.array([(h - 1) / 2.0, (w - 1) / 2.0])
        centres = xp.asarray(np.asarray(corners, np.float64) + (self.n - 1) / 2.0 - origin)       # c_j
        ys = xp.arange(h, dtype=np.float64) - origin[0]
        xs = xp.arange(w, dtype=np.float64) - origin[1]
        g = scattered.astype(np.complex128, copy=False)
        s = xp.asarray(numerators, dtype=np.float64)
        for a in range(2):
            r = (xp.conj(box_d[a].astype(np.complex128, copy=False)) * g).real    # Re conj(∂_a O) Σ g
            self.first[a, 0] += ys @ r.sum(axis=1) - centres[:, 0] @ s[:, a]
            self.first[a, 1] += r.sum(axis=0) @ xs - centres[:, 1] @ s[:, a]

    def add_gram(self, d, w, start: int = 0) -> None:
        """The normal matrix's share of one sub-batch starting at pattern ``start`` of the chunk
        (every ``gram_stride``-th pattern): ``d`` the windows of (∂_y O, ∂_x O), ``w`` Σ_k |S_f P_k|²."""
        pick = slice((-start) % self.gram_stride, w.shape[0], self.gram_stride)
        if pick.start >= w.shape[0]:
            return
        d = (d[0][pick], d[1][pick])
        w = w[pick]
        ones = self.xp.ones(w.shape[0], w.dtype)
        views = [_real_view(x) for x in d]
        weighted = [_real_view(x * w) for x in d]             # w_j ∂_c O_j (w real: scales re and im)
        weights = self.second_weights.astype(w.dtype, copy=False)
        for row, (a, c) in enumerate(_PAIRS):
            per_pixel = ones @ (views[a] * weighted[c])        # Σ_j over the picked patterns
            self.second[row] += per_pixel @ weights

    def sums(self, positions) -> dict:
        """The chunk's additive sums (host, float64), with Σ positions and their count."""
        first = np.asarray(to_numpy(self.first), np.float64)                       # (a, b)
        second = np.asarray(to_numpy(self.second), np.float64) * self.gram_stride
        pair = {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 2}
        gram = np.empty((4, 4))
        for a in range(2):
            for b in range(2):
                for c in range(2):
                    for d in range(2):
                        gram[2 * a + b, 2 * c + d] = second[pair[a, c], pair[b, d]]
        pos = np.asarray(positions, np.float64)
        return {"window_num": first.reshape(4), "window_gram": gram,
                "window_positions": np.r_[pos.sum(axis=0), len(pos)]}
