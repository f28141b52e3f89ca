"""Figure of a data set as imported: scan positions and the mean diffraction pattern (log).

Matplotlib is optional (``pip install 'daskpty[plot]'``) and imported inside the function; the
figure is a plain :class:`matplotlib.figure.Figure` (no pyplot state, headless-safe).
"""
from __future__ import annotations

import numpy as np

#: linear overlap below which ``daskpty info`` warns
LOW_OVERLAP = 0.5


def mean_pattern(data) -> np.ndarray:
    """Mean of all patterns of a data set (one streamed pass over the store, dask threads)."""
    return np.asarray(data.intensities.mean(axis=0, dtype=np.float64).compute(scheduler="threads"))


def scan_figure(data, mean=None, probe_diameter_px: float | None = None):
    """Two panels: positions (x right, y down, coloured by pattern index, one probe-sized circle
    at the first position) and the mean pattern on a log scale, masked pixels blank."""
    from matplotlib.figure import Figure  # lazy: optional dependency (daskpty[plot])
    from matplotlib.patches import Circle  # lazy: optional dependency (daskpty[plot])

    mean = mean_pattern(data) if mean is None else np.asarray(mean, dtype=np.float64)
    fig = Figure(figsize=(10, 4.6), layout="constrained")
    ax_scan, ax_mean = fig.subplots(1, 2)
    pos = data.positions
    dots = ax_scan.scatter(pos[:, 1], pos[:, 0], c=np.arange(len(pos)), s=8, cmap="viridis")
    if probe_diameter_px:
        ax_scan.add_patch(Circle((pos[0, 1], pos[0, 0]), probe_diameter_px / 2, fill=False,
                                 color="tab:red", lw=1.2, label="probe (estimate)"))
        ax_scan.legend(loc="upper right", fontsize=8)
    ax_scan.set_aspect("equal")
    ax_scan.invert_yaxis()
    ax_scan.set_xlabel("x (object pixels)")
    ax_scan.set_ylabel("y (object pixels)")
    ax_scan.set_title(f"scan: {len(pos):,} positions")
    fig.colorbar(dots, ax=ax_scan, label="pattern index", shrink=0.8)
    shown = np.where(mean > 0, mean, np.nan)
    if data.mask is not None:
        shown = np.where(data.mask, shown, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        image = ax_mean.imshow(np.log10(shown), cmap="magma", interpolation="nearest")
    n = mean.shape[-1]
    ax_mean.plot([n / 2], [n / 2], "+", color="cyan", ms=10, label="pattern centre")
    ax_mean.legend(loc="upper right", fontsize=8)
    ax_mean.set_title("mean diffraction pattern (log10 counts)")
    fig.colorbar(image, ax=ax_mean, shrink=0.8)
    return fig
