"""An acquisition stand-in: a simulated scan written at a frame rate into a live store.

Frames are computed in this process in acquisition order and appended through
:class:`daskpty.ScanWriter` in blocks of :data:`BLOCK_SECONDS` worth of frames, each when its
last frame would have been recorded (frame ``i`` at ``(i + 1) / rate`` seconds after the start),
so tests, demos and benchmarks can follow a store that grows as a real scan's would.
"""
from __future__ import annotations

import math
import time
import warnings

#: seconds of frames per block
BLOCK_SECONDS = 0.25


def block_frames(rate: float) -> int:
    """Frames per block at ``rate`` frames per second (at least one)."""
    return max(1, round(rate * BLOCK_SECONDS))


def acquire(path, cfg, meta: dict, obj, probe, guess, positions, truth, rate: float, simulate_patterns, *,
            overwrite: bool = False, progress: bool = False) -> float:
    """Write the scan ``cfg`` (see :func:`daskpty.simulate`) into a live store at ``path`` at
    ``rate`` frames per second and end it; returns the seconds from the first frame's start to
    the end. ``simulate_patterns(obj, probe, positions, start, seed, dose, dtype)`` makes a
    block's frames (the simulator's own). Warns when computing the frames could not keep up
    with the rate."""
    from ..io.live import ScanWriter
    from ..io.progress import TextProgress

    n_total, step = cfg.n_patterns, block_frames(rate)
    bar = TextProgress(math.ceil(n_total / step), "acquire", unit="blocks", item="frames",
                       enabled=progress)
    stats = {"saturated": 0, "total": 0.0, "max": 0.0}
    with ScanWriter(path, pattern_shape=(cfg.probe_size, cfg.probe_size), dtype=cfg.dtype,
                    planned_frames=n_total, probe=guess, truth=truth, attributes=meta,
                    overwrite=overwrite) as writer:
        start = time.monotonic()
        try:
            for s in range(0, n_total, step):
                e = min(n_total, s + step)
                frames, st = simulate_patterns(obj, probe, positions[s:e], s, cfg.seed, cfg.dose,
                                               cfg.dtype)
                delay = start + e / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                writer.append(frames, positions[s:e])
                stats["saturated"] += st["saturated"]
                stats["total"] += st["total"]
                stats["max"] = max(stats["max"], st["max"])
                bar.update(1, e - s)
        finally:
            bar.close()
        _record_stats(path, stats, n_total)
        elapsed = time.monotonic() - start
    achieved = n_total / elapsed if elapsed > 0 else float("inf")
    if elapsed > 1.1 * n_total / rate + BLOCK_SECONDS:  # more than a block's lag behind the rate
        warnings.warn(f"the scan was written at {achieved:,.0f} frames/s, below the requested "
                      f"{rate:g}: computing the frames is slower than that here; lower --rate or "
                      f"the pattern size", UserWarning, stacklevel=3)
    if stats["saturated"]:
        warnings.warn(f"{stats['saturated']} pixel values exceeded the {cfg.dtype} range and were "
                      f"clipped (detector saturation); use dtype='uint32' or a lower dose",
                      UserWarning, stacklevel=3)
    return elapsed


def _record_stats(path, stats: dict, n_total: int) -> None:
    """The realised counts in the ``simulation`` attribute, as the batch simulator records them."""
    import zarr

    group = zarr.open_group(path, mode="r+")
    sim = dict(group.attrs["simulation"])
    sim["saturated_values"] = stats["saturated"]
    sim["mean_counts_per_pattern"] = stats["total"] / n_total
    sim["max_count"] = stats["max"]
    group.attrs["simulation"] = sim
