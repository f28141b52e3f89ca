"""The sample's part of the forward model, chosen once per run and injected into the engines.

:class:`SampleModel` is the :class:`~.forward_model.ForwardModel` the run's data need: one slice
in the far field (the adapters hold ``None`` for it: :data:`~.forward_model.THIN`), or K slices
Δz apart and/or a near-field detector. The engines' chunk steps take it as an argument
(``sample=``), and the refining and varying-probe steps the bound step (``step=``,
``gradient=``), so position refinement and a varying probe compose with every sample without a
class per combination. No dask.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from . import ad, lsqml
from . import multislice as ms
from .forward_model import THIN, ForwardModel

SampleModel = ForwardModel


def forward_model(sample: ForwardModel | None) -> ForwardModel:
    """The forward model of ``sample`` (None: one slice in the far field)."""
    return THIN if sample is None else sample


def carries_position_sums(sample: SampleModel | None) -> bool:
    """Whether position refinement's sums go through transforms for ``sample`` (K slices or a
    near-field detector; :mod:`.multislice_positions`), so that its chunks keep what they carried."""
    return sample is not None and (sample.n_slices > 1 or sample.detector is not None)


def lsqml_step(sample: SampleModel | None):
    """The LSQML chunk step through ``sample`` (:func:`daskpty.engines.lsqml.chunk_step`)."""
    return partial(lsqml.chunk_step, sample=forward_model(sample))


def ad_gradient(sample: SampleModel | None):
    """The AD chunk gradient through ``sample`` (:func:`daskpty.engines.ad.chunk_gradient`)."""
    return partial(ad.chunk_gradient, sample=forward_model(sample))


def ad_loss(sample: SampleModel | None):
    """The AD loss-only chunk function of ``sample``."""
    return partial(ad.chunk_loss, sample=forward_model(sample))


def forward_sums(sample: SampleModel | None):
    """Σ measured and Σ model intensity of a chunk (the first epoch's probe rescale)."""
    return partial(lsqml.forward_sums, sample=forward_model(sample))


def lsqml_apply(sample: SampleModel | None):
    """``apply`` of the LSQML state of ``sample`` ((H, W) or (K, H, W) object)."""
    return lsqml.apply


def lsqml_end_epoch(sample: SampleModel | None):
    """``end_epoch`` of the LSQML state of ``sample`` (slices normalised one by one)."""
    return lsqml.end_epoch if sample is None else ms.end_epoch


def as_slices(obj, sample: SampleModel | None):
    """The object in the layout ``sample`` keeps: (H, W) for None, else (K, H, W) complex64."""
    if sample is None:
        return obj
    obj = np.asarray(obj, dtype=np.complex64)
    return obj[None] if obj.ndim == 2 else obj
