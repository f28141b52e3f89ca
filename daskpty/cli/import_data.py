"""``daskpty import SRC -o DATA.zarr``: a measured data file → a data-set store (streamed)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..io.importers import Geometry, Preprocess, detect_format, import_file
from ..io.importers.frames import read_frame
from ..io.near_field_hint import near_field_hint

NAME = "import"
UNITS = ("m", "mm", "um", "nm", "A", "px")


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="import a CXI / HDF5 / EMPAD / NumPy / TIFF file into a data-set store",
        description="Stream detector frames and scan positions from a measured data file into a "
                    "daskpty data-set store, shard by shard, with optional detector "
                    "preprocessing (crop around the beam centre, binning, flips, dark / "
                    "background subtraction, bad / saturated / hot pixel masks; negative values "
                    "are clipped). Geometry comes from the file where it is recorded; flags "
                    "override it. Positions are stored in object pixels (y, x).")
    p.add_argument("source", metavar="SRC", help="file to import (.cxi .h5 .nxs .raw .npy .npz "
                   ".tif), or a directory / glob of TIFF frames")
    p.add_argument("-o", "--output", required=True, metavar="DATA", help="store to write (.zarr)")
    p.add_argument("--format", choices=["cxi", "hdf5", "empad", "npy", "tiff"], default=None,
                   help="input format (default: from the suffix)")
    g = p.add_argument_group("data and positions")
    g.add_argument("--data", metavar="PATH", help="detector dataset (HDF5 path or .npz key)")
    g.add_argument("--positions", metavar="SPEC",
                   help="positions: a dataset in SRC (PATH, or YPATH,XPATH), an .npz key, or a "
                        "separate file (pos.npy, pos.csv, other.h5::/path)")
    g.add_argument("--units", choices=UNITS, default=None,
                   help="units of the positions (default: the dataset's units attribute; CXI: m)")
    g.add_argument("--motion", choices=["probe", "sample"], default=None,
                   help="whether positions say where the probe or the sample moved "
                        "(default: probe; CXI translations: sample)")
    g.add_argument("--columns", choices=["yx", "xy"], default="yx",
                   help="column order of (N, 2) positions (default yx)")
    g.add_argument("--scan-shape", type=_shape, default=None, metavar="ROWSxCOLS",
                   help="EMPAD: scan raster (frames in row-major order)")
    g.add_argument("--step", type=float, default=None,
                   help="EMPAD without --positions: raster step in --units")
    g = p.add_argument_group("geometry (overrides the file)")
    g.add_argument("--energy", type=float, default=None, metavar="EV", help="beam energy, eV")
    g.add_argument("--wavelength", type=float, default=None, metavar="M", help="wavelength, m")
    g.add_argument("--distance", type=float, default=None, metavar="M",
                   help="sample-detector distance (camera length), m")
    g.add_argument("--pixel-size", type=float, default=None, metavar="M",
                   help="detector pixel size (unbinned), m")
    g.add_argument("--object-pixel-size", type=float, default=None, metavar="M",
                   help="object pixel size, m (default: wavelength x distance / (n x pixel))")
    g.add_argument("--radiation", choices=["xray", "electron"], default=None,
                   help="how --energy converts to a wavelength (default xray; electron for EMPAD "
                        "and with --convergence-semiangle or --defocus)")
    g.add_argument("--convergence-semiangle", type=float, default=None, metavar="MRAD",
                   help="electrons: the probe's convergence semi-angle, mrad (stored in rad as "
                        "convergence_semiangle_rad; what reconstruct --probe aperture needs, with "
                        "--energy)")
    g.add_argument("--defocus", type=float, default=None, metavar="M",
                   help="electrons: the probe's defocus, m (with --convergence-semiangle the store "
                        "gets the aperture's defocused probe as its start probe)")
    g.add_argument("--near-field", action="store_true",
                   help="near-field (holographic) scan: object pixel = detector pixel / magnification, "
                        "no far-field shift when reconstructing")
    g.add_argument("--focus-to-sample", type=float, default=None, metavar="M",
                   help="divergent beam: focus-to-sample distance z1, m (implies --near-field; "
                        "magnification (z1 + distance) / z1)")
    g = p.add_argument_group("preprocessing")
    g.add_argument("--crop", type=int, default=None, metavar="N",
                   help="keep N x N detector pixels around the beam centre")
    g.add_argument("--center", type=float, nargs=2, default=None, metavar=("ROW", "COL"),
                   help="beam centre on the detector (default with --crop: centre of mass of "
                        "the mean pattern)")
    g.add_argument("--bin", type=int, default=1, metavar="B", help="sum B x B pixels")
    g.add_argument("--transpose", action="store_true", help="swap detector rows and columns")
    g.add_argument("--flip-y", action="store_true", help="flip detector rows")
    g.add_argument("--flip-x", action="store_true", help="flip detector columns")
    g.add_argument("--dark", metavar="SPEC", default=None,
                   help="dark frame (or stack, averaged) to subtract: file.npy, file.tif, "
                        "file.h5::/path")
    g.add_argument("--background", type=float, default=0.0, help="constant to subtract")
    g.add_argument("--mask", metavar="SPEC", default=None,
                   help="bad-pixel mask (H, W), non-zero = bad (see --mask-valid): file.npy, "
                        "file.tif, file.h5::/path; replaces a CXI file's mask")
    g.add_argument("--mask-valid", action="store_true",
                   help="the --mask file marks valid pixels (non-zero = valid)")
    g.add_argument("--saturation", type=float, default=None, metavar="VALUE",
                   help="mask pixels reaching VALUE in any frame")
    g.add_argument("--hot-pixels", type=float, default=None, metavar="SIGMA",
                   help="mask pixels whose mean or variance exceeds their neighbours' by SIGMA "
                        "robust standard deviations")
    p.add_argument("--shard-mib", type=float, default=64, help="target shard size (default 64)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return p


def _shape(text):
    try:
        rows, cols = (int(v) for v in text.lower().replace("*", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, got {text!r}") from None
    return rows, cols


def options(args) -> dict:
    """Keyword arguments of :func:`daskpty.io.importers.import_file` from parsed arguments."""
    fmt = args.format or detect_format(args.source)
    probe_optics = args.convergence_semiangle is not None or args.defocus is not None
    radiation = args.radiation or ("electron" if fmt == "empad" or probe_optics else "xray")
    geometry = Geometry(wavelength_m=args.wavelength, energy_ev=args.energy,
                        distance_m=args.distance, pixel_size_m=args.pixel_size,
                        object_pixel_size_m=args.object_pixel_size, radiation=radiation,
                        focus_to_sample_m=args.focus_to_sample, near_field=args.near_field,
                        convergence_semiangle_mrad=args.convergence_semiangle, defocus_m=args.defocus)
    dark = None if args.dark is None else read_frame(args.dark, "dark frame")
    pre = Preprocess(crop=args.crop, center=None if args.center is None else tuple(args.center),
                     bin=args.bin, transpose=args.transpose, flip_y=args.flip_y,
                     flip_x=args.flip_x, dark=dark, background=args.background,
                     saturation=args.saturation, hot_sigma=args.hot_pixels)
    kw = dict(format=fmt, geometry=geometry, preprocess=pre, overwrite=args.overwrite,
              progress=not args.quiet, positions=args.positions, units=args.units,
              shard_bytes=int(args.shard_mib * 2**20))
    if args.mask is not None:
        m = read_frame(args.mask, "mask") != 0
        kw["mask"] = ~m if args.mask_valid else m
    if fmt != "cxi":
        kw.update(motion=args.motion or "probe", columns=args.columns)
    elif args.motion == "probe":
        raise ValueError("CXI translations record the sample's motion; --motion applies to "
                         "--positions given with another format")
    if fmt in ("hdf5", "npy"):
        kw["data"] = args.data
    elif args.data is not None:
        raise ValueError(f"--data applies to HDF5 and .npz files, not {fmt}")
    if fmt == "empad":
        kw.update(scan_shape=args.scan_shape, step=args.step)
    elif args.scan_shape is not None or args.step is not None:
        raise ValueError("--scan-shape and --step apply to EMPAD raw files (--format empad)")
    return kw


def daskpty_store_kind(path) -> str | None:
    """``"data-set"`` or ``"reconstruction"`` when ``path`` is a daskpty store, else None."""
    try:
        with open(os.path.join(path, "zarr.json")) as f:
            marker = (json.load(f).get("attributes") or {}).get("daskpty") or {}
    except (OSError, ValueError, AttributeError):
        return None
    fmt = marker.get("format", "") if isinstance(marker, dict) else ""
    return {"daskpty-dataset": "data-set"}.get(fmt, "reconstruction" if fmt else None)


def run(args) -> int:
    kind = daskpty_store_kind(args.source)
    if kind == "data-set":
        raise ValueError(f"{args.source} is already a daskpty data-set store; use it directly "
                         f"(daskpty info {args.source} / daskpty reconstruct {args.source} -o ...)")
    if kind == "reconstruction":
        raise ValueError(f"{args.source} is a daskpty reconstruction store, not detector data; "
                         f"look at it with daskpty show, or write it out with daskpty export")
    if args.shard_mib <= 0:
        raise ValueError(f"--shard-mib must be positive, got {args.shard_mib}")
    data = import_file(args.source, args.output, **options(args))
    if not args.quiet:
        meta = data.metadata
        px = meta.get("object_pixel_size_m")
        where = f", object pixel {px * 1e9:.4g} nm" if px else ""
        if meta.get("electron_voltage_v"):
            where += f", {meta['electron_voltage_v'] / 1e3:g} kV electrons"
        if meta.get("convergence_semiangle_rad"):
            where += f", convergence semi-angle {meta['convergence_semiangle_rad'] * 1e3:g} mrad"
        if meta.get("defocus_m") is not None:
            where += f", defocus {meta['defocus_m'] * 1e9:g} nm"
        print(f"wrote {args.output}: {data.n_patterns} patterns of {data.pattern_shape[0]}x"
              f"{data.pattern_shape[1]} {data.dtype}{where}", file=sys.stdout)

    hint = near_field_hint(data)   # a few hundred frames at most: cheap next to the import
    if hint:
        print(f"daskpty: note: {hint}", file=sys.stderr)
    return 0
