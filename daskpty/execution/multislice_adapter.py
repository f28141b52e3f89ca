"""Binds the multislice engines (:mod:`daskpty.engines.multislice`) to the round loop.

Same protocol as :class:`~.driver.LSQMLAdapter` and :class:`~.ad_adapter.ADAdapter`
(``chunk_function``, ``payload``, ``apply``, ``begin_epoch``, ``end_epoch``, ``initialise``,
``new_state``, ``engine_state``, ``copy_state``). The state's object is (K, H, W) — also for
K = 1 in the near field — and so are the velocity and illumination; every partial holds K boxed
slices. The payload carries, besides the state's object and probe, the slice-to-slice kernel
``SliceGeometry(K, Δz, λ, Δx).kernel(n)`` (None for K = 1) and the detector operator (None: far
field; else the near-field transfer function), both (n, n) complex64, broadcast with it.

:func:`multislice_adapter` turns the single-slice adapter that ``reconstruct`` built into its
multislice counterpart when the sample needs it (K > 1 or a near-field detector); K = 1 in the far
field keeps the single-slice adapter, so that path stays bit for bit what it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines import multislice as ms
from .ad_adapter import ADAdapter, ADPayload
from .driver import LSQMLAdapter, LSQMLPayload
from .rounds import map_reduce


# --------------------------------------------------------------------------------------------------
# LSQML


@dataclass
class MultisliceLSQMLPayload(LSQMLPayload):
    kernel: np.ndarray | None = None
    detector: np.ndarray | None = None


def ms_lsqml_chunk(intensities, positions, payload: MultisliceLSQMLPayload, local=None):
    """The multislice LSQML chunk step (no per-pattern state: position refinement is refused)."""
    return ms.chunk_step(payload.object, payload.probe, intensities, positions, options=payload.options,
                         kernel=payload.kernel, detector=payload.detector,
                         update_probe=payload.update_probe, valid=payload.valid)


def ms_forward_sums_chunk(intensities, positions, payload):
    return ms.forward_sums(payload.object, payload.probe, intensities, positions, kernel=payload.kernel,
                           detector=payload.detector, valid=payload.valid)


class MultisliceLSQMLAdapter(LSQMLAdapter):
    """LSQML multislice: per-slice directions and joint step lengths, (K, H, W) state."""

    chunk_function = staticmethod(ms_lsqml_chunk)

    def __init__(self, options, valid=None, *, kernel=None, detector=None):
        super().__init__(options, valid, None)
        self.kernel, self.detector = kernel, detector

    def payload(self, state) -> MultisliceLSQMLPayload:
        return MultisliceLSQMLPayload(state.object, state.probe, self.options, state.update_probe(self.options),
                                      self.valid, kernel=self.kernel, detector=self.detector)

    def apply(self, state, total):
        return ms.apply(state, total, self.options)

    def end_epoch(self, state):
        return ms.end_epoch(state, self.options)

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        return super().new_state(_slices(obj), probe, epoch, engine_state)

    def initialise(self, client, data, state, *, split_every: int):
        """First-epoch probe intensity rescale so that Σŷ = Σy (through the slices and detector)."""
        sums = map_reduce(client, data, ms_forward_sums_chunk, self.payload(state), split_every=split_every)
        return ms.rescale_probe(state, sums)


# --------------------------------------------------------------------------------------------------
# AD


@dataclass
class MultisliceADPayload(ADPayload):
    kernel: np.ndarray | None = None
    detector: np.ndarray | None = None


def ms_ad_gradient_chunk(intensities, positions, payload: MultisliceADPayload, local=None):
    """Exact gradients through the K slices (w.r.t. each slice and the probe)."""
    o = payload.options
    part = ms.chunk_gradient(payload.object, payload.probe, intensities, positions, kernel=payload.kernel,
                             detector=payload.detector, loss=o.loss, valid=payload.valid, eps=o.eps,
                             want_probe=payload.want_probe)
    if not payload.want_object:
        part.boxes.pop("object_grad", None)
    return part


def ms_ad_loss_chunk(intensities, positions, payload: MultisliceADPayload, local=None):
    """The loss only (CG line search)."""
    o = payload.options
    return ms.chunk_loss(payload.object, payload.probe, intensities, positions, kernel=payload.kernel,
                         detector=payload.detector, loss=o.loss, valid=payload.valid, eps=o.eps)


class MultisliceADAdapter(ADAdapter):
    """AD multislice: the AD engine's optimisers on the (K, H, W) object and the probe."""

    chunk_function = staticmethod(ms_ad_gradient_chunk)
    loss_function = staticmethod(ms_ad_loss_chunk)

    def __init__(self, options=None, valid=None, *, kernel=None, detector=None):
        super().__init__(options, valid, None)
        self.kernel, self.detector = kernel, detector

    def payload(self, state, object=None, probe=None) -> MultisliceADPayload:
        return MultisliceADPayload(state.object if object is None else object,
                                   state.probe if probe is None else probe, self.options,
                                   state.active("object", self.options), state.active("probe", self.options),
                                   self.valid, kernel=self.kernel, detector=self.detector)

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        return super().new_state(_slices(obj), probe, epoch, engine_state)

    def initialise(self, client, data, state, *, split_every: int):
        sums = map_reduce(client, data, ms_forward_sums_chunk, self.payload(state), split_every=split_every)
        from ..engines import ad

        return ad.rescale_probe(state, sums)


# --------------------------------------------------------------------------------------------------


def _slices(obj):
    obj = np.asarray(obj, dtype=np.complex64)
    return obj[None] if obj.ndim == 2 else obj


def multislice_adapter(adapter, sample):
    """The adapter for ``sample`` (a :class:`daskpty.sample.ResolvedSample`): ``adapter`` itself for
    a thin sample in the far field, else the multislice LSQML / AD adapter with its options.

    Raises ValueError (one line) for what the multislice engines do not support: position
    refinement and a varying probe (OPR, intensity factors, background).
    """
    if not sample.multislice:
        return adapter
    what = f"{sample.n_slices} slices" if sample.n_slices > 1 else "a near-field detector"
    if getattr(adapter, "positions", None) is not None:
        raise ValueError(f"position refinement (refine_positions) is not supported with {what}; "
                         "refine the positions on a single-slice far-field run first")
    if not isinstance(adapter, (LSQMLAdapter, ADAdapter)) or hasattr(adapter, "model"):
        raise ValueError(f"a varying probe (opr_modes, fit_intensity, background) is not supported with {what}")
    kernel = None if sample.kernel is None else np.asarray(sample.kernel, np.complex64)
    detector = None if sample.detector_kernel is None else np.asarray(sample.detector_kernel, np.complex64)
    if isinstance(adapter, ADAdapter):
        return MultisliceADAdapter(adapter.options, adapter.valid, kernel=kernel, detector=detector)
    return MultisliceLSQMLAdapter(adapter.options, adapter.valid, kernel=kernel, detector=detector)
