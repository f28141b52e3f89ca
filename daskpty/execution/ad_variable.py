"""The AD engine's adapter with a varying probe (see :mod:`.variable_probe`)."""
from __future__ import annotations

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
        return self._with_model(VariableADPayload, super().payload(state, object, probe), state)

    def apply(self, state, total, evaluate=None):
        state = super().apply(state, total, evaluate)
        if total is not None:
            ad_opr.apply(state, total, self.model, self.options.loss, self.options.delta)
        return state

    def end_epoch(self, state):
        lsqml_opr.end_epoch(state, self.model)   # the same orthonormalisation and T
        state = super().end_epoch(state)
        return state
