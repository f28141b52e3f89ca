"""The state the LSQML and PIE engines share (object, probe, epoch and the parts' memory), and a
robust mean of per-pattern step lengths. No dask."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class EngineState:
    """Object (H, W), or (K, H, W) through slices or to a near-field detector, and probe
    (M, n, n), complex64 on the host, plus the engine's and the parts' memory."""

    object: np.ndarray
    probe: np.ndarray
    epoch: int = 0
    velocity: np.ndarray | None = None      # momentum buffer (object frame)
    epoch_start_object: np.ndarray | None = None
    illumination: np.ndarray | None = None  # last epoch's Σ|S_f P|² (object frame, float32)
    extra: dict = field(default_factory=dict)
    affine: np.ndarray | None = None        # position refinement: map fitted after the last epoch
    affine_boost: np.ndarray | None = None  # the extra affine move of the next epoch (see positions)
    affine_sums: dict | None = None         # its normal equations, summed over this epoch's rounds
    window_sums: dict | None = None         # the windows' deformation sums of this epoch (positions)
    window_deformation: np.ndarray | None = None  # L (2, 2) of the last epoch, for the history
    window_map: np.ndarray | None = None    # the positions' map of the next epoch (3, 2), or None
    window_gram: np.ndarray | None = None   # the windows' normal matrix (4, 4) last formed (kept between)
    positions_start: int | None = None   # start epoch decided by start_epoch='auto' (positions)
    epoch_start_probe: np.ndarray | None = None  # the probe at the epoch's start, while undecided
    eigen_probes: np.ndarray | None = None  # varying probe (engines.probe_model): OPR eigen-probes U_1…
    weight_transform: np.ndarray | None = None  # T of the last orthonormalisation (chunks apply it)
    eigen_weight_sums: np.ndarray | None = None  # this epoch's count and Σ_j w_jk of the eigen-weights (K,)
    eigen_lag_sums: np.ndarray | None = None  # this epoch's Σ of neighbours' weight products and their count
    background: np.ndarray | None = None    # fitted background, (1, 1) or (n, n)

    def update_probe(self, options) -> bool:
        return options.probe_start_epoch is not None and self.epoch >= options.probe_start_epoch


def trimmed_mean(x, xp, trim: float = 0.1) -> float:
    """Mean of ``x`` (B,) without its ``trim`` smallest and largest shares."""
    n = x.shape[0]
    k = int(n * trim)
    if n - 2 * k <= 0:
        return float(x.mean())
    return float(xp.sort(x)[k:n - k].mean())
