"""The dose of a data set from a few of its patterns: mean counts per detector pixel where the
intensities are counts (integer-valued), which some engine defaults follow
(:meth:`daskpty.engines.lsqml.LSQMLOptions.for_slices`).

NumPy only; a dask or Zarr array is read in a few small slices (``SAMPLE_BLOCKS`` ×
``SAMPLE_LENGTH`` patterns spread over the scan), never whole.
"""
from __future__ import annotations

import numpy as np

#: patterns read: SAMPLE_BLOCKS runs of SAMPLE_LENGTH consecutive ones, evenly spread over the scan
SAMPLE_BLOCKS, SAMPLE_LENGTH = 4, 8


def sample_patterns(intensities) -> np.ndarray:
    """A few patterns of ``intensities`` (N, n, n) as float64: runs of consecutive patterns
    spread over the scan (consecutive, so that a chunked array is read in few chunks)."""
    n = int(intensities.shape[0])
    starts = np.unique(np.linspace(0, max(n - SAMPLE_LENGTH, 0), SAMPLE_BLOCKS).astype(int))
    runs = []
    for start in starts:
        block = intensities[int(start):int(start) + SAMPLE_LENGTH]
        block = block.compute() if hasattr(block, "compute") else block
        runs.append(np.asarray(block, dtype=np.float64))
    return np.concatenate(runs)


def _counts(intensities, valid=None) -> np.ndarray | None:
    """The finite values of :func:`sample_patterns` over the ``valid`` pixels, or None where the
    intensities are not counts (any fractional value) or hold nothing finite."""
    sample = sample_patterns(intensities)
    if valid is not None:
        sample = sample[:, np.asarray(valid, dtype=bool)]
    finite = sample[np.isfinite(sample)]
    if finite.size == 0:
        return None
    if not np.issubdtype(np.dtype(intensities.dtype), np.integer) and np.any(finite != np.round(finite)):
        return None
    return finite


def counts_per_pixel(intensities, valid=None) -> float | None:
    """Mean counts per detector pixel of counting data (integer dtype, or floats that are all
    whole numbers on the sample), from :func:`sample_patterns`, over the ``valid`` pixels (a
    boolean (n, n) mask in the stored layout; None: all); None where the intensities are not
    counts (any fractional value) or hold nothing finite."""
    finite = _counts(intensities, valid)
    return None if finite is None else float(finite.mean())


def counts_per_lit_pixel(intensities, valid=None) -> float | None:
    """Mean counts over the sampled pixels that counted at least one (of the ``valid`` ones):
    the dose where the signal is, whatever share of the detector stays dark. None as for
    :func:`counts_per_pixel`, or where no sampled pixel counted."""
    finite = _counts(intensities, valid)
    if finite is None or not np.any(finite > 0):
        return None
    lit = finite[finite > 0]
    return float(lit.mean())
