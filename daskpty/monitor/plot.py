"""Figures of a reconstruction: object, probe modes, loss curve and FRC against ground truth.

Matplotlib is an optional dependency (``pip install 'daskpty[plot]'``); it is imported inside the
functions, so importing this module costs nothing. Figures are built on
:class:`matplotlib.figure.Figure` directly (no ``pyplot`` state, no GUI backend), which makes them
safe in headless processes and threads.

The panel-drawing functions take the axes to draw into, so they compose into any layout;
:func:`summary_figure` puts them together and :func:`summary_panels` says which panels it makes.
"""
from __future__ import annotations

import math

import numpy as np

from ..metrics import align, frc
from ..metrics import truth_frame as _truth_frame
from ..physics import mode_powers

__all__ = [
    "MAX_PROBE_PANELS", "complex_to_rgb", "format_length", "panel_names", "plot_frc", "plot_history",
    "plot_object", "plot_positions", "plot_probe", "scale_bar", "scale_bar_length", "summary_figure", "summary_panels",
    "truth_frame",
]

#: at most this many probe modes get a panel in :func:`summary_figure` (strongest first)
MAX_PROBE_PANELS = 8
#: illumination fraction (of the maximum) that delimits the displayed object region
DISPLAY_FRACTION = 0.1
#: illumination fraction that delimits the region compared with the truth (FRC)
COMPARE_FRACTION = 0.3

_PANEL_LABEL = "daskpty-panel:"


def _mpl():
    try:
        import matplotlib  # lazy: optional dependency (daskpty[plot])
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("daskpty figures need matplotlib: pip install 'daskpty[plot]'") from exc
    return matplotlib


# ------------------------------------------------------------------------------------ helpers


def format_length(metres: float) -> str:
    """``2e-6 -> '2 µm'``, ``5e-7 -> '500 nm'``: a length with the unit that gives a value ≥ 1."""
    m = float(metres)
    for unit, scale in (("m", 1.0), ("mm", 1e-3), ("µm", 1e-6), ("nm", 1e-9), ("pm", 1e-12)):
        if abs(m) >= scale * (1 - 1e-9) or unit == "pm":
            return f"{m / scale:.3g} {unit}"
    return f"{m:g} m"  # pragma: no cover


def scale_bar_length(width_m: float, target: float = 0.25) -> float:
    """The largest round length (1, 2 or 5 × 10^k m) not longer than ``target`` × ``width_m``."""
    if not (width_m > 0 and math.isfinite(width_m)):
        raise ValueError(f"image width must be a positive length, got {width_m}")
    goal = target * width_m
    k = math.floor(math.log10(goal))
    best = 10.0 ** k
    for d in (1, 2, 5, 10):
        if d * 10.0 ** k <= goal * (1 + 1e-9):
            best = d * 10.0 ** k
    return best


def scale_bar(ax, pixel_size_m: float, width_px: float, *, origin=(0.0, 0.0), height_px=None,
              color="white", fontsize=8):
    """Draw a round-length scale bar at the lower left of an image shown with ``extent`` starting at
    ``origin`` (y0, x0) in pixels and ``width_px`` wide. Returns the label's Text artist."""
    from matplotlib import patheffects  # lazy: optional dependency (daskpty[plot])
    from matplotlib.patches import Rectangle  # lazy: optional dependency (daskpty[plot])

    length_m = scale_bar_length(width_px * pixel_size_m)
    length_px = length_m / pixel_size_m
    y0, x0 = origin
    ylim = ax.get_ylim()
    height_img = abs(ylim[1] - ylim[0])
    bar_h = height_px if height_px is not None else max(height_img * 0.018, 0.5)
    margin = 0.05 * width_px
    # images are shown with origin="upper": y grows downwards, so the lower edge is max(ylim)
    y_bottom = max(ylim) - 0.06 * height_img
    outline = [patheffects.withStroke(linewidth=2.5, foreground="black")]
    rect = Rectangle((x0 + margin, y_bottom - bar_h), length_px, bar_h, facecolor=color,
                     edgecolor="black", linewidth=0.6, gid="scalebar")
    ax.add_patch(rect)
    text = ax.text(x0 + margin + length_px / 2, y_bottom - bar_h - 0.015 * height_img,
                   format_length(length_m), color=color, ha="center", va="bottom", fontsize=fontsize,
                   path_effects=outline, gid="scalebar")
    return text


