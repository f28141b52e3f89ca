"""A varying probe (OPR eigen-probes and weights, intensity factors, background) as a part that
any engine's adapter holds, rather than a subclass per engine.

:class:`ProbeModelPart` carries the probe model's options and does for an adapter what the
model adds to the round loop: the per-pattern state it keeps with each chunk, the global arrays
of the state (eigen-probes, the last orthonormalisation's weight transform T, background) and
their checkpoint names, the payload fields every chunk needs, and the first-epoch rescale of
the eigen-probes. The engines' per-chunk mathematics is in :mod:`daskpty.engines.lsqml_opr`
and :mod:`daskpty.engines.ad.opr`.
"""
from __future__ import annotations

import numpy as np

from ..engines import probe_model as pm
from ..engines.eigen_probes import initial_eigen_probes

#: Engine-state names of the probe model's global arrays (checkpoints, results).
EIGEN, TRANSFORM, BACKGROUND = "opr_eigen_probes", "opr_weight_transform", "background"


class ProbeModelPart:
    """The probe model ``model`` as used by engine ``engine`` (``"lsqml"`` or ``"ad"``)."""

    def __init__(self, model: pm.ProbeModelOptions, engine: str):
        self.model = model
        self.engine = engine

    @property
    def per_pattern(self) -> bool:
        """Whether the model keeps per-pattern state (weights, intensity factors) with the chunks."""
        return self.model.per_pattern

    def initial_local(self, n_patterns: int) -> dict:
        return pm.initial_local(n_patterns, self.model.for_engine(self.engine))

    def payload_fields(self, state) -> dict:
        """What every chunk step needs besides object and probe."""
        return {"model": self.model, "eigen": state.eigen_probes, "transform": state.weight_transform,
                "background": state.background}

    def attach(self, state, probe, engine_state: dict | None) -> None:
        """The model's arrays on a new state: resumed from ``engine_state`` or initial."""
        engine_state = engine_state or {}
        n = np.shape(probe)[-1]
        eigen = engine_state.get(EIGEN)
        if eigen is None and self.model.n_eigen:
            eigen = initial_eigen_probes(np.asarray(probe)[0], self.model.n_eigen)
        state.eigen_probes = None if eigen is None else np.asarray(eigen, np.complex64)
        state.weight_transform = engine_state.get(TRANSFORM)
        background = engine_state.get(BACKGROUND)
        state.background = pm.initial_background(self.model, n) if background is None else np.asarray(background)

    @staticmethod
    def stored(state) -> dict:
        """The model's arrays a checkpoint keeps to resume bit for bit."""
        out = {}
        for name, value in ((EIGEN, state.eigen_probes), (TRANSFORM, state.weight_transform),
                            (BACKGROUND, state.background)):
            if value is not None:
                out[name] = value
        return out

    @staticmethod
    def rescaled(state, before: np.ndarray):
        """After the first-epoch probe rescale: the eigen-probes scale with the mean probe."""
        if state.eigen_probes is not None:
            b, a = np.linalg.norm(before[0]), np.linalg.norm(state.probe[0])
            if b > 0:
                state.eigen_probes = (state.eigen_probes * np.float32(a / b)).astype(np.complex64)
        return state

    @staticmethod
    def epoch_scalars(state) -> dict:
        return {} if state.background is None else {"background_mean": float(np.mean(state.background))}
