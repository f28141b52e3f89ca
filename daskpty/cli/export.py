"""``daskpty export RECON.zarr OUT.cxi|OUT.h5|OUT.tif|OUT.png``: results for other tools."""
from __future__ import annotations

import os
import sys

from ..io.export import FORMATS, export

NAME = "export"


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="export a reconstruction to CXI / HDF5 / TIFF / PNG",
        description="Write a reconstruction store's object, probe, positions and geometry "
                    "(the one the store was reconstructed with, or that of --data), near field "
                    "included, to a CXI or HDF5 file, or images of it to "
                    "TIFF (float32 amplitude and phase pages, each with a description) or PNG "
                    "(8-bit grey). The type follows the suffix. The file is built in memory and "
                    "written only when the disk has room for it: a full disk or a read-only "
                    "directory ends in one line and leaves nothing.")
    p.add_argument("recon", metavar="RECON", help="reconstruction store (.zarr)")
    p.add_argument("output", metavar="OUT", help="file to write: .cxi .h5 .hdf5 .tif .tiff .png")
    p.add_argument("--data", default=None, metavar="DATA",
                   help="the data-set store that was reconstructed (geometry for CXI / HDF5, "
                        "the pixel size for TIFF); needed only for a store written without "
                        "its geometry")
    p.add_argument("--what", choices=["object", "probe", "phase", "amplitude"], default=None,
                   help="TIFF: object (amplitude + phase, default), probe, phase, amplitude; "
                        "PNG: phase (default), amplitude, probe")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    return p


def run(args) -> int:
    suffix = os.path.splitext(args.output)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"{args.output}: unsupported export type {suffix or '(no suffix)'!r}; "
                         f"use one of {', '.join(FORMATS)}")
    if not os.path.isdir(args.recon) and not os.path.isdir(args.recon.rstrip("/") + ".previous"):
        raise FileNotFoundError(f"{args.recon}: no such reconstruction store")
    if args.data is not None and not os.path.exists(args.data):
        raise FileNotFoundError(f"{args.data}: no such data-set store")
    export(args.recon, args.output, data=args.data, what=args.what, overwrite=args.overwrite)
    print(f"wrote {args.output}", file=sys.stdout)
    if args.data is None and suffix in (".cxi", ".h5", ".hdf5") and not _has_geometry(args.recon):
        print(f"daskpty: note: {args.output} carries no experiment geometry (wavelength, "
              f"distances, pixel sizes); pass --data DATA.zarr, the data set that was "
              f"reconstructed, to include it", file=sys.stderr)
    return 0


def _has_geometry(recon) -> bool:
    """Whether the store records the wavelength or a distance or pixel size it was reconstructed with."""
    from ..io.export import GEOMETRY_KEYS
    from ..io.results import stored_geometry  # lazy: zarr stays out of the CLI's start

    return any(k in GEOMETRY_KEYS for k in stored_geometry(recon))
