"""Errors against ground truth: aligned object NRMSE, probe error up to mode mixing, the truth frame."""
from __future__ import annotations

import numpy as np

from .registration import _align, _check_mask, _check_pair

def nrmse(estimate, truth, *, mask=None, subpixel=True, ramp=True) -> float:
    """Normalised RMS error after :func:`align`.

    ``sqrt( sum_mask |align(estimate) - truth|^2 / sum_mask |truth|^2 )``: 0 for a perfect
    reconstruction, about 1 for an unrelated image.

    Parameters
    ----------
    estimate, truth : array_like, shape (H, W)
        Complex (or real) images of equal shape.
    mask : array_like of bool, shape (H, W), optional
        Pixels that count. Default: all.
    subpixel, ramp : bool
        Passed to :func:`align`.

    Returns
    -------
    float
        ``nan`` if ``estimate`` contains non-finite values (a diverged reconstruction).

    Raises
    ------
    ValueError
        On shape mismatch, an empty mask or a truth that is zero (or non-finite) inside the mask.
    """
    y, t = _check_pair(estimate, truth)
    m = _check_mask(mask, t.shape)
    if not np.all(np.isfinite(t)):
        raise ValueError("truth contains non-finite values")
    if not np.all(np.isfinite(y)):
        return float("nan")
    norm = float(np.sum(np.abs(t[m].astype(np.complex128)) ** 2))
    if norm == 0:
        raise ValueError("truth is zero inside the mask")
    a, _, t, m = _align(y, t, m, subpixel, ramp)
    return float(np.sqrt(np.sum(np.abs(a[m] - t[m]) ** 2) / norm))



def probe_error(estimate, truth) -> float:
    """Error of probe modes up to mode mixing, global phase and global scale.

    Mixed-state probes are only defined up to a unitary mixing of the modes, so the comparison is made
    on the density matrices ``rho = sum_k p_k p_k^H`` (``p_k`` a mode flattened to a vector). With
    ``C = <rho_e, rho_t>_F / (||rho_e||_F ||rho_t||_F)`` (the cosine similarity, in [0, 1]) the error is
    ``sqrt(1 - C)``. For single modes ``C = |<e, t>|^2 / (||e||^2 ||t||^2)``, so this equals the usual
    relative error ``min_c ||c e - t|| / ||t||`` after a global complex scale fit. In general it relates
    to the relative Frobenius error of the density matrices after a scale fit,
    ``e_F = min_s ||s rho_e - rho_t||_F / ||rho_t||_F = sqrt(1 - C^2)``, by ``sqrt(1 - C) = e_F / sqrt(1 + C)``
    (about ``e_F / sqrt(2)`` for small errors).

    The n² × n² density matrices are never formed: with ``E`` (M_e × n²) and ``T`` (M_t × n²) the mode
    matrices, ``||rho_e||_F = ||conj(E) E^T||_F`` and ``<rho_e, rho_t>_F = ||conj(E) T^T||_F^2`` use only
    the small Gram matrices.

    Parameters
    ----------
    estimate, truth : array_like, shape (M, n, n) or (n, n)
        Probe modes; the mode counts may differ (e.g. an extra, empty mode), the mode shape may not.

    Returns
    -------
    float
        0 when ``rho_e`` is proportional to ``rho_t``; 1 for probes with orthogonal supports.

    Raises
    ------
    ValueError
        On mismatched mode shapes or an all-zero probe.
    """
    e = np.asarray(estimate)
    t = np.asarray(truth)
    if e.ndim == 2:
        e = e[None]
    if t.ndim == 2:
        t = t[None]
    if e.ndim != 3 or t.ndim != 3:
        raise ValueError(f"probes must have shape (M, n, n) or (n, n); got {np.shape(estimate)} and {np.shape(truth)}")
    if e.shape[1:] != t.shape[1:]:
        raise ValueError(f"shape mismatch: estimate modes are {e.shape[1:]}, truth modes are {t.shape[1:]}")
    E = e.reshape(e.shape[0], -1).astype(np.complex128)
    T = t.reshape(t.shape[0], -1).astype(np.complex128)
    ne, nt = np.linalg.norm(E), np.linalg.norm(T)
    if ne == 0 or nt == 0:
        raise ValueError("probe is identically zero")
    E /= ne
    T /= nt
    gee = np.linalg.norm(np.conj(E) @ E.T)
    gtt = np.linalg.norm(np.conj(T) @ T.T)
    get = np.linalg.norm(np.conj(E) @ T.T) ** 2
    cos = min(max(get / (gee * gtt), 0.0), 1.0)
    return float(np.sqrt(1.0 - cos))


