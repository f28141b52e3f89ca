"""Position refinement's sums of one chunk step, gathered block by block against the forward
model (:mod:`.forward_model`), for every engine (no dask).

Per pattern the LSQML shift's numerator Re⟨∂_a O_j, g_j⟩ (and its denominator ‖d_a‖²), and per
chunk the windows' deformation sums (:class:`~.window_deformation.WindowDeformation`). One slice
in the far field forms them per block on the box (∂_a O by central differences; the denominator
⟨|∂_a O_j|², Σ_m |S_f P_m|²⟩: three gathers and four dot products per pattern, no FFT); K slices
or the near field carry the changes through the slices (:func:`.multislice_positions.position_sums`,
the whole chunk being one block there).
"""
from __future__ import annotations

import numpy as np

from ..physics.backend import channel_dots, real_dots, to_numpy
from .multislice_positions import keep_ratios, position_sums, reused_sums
from .positions import (central_gradients, finish_step, lsqml_shift, noise_limited, positions_for_step,
                        step_with_momentum)
from .tile_frame import step_positions, whole_shape
from .window_deformation import WindowDeformation, squared_gradients, wants_window_sums


class PositionSums:
    """The sums of one chunk step: ``shifts`` the shift terms (numerator and denominator),
    ``window`` the deformation sums, ``reuse`` an earlier epoch's carried sums
    (:class:`~.multislice_positions.ReusedSums`; through slices only)."""

    def __init__(self, chunk, *, shifts: bool, window: bool, reuse=None):
        self.chunk, self.shifts, self.window, self.reuse = chunk, shifts, window, reuse
        xp, n, b = chunk.xp, chunk.n, chunk.n_patterns
        self.residual_power = None
        if not chunk.thin:
            self._kept = None
            return
        self.box_d = central_gradients(chunk.obj_box[0], xp)
        self.numerators = xp.empty((b, 2))
        self._d = xp.empty((2, chunk.step, n, n), chunk.cdtype)      # ∂_y O, ∂_x O windows of a block
        if shifts:
            self.box_squares = squared_gradients(self.box_d, xp)    # |∂_y O|² + i |∂_x O|²
            self.denominators = xp.empty((b, 2))
            self._squares = xp.empty((chunk.step, n, n), np.complex64)
        self.deform = WindowDeformation(n, xp, self.box_d) if window else None

    def add(self, blk, grads, lit, residual=None) -> None:
        """One block's share: ``grads`` and ``lit`` the slices' Σ_m conj(φ_k) g_k and
        Σ_m |φ_k|² (lists of K (b, n, n)), g the exact gradient (LSQML's χ carried back); one
        slice in the far field: with ``residual`` (χ, (b, M, n, n)) also Σ |χ_j|², the shift's
        noise level (:attr:`residual_power`)."""
        c, batch = self.chunk, blk.batch
        if not c.thin:
            self._kept = (blk, grads, lit)
            return
        b = batch.stop - batch.start
        if residual is not None:
            if self.residual_power is None:
                self.residual_power = c.xp.empty(c.n_patterns)
            self.residual_power[batch] = real_dots(residual.reshape(b, -1), residual.reshape(b, -1))
        g, w = grads[0], lit[0]
        d = [c.index.extract(self.box_d[a], batch, out=self._d[a, :b]) for a in range(2)]
        for a in range(2):
            self.numerators[batch, a] = real_dots(d[a], g)
        squares = None
        if self.shifts:
            squares = c.index.extract(self.box_squares, batch, out=self._squares[:b])
            self.denominators[batch] = channel_dots(w, squares)
        if self.deform is not None:
            self.deform.add_gram(batch, w, d, squares)

    def finish(self, positions, scattered=None):
        """``(shift_terms, window)``: shift_terms (numerators, denominators[, ratios]) on the
        host, or None without ``shifts``; window the deformation sums (``scattered``: Σ_j g_j on
        the box, not yet scaled; K slices scatter their own when None), or None."""
        c = self.chunk
        if not c.thin:
            blk, grads, lit = self._kept
            grads, lit = c.xp.stack(grads), c.xp.stack(lit)
            if self.window and scattered is None:
                scattered = c.xp.stack([_scattered(c, g) for g in grads])
            return position_sums(blk, grads, blk.incident, positions=positions, lit=lit, shifts=self.shifts,
                                 scattered=scattered if self.window else None, reuse=self.reuse)
        terms = (to_numpy(self.numerators), to_numpy(self.denominators)) if self.shifts else None
        if self.deform is None:
            return terms, None
        self.deform.add_first(scattered if scattered.ndim == 2 else scattered[0], c.index.corners, self.numerators)
        return terms, self.deform.sums(positions)


def _scattered(c, patches):
    out = c.xp.zeros(c.obj_box.shape[1:], np.complex64)
    c.index.scatter_add(out, patches)
    return out


def refining_step(step, obj, probe, intensities, nominal, local: dict, *, positions, epoch: int, affine=None,
                  frame=None, **keywords):
    """``step`` (a chunk step returning the shift sums, LSQML's or PIE's, with ``keywords``) at
    the refined positions ``local["positions"]``, moving them by the LSQML shift from epoch
    ``positions.start_epoch`` on. Before the step the refined positions are pulled towards
    ``affine`` (the map fitted after the last epoch, if any); after it each moves by the shift
    (shrunk by its noise level where the step measured it) with momentum, limited to ``max_step``
    per axis and kept inside the object. The partial gains the affine normal equations of the new
    positions (additive), ``position_update_sq`` / ``position_refined`` (for the rms update) and,
    in ``local``, the patterns' new per-pattern state. Chunks whose step carries the sums through
    slices keep the carried ones in ``local`` and reuse them between refreshes
    (:func:`~.multislice_positions.reused_sums`)."""
    n = probe.shape[-1]
    shape = whole_shape(obj, frame)       # (a tile's frame: the whole object's)
    refined = positions_for_step(local, nominal, affine, positions, epoch, n, shape)
    active = positions.active(epoch)
    reuse = reused_sums(local, positions, epoch) if active else None
    part = step(obj, probe, intensities, step_positions(refined, frame, n, obj), position_terms=active,
                window_sums=wants_window_sums(positions, epoch), **keywords,
                **({} if reuse is None else {"reuse": reuse}))
    if frame is not None:
        frame.sums_to_object(part)
    if not active or not part.scalars:
        part.local = {}
        return part
    terms = part.local.pop("shift_terms")
    shift = positions.gain * lsqml_shift(terms[0], terms[1], positions.regularization)
    shift = noise_limited(shift, terms[1], part.local.pop("residual_power", None), probe.size,
                          positions.noise_threshold)
    new, _ = step_with_momentum({**local, "positions": refined}, shift, positions)
    keep_ratios(terms, new, local)
    return finish_step(part, new, refined, nominal, positions, epoch, n, shape)
