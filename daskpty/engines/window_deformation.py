"""The windows' deformation sums of position refinement, shared by both engines' chunk steps.

A scan whose positions carry a global scale or rotation error reconstructs a stretched or turned
object that the per-pattern shifts cannot see; inside each window the data still see it, as one
linear deformation L (2 × 2) of the window's content. :class:`WindowDeformation` sums the normal
equations of L over a chunk's patterns (tiny, additive: they ride the tree reduce);
:func:`~daskpty.engines.positions.fit_window` solves them once per epoch. No dask in here.
"""
from __future__ import annotations

import functools

import numpy as np

from .tile_frame import whole_shape
from ..physics.backend import get_xp, to_numpy
from .positions import central_gradients

#: The normal matrix (the curvature, no data residual in it) takes every GRAM_STRIDE-th pattern,
#: scaled to all of them: it is a smooth average (on LSQML's three noise draws of
#: bench_positions.py every 4th is as good as every pattern; every 8th is worse).
GRAM_STRIDE = 4


def wants_window_sums(positions, epoch: int) -> bool:
    """Whether a refining chunk step of ``epoch`` forms the window sums (both engines): with the
    window correction on (``window_gain`` > 0), in the first epoch of refinement and every
    ``window_every``-th after it. They take every pattern's right-hand side: the estimate's
    noise is applied every epoch (``window_gain``), so its global warps add up, and a sample of
    the patterns costs accuracy (docs/benchmarks.md, bench_positions.py). Every 2nd *epoch* with
    twice the gain keeps AD's figures (``PositionOptions.window_every``)."""
    if not positions.window_gain or not positions.active(epoch):
        return False
    return (epoch - positions.start_epoch) % (positions.window_every or 1) == 0


@functools.lru_cache(maxsize=8)
def _offset_products(n: int) -> np.ndarray:
    """(n², 3) float64: u_y², u_y u_x, u_x² of every window pixel's offset from the centre."""
    c = np.arange(n) - (n - 1) / 2.0
    uy, ux = (u.ravel() for u in np.meshgrid(c, c, indexing="ij"))
    weights = np.stack([uy * uy, uy * ux, ux * ux], 1)
    weights.flags.writeable = False
    return weights


