"""The half-set FRC: reconstruct two interleaved halves of a scan apart and compare them.

Two reconstructions from independent photons agree only where both resolve the same structure, so
their Fourier ring correlation against the ½-bit threshold estimates the resolution, and its mean
over 0.1–0.6 Nyquist is a single number to compare settings by. The registration and the FRC are
:mod:`daskpty.metrics`; this module runs the reconstructions.
"""
from __future__ import annotations

import numpy as np

from ..api import reconstruct
from ..engines.initial import object_frame
from ..execution.cluster import client_context
from ..io.store import from_arrays, open_data
from ..metrics.frc import BAND, HalfSetFRC, common_region, illumination_map, registered_frc, split_halves

#: Reconstruct options that cannot be shared by the two half reconstructions.
_REFUSED = ("object", "resume", "checkpoint")


def half_set_frc(data, *, split="checkerboard", fraction: float = 0.3, ramp: bool = True,
                 taper: float | None = None, band=BAND, client=None, n_workers: int | None = None,
                 **reconstruct_options) -> HalfSetFRC:
    """Reconstruct two interleaved halves of ``data`` apart and return their registered FRC.

    Parameters
    ----------
    data : str or PtychoData
        A data-set store path or an opened data set (e.g. from :func:`daskpty.from_arrays`).
    split : {"checkerboard", "alternate"} or array of bool
        How to halve the patterns (:func:`split_halves`), or a boolean array of length N marking
        the second half.
    fraction : float
        The region compared is where both halves' illumination (``Σ |probe|²`` of their own
        reconstructed probe at their positions) exceeds this fraction of its maximum.
    ramp, taper, band
        Passed to :func:`registered_frc`.
    client, n_workers
        Cluster for both reconstructions (one embedded cluster serves both when none is given).
    **reconstruct_options
        Passed to :func:`daskpty.reconstruct` for both halves (``epochs``, ``rounds_per_epoch``,
        ``engine``, ``probe``, ...). The halves share the object frame of the whole scan, so
        ``object``, ``resume`` and ``checkpoint`` are refused.

    Returns
    -------
    HalfSetFRC
        With ``halves`` (the two Reconstruction results), ``indices`` and ``seconds_per_epoch``.
    """
    refused = sorted(set(reconstruct_options) & set(_REFUSED))
    if refused:
        raise TypeError(f"half_set_frc does not take {refused}: the halves share a fresh object frame")
    if isinstance(data, (str, bytes)) or hasattr(data, "__fspath__"):
        data = open_data(data)
    positions = np.asarray(data.positions, dtype=np.float64)
    n = int(data.intensities.shape[-1])
    if isinstance(split, str):
        idx_a, idx_b = split_halves(positions, split)
    else:
        second = np.asarray(split, dtype=bool)
        if second.shape != (len(positions),):
            raise ValueError(f"a split array must have one boolean per pattern ({len(positions)}); "
                             f"got shape {second.shape}")
        idx_a, idx_b = np.nonzero(~second)[0], np.nonzero(second)[0]
    if min(len(idx_a), len(idx_b)) == 0:
        raise ValueError("one half of the split is empty")
    shape, origin = object_frame(positions, n)
    frame = positions + origin
    halves = []
    with client_context(client, n_workers=n_workers) as c:
        for idx in (idx_a, idx_b):
            half = from_arrays(data.intensities[idx], frame[idx], mask=getattr(data, "mask", None),
                               probe=getattr(data, "probe", None))
            halves.append(reconstruct(half, object=np.ones(shape, dtype=np.complex64), client=c,
                                      **reconstruct_options))
    ra, rb = halves
    region = common_region(illumination_map(ra.probe, ra.positions, shape),
                           illumination_map(rb.probe, rb.positions, shape), fraction)
    if not region.any():
        raise ValueError("the two halves share no illuminated region; lower `fraction`")
    result = registered_frc(ra.object, rb.object, region, ramp=ramp, taper=taper, band=band)
    seconds = [h.get("seconds") for r in halves for h in (r.history[1:] or r.history)
               if h.get("seconds") is not None]
    return HalfSetFRC(**{**result.__dict__, "halves": (ra, rb), "indices": (idx_a, idx_b),
                         "seconds_per_epoch": float(np.median(seconds)) if seconds else None})
