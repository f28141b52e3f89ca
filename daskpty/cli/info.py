"""``daskpty info STORE``: describe a data-set store (optionally check every value), or a
reconstruction store in a few numbers (``frames_used`` for a followed scan's snapshot)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import uuid
import warnings

import numpy as np

from ..io.near_field_hint import near_field_hint
from ..io.scan import linear_overlap, nearest_neighbour_steps, probe_diameter
from ..io.validate import check_position_scale, check_values
from ..monitor.scan_plot import LOW_OVERLAP, scan_figure
from ._format import human_bytes, human_metres
from .show import _check_output

NAME = "info"


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="describe a data-set store (shape, chunking, scan, metadata) or a reconstruction store",
        description="Print the layout of a daskpty data-set store: patterns, dtype, shard and "
                    "inner-chunk shapes, size on disk, scan extent, step and probe overlap, "
                    "geometry, provenance and ground truth. --check also reads every intensity "
                    "once and fails on NaN, infinite or negative values. A reconstruction store: "
                    "its engine, epoch, shapes and the data frames its newest snapshot used.")
    p.add_argument("store", metavar="STORE", help="path of a data-set or reconstruction store (.zarr)")
    p.add_argument("--check", action="store_true",
                   help="read all intensities once; exit 2 on NaN / infinite / negative values")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--plot", metavar="FIG", default=None,
                   help="also draw the scan positions and the mean diffraction pattern (log "
                        "scale) to FIG (.png, .pdf, .svg; needs matplotlib)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --plot figure")
    return p


def overlap_warning(d: dict) -> str | None:
    """A warning when the median step and the probe diameter give little linear overlap."""
    p = d["positions"]
    overlap = p["linear_overlap"]
    if not math.isfinite(overlap) or overlap >= LOW_OVERLAP:
        return None
    return (f"little overlap: the median scan step is {p['median_step_px']:.1f} px and the probe "
            f"about {p['probe_diameter_px']:.1f} px across ({p['probe_diameter_source']}), a "
            f"linear overlap of {100 * overlap:.0f} % (below {100 * LOW_OVERLAP:.0f} %); "
            f"reconstructions converge poorly — check the positions' units and pixel size, or "
            f"scan with smaller steps")


def write_plot(data, d: dict, path: str, overwrite: bool) -> None:
    """Draw :func:`daskpty.monitor.scan_plot.scan_figure` to ``path`` atomically."""
    fmt = _check_output(path, overwrite)
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ValueError("daskpty info --plot needs matplotlib: pip install 'daskpty[plot]'") \
            from exc
    fig = scan_figure(data, probe_diameter_px=d["positions"]["probe_diameter_px"])
    out = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial-{uuid.uuid4().hex[:8]}")
    try:
        fig.savefig(tmp, format=fmt, dpi=100)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _probe_size_estimate(data):
    """(diameter in pixels, where it came from): 90 %-power diameter of the true probe, else of
    the initial guess, else the simulator's record, else n/2."""
    if data.truth is not None and data.truth.probe is not None:
        return probe_diameter(data.truth.probe), "truth probe"
    if data.probe is not None:
        return probe_diameter(data.probe), "initial probe"
    sim = data.metadata.get("simulation") or {}
    if isinstance(sim.get("probe_diameter_px"), (int, float)):
        return float(sim["probe_diameter_px"]), "simulation attributes"
    return data.pattern_shape[-1] / 2.0, "assumed n/2 (no probe stored)"


