"""The windows' deformation sums of position refinement, shared by both engines' chunk steps.

A scan whose positions carry a global scale or rotation error reconstructs a stretched or turned
object that the per-pattern shifts cannot see; inside each window the data still see it, as one
linear deformation L (2 × 2) of the window's content. :class:`WindowDeformation` sums the normal
equations of L over a chunk's patterns (tiny, additive: they ride the tree reduce);
:func:`~daskpty.engines.positions.fit_window` solves them once per epoch. No dask in here.
"""
from __future__ import annotations

import numpy as np

from ..physics.backend import real_dots, to_numpy

#: The window deformation's sums take every WINDOW_STRIDE-th pattern of a chunk when only the
#: rotation is corrected (its estimate is robust: stride 4 leaves 0.747 px where 1 left 0.741
#: on the 576 × 64² case); the scale (``window_scale``) needs every pattern (stride 2 and 4 left
#: 0.66 and 0.85 px where 1 left 0.52).
WINDOW_STRIDE = 4

#: The normal matrix (the curvature, no data residual in it) takes every GRAM_STRIDE-th pattern
#: at least, scaled to the patterns of the right-hand side: it is a smooth average, and its
#: products were three fifths of the sums' cost.
GRAM_STRIDE = 4

#: The (a, c) pairs of the normal matrix's distinct rows: yy, yx, xx.
_PAIRS = ((0, 0), (0, 1), (1, 1))


def window_sum_stride(positions) -> int:
    """Every how many patterns a refining chunk step forms the window sums (both engines): 0
    without the window correction, 1 with ``window_scale``, else :data:`WINDOW_STRIDE`. AD
    needs every pattern for the scale as LSQML does: every 4th or 2nd left 0.184 / 0.161 px
    where every one left 0.056 px (576 × 64², 1 px + 1.5 % + 0.5°, noise draw 2, 150 epochs),
    and forming the sums only every other epoch 0.124 px where every epoch left 0.061 (draw 1,
    from the store's probe). Re-measured with the sums as one product (thirteenth session),
    every 2nd pattern: AD draws 1 / 2 unchanged (1.12 / 1.14×), but from the store's probe
    1.20× / 0.081 px against 1.15× / 0.070; LSQML draws 1 / 2 / 3 (calibration probe)
    1.30 / 1.20 / 1.17× against 1.08 / 1.10 / 1.02×. The estimate's noise is applied every
    epoch (``window_gain``), so its global warps add up."""
    if not positions.window_gain:
        return 0
    return 1 if positions.window_scale else WINDOW_STRIDE


def _real_view(a):
    """(B, n, n) complex64 as (B, 2n²) float32, (re, im) interleaved, without a copy."""
    return a.view(np.float32).reshape(a.shape[0], -1)


