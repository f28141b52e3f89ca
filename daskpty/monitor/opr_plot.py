"""Figures of a varying probe (OPR): the eigen-probes and the weight maps over the scan.

Matplotlib is imported inside the functions (optional dependency), as in :mod:`.plot`.
"""
from __future__ import annotations

import numpy as np

from .plot import _mark, _mpl, complex_to_rgb


def plot_eigen_probes(axes, rec):
    """The mean probe (U_0, ``rec.probe[0]``) and the eigen-probes U_1 … as colour-wheel images
    (hue: phase, brightness: amplitude), one per axis."""
    _mpl()
    eigen = rec.eigen_probes
    modes = [np.asarray(rec.probe)[0]] + ([] if eigen is None else list(np.asarray(eigen)))
    for k, (ax, u) in enumerate(zip(axes, modes)):
        ax.imshow(complex_to_rgb(u / (np.abs(u).max() or 1.0)))
        ax.set_title("mean probe U0" if k == 0 else f"eigen-probe U{k}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])


def plot_weight_map(ax, rec, k: int):
    """Weight ``k`` of every pattern (``rec.probe_weights[:, k]``) at its scan position."""
    _mpl()
    w = np.asarray(rec.probe_weights)[:, k]
    pos = np.asarray(rec.positions)
    dots = ax.scatter(pos[:, 1], pos[:, 0], c=w, s=max(4.0, 4000.0 / len(pos)), cmap="coolwarm" if k else "viridis")
    ax.figure.colorbar(dots, ax=ax, shrink=0.8)
    ax.invert_yaxis()
    ax.set_aspect("equal")
    ax.set_title(f"weight of U{k} over the scan", fontsize=9)
    ax.set_xlabel("x [px]")
    ax.set_ylabel("y [px]")
    return w


def opr_figure(rec, *, figsize=None):
    """Eigen-probes (top row) and their weight maps over the scan (bottom row); a figure not
    registered with ``pyplot``. Panels are named ``"probe U<k>"`` and ``"weights U<k>"``."""
    _mpl()
    from matplotlib.figure import Figure  # lazy: optional dependency (daskpty[plot])

    k = np.asarray(rec.probe_weights).shape[1]
    fig = Figure(figsize=figsize or (3.2 * k + 1, 6.5), layout="constrained")
    grid = fig.add_gridspec(2, k)
    top = [fig.add_subplot(grid[0, i]) for i in range(k)]
    bottom = [fig.add_subplot(grid[1, i]) for i in range(k)]
    plot_eigen_probes(top, rec)
    for i in range(k):
        plot_weight_map(bottom[i], rec, i)
        _mark(top[i], f"probe U{i}")
        _mark(bottom[i], f"weights U{i}")
    fig.suptitle(f"orthogonal probe relaxation: {k} mode(s) over {len(rec.probe_weights)} patterns", fontsize=11)
    return fig
