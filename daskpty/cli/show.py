"""``daskpty show RECON.zarr -o fig.png``: a summary figure of a reconstruction store."""
from __future__ import annotations

import os
import sys
import time
import uuid

from ..io.safety import write_error

NAME = "show"

#: output formats by file suffix
FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}
#: An object larger than this (bytes) is never read whole: it is drawn from a block-mean view
#: of at most :data:`VIEW_SIDE` pixels a side, read chunk by chunk.
FULL_READ_BYTES = 256 * 2**20
VIEW_SIDE = 4096


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="draw a summary figure of a reconstruction store (needs matplotlib)",
        description="Draw the object phase and amplitude (illuminated region), the probe modes "
                    "with their power fractions, the loss per epoch and — when --data points at "
                    "a data set with truth/ — the FRC against the true object. --data also "
                    "supplies the object pixel size for scale bars. Needs the 'plot' extra: "
                    "pip install 'daskpty[plot]'.")
    p.add_argument("recon", metavar="RECON", help="reconstruction store (.zarr)")
    p.add_argument("-o", "--output", required=True, metavar="FIG",
                   help="figure to write (.png; .pdf and .svg also work)")
    p.add_argument("--data", default=None, metavar="DATA",
                   help="the data-set store that was reconstructed (ground truth, pixel size)")
    p.add_argument("--dpi", type=int, default=100, help="resolution of a PNG (default 100)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing figure")
    return p


def _check_output(path: str, overwrite: bool) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: unsupported figure type {suffix or '(no suffix)'!r}; "
                         f"use one of {', '.join(FORMATS)}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give a file name such as fig.png")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; choose another output or pass --overwrite")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output directory {parent} does not exist")
    return FORMATS[suffix]


#: reads of a store a running follow or checkpoint replaced while it was read, before giving up
READ_TRIES = 5


def _read_reconstruction(path: str):
    """The reconstruction at ``path``, read whole while no checkpoint replaced it.

    A running reconstruction (``reconstruct --follow`` publishing snapshots, any checkpoint)
    swaps a new store in by renames (:meth:`~daskpty.io.results.Reconstruction.to_zarr`) and
    removes the old one: a read that overlapped a swap is repeated (the directory at ``path`` is
    another one after it), and ``PATH.previous`` alone is read only once it stays so (a swap
    left half done, not one in progress)."""
    path = os.fspath(path).rstrip("/") or path
    for attempt in range(READ_TRIES):
        before = _identity(path)
        if before is None and attempt + 1 < READ_TRIES and os.path.isdir(path + ".previous"):
            time.sleep(0.2)  # (between a swap's two renames: a moment)
            continue
        try:
            rec = _read_once(path)
        except (ValueError, OSError):
            if _identity(path) != before and attempt + 1 < READ_TRIES:
                continue
            raise
        if _identity(path) == before:
            return rec
    return rec


def _identity(path: str):
    """(device, inode) of the directory at ``path``: a swapped-in store is another directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _read_once(path: str):
    from daskpty.io.results import Reconstruction  # lazy: zarr stays out of the CLI's start

    if not os.path.exists(path) and not os.path.isdir(path + ".previous"):  # see Reconstruction.to_zarr
        raise FileNotFoundError(f"{path}: no such reconstruction store")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is not a daskpty reconstruction store (not a Zarr directory)")
    try:
        return Reconstruction.from_zarr(path, lazy=_object_bytes(path) > FULL_READ_BYTES)
    except ValueError as exc:
        fmt = _store_format(path)
        if fmt == "daskpty-dataset":
            raise ValueError(f"{path} is a daskpty data set, not a reconstruction; pass it as "
                             f"--data and give the reconstruction store first") from exc
        raise
    except Exception as exc:  # zarr's own errors for missing or damaged groups/arrays
        raise ValueError(f"{path} is not a readable daskpty reconstruction store "
                         f"({type(exc).__name__}: {exc})") from exc


def _object_bytes(path: str) -> int:
    """The stored object's size in bytes (0 when it cannot be told: the full read then says why)."""
    try:
        import zarr  # lazy: zarr stays out of the CLI's start

        node = zarr.open_group(path if os.path.isdir(path) else path + ".previous", mode="r")["object"]
        return int(node.nbytes)
    except Exception:
        return 0