class WindowDeformation:
    """The normal equations of one linear deformation L (2 × 2) of every pattern's object
    window, summed over a chunk's patterns (for :func:`~.positions.fit_window`).

    Sampling the object at u + L u instead of u (u the pixel's offset from the window centre)
    changes the exit wave by Σ_ab L_ab u_b ∂_a O · S_f P, so with the products the position
    shift already forms, b_ab = Re Σ_j Σ_u u_b conj(∂_a O_j) g_j and
    G_(ab),(cd) = Σ_j Σ_u u_b u_d Re(conj(∂_a O_j) ∂_c O_j) Σ_k |S_f P_jk|².

    Both are one element-wise product of real views and one matrix product with fixed pixel
    weights: for b, ∂_a O_j · g_j against the columns (1, u_y, u_x), which also gives LSQML's
    shift numerator Re⟨∂_a O_j, g_j⟩ (:meth:`numerators`); for G, ∂_a O_j · (w_j ∂_c O_j)
    summed over patterns first, against (u_y², u_y u_x, u_x²), on every ``gram_stride``-th
    pattern only. The sums stay where the arrays are (no host sync until :meth:`sums`).
    """

    def __init__(self, n: int, xp, stride: int = WINDOW_STRIDE, gram_stride: int = GRAM_STRIDE):
        self.xp = xp
        self.stride = max(1, int(stride))
        self.gram_stride = max(self.stride, int(gram_stride))
        c = np.arange(n) - (n - 1) / 2.0
        uy, ux = (u.ravel() for u in np.meshgrid(c, c, indexing="ij"))
        # every weight twice: the real views interleave (re, im), and Re(conj a b) = a.re b.re + a.im b.im
        moments = np.stack([np.ones_like(uy), uy, ux], 1)                         # (1, u_y, u_x)
        self.moments = xp.asarray(np.repeat(moments, 2, axis=0), dtype=np.float32)          # (2n², 3)
        self.second_weights = xp.asarray(np.repeat(np.stack([uy * uy, uy * ux, ux * ux], 1), 2, axis=0),
                                         dtype=np.float32)                                  # (2n², 3)
        self.first = xp.zeros((2, 2))    # b_ab, float64
        self.second = xp.zeros((3, 3))   # rows (a, c) = yy, yx, xx; columns (b, d) = yy, yx, xx
        self._product = None

    def _pick(self, start: int, b: int, stride: int) -> slice:
        return slice((-start) % stride, b, stride)

    def _products(self, d, g):
        """(2, B, 3) float32: Re Σ_u (1, u_y, u_x) conj(∂_a O_j) g_j for a = y, x."""
        b = g.shape[0]
        gv = _real_view(g)
        if self._product is None or self._product.shape[1] < gv.shape[1] or self._product.shape[0] < b:
            self._product = self.xp.empty((max(b, 1), gv.shape[1]), np.float32)
        prod = self._product[:b]
        out = []
        for a in range(2):
            self.xp.multiply(_real_view(d[a]), gv, out=prod)
            out.append(prod @ self.moments)
        return out

    def numerators(self, d, g, start: int = 0):
        """LSQML's shift numerators Re⟨∂_a O_j, g_j⟩ of every pattern of one sub-batch starting at
        pattern ``start`` of the chunk ((B, 2) float64; ``d`` the windows of (∂_y O, ∂_x O)), and
        the first moments b of every ``stride``-th pattern added on the way."""
        if self.stride > 1:  # batched BLAS dots for all, the moments' products on the picked only
            self.add_first(d, g, start)
            return self.xp.stack([real_dots(d[0], g), real_dots(d[1], g)], axis=1)
        out = self._products(d, g)
        for a in range(2):
            self.first[a] += out[a][:, 1:].sum(axis=0, dtype=np.float64)
        return self.xp.stack([out[0][:, 0], out[1][:, 0]], axis=1).astype(np.float64)

    def add_first(self, d, g, start: int = 0) -> None:
        """The first moments b of every ``stride``-th pattern of one sub-batch."""
        pick = self._pick(start, g.shape[0], self.stride)
        if pick.start < g.shape[0]:
            out = self._products((d[0][pick], d[1][pick]), g[pick])
            for a in range(2):
                self.first[a] += out[a][:, 1:].sum(axis=0, dtype=np.float64)

    def add(self, d, g, w, start: int = 0) -> None:
        """One sub-batch starting at pattern ``start`` of the chunk: ``d`` the windows of
        (∂_y O, ∂_x O), ``g`` and ``w`` as in the shift. Only every ``stride``-th
        pattern of the chunk is summed (every ``gram_stride``-th for the normal matrix): L is
        one global quantity."""
        self.add_first(d, g, start)
        self.add_gram(d, w, start)

    def add_gram(self, d, w, start: int = 0) -> None:
        """The normal matrix's share of one sub-batch (every ``gram_stride``-th pattern)."""
        pick = self._pick(start, w.shape[0], self.gram_stride)
        if pick.start >= w.shape[0]:
            return
        d = (d[0][pick], d[1][pick])
        w = w[pick]
        ones = self.xp.ones(w.shape[0], np.float32)
        views = [_real_view(x) for x in d]
        weighted = [_real_view(x * w) for x in d]             # w_j ∂_c O_j (w real: scales re and im)
        for row, (a, c) in enumerate(_PAIRS):
            per_pixel = ones @ (views[a] * weighted[c])        # Σ_j over the picked patterns
            self.second[row] += per_pixel @ self.second_weights

    def sums(self, positions) -> dict:
        """The chunk's additive sums (host, float64), with Σ positions and their count."""
        first = np.asarray(to_numpy(self.first), np.float64)                       # (a, b)
        second = np.asarray(to_numpy(self.second), np.float64) * (self.gram_stride / self.stride)
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
