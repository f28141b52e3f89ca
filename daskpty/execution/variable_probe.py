"""Adapters of the engines with a varying probe (OPR, intensity factors, background).

:class:`VariableLSQMLAdapter` and :class:`VariableADAdapter` extend the plain adapters (which
stay today's code path when the probe does not vary): the payload gains the probe model, the
eigen-probes, the last orthonormalisation's weight transform T and the background; each chunk's
per-pattern state is the union of what its enabled features keep (refined positions and their
optimiser memory, OPR weights, intensity factors); ``apply`` and ``end_epoch`` add the probe
model's global updates (see :mod:`daskpty.engines.lsqml_opr`, :mod:`daskpty.engines.ad.opr`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..engines import lsqml_opr
from ..engines import probe_model as pm
from ..engines.eigen_probes import initial_eigen_probes
from ..engines.positions import initial_local as position_local
from .driver import LSQMLAdapter, LSQMLPayload

#: Engine-state names of the probe model's global arrays (checkpoints, results).
EIGEN, TRANSFORM, BACKGROUND = "opr_eigen_probes", "opr_weight_transform", "background"


@dataclass
class VariableLSQMLPayload(LSQMLPayload):
    model: pm.ProbeModelOptions | None = None
    eigen: np.ndarray | None = None
    transform: np.ndarray | None = None
    background: np.ndarray | None = None


def variable_lsqml_chunk(intensities, positions, payload: VariableLSQMLPayload, local=None):
    """The LSQML chunk step with the varying probe (``positions`` nominal when refining)."""
    return lsqml_opr.variable_chunk_step(
        payload.object, payload.probe, intensities, positions, local, options=payload.options,
        model=payload.model, eigen=payload.eigen, transform=payload.transform, background=payload.background,
        epoch=payload.epoch, update_probe=payload.update_probe, valid=payload.valid,
        positions=payload.positions, affine=payload.affine)


class _ProbeModelMixin:
    """What both engines' varying-probe adapters share: per-pattern state and the stored arrays."""

    model: pm.ProbeModelOptions
    engine_label = "lsqml"
    device_fields = ()  # the probe model's state stays on the host (not yet device-resident)

    @property
    def local_state(self) -> bool:
        return self.positions is not None or self.model.per_pattern

    def initial_local(self, nominal) -> dict:
        local = {} if self.positions is None else position_local(nominal, self.positions, self.engine_label)
        local.update(pm.initial_local(len(nominal), self.model.for_engine(self.engine_label)))
        return local

    # The adapter protocol, extended (the engine's adapter comes next in the MRO).
    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        state = super().new_state(obj, probe, epoch, engine_state)
        self._attach(state, probe, engine_state)
        return state

    def engine_state(self, state) -> dict:
        return {**super().engine_state(state), **self._stored(state)}

    def initialise(self, client, data, state, *, split_every: int):
        before = state.probe
        return self._rescaled(super().initialise(client, data, state, split_every=split_every), before)

    def _with_model(self, payload_cls, base, state):
        """The engine's payload ``base`` as a ``payload_cls`` that also carries the probe model."""
        return payload_cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                           model=self.model, eigen=state.eigen_probes,
                           transform=state.weight_transform, background=state.background)

    def _attach(self, state, probe, engine_state: dict | None) -> None:
        engine_state = engine_state or {}
        n = np.shape(probe)[-1]
        eigen = engine_state.get(EIGEN)
        if eigen is None and self.model.n_eigen:
            eigen = initial_eigen_probes(np.asarray(probe)[0], self.model.n_eigen)
        state.eigen_probes = None if eigen is None else np.asarray(eigen, np.complex64)
        state.weight_transform = engine_state.get(TRANSFORM)
        background = engine_state.get(BACKGROUND)
        state.background = pm.initial_background(self.model, n) if background is None else np.asarray(background)

    def _stored(self, state) -> dict:
        out = {}
        for name, value in ((EIGEN, state.eigen_probes), (TRANSFORM, state.weight_transform),
                            (BACKGROUND, state.background)):
            if value is not None:
                out[name] = value
        return out

    def _rescaled(self, state, before: np.ndarray):
        """After the first-epoch probe rescale: the eigen-probes scale with the mean probe."""
        if state.eigen_probes is not None:
            b, a = np.linalg.norm(before[0]), np.linalg.norm(state.probe[0])
            if b > 0:
                state.eigen_probes = (state.eigen_probes * np.float32(a / b)).astype(np.complex64)
        return state

    def epoch_scalars(self, state) -> dict:
        out = super().epoch_scalars(state)
        if state.background is not None:
            out["background_mean"] = float(np.mean(state.background))
        return out


class VariableLSQMLAdapter(_ProbeModelMixin, LSQMLAdapter):
    """:class:`LSQMLAdapter` with a varying probe."""

    chunk_function = staticmethod(variable_lsqml_chunk)

    def __init__(self, options, valid=None, positions=None, model: pm.ProbeModelOptions | None = None):
        super().__init__(options, valid, positions)
        self.model = model

    def payload(self, state) -> VariableLSQMLPayload:
        return self._with_model(VariableLSQMLPayload, super().payload(state), state)

    def apply(self, state, total):
        state = super().apply(state, total)
        if total is not None:
            lsqml_opr.apply(state, total, self.model, self.options.delta, self.valid)
        return state

    def end_epoch(self, state):
        lsqml_opr.end_epoch(state, self.model)
        return super().end_epoch(state)


def with_probe_model(adapter, model: pm.ProbeModelOptions | None):
    """The varying-probe adapter of the same engine, options, mask and position refinement
    (``adapter`` itself when ``model`` is None: the probe does not vary)."""
    if model is None:
        return adapter
    if adapter.name == "ad":
        from .ad_variable import VariableADAdapter

        return VariableADAdapter(adapter.options, adapter.valid, adapter.positions, model=model)
    return VariableLSQMLAdapter(adapter.options, adapter.valid, adapter.positions, model=model)
