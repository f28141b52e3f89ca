"""The AD engine's adapter with a varying probe (see :mod:`.variable_probe`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..engines import lsqml_opr
from ..engines import probe_model as pm
from ..engines.ad import opr as ad_opr
from .ad_adapter import ADAdapter, ADPayload
from .variable_probe import _ProbeModelMixin


@dataclass
class VariableADPayload(ADPayload):
    model: pm.ProbeModelOptions | None = None
    eigen: np.ndarray | None = None
    transform: np.ndarray | None = None
    background: np.ndarray | None = None


def variable_ad_chunk(intensities, positions, payload: VariableADPayload, local=None):
    return ad_opr.variable_chunk_gradient(
        payload.object, payload.probe, intensities, positions, local, options=payload.options,
        model=payload.model, eigen=payload.eigen, transform=payload.transform, background=payload.background,
        epoch=payload.epoch, valid=payload.valid, want_object=payload.want_object,
        want_probe=payload.want_probe, positions=payload.positions, affine=payload.affine)


class VariableADAdapter(_ProbeModelMixin, ADAdapter):
    """:class:`ADAdapter` with a varying probe (Adam / SGD; the CG line search is not offered)."""

    chunk_function = staticmethod(variable_ad_chunk)
    engine_label = "ad"

    def __init__(self, options=None, valid=None, positions=None, model: pm.ProbeModelOptions | None = None):
        super().__init__(options, valid, positions)
        if self.options.optimizer == "cg":
            raise ValueError("opr_modes / fit_intensity / background with engine='ad' need optimizer "
                             "'sgd' or 'adam' (the CG line search does not move per-pattern parameters)")
        self.model = model

    def payload(self, state, object=None, probe=None) -> VariableADPayload:
        base = super().payload(state, object, probe)
        return VariableADPayload(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                 model=self.model, eigen=state.eigen_probes,
                                 transform=state.weight_transform, background=state.background)

    def apply(self, state, total, evaluate=None):
        state = super().apply(state, total, evaluate)
        if total is not None:
            ad_opr.apply(state, total, self.model, self.options.loss, self.options.delta)
        return state

    def end_epoch(self, state):
        lsqml_opr.end_epoch(state, self.model)   # the same orthonormalisation and T
        state = super().end_epoch(state)
        return state

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        state = super().new_state(obj, probe, epoch, engine_state)
        self._attach(state, probe, engine_state)
        return state

    def engine_state(self, state) -> dict:
        return {**super().engine_state(state), **self._stored(state)}

    def initialise(self, client, data, state, *, split_every: int):
        before = state.probe
        return self._rescaled(super().initialise(client, data, state, split_every=split_every), before)
