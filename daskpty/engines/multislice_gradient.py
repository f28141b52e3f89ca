"""The AD chunk gradient and loss with the sample given as its kernels (K slices, near field)
and the loss as keywords: :func:`daskpty.engines.ad.chunk_gradient` / ``chunk_loss``. No dask."""
from __future__ import annotations

from functools import partial

from .ad import gradient
from .ad.losses import DEFAULT_EPS
from .ad.state import ADOptions
from .forward_model import ForwardModel


def _bound(function, obj, probe, intensities, positions, *, options=None, kernel=None, detector=None,
           loss: str | None = None, eps: float | None = None, **keywords):
    if options is None:
        options = ADOptions(loss=loss or "gaussian", eps=DEFAULT_EPS if eps is None else eps)
    sample = ForwardModel(1 if obj.ndim == 2 else obj.shape[0], kernel, detector)
    return function(obj, probe, intensities, positions, options=options, sample=sample, **keywords)


chunk_gradient = partial(_bound, gradient.chunk_gradient)
chunk_loss = partial(_bound, gradient.chunk_loss)
