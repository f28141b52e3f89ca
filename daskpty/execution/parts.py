"""Composing an engine's adapter from the parts of the forward model a run asks for.

``reconstruct`` builds the engine's adapter from the registry, then hands it its parts here:
:func:`with_probe_model` (a varying probe) and :func:`with_sample` (K slices and/or a near-field
detector). Every engine that declares the feature in the registry takes every combination;
an engine that does not is refused there, in one line, before this point.
"""
from __future__ import annotations

import numpy as np

from ..engines.probe_model import ProbeModelOptions
from ..engines.sample_model import SampleModel
from ..engines.specs import engine_spec
from .ad_adapter import check_probe_model_optimizer
from .probe_model_part import ProbeModelPart


def with_probe_model(adapter, model: ProbeModelOptions | None):
    """``adapter`` with the varying probe ``model`` (None: the probe does not vary)."""
    if model is None:
        return adapter
    if engine_spec(adapter.name).gradient_based:
        check_probe_model_optimizer(adapter.options)
    adapter.probe_model = ProbeModelPart(model, adapter.name)
    return adapter


def sample_model(sample) -> SampleModel | None:
    """The engines' :class:`SampleModel` of a resolved sample (:class:`daskpty.engines.sample_options.ResolvedSample`):
    None for one slice in the far field (the single-slice code path, bit for bit what it was)."""
    if not sample.multislice:
        return None
    kernel = None if sample.kernel is None else np.asarray(sample.kernel, np.complex64)
    detector = None if sample.detector_kernel is None else np.asarray(sample.detector_kernel, np.complex64)
    return SampleModel(sample.n_slices, kernel, detector)


def with_sample(adapter, sample):
    """``adapter`` with the sample's forward model (slices, detector) of a resolved sample, and
    the engine's defaults that follow the slices resolved (AD's SGD momentum, LSQML's
    preconditioner δ: ``ADOptions.for_slices``, ``LSQMLOptions.for_slices``)."""
    adapter.sample = sample_model(sample)
    if hasattr(adapter.options, "for_slices"):
        adapter.options = adapter.options.for_slices(sample.n_slices)
    return adapter
