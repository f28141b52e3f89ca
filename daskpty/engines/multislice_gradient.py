"""The AD chunk gradient and loss with the sample given as its kernels (K slices, near field)
and the loss as keywords: :func:`daskpty.engines.ad.chunk_gradient` / ``chunk_loss``. No dask."""
from __future__ import annotations

from .ad import gradient
from .ad.losses import DEFAULT_EPS
from .ad.state import ADOptions
from .forward_model import ForwardModel
from .partials import Partial


def _bound(obj, kernel, detector, options, loss, eps) -> dict:
    if options is None:
        options = ADOptions(loss=loss or "gaussian", eps=DEFAULT_EPS if eps is None else eps)
    return {"sample": ForwardModel(1 if obj.ndim == 2 else obj.shape[0], kernel, detector), "options": options}


def chunk_gradient(obj, probe, intensities, positions, *, options=None, kernel=None, detector=None,
                   loss: str | None = None, eps: float | None = None, **keywords) -> Partial:
    """:func:`daskpty.engines.ad.chunk_gradient` through the slices of ``kernel`` to ``detector``."""
    return gradient.chunk_gradient(obj, probe, intensities, positions,
                                   **_bound(obj, kernel, detector, options, loss, eps), **keywords)


def chunk_loss(obj, probe, intensities, positions, *, options=None, kernel=None, detector=None,
               loss: str | None = None, eps: float | None = None, **keywords) -> Partial:
    """:func:`daskpty.engines.ad.chunk_loss` through the slices of ``kernel`` to ``detector``."""
    return gradient.chunk_loss(obj, probe, intensities, positions,
                               **_bound(obj, kernel, detector, options, loss, eps), **keywords)