#: Objects larger than this (pixels per side, in the truth frame) are compared on a central crop of
#: this side: the alignment's FFTs and zoomed DFTs then cost the same at any object size.
NRMSE_CROP = 2048


def _frame_offset(positions, truth_positions=None, origin=None) -> tuple[int, int]:
    """Integer offset ``(dy, dx)`` from the truth frame to the reconstruction's frame."""
    if truth_positions is not None and np.shape(truth_positions) == np.shape(positions):
        offset = np.round(np.median(np.asarray(positions) - np.asarray(truth_positions), axis=0))
    else:
        offset = np.round(np.asarray(origin if origin is not None else (0, 0), dtype=np.float64))
    oy, ox = (int(v) for v in offset)
    return oy, ox


def _place(obj, illuminated, offset, window):
    """The reconstruction's pixels (1 outside it) and the mask of ``illuminated`` (a boolean array
    or a callable on a slice of the object's frame) on ``window = (y0, y1, x0, x1)`` of the truth
    frame; only the window is allocated."""
    oy, ox = offset
    y0, y1, x0, x1 = window
    est = np.ones((y1 - y0, x1 - x0), dtype=np.result_type(obj.dtype, np.complex64))
    mask = np.zeros(est.shape, dtype=bool)
    ys, xs = max(y0 + oy, 0), max(x0 + ox, 0)  # the window in the object's frame, clipped to it
    ye, xe = min(y1 + oy, obj.shape[0]), min(x1 + ox, obj.shape[1])
    if ye > ys and xe > xs:
        inside = (slice(ys - oy - y0, ye - oy - y0), slice(xs - ox - x0, xe - ox - x0))
        est[inside] = obj[ys:ye, xs:xe]
        region = (slice(ys, ye), slice(xs, xe))
        mask[inside] = illuminated(region) if callable(illuminated) else np.asarray(illuminated)[region]
    return est, mask


def truth_frame(obj, positions, illuminated, truth_object, truth_positions=None, origin=None):
    """Place a reconstructed object into the ground truth's pixel frame.

    The integer offset between the frames is the median of ``positions - truth_positions``
    (rounded), or ``origin`` when truth positions are not given. Pixels the reconstruction does not
    cover are 1 and lie outside the returned mask. Returns ``(estimate, mask, (dy, dx))``.
    """
    offset = _frame_offset(positions, truth_positions, origin)
    ty, tx = np.shape(truth_object)[-2:]
    est, mask = _place(np.asarray(obj), illuminated, offset, (0, ty, 0, tx))
    return est, mask, offset


def central_window(shape, max_side: int | None = NRMSE_CROP, positions=None) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the whole of ``shape``, or a ``max_side``-wide window (per axis where
    the image is larger) centred on the scan (``positions``' bounding box) or on the image."""
    window = []
    for axis, size in enumerate(shape[-2:]):
        size = int(size)
        if not max_side or size <= max_side:
            window += [0, size]
            continue
        if positions is not None and len(positions):
            p = np.asarray(positions)[:, axis]
            centre = 0.5 * (float(p.min()) + float(p.max()))
        else:
            centre = size / 2
        start = int(np.clip(round(centre - max_side / 2), 0, size - max_side))
        window += [start, start + int(max_side)]
    return tuple(window)


def nrmse_vs_truth(obj, positions, illumination, truth, fraction: float = 0.3, *,
                   max_side: int | None = NRMSE_CROP, return_window: bool = False):
    """Object NRMSE against a ground truth (``truth.object``, ``truth.positions``) on the region
    whose illumination exceeds ``fraction`` of its maximum, after :func:`truth_frame`.

    A truth frame wider than ``max_side`` pixels is compared on a central ``max_side``-wide crop
    (:func:`central_window`, on the scan's centre; None: the whole frame), so the cost and the
    memory stay those of the crop: only the crop of ``truth.object`` is read (a Zarr array is
    fine) and no object-sized temporary is made. ``return_window``: also return the window
    ``(y0, y1, x0, x1)`` in the truth frame, or None when it is the whole frame.
    """
    t_obj = truth.object
    t_pos = getattr(truth, "positions", None)
    shape = tuple(np.shape(t_obj))[-2:]
    window = central_window(shape, max_side, t_pos)
    illumination = np.asarray(illumination)
    threshold = fraction * illumination.max()
    est, mask = _place(np.asarray(obj), lambda region: illumination[region] > threshold,
                       _frame_offset(positions, t_pos), window)
    y0, y1, x0, x1 = window
    value = nrmse(est, np.asarray(t_obj[y0:y1, x0:x1]), mask=mask)
    whole = window == (0, shape[0], 0, shape[1])
    return (value, None if whole else window) if return_window else value
