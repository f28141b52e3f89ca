"""LSQML's state through K slices or to a near-field detector: the (K, H, W) object's update
(:func:`apply`, each slice preconditioned by its own illumination), the epoch end (the slices'
scale ambiguity removed one by one) and the names that bind the forward model's kernels
(:func:`chunk_step`, :func:`forward_sums`, :func:`SliceChunk`). The chunk step itself is
:func:`daskpty.engines.lsqml.chunk_step` (after the multislice LSQML of PtychoShelves' GPU_MS:
per-slice directions and a joint (K + 1)-unknown step system). No dask in here.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..physics import get_xp
from ..physics.multislice import (detector_forward, multislice_forward,  # noqa: F401  (the tests' names)
                                  multislice_vjp)
from . import lsqml
from .forward_model import ForwardModel
from .lsqml import (STEP_SAMPLE_MIN, STEP_STRIDE, LSQMLOptions, LSQMLState,  # noqa: F401  (re-exported)
                    begin_epoch, rescale_probe, step_sample_stride)
from .partials import Partial


def SliceChunk(obj, probe, intensities, positions, kernel, detector, cdtype=np.complex64, variable=None):
    """The whole chunk as one block of the forward model through ``kernel``'s slices to
    ``detector`` (:class:`~.forward_model.Block`: box, windows, ramps, S_f P, the incident, exit and
    detected waves); obj (K, H, W) or (H, W)."""
    obj = obj[None] if obj.ndim == 2 else obj
    c = ForwardModel(obj.shape[0], kernel, detector).chunk(obj, probe, intensities, positions, cdtype=cdtype,
                                                           variable=variable, whole=True)
    return c.forward(c.blocks[0])


def chunk_step(obj, probe, intensities, positions, *, kernel=None, detector=None, window_sums: bool = False,
               **keywords) -> Partial:
    """:func:`daskpty.engines.lsqml.chunk_step` through the slices of ``kernel`` to ``detector``
    (obj (K, H, W), or (H, W) for K = 1)."""
    obj = obj[None] if obj.ndim == 2 else obj
    return lsqml.chunk_step(obj, probe, intensities, positions, sample=ForwardModel(obj.shape[0], kernel, detector),
                            window_sums=window_sums, **keywords)


apply = lsqml.apply   # (it takes (K, H, W) objects)


def end_epoch(state: LSQMLState, options: LSQMLOptions, *, agree: bool | None = None,
              scales=None, in_place: bool = False) -> LSQMLState:
    """:func:`daskpty.engines.lsqml.end_epoch` (momentum, mode orthogonalisation) with the scale
    ambiguity removed slice by slice (:func:`normalize_scale`). ``agree`` and ``scales`` (the
    slices' mean |O_k| where lit) come from outside when the state holds a tile; ``in_place``
    as :func:`daskpty.engines.lsqml.end_epoch`."""
    owned = lsqml.owned_at_end(state, options, in_place)
    state = lsqml.end_epoch(state, dataclasses.replace(options, normalize_every=0), agree=agree, in_place=in_place)
    if options.normalize_every and state.epoch % options.normalize_every == 0:
        normalize_scale(state, scales, owned)
    return state


def normalize_scale(state: LSQMLState, scales=None, owned: tuple = ()) -> None:
    """Remove the slices' scale ambiguity O_k c_k, P / Π c_k: mean |O_k| = 1 where slice k is lit
    (``scales``: those means, when the state holds only a tile of the object; ``owned``: the
    arrays it may divide in place, "object" and "velocity")."""
    if state.illumination is None and scales is None:
        return
    obj = state.object if "object" in owned else state.object.copy()
    velocity_owned = "velocity" in owned
    total = 1.0
    for k in range(obj.shape[0]):
        if scales is not None:
            c = float(scales[k])
        else:
            w = state.illumination[k]
            lit = w > 0.5 * w.max()
            c = float(get_xp(obj).abs(obj[k][lit]).mean()) if bool(lit.any()) else 0.0
        if c > 0 and np.isfinite(c):
            obj[k] /= np.float32(c)
            total *= c
            if state.velocity is not None:
                if not velocity_owned:  # (once: a copy per slice cost K of them)
                    state.velocity, velocity_owned = state.velocity.copy(), True
                state.velocity[k] /= np.float32(c)
    state.object = obj
    state.probe = (state.probe * np.float32(total)).astype(np.complex64)
    if state.eigen_probes is not None:  # they scale with the mean probe (weights unchanged)
        state.eigen_probes = (state.eigen_probes * np.float32(total)).astype(np.complex64)


def forward_sums(obj, probe, intensities, positions, *, kernel=None, detector=None, valid=None) -> Partial:
    """Σ measured and Σ model intensity of one chunk (for :func:`rescale_probe`)."""
    obj = obj[None] if obj.ndim == 2 else obj
    return lsqml.forward_sums(obj, probe, intensities, positions, sample=ForwardModel(obj.shape[0], kernel, detector),
                              valid=valid)