def complex_to_rgb(z: np.ndarray) -> np.ndarray:
    """RGB image of a complex array: hue = phase, brightness = amplitude (normalised to its max)."""
    from matplotlib.colors import hsv_to_rgb  # lazy: optional dependency (daskpty[plot])

    amp = np.abs(z)
    top = float(amp.max()) if amp.size else 0.0
    hsv = np.empty(z.shape + (3,), dtype=np.float64)
    hsv[..., 0] = (np.angle(z) + np.pi) / (2 * np.pi)
    hsv[..., 1] = 1.0
    hsv[..., 2] = amp / top if top > 0 else 0.0
    return hsv_to_rgb(np.clip(hsv, 0.0, 1.0))


def _squeeze_image(x) -> np.ndarray:
    """A 2-D image; a multislice object (K, H, W) is projected: the product of its slices (its
    phase is the sum of the slices' phases)."""
    x = np.asarray(x)
    while x.ndim > 2 and x.shape[0] == 1:
        x = x[0]
    if x.ndim == 3 and np.iscomplexobj(x):
        x = np.prod(x, axis=0)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D object, got shape {x.shape}")
    return x


def _bbox(mask: np.ndarray):
    """(y0, y1, x0, x1), end-exclusive, of the True pixels (the whole image when none)."""
    rows = np.nonzero(mask.any(axis=1))[0]
    cols = np.nonzero(mask.any(axis=0))[0]
    if rows.size == 0:
        return 0, mask.shape[0], 0, mask.shape[1]
    return int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1


def _robust_limits(values: np.ndarray, lo=0.5, hi=99.5):
    values = values[np.isfinite(values)]
    if values.size == 0:
        return 0.0, 1.0
    a, b = np.percentile(values, [lo, hi])
    if not b > a:
        a, b = a - 0.5, b + 0.5
    return float(a), float(b)


def _mark(ax, name: str):
    ax.set_label(_PANEL_LABEL + name)


def panel_names(fig) -> list[str]:
    """Names of the panels of a figure made by :func:`summary_figure` (colour bars excluded)."""
    return [ax.get_label()[len(_PANEL_LABEL):] for ax in fig.axes
            if ax.get_label().startswith(_PANEL_LABEL)]


# ------------------------------------------------------------------------------------- panels


def plot_object(ax_phase, ax_amp, rec, pixel_size_m=None, *, fraction=DISPLAY_FRACTION,
                colorbar=True, slice_index=None, title=None):
    """Object phase (rad, global phase removed) and amplitude, cropped to the illuminated region.

    ``rec`` is a :class:`~daskpty.io.results.Reconstruction`; ``fraction`` the illumination threshold
    of :meth:`~daskpty.io.results.Reconstruction.illuminated`. With ``pixel_size_m`` each image gets a
    scale bar in metres, otherwise the axes are in object pixels. Either axis may be ``None``.
    A multislice object (K, H, W) is drawn projected (sum of the slices' phases), or its slice
    ``slice_index`` alone. ``title``: the phase panel's title. Returns the two image artists
    (``None`` for a skipped axis).
    """
    _mpl()
    obj = _squeeze_image(rec.object) if slice_index is None else np.asarray(rec.object)[slice_index]
    lit = rec.illuminated(fraction)
    if lit.ndim == 3:  # multislice: the entrance slice's illumination
        lit = lit[0]
    if lit.shape != obj.shape:
        lit = np.ones(obj.shape, dtype=bool)
    y0, y1, x0, x1 = _bbox(lit)
    crop = obj[y0:y1, x0:x1].astype(np.complex128)
    inside = lit[y0:y1, x0:x1]
    # remove the global phase (a free constant of the reconstruction) before showing the phase
    ref = np.sum(crop[inside])
    if abs(ref) > 0:
        crop = crop * np.exp(-1j * np.angle(ref))
    extent = (x0 - 0.5, x1 - 0.5, y1 - 0.5, y0 - 0.5)
    images = []
    for ax, values, cmap, label, unit in (
            (ax_phase, np.angle(crop), "viridis", title or "object phase", "rad"),
            (ax_amp, np.abs(crop), "gray", "object amplitude", "|O|")):
        if ax is None:
            images.append(None)
            continue
        vmin, vmax = _robust_limits(values[inside])
        im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, extent=extent, origin="upper",
                       interpolation="nearest")
        ax.set_title(label)
        if pixel_size_m:
            ax.set_xticks([])
            ax.set_yticks([])
            scale_bar(ax, float(pixel_size_m), x1 - x0, origin=(y0 - 0.5, x0 - 0.5))
        else:
            ax.set_xlabel("x [px]")
            ax.set_ylabel("y [px]")
        if colorbar:
            cb = ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
            cb.set_label(unit)
        images.append(im)
    return tuple(images)


