"""The sample's part of the forward model, chosen once per run and injected into the engines.

:class:`SampleModel` is the :class:`~.forward_model.ForwardModel` the run's data need: one slice
in the far field (:data:`~.forward_model.THIN`), or K slices Δz apart and/or a near-field
detector. The engines' chunk steps take it as an argument (``sample=``), and the refining and
varying-probe steps the bound step (``step=``, ``gradient=``), so position refinement and a
varying probe compose with every sample without a class per combination. No dask.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from . import ad, lsqml
from .forward_model import ForwardModel

SampleModel = ForwardModel


def carries_position_sums(sample: SampleModel) -> bool:
    """Whether position refinement's sums go through transforms for ``sample`` (K slices or a
    near-field detector; :mod:`.multislice_positions`), so that its chunks keep what they carried."""
    return sample.stacked


def lsqml_step(sample: SampleModel):
    """The LSQML chunk step through ``sample`` (:func:`daskpty.engines.lsqml.chunk_step`)."""
    return partial(lsqml.chunk_step, sample=sample)


def ad_gradient(sample: SampleModel):
    """The AD chunk gradient through ``sample`` (:func:`daskpty.engines.ad.chunk_gradient`)."""
    return partial(ad.chunk_gradient, sample=sample)


def ad_loss(sample: SampleModel):
    """The AD loss-only chunk function of ``sample``."""
    return partial(ad.chunk_loss, sample=sample)


def forward_sums(sample: SampleModel):
    """Σ measured and Σ model intensity of a chunk (the first epoch's probe rescale)."""
    return partial(lsqml.forward_sums, sample=sample)


def as_slices(obj, sample: SampleModel):
    """The object in the layout ``sample`` keeps: (H, W) for one slice in the far field, else
    (K, H, W) complex64."""
    if not sample.stacked:
        return obj
    obj = np.asarray(obj, dtype=np.complex64)
    return obj[None] if obj.ndim == 2 else obj
