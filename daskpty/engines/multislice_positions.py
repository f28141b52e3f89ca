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

Carrying the changes costs transforms (a fifth of a refining 3-slice step, more with more
slices), yet what they give changes slowly: the normal matrix of the windows' deformation (4 × 4,
summed over the scan) and each chunk step's ratio of the exact shift denominators to their
slice-wise form. Both are formed in the first epoch of refinement and every
:data:`SUMS_REFRESH`-th after it and kept in between (:class:`ReusedSums`: the ratios live with
their patterns, the matrix with the state's window fit).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..physics.backend import channel_dots, real_dots, to_numpy
from ..physics.multislice import detector_forward, transmit_sum
from ..physics.noise import model_intensity
from .window_deformation import GRAM_STRIDE, WindowDeformation, squared_gradients

#: The shift denominators are carried through the slices on every SHIFT_STRIDE-th pattern
#: (:func:`shift_denominators`).
SHIFT_STRIDE = 4

#: The carried sums (shift denominators' ratios, the windows' normal matrix) are formed in the
#: first epoch of refinement and every SUMS_REFRESH-th after it, and kept in between. abTEM's
#: 576 × 64² electron scan with scan errors, LSQML, 50 epochs: the same NRMSE and position error
#: as carrying them every epoch (3 slabs 0.0775 / 0.116 px; 6 slices 0.121 / 0.239 px) at 0.17
#: instead of 0.21 s/epoch (6 slices: 0.37 instead of 0.47; docs/benchmarks.md).
SUMS_REFRESH = 4

#: The per-pattern state's name of the kept ratios (B, 2): exact / slice-wise ‖d_a‖² of the
#: chunk step the pattern took part in (NaN: not formed yet).
RATIO_KEY = "shift_ratio"

#: (a, b) of L_ab in the order of the normal equations' unknowns (row-major L).
_PAIRS = ((0, 0), (0, 1), (1, 0), (1, 1))


@dataclass(frozen=True)
class ReusedSums:
    """What a refining chunk step through the slices takes from an earlier epoch instead of
    carrying changes through them: ``shift_ratio`` (B, 2) its patterns' kept ratios of the shift
    denominators (None: AD, which forms none); the windows' normal matrix is not formed at all
    (the state's window fit keeps the last one, :func:`~.position_fits.fit_window`)."""

    shift_ratio: np.ndarray | None = None


def refreshes(options, epoch: int) -> bool:
    """Whether the refining chunk steps of ``epoch`` carry the sums (the first epoch of
    refinement and every :data:`SUMS_REFRESH`-th after it; ``options`` resolved)."""
    return (epoch - options.start_epoch) % SUMS_REFRESH == 0


def reused_sums(local: dict, options, epoch: int) -> ReusedSums | None:
    """The sums a refining chunk step of ``epoch`` reuses, or None when it forms them: a chunk
    keeping no ratios (one slice in the far field carries nothing), the first epoch of
    refinement and every :data:`SUMS_REFRESH`-th after it, or ratios not yet formed (a resumed
    store without them). ``options``: the resolved :class:`~.position_options.PositionOptions`."""
    ratio = local.get(RATIO_KEY)
    if ratio is None or refreshes(options, epoch) or not np.isfinite(ratio).all():
        return None
    return ReusedSums(np.asarray(ratio, np.float64))


def initial_ratios(n_patterns: int) -> dict:
    """The per-pattern state of a chunk whose refining steps carry sums through slices (or to a
    near-field detector): no ratios formed yet."""
    return {RATIO_KEY: np.full((int(n_patterns), 2), np.nan)}


def keep_ratios(shift_terms, new: dict, local: dict) -> None:
    """Into the patterns' new per-pattern state ``new``: the ratios of the step's ``shift_terms``
    (:func:`position_sums`: their third entry), when the chunk keeps them (only chunks whose
    steps carry sums through slices do, and those steps always return them)."""
    if RATIO_KEY in local:
        new[RATIO_KEY] = np.asarray(shift_terms[2], np.float64)


def _carried(c, moves, incident, pick=slice(None)):
    """The detected changes d = D Σ_k T_k(δO_k · φ_k) of the patterns ``pick`` (S, b, M, n, n)
    for S moves of the windows at once (``moves``: K arrays (S, b, n, n), slice k's δO_k of each
    move), carried forward slice by slice: one batch of transforms for all of them."""
    change = transmit_sum((moves[k][:, :, None] * incident[k][pick][None] for k in range(c.n_slices)),
                          c.patches[:, pick], c.kernel)
    if c.detector is not None:
        change = detector_forward(change, c.detector[pick][None])
    return change


def _sampled_changes(c, windows, incident, stride: int, *, shifts: bool, window: bool):
    """The detected changes of every ``stride``-th pattern (S, b, M, n, n) for the two shifts
    ∂_a O_k (``shifts``) followed by the windows' four moves u_b ∂_a O_k of :data:`_PAIRS`
    (``window``), in one :func:`_carried` call."""
    pick = slice(0, None, max(1, int(stride)))
    u = c.xp.asarray(np.arange(c.n) - (c.n - 1) / 2.0, dtype=windows[0][0].real.dtype)
    offsets = (u[:, None], u[None, :])
    count = (2 if shifts else 0) + (4 if window else 0)
    moves = []
    for k in range(c.n_slices):   # each slice's moves written into one (S, b, n, n) array
        first = windows[0][k][pick]
        per_move = c.xp.empty((count,) + first.shape, first.dtype)
        i = 0
        if shifts:
            per_move[0], per_move[1], i = first, windows[1][k][pick], 2
        if window:
            for a, b in _PAIRS:
                c.xp.multiply(offsets[b], windows[a][k][pick], out=per_move[i])
                i += 1
        moves.append(per_move)
    return _carried(c, moves, incident, pick)


def position_sums(c, grads, incident, *, scattered=None, positions=None, gram_stride: int = GRAM_STRIDE,
                  shift_stride: int = SHIFT_STRIDE, lit=None, shifts: bool = True, reuse: ReusedSums | None = None):
    """The LSQML position shift's terms of every pattern and, with ``scattered``, the windows'
    deformation sums of the chunk.

    ``c`` a whole-chunk :class:`~.forward_model.Block`; ``grads`` (K, B, n, n) the slices' gradients
    g_k = Σ_m conj(φ_km) T_k†χ; ``incident`` (K, B, M, n, n). Returns ``(shift_terms, window)``:
    shift_terms the numerator Re⟨d_a, χ⟩ and denominator ‖d_a‖² ((B, 2) float64 each, on the
    host; :func:`~.positions.lsqml_shift`); the denominators are carried through the slices on
    every ``shift_stride``-th pattern and the others' are their cheap slice-wise form Σ_k Σ_u
    |∂_a O_k|² Σ_m |φ_km|² (``lit``: the (K, B, n, n) Σ_m |φ_km|² when the caller has them) scaled
    by the chunk's ratio of the two on those patterns (:func:`shift_denominators`; ``shifts=False``:
    shift_terms None, for callers that only want the window's sums); window None,
    or the sums of
    :meth:`WindowDeformation.sums` (``scattered`` (K, h, w): the g_k scattered on the box, not
    yet scaled; ``positions`` (B, 2) the chunk's): b_ab = Σ_k Re Σ_j Σ_u u_b conj(∂_a O_kj) g_kj on
    the box (:meth:`WindowDeformation.add_first`, slice by slice) and the normal matrix
    G_(ab),(cd) = Σ_j Re⟨d_ab, d_cd⟩ on every ``gram_stride``-th pattern (scaled to all), d_ab
    the detected change of the move u_b ∂_a O_k carried through the slices — exact where the
    single slice's box form (Σ_k |S_f P_k|² per pixel) holds only for one slice in the far field.
    ``shift_terms[2]``: the chunk's ratios of the denominators (exact / slice-wise, per axis) for
    every pattern (B, 2), to keep. ``reuse`` (:class:`ReusedSums`): nothing is carried; the
    denominators are the slice-wise form times the kept ratios and the window sums have no
    ``window_gram``.

    Moving the probe over the windows instead differs by a translation of the exit wave, to
    which far-field intensities are blind but whose norm would swamp ‖d_a‖²."""
    xp, n_slices = c.xp, c.n_slices
    box_d = c.box_gradients()
    windows = [[c.index.extract(xp.ascontiguousarray(box_d[k][a])) for k in range(n_slices)] for a in range(2)]
    per_slice = [xp.stack([real_dots(windows[a][k], grads[k]) for a in range(2)], axis=1) for k in range(n_slices)]
    shift_terms = shared = None
    if shifts:
        if scattered is not None and reuse is None and max(1, int(shift_stride)) == max(1, int(gram_stride)):
            # one batch of transforms for both when they sample the same patterns
            shared = _sampled_changes(c, windows, incident, shift_stride, shifts=True, window=True)
        den, ratio = shift_denominators(c, windows, incident, shift_stride, lit, box_d=box_d,
                                        changes=None if shared is None else shared[:2],
                                        ratio=None if reuse is None else reuse.shift_ratio)
        shift_terms = (to_numpy(sum(per_slice)), den, ratio)
    if scattered is None:
        return shift_terms, None
    deform = WindowDeformation(c.n, xp, None, gram_stride)
    for k in range(n_slices):
        deform.add_first(scattered[k], c.index.corners, per_slice[k], box_d=box_d[k])
    if reuse is not None:
        return shift_terms, deform.sums(positions, gram=False)
    gram = window_gram(c, windows, incident, gram_stride, changes=None if shared is None else shared[2:])
    return shift_terms, deform.sums(positions, gram=gram)


def shift_denominators(c, windows, incident, stride: int = SHIFT_STRIDE, lit=None, changes=None,
                       box_d=None, ratio=None) -> tuple[np.ndarray, np.ndarray]:
    """``(den, ratio)``: ‖d_a‖² per pattern and axis (B, 2) float64, d_a = D Σ_k T_k(∂_a O_k · φ_k),
    exact (carried through the slices) on every ``stride``-th pattern and on the others the
    slice-wise form Σ_k Σ_u |∂_a O_k|² Σ_m |φ_km|² times the chunk's ratio exact / slice-wise over
    the exact ones; and that ratio for every pattern (B, 2). ``ratio`` (B, 2): kept ratios (an
    earlier epoch's, :class:`ReusedSums`): every denominator is its slice-wise form times its
    pattern's ratio, nothing is carried.

    Carrying both axes' changes through K slices costs 4 (K − 1) transforms per pattern, a fifth
    of a 3-slice LSQML step; the denominator only sets the step length, not where the shift
    stops (the numerator's zero), and the ratio takes up what the slices and the propagation add
    on average (the alike slabs' coherent sum, the near-field operator). ``changes``: the two
    shifts' sampled changes (2, b, M, n, n) when the caller carried them already; ``box_d``:
    the slices' (∂_y O_k, ∂_x O_k) on the box (the slice-wise form then gathers |∂_y O_k|² and
    |∂_x O_k|² packed in one complex window, half the passes of forming them per window)."""
    b = windows[0][0].shape[0]
    if ratio is not None:
        ratio = np.asarray(ratio, np.float64)
        return _slice_wise(c, windows, incident, lit, box_d) * ratio, ratio
    stride = max(1, int(stride))
    pick = slice(0, None, stride)
    if changes is None:
        changes = _sampled_changes(c, windows, incident, stride, shifts=True, window=False)
    exact = np.stack([to_numpy(real_dots(changes[a], changes[a])) for a in range(2)], axis=1)
    cheap = _slice_wise(c, windows, incident, lit, box_d)
    sampled = cheap[pick].sum(axis=0)
    chunk_ratio = np.where(sampled > 0, exact.sum(axis=0) / np.where(sampled > 0, sampled, 1.0), 1.0)
    den = cheap * chunk_ratio
    den[pick] = exact
    return den, np.repeat(chunk_ratio[None], b, axis=0)


def _slice_wise(c, windows, incident, lit=None, box_d=None) -> np.ndarray:
    """Σ_k Σ_u |∂_a O_k|² Σ_m |φ_km|² per pattern and axis (B, 2) float64: no transforms."""
    xp, n_slices = c.xp, c.n_slices
    b = windows[0][0].shape[0]
    if lit is None:
        lit = xp.stack([model_intensity(incident[k]) for k in range(n_slices)])
    cheap = np.zeros((b, 2))
    for k in range(n_slices):   # Σ_u |∂_a O_k|² Σ_m |φ_km|²
        if box_d is None or lit.dtype != np.float32:   # (squared_gradients packs complex64)
            cheap += np.stack([to_numpy(real_dots(w, w * lit[k])) for w in (windows[0][k], windows[1][k])], axis=1)
            continue
        cheap += to_numpy(channel_dots(lit[k], c.index.extract(squared_gradients(box_d[k], xp))))
    return cheap


def window_gram(c, windows, incident, gram_stride: int = GRAM_STRIDE, changes=None) -> np.ndarray:
    """G_(ab),(cd) = Σ_j Re⟨d_ab, d_cd⟩ (4, 4) float64 on every ``gram_stride``-th pattern, times
    ``gram_stride`` (the single slice's sampling), d_ab the detected change of the windows' move
    u_b ∂_a O_k (``windows[a][k]``: the (B, n, n) windows of ∂_a O_k; ``changes``: the four
    moves' sampled changes (4, b, M, n, n) when the caller carried them already)."""
    if changes is None:
        changes = _sampled_changes(c, windows, incident, gram_stride, shifts=False, window=True)
    flat = [changes[i].reshape(changes.shape[1], -1) for i in range(4)]
    gram = np.empty((4, 4))
    for i in range(4):
        for j in range(i, 4):
            gram[i, j] = gram[j, i] = float(to_numpy(real_dots(flat[i], flat[j])).sum())
    return gram * max(1, int(gram_stride))