def describe(data) -> dict:
    """A JSON-able description of an opened data set (:class:`~daskpty.io.store.PtychoData`)."""
    import zarr  # lazy: zarr stays out of the CLI's start

    from daskpty.io.store import store_size_bytes  # lazy: dask, zarr stay out of the CLI's start

    group = zarr.open_group(data.path, mode="r")
    arr = group["intensities"]
    n, (h, w) = data.n_patterns, data.pattern_shape
    itemsize = np.dtype(data.dtype).itemsize
    shard = tuple(int(s) for s in (arr.shards or arr.chunks))
    inner = tuple(int(s) for s in arr.chunks)
    raw = n * h * w * itemsize
    disk = store_size_bytes(data.path)
    meta = data.metadata
    px = meta.get("object_pixel_size_m")
    pos = data.positions
    lo, hi = pos.min(axis=0), pos.max(axis=0)
    span = hi - lo
    steps = nearest_neighbour_steps(pos)
    step = float(np.median(steps)) if np.isfinite(steps).any() else float("nan")
    diameter, source = _probe_size_estimate(data)
    overlap = linear_overlap(step, diameter)
    out = {
        "path": data.path,
        "format": meta.get("daskpty"),
        "n_patterns": n,
        "frames_committed": n,
        "live": _live(data),
        "pattern_shape": [h, w],
        "dtype": str(data.dtype),
        "uncompressed_bytes": raw,
        "disk_bytes": disk,
        "compression_ratio": raw / disk if disk else None,
        "sharded": arr.shards is not None,
        "shard_shape": list(shard),
        "shard_bytes": int(np.prod(shard)) * itemsize,
        "inner_chunk_shape": list(inner),
        "inner_chunk_bytes": int(np.prod(inner)) * itemsize,
        "n_shards": len(data.intensities.chunks[0]),
        "dask_chunks": [int(data.intensities.chunks[0][0]), h, w],
        "compressors": [str(c) for c in (arr.compressors or ())],
        "positions": {
            "y_range_px": [float(lo[0]), float(hi[0])],
            "x_range_px": [float(lo[1]), float(hi[1])],
            "extent_px": [float(span[0]), float(span[1])],
            "extent_m": [float(span[0] * px), float(span[1] * px)] if px else None,
            "median_step_px": step,
            "probe_diameter_px": diameter,
            "probe_diameter_source": source,
            "linear_overlap": overlap,
        },
        "mask": None if data.mask is None else {
            "valid_fraction": float(data.mask.mean())},
        "probe": None if data.probe is None else {
            "shape": list(data.probe.shape), "dtype": str(data.probe.dtype)},
        "geometry": {k: meta.get(k) for k in ("wavelength_m", "detector_distance_m",
                                              "detector_pixel_size_m", "object_pixel_size_m")},
        "units": meta.get("units"),
        "provenance": meta.get("provenance"),
        "truth": None if data.truth is None else {
            k: {"shape": list(s), "dtype": d} for k, (s, d) in data.truth.shapes().items()},
        "other_metadata": {k: v for k, v in meta.items() if k not in (
            "daskpty", "wavelength_m", "detector_distance_m", "detector_pixel_size_m",
            "object_pixel_size_m", "units", "provenance", "live")},
    }
    return out


def _live(data) -> dict | None:
    """Where a live store stands (None for an ordinary store): frames committed, the plan,
    whether the scan ended, and a one-line description."""
    from daskpty.io.live import LiveStore
    from daskpty.io.live_format import is_live

    if not is_live(data.metadata):
        return None
    status = LiveStore(data.path).status()
    if status.frames_committed != data.n_patterns:  # blocks came after the opened snapshot
        status = dataclasses.replace(status, frames_committed=data.n_patterns, ended=False,
                                     writer=status.writer or "the scan ended since")
    return {"frames_committed": status.frames_committed, "planned_frames": status.planned_frames,
            "ended": status.ended, "blocks": status.blocks, "updated_unix": status.updated_unix,
            "writer": status.writer or None, "text": status.describe()}


def _fmt_num(v, fmt=".4g"):
    return "—" if v is None else format(v, fmt)


def format_text(d: dict) -> str:
    p = d["positions"]
    geo = d["geometry"]
    fmt = d["format"] or {}
    lines = [
        f"store        {d['path']}  ({fmt.get('format')} v{fmt.get('version')})",
        f"patterns     {d['n_patterns']:,} x {d['pattern_shape'][0]} x {d['pattern_shape'][1]}  "
        f"{d['dtype']}",
        (f"chunking     shards {tuple(d['shard_shape'])} ({human_bytes(d['shard_bytes'])}) = "
         f"dask chunks, {d['n_shards']} shard(s); inner chunks {tuple(d['inner_chunk_shape'])} "
         f"({human_bytes(d['inner_chunk_bytes'])})" if d.get("sharded", True) else
         f"chunking     chunks {tuple(d['shard_shape'])} ({human_bytes(d['shard_bytes'])}) = "
         f"dask chunks, {d['n_shards']} chunk(s), not sharded"),
        f"size         {human_bytes(d['uncompressed_bytes'])} uncompressed, "
        f"{human_bytes(d['disk_bytes'])} on disk"
        + (f" (ratio {d['compression_ratio']:.2f})" if d["compression_ratio"] else ""),
        f"scan         y {p['y_range_px'][0]:.1f} .. {p['y_range_px'][1]:.1f} px, "
        f"x {p['x_range_px'][0]:.1f} .. {p['x_range_px'][1]:.1f} px; extent "
        f"{p['extent_px'][0]:.1f} x {p['extent_px'][1]:.1f} px"
        + (f" = {human_metres(p['extent_m'][0])} x {human_metres(p['extent_m'][1])}"
           if p["extent_m"] else ""),
        f"overlap      median nearest-neighbour step {p['median_step_px']:.2f} px, probe "
        f"diameter {p['probe_diameter_px']:.1f} px ({p['probe_diameter_source']}), linear "
        f"overlap " + ("?" if not math.isfinite(p["linear_overlap"])
                       else f"{100 * p['linear_overlap']:.0f} %")
        + (" (not meaningful: the patterns look near-field, see the warning)"
           if d.get("near_field_hint") else ""),
        f"geometry     wavelength {human_metres(geo['wavelength_m'])}, distance "
        f"{human_metres(geo['detector_distance_m'])}, detector pixel "
        f"{human_metres(geo['detector_pixel_size_m'])}, object pixel "
        f"{human_metres(geo['object_pixel_size_m'])}",
        "mask         " + ("none" if d["mask"] is None
                           else f"{100 * d['mask']['valid_fraction']:.1f} % valid pixels"),
        "probe        " + ("none (no initial guess)" if d["probe"] is None
                           else f"initial guess {tuple(d['probe']['shape'])} {d['probe']['dtype']}"),
        "truth        " + ("none" if d["truth"] is None else ", ".join(
            f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in d["truth"].items())),
        f"provenance   {d['provenance'] or '—'}",
    ]
    if d.get("live"):
        lines.insert(2, f"live         {d['live']['text'].removeprefix('live: ')}")
    for key, value in d["other_metadata"].items():
        if key == "import" and isinstance(value, dict):  # the provenance line says what was done
            value = f"{value.get('format')} file {value.get('source')} (details: --json)"
        text = json.dumps(value) if not isinstance(value, str) else value
        if len(text) > 300:
            text = text[:297] + "..."
        lines.append(f"{key:<12} {text}")
    if "check" in d:
        c = d["check"]
        lines.append(
            f"check        {'OK' if c['ok'] else 'FAILED'}: {c['n_nan']} NaN, {c['n_inf']} "
            f"infinite, {c['n_negative']} negative; min {_fmt_num(c['minimum'])}, max "
            f"{_fmt_num(c['maximum'])}, mean {c['total'] / d['n_patterns']:,.1f} counts/pattern")
    return "\n".join(lines)


