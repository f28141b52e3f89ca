"""Shared helpers for the benchmark scripts (not part of the package, not run in CI)."""
from __future__ import annotations

import os
import resource
import time



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
    from daskpty.metrics import nrmse_vs_truth

    return float(nrmse_vs_truth(obj, positions, illumination, truth, fraction))


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
