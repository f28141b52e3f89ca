"""``daskpty simulate OUT.zarr``: write a synthetic data set (see daskpty.simulate)."""
from __future__ import annotations

import argparse
import sys
import time

from ..simulate import PRESETS, simulate
from ..simulate.electron import ELECTRON, POSITION_ERRORS
from ._format import human_bytes

NAME = "simulate"
#: the electron preset's flags (argparse names) and the keywords of simulate() they set
ELECTRON_FLAGS = {"slices": "slices", "slice_spacing": "slice_spacing_m", "energy": "energy_ev",
                  "convergence_semiangle": "convergence_semiangle_mrad", "defocus": "defocus_m",
                  "position_errors": "position_errors"}


def _grid(text: str):
    parts = text.lower().replace("×", "x").split("x")
    try:
        rows, cols = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS like 24x24, got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"grid sides must be positive, got {text!r}")
    return rows, cols


def _dose(text: str):
    if text.lower() in ("none", "inf", "noise-free"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected photons per pattern or 'none', got {text!r}") \
            from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"dose must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected frames per second, got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"the rate must be a positive number of frames per second, "
                                         f"got {text!r}")
    return value


def _powers(text: str):
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _position_errors(text: str):
    """``--position-errors [rms=PX,scale=FRACTION,rotation=DEGREES]`` → a dict."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in POSITION_ERRORS:
            raise argparse.ArgumentTypeError(
                f"expected rms=PX,scale=FRACTION,rotation=DEGREES items, got {item!r}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key.strip()} must be a number, got {value!r}") from None
    return out or True


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="simulate a data set (structured object, focused probe, Poisson noise)",
        description="Simulate a ptychography data set into a new Zarr v3 store. Presets: small "
                    "(24x24 scan, 64^2 patterns), medium (40x40, 128^2), large (512x512, 128^2, "
                    "8 GiB uint16), electron (a multislice 4D-STEM scan: 12x12 scan, 64^2 "
                    "patterns, 3 slices 2 nm apart, 300 kV; reconstruct it with --slices and "
                    "--slice-spacing). The ground truth is stored under truth/.")
    p.add_argument("out", metavar="OUT.zarr", help="path of the store to create")
    p.add_argument("--preset", choices=[*PRESETS, "electron"], default="small", help="default: small")
    p.add_argument("--scan", choices=["raster", "fermat"],
                   help="raster with jitter (default) or Fermat spiral")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--grid", type=_grid, metavar="ROWSxCOLS", help="scan grid, e.g. 24x24")
    size.add_argument("--n-patterns", type=_positive_int, metavar="N", help="number of positions")
    p.add_argument("--step", type=float, metavar="PX",
                   help="scan step in object pixels (default: ~72%% linear probe overlap)")
    p.add_argument("--probe-size", type=_positive_int, metavar="n", help="pattern/probe size n")
    p.add_argument("--modes", type=_positive_int, metavar="M", help="incoherent probe modes (1)")
    p.add_argument("--mode-powers", type=_powers, metavar="P1,P2,..",
                   help="power fractions of the modes (default 1 : 1/4 : 1/16 ...)")
    p.add_argument("--dose", type=_dose, default=argparse.SUPPRESS, metavar="D",
                   help="mean photons (electrons) per pattern with Poisson noise (default 1e6); 'none' = "
                        "noise-free float32")
    p.add_argument("--dtype", choices=["uint16", "uint32", "float32"],
                   help="intensity dtype (default uint16, float32 when noise-free)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--shard-mib", type=float, metavar="MiB", default=64.0,
                   help="target shard (= dask chunk) size in MiB (default 64)")
    p.add_argument("--workers", type=_positive_int, metavar="W",
                   help="start a local cluster of W worker processes (default: one per core, or "
                        "the current dask client)")
    g = p.add_argument_group("electron preset (--preset electron)")
    g.add_argument("--slices", type=_positive_int, metavar="K",
                   help=f"object slices (default {ELECTRON['slices']})")
    g.add_argument("--slice-spacing", type=float, metavar="M",
                   help=f"distance between slices, m (default {ELECTRON['slice_spacing_m']:g})")
    g.add_argument("--energy", type=float, metavar="EV",
                   help=f"beam energy, eV (default {ELECTRON['energy_ev']:g})")
    g.add_argument("--convergence-semiangle", type=float, metavar="MRAD",
                   help=f"probe convergence semi-angle, mrad (default "
                        f"{ELECTRON['convergence_semiangle_mrad']:g})")
    g.add_argument("--defocus", type=float, metavar="M",
                   help=f"probe defocus, m (default {ELECTRON['defocus_m']:g})")
    g.add_argument("--position-errors", type=_position_errors, nargs="?", const=True,
                   metavar="rms=PX,scale=F,rotation=DEG",
                   help="store positions with scan errors (noise, scale, rotation about the "
                        "centre) and keep the true ones in truth/; without values: "
                        + ", ".join(f"{k}={v:g}" for k, v in POSITION_ERRORS.items()))
    p.add_argument("--rate", type=_rate, metavar="HZ",
                   help="an acquisition stand-in: write the frames in scan order at HZ frames/s, "
                        "a quarter second per block, into a live store other commands can read "
                        "while it grows (computed in this process; not with --workers or the "
                        "electron preset)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at OUT")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar or summary")
    return p


def run(args) -> int:
    from daskpty.io.store import store_size_bytes  # lazy: dask, zarr stay out of the CLI's start
    kwargs = {}
    if hasattr(args, "dose"):  # absent: the preset's dose
        kwargs["dose"] = args.dose
    electron = {dest: getattr(args, dest) for dest in ELECTRON_FLAGS if getattr(args, dest) is not None}
    if args.preset == "electron":
        kwargs.update({ELECTRON_FLAGS[dest]: value for dest, value in electron.items()})
    elif electron:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in electron)
        raise ValueError(f"{flags} apply to --preset electron only")
    if args.rate is not None:
        if args.preset == "electron" or args.workers is not None:
            raise ValueError("--rate writes the scan from this process; it does not take "
                             + ("--preset electron" if args.preset == "electron" else "--workers"))
        kwargs["rate"] = args.rate
    start = time.perf_counter()
    data = simulate(args.out, args.preset, scan=args.scan, grid=args.grid,
                    n_patterns=args.n_patterns, step=args.step, probe_size=args.probe_size,
                    modes=args.modes, mode_powers=args.mode_powers, dtype=args.dtype,
                    shard_bytes=int(args.shard_mib * 2**20), seed=args.seed,
                    n_workers=args.workers, progress=not args.quiet, overwrite=args.overwrite,
                    **kwargs)
    elapsed = time.perf_counter() - start
    if args.preset == "electron":
        if not args.quiet:
            _electron_summary(args.out, data, elapsed)
        return 0
    if args.rate is not None:
        if not args.quiet:
            print(f"wrote {data.path}: {data.n_patterns} frames of {data.pattern_shape[0]}x"
                  f"{data.pattern_shape[1]} {data.dtype} at {args.rate:g} frames/s into a live "
                  f"store, now ended; {elapsed:.1f} s ({data.n_patterns / elapsed:,.1f} frames/s "
                  f"with the start)")
            sys.stdout.flush()
        return 0
    if not args.quiet:
        n = data.n_patterns
        h, w = data.pattern_shape
        raw = data.intensities.nbytes
        disk = store_size_bytes(data.path)
        sim = data.metadata.get("simulation", {})
        print(f"wrote {data.path}: {n} patterns of {h}x{w} {data.dtype} in "
              f"{len(data.intensities.chunks[0])} shard(s) of {data.chunk_length}; "
              f"{human_bytes(raw)} raw, {human_bytes(disk)} on disk; "
              f"{elapsed:.1f} s ({n / elapsed:,.0f} patterns/s)")
        print(f"scan {sim.get('scan')} step {sim.get('step_px')} px, probe diameter "
              f"{sim.get('probe_diameter_px', float('nan')):.1f} px, linear overlap "
              f"{100 * sim.get('linear_overlap', float('nan')):.0f} %, object "
              f"{sim.get('object_shape')}, mean {sim.get('mean_counts_per_pattern', 0):,.0f} "
              f"counts/pattern")
        sys.stdout.flush()
    return 0


def _electron_summary(out: str, data, elapsed: float) -> None:
    """What was written, and the flags that reconstruct it."""
    sim = data.metadata.get("simulation", {})
    h, w = data.pattern_shape
    errors = sim.get("position_errors")
    scan = (f"positions off by {sim['position_error_rms_px']:.2f} px rms (noise {errors['rms']:g} px, "
            f"scale {errors['scale']:+g}, rotation {errors['rotation']:+g} deg; true ones in truth/)"
            if errors else "exact positions")
    print(f"wrote {out}: {data.n_patterns} patterns of {h}x{w} {data.dtype}, "
          f"{sim['energy_ev'] / 1e3:g} kV electrons, {sim['slices']} slices "
          f"{sim['slice_spacing_m']:g} m apart, object pixel {sim['object_pixel_size_m'] * 1e10:g} A, "
          f"{scan}; {elapsed:.1f} s")
    print(f"reconstruct it with: daskpty reconstruct {out} -o RECON.zarr --slices "
          f"{sim['slices']} --slice-spacing {sim['slice_spacing_m']:g}")
    sys.stdout.flush()