def describe_result(path: str) -> dict:
    """A reconstruction store in a few numbers, from its metadata only (no array is read):
    the epoch, the shapes, ``frames_used`` (the data frames of its newest snapshot) and, for a
    snapshot of a scan being followed, its ``live`` record."""
    import zarr

    root = zarr.open_group(path, mode="r")
    attrs = dict(root.attrs)
    live = attrs.get("live") if isinstance(attrs.get("live"), dict) else None
    options = attrs.get("options") or {}
    d = {"path": os.path.abspath(path), "format": "daskpty-reconstruction", "epoch": attrs.get("epoch"),
         "object_shape": list(root["object"].shape), "probe_shape": list(root["probe"].shape),
         "frames_used": int((live or {}).get("frames_used", root["positions"].shape[0])),
         "engine": options.get("engine"), "settings": _engine_settings(options)}
    if live is not None:
        d["live"] = live
    return d


def _engine_settings(options: dict) -> dict:
    """The engine's own settings among a result's stored ``options`` (as the run resolved them,
    e.g. LSQML's momentum through slices on low-dose data); empty for an unknown engine."""
    from ..engines.specs import ENGINE_SPECS

    spec = ENGINE_SPECS.get(options.get("engine"))
    if spec is None:
        return {}
    return {f.name: options[f.name] for f in dataclasses.fields(spec.options) if f.name in options}


def format_result_text(d: dict) -> str:
    live = d.get("live") or {}
    state = "" if not live else " (scan ended)" if live.get("scan_ended") else " (scan still being written)"
    lines = [f"reconstruction {d['path']}", f"engine       {d['engine']}, epoch {d['epoch']}",
             f"object       {tuple(d['object_shape'])}, probe {tuple(d['probe_shape'])}",
             f"frames used  {d['frames_used']:,}{state}"]
    if d.get("settings"):
        lines.append("settings     " + ", ".join(f"{k}={v}" for k, v in d["settings"].items()))
    return "\n".join(lines)


def run(args) -> int:
    from daskpty.io.safety import store_format
    from daskpty.io.store import open_data  # lazy: dask, zarr stay out of the CLI's start
    if store_format(args.store) == "daskpty-reconstruction":
        if args.check or args.plot is not None:
            raise ValueError(f"{args.store} is a reconstruction store: --check and --plot describe data-set stores")
        d = describe_result(args.store)
        print(json.dumps(d, indent=2, default=str) if args.json else format_result_text(d))
        return 0
    data = open_data(args.store, validate="metadata", frames="committed")
    d = describe(data)
    report = None
    if args.check:
        report = check_values(data)
        d["check"] = report.as_dict()
    if args.plot is not None:
        write_plot(data, d, args.plot, args.overwrite)
    d["near_field_hint"] = near_field_hint(data)   # reads a few hundred frames at most
    if args.json:
        print(json.dumps(d, indent=2, default=str, allow_nan=True))
    else:
        print(format_text(d))
    imported = data.metadata.get("import")  # after the description: it shows the extent
    check_position_scale(data.positions, data.pattern_shape[-1], pixel_m=d["geometry"][
        "object_pixel_size_m"], units=((imported or {}).get("positions") or {}).get("units")
        if isinstance(imported, dict) else None)
    # holograms stored as far field: the far-field pixel size makes the overlap meaningless,
    # so the hint replaces the overlap warning
    warning = d["near_field_hint"] or overlap_warning(d)
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=1)
    if report is not None:
        report.raise_if_bad()
    return 0
