"""Shared helpers for the benchmark scripts (not part of the package, not run in CI)."""
from __future__ import annotations

import os
import resource
import time

import numpy as np


def peak_rss_mib() -> float:
    """Peak resident memory of this process and its finished children (MiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0


def simulated(path: str, preset: str = "small", **kw):
    """Open (simulating first if needed) a simulated data set."""
    import daskpty

    if not os.path.exists(path):
        daskpty.simulate(path, preset=preset, **kw)
    return daskpty.open_data(path)


def object_nrmse_in_truth_frame(obj, positions, truth, illumination, fraction: float = 0.3) -> float:
    """NRMSE of an object (in a frame where the scan sits at ``positions``) against ``truth``,
    on the region illuminated above ``fraction`` of the maximum."""
    from daskpty.metrics import nrmse

    offset = np.round(np.median(np.asarray(positions) - np.asarray(truth.positions), axis=0)).astype(int)
    t = np.asarray(truth.object)
    est = np.ones_like(t)
    lit = np.zeros(t.shape, bool)
    ty, tx = t.shape
    ys, xs = max(0, offset[0]), max(0, offset[1])
    ye, xe = min(obj.shape[0], ty + offset[0]), min(obj.shape[1], tx + offset[1])
    est[ys - offset[0]:ye - offset[0], xs - offset[1]:xe - offset[1]] = obj[ys:ye, xs:xe]
    lit_full = illumination > fraction * illumination.max()
    lit[ys - offset[0]:ye - offset[0], xs - offset[1]:xe - offset[1]] = lit_full[ys:ye, xs:xe]
    return float(nrmse(est, t, mask=lit))


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