def plot_probe(axes, probe, pixel_size_m=None, *, phase=True):
    """Each probe mode in its own axis, titled with its share of the total power.

    ``phase=True`` colour-encodes the phase (hue) with brightness = amplitude; ``False`` shows the
    amplitude alone. Each mode is normalised to its own maximum so weak modes stay visible. Modes
    beyond ``len(axes)`` are not drawn; surplus axes are hidden. Returns the power fractions.
    """
    _mpl()
    probe = np.asarray(probe)
    if probe.ndim == 2:
        probe = probe[None]
    if probe.ndim != 3:
        raise ValueError(f"probe must have shape (M, n, n), got {probe.shape}")
    axes = list(np.ravel(np.asarray(axes, dtype=object)))
    powers = np.asarray(mode_powers(probe))
    n_modes = probe.shape[0]
    for k, ax in enumerate(axes):
        if k >= n_modes:
            ax.set_visible(False)
            continue
        mode = probe[k]
        if phase:
            ax.imshow(complex_to_rgb(mode), origin="upper", interpolation="nearest")
        else:
            ax.imshow(np.abs(mode), cmap="magma", origin="upper", interpolation="nearest")
        if n_modes == 1:
            ax.set_title(f"probe: {100 * powers[k]:.1f} %", fontsize=9)
        else:  # two short lines: narrow panels side by side keep their titles apart
            ax.set_title(f"mode {k + 1}\n{100 * powers[k]:.1f} %", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        if pixel_size_m:
            scale_bar(ax, float(pixel_size_m), mode.shape[-1], origin=(-0.5, -0.5),
                      fontsize=8 if n_modes == 1 else 6)
    return powers


def plot_history(ax, history):
    """Data loss per epoch on a logarithmic axis. ``history`` is a list of dicts with ``loss``
    (and ``epoch``; the position in the list otherwise)."""
    _mpl()
    ax.set_title("data loss")
    ax.set_xlabel("epoch")
    rows = [h for h in (history or []) if isinstance(h, dict) and "loss" in h]
    epochs = np.array([float(h.get("epoch", i + 1)) for i, h in enumerate(rows)])
    loss = np.array([float(h["loss"]) if h["loss"] is not None else np.nan for h in rows])
    good = np.isfinite(loss) & (loss > 0)
    if not good.any():
        ax.text(0.5, 0.5, "no loss history", transform=ax.transAxes, ha="center", va="center")
        ax.set_yticks([])
        return
    ax.plot(epochs[good], loss[good], marker="." if good.sum() < 40 else None, lw=1.2)
    ax.set_yscale("log")
    ax.set_ylabel("loss per pattern")
    ax.grid(True, which="both", alpha=0.3)
    last = loss[good][-1]
    ax.text(0.98, 0.95, f"final {last:.4g}", transform=ax.transAxes, ha="right", va="top", fontsize=8)


def plot_positions(ax, rec, *, max_arrows: int = 4000):
    """Position refinement: the nominal scan (grey dots) and arrows to the refined positions,
    coloured by the distance moved (arrows enlarged so that the median one is visible), with the
    last epoch's affine fit in the title."""
    _mpl()
    nominal = np.asarray(rec.nominal_positions, dtype=np.float64)
    refined = np.asarray(rec.positions, dtype=np.float64)
    moved = refined - nominal
    distance = np.hypot(moved[:, 0], moved[:, 1])
    every = max(1, len(nominal) // max_arrows)
    ax.scatter(nominal[:, 1], nominal[:, 0], s=2, color="0.6", lw=0)
    step = np.median(np.hypot(*np.diff(nominal, axis=0).T)) if len(nominal) > 1 else 1.0
    typical = float(np.median(distance)) if np.median(distance) > 0 else 1.0
    gain = max(1.0, 0.5 * step / typical)
    arrows = ax.quiver(nominal[::every, 1], nominal[::every, 0], moved[::every, 1] * gain,
                       moved[::every, 0] * gain, distance[::every], cmap="viridis",
                       angles="xy", scale_units="xy", scale=1.0, width=0.004)
    ax.figure.colorbar(arrows, ax=ax, label="moved [px]", shrink=0.8, location="bottom")  # (the right edge is the figure's)
    ax.invert_yaxis()
    ax.set_aspect("equal")
    ax.set_xlabel("x [px]")
    ax.set_ylabel("y [px]")
    last = rec.history[-1] if rec.history else {}
    lines = [f"positions: moved {np.sqrt(np.mean(distance ** 2)):.2f} px rms", f"(arrows ×{gain:.0f})"]
    if "affine_scale_x" in last:
        lines[1] += f", affine rotation {last['affine_rotation_deg']:.2f}°"
        lines.append(f"affine scale {last['affine_scale_y']:.4f} / {last['affine_scale_x']:.4f}")
    # what the windows still asked for at their last sums (AD takes them every 2nd epoch)
    windows = next((h for h in reversed(rec.history) if "affine_window_scale" in h), None)
    if windows is not None:
        lines.append(f"windows ask {100 * windows['affine_window_scale']:+.2f} %, "
                     f"{windows['affine_window_rotation_deg']:+.3f}°")
    ax.set_title("\n".join(lines), fontsize=8)  # short lines: the panel is narrow
    return distance


def truth_frame(rec, truth, fraction=COMPARE_FRACTION):
    """The reconstruction's object in the ground truth's frame, and the illuminated mask there
    (see :func:`daskpty.metrics.truth_frame`). Returns ``(estimate, mask, offset)``."""
    lit = rec.illuminated(fraction)
    return _truth_frame(_squeeze_image(rec.object), rec.positions, lit[0] if lit.ndim == 3 else lit,
                        _squeeze_image(truth.object), getattr(truth, "positions", None), rec.origin)


def plot_frc(ax, rec, truth, pixel_size_m=None, *, fraction=COMPARE_FRACTION):
    """FRC of the aligned object against the true object in the illuminated region, with the ½-bit
    threshold. The reconstruction is put into the truth frame (:func:`truth_frame`), aligned
    (:func:`daskpty.metrics.align`: shift, phase ramp, complex scale) and both images are cropped to
    the bounding box of the illuminated region. Returns the :class:`~daskpty.metrics.FRCResult`."""
    _mpl()
    est, lit, _ = truth_frame(rec, truth, fraction)
    if not lit.any():
        raise ValueError("the reconstruction's illuminated region does not overlap the true object")
    t_obj = _squeeze_image(truth.object)
    aligned = align(est, t_obj, mask=lit)
    y0, y1, x0, x1 = _bbox(lit)
    res = frc(aligned[y0:y1, x0:x1], t_obj[y0:y1, x0:x1])
    ax.plot(res.frequency, res.frc, lw=1.4, label="FRC vs truth")
    ax.plot(res.frequency, res.half_bit, lw=1.0, ls="--", color="gray", label="½-bit threshold")
    ax.set_xlim(0, 0.5)
    ax.set_ylim(min(-0.05, float(np.nanmin(res.frc)) - 0.05), 1.05)
    ax.set_xlabel("spatial frequency [cycles / pixel]")
    ax.set_ylabel("FRC")
    ax.grid(True, alpha=0.3)
    if res.resolution is not None:
        ax.axvline(res.resolution, color="C3", lw=0.8)
        period_px = 1.0 / res.resolution
        where = (f"{format_length(period_px * pixel_size_m)}" if pixel_size_m
                 else f"{period_px:.3g} px")
        detail = f"½-bit at period {where}"
    else:
        detail = "above ½-bit to Nyquist"
    ax.set_title(f"FRC vs truth\n{detail}", fontsize=10)  # two lines: it sits between narrow panels
    ax.legend(loc="lower left", fontsize=8)
    return res


# ------------------------------------------------------------------------------------- summary


#: most object slices drawn one by one (a multislice object's further slices are left out)
MAX_SLICE_PANELS = 6
#: height of the row of slice panels in :func:`summary_figure`, inches, at most
SLICE_ROW_INCHES = 3.2


def summary_panels(n_modes: int, has_truth: bool, has_positions: bool = False, n_slices: int = 1) -> list[str]:
    """Names of the panels :func:`summary_figure` draws, in order — the single place that decides
    the layout's content (colour bars are not panels)."""
    shown = min(int(n_modes), MAX_PROBE_PANELS)
    probe = ["probe"] if shown == 1 else [f"probe mode {k + 1}" for k in range(shown)]
    slices = [f"slice {k + 1} phase" for k in range(min(int(n_slices), MAX_SLICE_PANELS))] if n_slices > 1 else []
    return ["object phase", "object amplitude", *slices, *probe, "loss", *(["FRC"] if has_truth else []),
            *(["positions"] if has_positions else [])]


def _has_truth(truth) -> bool:
    return truth is not None and getattr(truth, "object", None) is not None


def summary_figure(rec, truth=None, pixel_size_m=None, *, figsize=None):
    """One figure summarising a reconstruction.

    Top row: object phase and amplitude (illuminated region, scale bar when ``pixel_size_m`` is
    known). Bottom row: probe modes (up to :data:`MAX_PROBE_PANELS`), the loss curve and — with a
    ``truth`` holding ``.object`` (and ``.positions``) — the FRC against it.
    Returns a :class:`matplotlib.figure.Figure` (not registered with ``pyplot``).
    """
    _mpl()
    from matplotlib.figure import Figure  # lazy: optional dependency (daskpty[plot])

    probe = np.asarray(rec.probe)
    if probe.ndim == 2:
        probe = probe[None]
    with_truth = _has_truth(truth)
    with_positions = getattr(rec, "nominal_positions", None) is not None
    n_slices = int(np.shape(rec.object)[0]) if np.ndim(rec.object) == 3 else 1
    names = summary_panels(probe.shape[0], with_truth, with_positions, n_slices)
    slice_names = [n for n in names if n.startswith("slice ")]
    probe_names = [n for n in names if n.startswith("probe")]
    n_probe = len(probe_names)
    p_rows = 1 if n_probe <= 2 else 2
    p_cols = math.ceil(n_probe / p_rows)

    # the slice row is as high as its square panels are wide (at most SLICE_ROW_INCHES)
    slice_row_in = min(SLICE_ROW_INCHES, 10.5 / len(slice_names)) if slice_names else 0.0
    fig = Figure(figsize=figsize or (12.0, 8.5 + slice_row_in), layout="constrained")
    outer = fig.add_gridspec(3, 1, height_ratios=[1.25, slice_row_in / 3.78, 1.0]) if slice_names else \
        fig.add_gridspec(2, 1, height_ratios=[1.25, 1.0])
    slice_row = None
    if slice_names:  # a row of slice phases between the projected object and the probe
        slice_row = outer[1].subgridspec(1, len(slice_names))
        outer = [outer[0], outer[2]]
    top = outer[0].subgridspec(1, 2)
    bottom_blocks = ([max(1.0, p_cols / p_rows), 1.3] + ([1.3] if with_truth else [])
                     + ([1.3] if with_positions else []))
    bottom = outer[1].subgridspec(1, len(bottom_blocks), width_ratios=bottom_blocks)

    axes = {}
    axes["object phase"] = fig.add_subplot(top[0, 0])
    axes["object amplitude"] = fig.add_subplot(top[0, 1])
    for k, name in enumerate(slice_names):
        axes[name] = fig.add_subplot(slice_row[0, k])
    pgrid = bottom[0, 0].subgridspec(p_rows, p_cols)
    for k, name in enumerate(probe_names):
        axes[name] = fig.add_subplot(pgrid[divmod(k, p_cols)])
    axes["loss"] = fig.add_subplot(bottom[0, 1])
    if with_truth:
        axes["FRC"] = fig.add_subplot(bottom[0, 2])
    if with_positions:
        axes["positions"] = fig.add_subplot(bottom[0, len(bottom_blocks) - 1])
    for name in names:  # panel order in fig.axes = summary_panels order; labels name them
        _mark(axes[name], name)

    plot_object(axes["object phase"], axes["object amplitude"], rec, pixel_size_m,
                title=f"object phase (sum of {n_slices} slices)" if n_slices > 1 else None)
    for k, name in enumerate(slice_names):
        plot_object(axes[name], None, rec, pixel_size_m, slice_index=k, title=name)
    plot_probe([axes[n] for n in probe_names], probe, pixel_size_m)
    plot_history(axes["loss"], rec.history)
    if with_truth:
        plot_frc(axes["FRC"], rec, truth, pixel_size_m)
    if with_positions:
        plot_positions(axes["positions"], rec)

    obj = _squeeze_image(rec.object)
    epochs = getattr(rec, "epochs", len(rec.history))
    modes = f"{probe.shape[0]} probe mode(s)"
    if n_probe < probe.shape[0]:
        modes += f", first {n_probe} shown"
    bits = [f"{epochs} epoch(s)", f"object {obj.shape[0]}×{obj.shape[1]}", modes]
    if n_slices > 1:
        bits.insert(2, f"{n_slices} slices" + (f", first {len(slice_names)} shown"
                                               if len(slice_names) < n_slices else ""))
    if pixel_size_m:
        bits.append(f"pixel {format_length(pixel_size_m)}")
    live = getattr(rec, "live", None) or {}
    if live.get("frames_used") and "final_from_epoch" not in live:  # a snapshot of a scan being followed
        bits.insert(0, f"snapshot of {int(live['frames_used']):,} frames"
                       + ("" if live.get("scan_ended") else " (scan live)"))
    fig.suptitle("daskpty reconstruction — " + ", ".join(bits), fontsize=11)
    return fig
