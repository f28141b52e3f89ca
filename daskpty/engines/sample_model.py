"""The sample's part of the forward model, chosen once per run and injected into the engines.

:class:`SampleModel` says how the exit wave is formed and detected: one slice in the far field
(``None``: the engines' own single-slice functions, the fastest path), or K slices Δz apart
and/or a near-field detector (:mod:`.forward_model`, :mod:`.multislice`). The engines'
per-chunk functions take the chosen step, gradient or loss as an argument (``step=``,
``gradient=``), so position refinement and a varying probe compose with every sample without
a class per combination. No dask.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from . import ad, lsqml
from . import multislice as ms
from .forward_model import THIN, ForwardModel


@dataclass(frozen=True)
class SampleModel(ForwardModel):
    """The sample's :class:`~.forward_model.ForwardModel` with the engines' steps bound to it."""

    def _bound(self, function):
        return partial(function, kernel=self.kernel, detector=self.detector)

    def lsqml_step(self):
        return self._bound(ms.chunk_step)

    def ad_gradient(self):
        return partial(ad.chunk_gradient, sample=self)

    def ad_loss(self):
        return partial(ad.chunk_loss, sample=self)

    def forward_sums(self):
        return self._bound(ms.forward_sums)


def forward_model(sample: SampleModel | None) -> ForwardModel:
    """The forward model of ``sample`` (None: one slice in the far field)."""
    return THIN if sample is None else sample


def carries_position_sums(sample: SampleModel | None) -> bool:
    """Whether position refinement's sums go through transforms for ``sample`` (K slices or a
    near-field detector; :mod:`.multislice_positions`), so that its chunks keep what they carried."""
    return sample is not None and (sample.n_slices > 1 or sample.detector is not None)


def lsqml_step(sample: SampleModel | None):
    """The LSQML chunk step of ``sample`` (:func:`daskpty.engines.lsqml.chunk_step` for None)."""
    return lsqml.chunk_step if sample is None else sample.lsqml_step()


def ad_gradient(sample: SampleModel | None):
    """The AD chunk gradient of ``sample`` (:func:`daskpty.engines.ad.chunk_gradient` for None)."""
    return ad.chunk_gradient if sample is None else sample.ad_gradient()


def ad_loss(sample: SampleModel | None):
    """The AD loss-only chunk function of ``sample``."""
    return ad.chunk_loss if sample is None else sample.ad_loss()


def forward_sums(sample: SampleModel | None):
    """Σ measured and Σ model intensity of a chunk (the first epoch's probe rescale)."""
    return lsqml.forward_sums if sample is None else sample.forward_sums()


def lsqml_apply(sample: SampleModel | None):
    """``apply`` of the LSQML state of ``sample`` ((H, W) or (K, H, W) object)."""
    return lsqml.apply if sample is None else ms.apply


def lsqml_end_epoch(sample: SampleModel | None):
    """``end_epoch`` of the LSQML state of ``sample`` (slices normalised one by one)."""
    return lsqml.end_epoch if sample is None else ms.end_epoch


def as_slices(obj, sample: SampleModel | None):
    """The object in the layout ``sample`` keeps: (H, W) for None, else (K, H, W) complex64."""
    if sample is None:
        return obj
    obj = np.asarray(obj, dtype=np.complex64)
    return obj[None] if obj.ndim == 2 else obj