def squared_gradients(box_d, xp):
    """|∂_y O|² + i |∂_x O|² on a chunk's box, from ``box_d`` (∂_y O, ∂_x O): two real images
    packed in one complex64 array, so that one gather per pattern takes both (LSQML's shift
    denominators, :func:`~daskpty.physics.backend.channel_dots`, and the normal matrix); also
    of a sub-batch's windows."""
    dy, dx = box_d
    packed = xp.empty(dy.shape, np.complex64)
    parts = packed.view(np.float32).reshape(dy.shape + (2,))     # (re, im): NumPy and CuPy alike
    for channel, d in enumerate((dy, dx)):
        part = xp.square(d.real)
        part += xp.square(d.imag)
        parts[..., channel] = part
    return packed


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
    numerator (:meth:`add_first`, once per chunk on the box). G needs only the three real
    products Re(conj(∂_a O) ∂_c O) (|∂_y O|², |∂_x O|² and the cross term) of each window, times
    w_j, summed over patterns pixel by pixel on every ``gram_stride``-th pattern
    (:meth:`add_gram`, from the windows the chunk step gathered), and
    weighted by (u_y², u_y u_x, u_x²) once per chunk (:meth:`sums`). The sums stay where the arrays are (no host sync until
    :meth:`sums`).

    ``box_d``: (∂_y O, ∂_x O) on the chunk's box (or None: given to :meth:`add_first` instead,
    as K slices do, one slice at a time).
    """

    def __init__(self, n: int, xp, box_d, gram_stride: int = GRAM_STRIDE):
        self.xp = xp
        self.n = n
        self.gram_stride = max(1, int(gram_stride))
        self.box_d = box_d
        self.first = xp.zeros((2, 2))    # b_ab, float64
        self.per_pixel = xp.zeros((n * n, 3), np.float32)   # Σ_j w_j · (|∂_y O|², cross, |∂_x O|²) windows

    def add_first(self, scattered, corners, numerators, box_d=None) -> None:
        """The first moments b of a chunk, on its box: ``scattered`` Σ_j g_j on the box,
        ``corners`` (B, 2) the windows' corners in it and ``numerators`` (B, 2) every pattern's
        s_ja = Re⟨∂_a O_j, g_j⟩ (``box_d``: the (∂_y O, ∂_x O) they are of, if not the
        constructor's). About the box centre (the two terms nearly cancel): the
        products in single precision like the numerators' own, every sum in float64."""
        xp = self.xp
        box_d = self.box_d if box_d is None else box_d
        h, w = scattered.shape[-2:]
        origin = np.array([(h - 1) / 2.0, (w - 1) / 2.0])
        centres = xp.asarray(np.asarray(corners, np.float64) + (self.n - 1) / 2.0 - origin)       # c_j
        ys = xp.arange(h, dtype=np.float64) - origin[0]
        xs = xp.arange(w, dtype=np.float64) - origin[1]
        s = xp.asarray(numerators, dtype=np.float64)
        r = xp.empty((h, w), scattered.real.dtype)
        for a in range(2):
            d = box_d[a]
            xp.multiply(d.real, scattered.real, out=r)                     # Re conj(∂_a O) Σ g
            r += d.imag * scattered.imag
            self.first[a, 0] += ys @ r.sum(axis=1, dtype=np.float64) - centres[:, 0] @ s[:, a]
            self.first[a, 1] += r.sum(axis=0, dtype=np.float64) @ xs - centres[:, 1] @ s[:, a]

    def add_gram(self, batch: slice, w, windows, squares=None) -> None:
        """The normal matrix's share of the sub-batch ``batch`` of the chunk's patterns: its
        every-``gram_stride``-th patterns of the chunk. ``w`` (b, n, n) Σ_k |S_f P_k|² and
        ``windows`` the (∂_y O, ∂_x O) windows of the sub-batch; ``squares`` their
        :func:`squared_gradients`, if the chunk step has them already."""
        first = batch.start + (-batch.start) % self.gram_stride
        if first >= batch.stop:
            return
        offset = first - batch.start
        w = w[offset::self.gram_stride].reshape(-1, self.n * self.n)
        dy, dx = (d[offset::self.gram_stride].reshape(w.shape) for d in windows)
        cross = dy.real * dx.real
        cross += dy.imag * dx.imag                                   # Re conj(∂_y O) ∂_x O
        if squares is None:
            squares = squared_gradients((dy, dx), self.xp)
        else:
            squares = squares[offset::self.gram_stride]
        sq = squares.view(np.float32).reshape(w.shape[0], -1, 2)
        ones = self.xp.ones(w.shape[0], np.float32)
        self.per_pixel[:, 0] += ones @ (sq[..., 0] * w)
        self.per_pixel[:, 1] += ones @ (cross * w)
        self.per_pixel[:, 2] += ones @ (sq[..., 1] * w)

    def sums(self, positions, gram=None) -> dict:
        """The chunk's additive sums (host, float64), with Σ positions and their count;
        ``gram``: the normal matrix (4, 4) formed elsewhere (through K slices), None: the one
        :meth:`add_gram` summed, False: none (the fit keeps an earlier epoch's,
        :func:`~.position_fits.fit_window`)."""
        first = np.asarray(to_numpy(self.first), np.float64)                       # (a, b)
        pos = np.asarray(positions, np.float64)
        out = {"window_num": first.reshape(4), "window_positions": np.r_[pos.sum(axis=0), len(pos)]}
        if gram is not False:
            out["window_gram"] = self._gram() if gram is None else gram
        return out

    def _gram(self) -> np.ndarray:
        """G (4, 4) from the per-pixel sums of :meth:`add_gram`, weighted by the offsets."""
        second = np.asarray(to_numpy(self.per_pixel), np.float64).T @ _offset_products(self.n) * self.gram_stride
        pair = {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 2}
        gram = np.empty((4, 4))
        for a in range(2):
            for b in range(2):
                for c in range(2):
                    for d in range(2):
                        gram[2 * a + b, 2 * c + d] = second[pair[a, c], pair[b, d]]
        return gram


def warp_object(a, matrix, offset, frame=None):
    """``a(matrix · x + offset)`` for an object-frame array (complex or real; None passes),
    where it lives (NumPy or CuPy), in its own dtype. The move is a fraction of a pixel (the
    window correction of one epoch), so it is the first-order step a + δ_y ∂_y a + δ_x ∂_x a
    with δ(x) = (matrix − I) x + offset (central differences; a few array passes, where a cubic
    resampling took a quarter of an epoch); a move of more than half a pixel anywhere is
    resampled (linear) instead. ``frame`` (:class:`~.tile_frame.TileFrame`): ``a`` is a tile of
    the object, whose own rows come out as the same rows of the whole object's warp (its
    edge rows are then wrong by the stencil's reach: the tile's owner sends them)."""
    if a is None:
        return None
    xp = get_xp(a)
    if a.ndim == 3:                    # the slices of a multislice object move together
        return xp.stack([warp_object(s, matrix, offset, frame) for s in a])
    m, o = np.asarray(matrix, np.float64), np.asarray(offset, np.float64)
    h, w = a.shape[-2:]
    origin = 0 if frame is None else int(frame.origin)
    whole_h, _ = whole_shape(a, frame)
    corners = np.array([[0, 0], [0, w - 1], [whole_h - 1, 0], [whole_h - 1, w - 1]], np.float64)
    largest = float(np.abs(corners @ (m - np.eye(2)).T + o).max())
    if largest <= 0.5:
        yy = xp.arange(origin, origin + h, dtype=np.float32)[:, None]   # (whole-object rows: exact)
        xx = xp.arange(w, dtype=np.float32)[None, :]
        dy = np.float32(m[0, 0] - 1) * yy + np.float32(m[0, 1]) * xx + np.float32(o[0])
        dx = np.float32(m[1, 0]) * yy + np.float32(m[1, 1] - 1) * xx + np.float32(o[1])
        gy, gx = central_gradients(a, xp)
        return (a + dy * gy + dx * gx).astype(a.dtype)
    if xp is np:
        from scipy.ndimage import affine_transform
    else:  # pragma: no cover - GPU only
        from cupyx.scipy.ndimage import affine_transform
    mm, oo = xp.asarray(m), xp.asarray(o + (m - np.eye(2)) @ np.array([origin, 0.0]))  # (in the tile's frame)
    def part(v):
        return affine_transform(v.astype(np.float32), mm, oo, order=1, mode="nearest")

    if xp.iscomplexobj(a):
        return (part(a.real) + 1j * part(a.imag)).astype(a.dtype)
    return part(a).astype(a.dtype)