def view_of(rec, side: int | None = None):
    """``(view, factor)``: ``rec`` with a lazy object and illumination replaced by their block
    means over ``factor`` × ``factor`` pixels (at most ``side`` a side, default
    :data:`VIEW_SIDE`), and positions and origin in that frame; ``rec`` itself and 1 when its
    object is in memory."""
    import copy

    import numpy as np

    from daskpty.monitor.dashboard_images import downsample  # lazy: see run()

    if not rec.is_lazy:
        return rec, 1
    side = VIEW_SIDE if side is None else int(side)
    factor = max(1, -(-max(rec.object.shape[-2:]) // int(side)))

    def down(a):
        if a is None:
            return None
        return np.stack([downsample(s, side) for s in a]) if a.ndim == 3 else downsample(a, side)

    view = copy.copy(rec)
    view.object = down(rec.object).astype(np.complex64)
    view.illumination = down(rec.illumination)
    view.positions, view.origin = rec.positions / factor, np.asarray(rec.origin) / factor
    if rec.nominal_positions is not None:
        view.nominal_positions = rec.nominal_positions / factor
    return view, factor


def _store_format(path: str):
    try:
        import zarr  # lazy: zarr stays out of the CLI's start

        return dict(zarr.open_group(path, mode="r").attrs).get("daskpty", {}).get("format")
    except Exception:
        return None


def _read_data(path: str, rec):
    """(truth or None, object pixel size in metres or None) from a data-set store."""
    from daskpty.io.store import open_data  # lazy: dask, zarr stay out of the CLI's start

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such data-set store")
    data = open_data(path, validate="metadata", frames="committed")  # (a live scan: those so far)
    snapshot = bool(getattr(rec, "live", None)) and data.n_patterns > len(rec.positions)
    if data.n_patterns != len(rec.positions) and not snapshot:
        raise ValueError(f"{path} has {data.n_patterns} patterns but the reconstruction has "
                         f"{len(rec.positions)} positions; was it reconstructed from this data set?")
    px = data.metadata.get("object_pixel_size_m")
    px = float(px) if isinstance(px, (int, float)) and px > 0 else None
    truth = data.truth if data.truth is not None and data.truth.object is not None else None
    return truth, px


def run(args) -> int:
    if not 1 <= args.dpi <= 1200:
        raise ValueError(f"--dpi must lie in 1 .. 1200, got {args.dpi}")
    fmt = _check_output(args.output, args.overwrite)
    rec = _read_reconstruction(args.recon)  # bad inputs are reported before a missing matplotlib
    truth, px = (None, None) if args.data is None else _read_data(args.data, rec)
    width = rec.object.shape[-1]
    rec, factor = view_of(rec)
    if factor > 1:
        print(f"{args.recon}: a {width}-pixel-wide object, drawn from "
              f"{factor} x {factor} block means" + (" (no FRC against the truth at that scale)"
                                                   if truth is not None else ""), file=sys.stdout)
        truth, px = None, None if px is None else px * factor
    try:
        from daskpty.monitor.plot import summary_figure  # lazy, with the optional matplotlib it needs
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ValueError("daskpty show needs matplotlib: pip install 'daskpty[plot]'") from exc

    fig = summary_figure(rec, truth=truth, pixel_size_m=px)
    _save(fig, args.output, fmt, args.dpi)
    w, h = (round(v * args.dpi) for v in fig.get_size_inches())
    extra = " with FRC vs truth" if truth is not None else ""
    epochs = getattr(rec, "epochs", len(rec.history))
    print(f"wrote {args.output}: {w}×{h} px, {epochs} epoch(s){extra}", file=sys.stdout)
    if getattr(rec, "probe_weights", None) is not None:  # OPR: eigen-probes and weight maps beside it
        from daskpty.monitor.opr_plot import opr_figure  # lazy: see summary_figure

        stem, ext = os.path.splitext(args.output)
        opr_path = f"{stem}-opr{ext}"
        _check_output(opr_path, args.overwrite)
        _save(opr_figure(rec), opr_path, fmt, args.dpi)
        print(f"wrote {opr_path}: eigen-probes and weight maps", file=sys.stdout)
    return 0


def _save(fig, path: str, fmt: str, dpi: int) -> None:
    """Write a figure atomically (a partial file renamed into place)."""
    out = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial-{uuid.uuid4().hex[:8]}")
    try:
        fig.savefig(tmp, format=fmt, dpi=dpi)
        os.replace(tmp, out)
    except OSError as exc:  # full or read-only disk, no permission: one line
        err = write_error(exc, "writing the figure", path, "nothing was left behind")
        if err is None:
            raise
        raise err from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
