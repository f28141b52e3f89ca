"""3PIE's names of :mod:`.pie` with the sample given as its kernels (K slices, near field). No dask."""
from __future__ import annotations

from .forward_model import ForwardModel
from .pie import chunk_step as _chunk_step
from .pie import end_epoch  # noqa: F401  (it takes (K, H, W) objects)


def chunk_step(obj, probe, intensities, positions, *, kernel=None, detector=None, **options):
    """:func:`daskpty.engines.pie.chunk_step` through the slices of ``kernel`` to ``detector``."""
    sample = ForwardModel(1 if obj.ndim == 2 else obj.shape[0], kernel, detector)
    return _chunk_step(obj, probe, intensities, positions, sample=sample, **options)
