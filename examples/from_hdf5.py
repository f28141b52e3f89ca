"""Convert a CXI / HDF5 ptychography file into a daskpty data-set store, chunk by chunk.

Without an input file the script first writes a small synthetic CXI-like file (a simulated scan
stored the way CXI files store it: patterns, sample translations in metres, photon energy in
joules, detector distance and pixel size, a bad-pixel mask), converts it, prints a
``daskpty info``-style summary and checks that the positions survived the trip::

    python examples/from_hdf5.py                          # synthetic file in a temporary directory
    python examples/from_hdf5.py scan.cxi -o scan.zarr    # your own file
    python examples/from_hdf5.py scan.cxi -o scan.zarr --crop 256 --center 1030 1012

Which CXI fields go where (docs/howto/convert.md explains each):

    entry_1/data_1/data                       (N, H, W)  -> intensities (cropped to --crop around --center)
    entry_1/sample_1/geometry_1/translation   (N, 3) m   -> positions (y, x) px = sign * (t_y, t_x) / dx
    entry_1/instrument_1/source_1/energy      J          -> wavelength_m = h c / E
    entry_1/instrument_1/detector_1/distance  m          -> detector_distance_m
    entry_1/instrument_1/detector_1/x_pixel_size, y_pixel_size  m -> detector_pixel_size_m
    entry_1/instrument_1/detector_1/mask      (H, W), non-zero = bad -> mask (True = valid)

with the object pixel size dx = wavelength * distance / (n * detector pixel) for n x n patterns.
The patterns are never loaded whole: the dataset is wrapped by ``dask.array.from_array`` in
shard-sized blocks and ``PtychoData.to_zarr`` writes one shard per block.

h5py is optional for daskpty (``pip install h5py``); without it the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

#: Planck constant times the speed of light, J m (exact in the SI)
HC_J_M = 6.62607015e-34 * 299792458.0
#: one electronvolt in joules (exact)
EV_J = 1.602176634e-19


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default=None,
                   help="CXI / HDF5 file to convert (default: write and convert a synthetic one)")
    p.add_argument("-o", "--output", default=None,
                   help="data-set store to write (default: next to the synthetic file)")
    p.add_argument("--crop", type=int, default=None,
                   help="keep an N x N window of every pattern (default: the whole, square, detector)")
    p.add_argument("--center", type=int, nargs=2, metavar=("CY", "CX"), default=None,
                   help="detector pixel of the direct beam (default: the detector centre)")
    p.add_argument("--sign", type=int, choices=[-1, 1], default=-1,
                   help="positions = sign * translation / dx; -1 (default) because CXI records "
                        "where the sample moved, and the beam then moves the other way on it")
    p.add_argument("--energy-ev", type=float, default=None, help="override the photon energy (eV)")
    p.add_argument("--distance-m", type=float, default=None, help="override the detector distance (m)")
    p.add_argument("--pixel-size-m", type=float, default=None, help="override the detector pixel size (m)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.add_argument("--grid", type=int, default=8,
                   help="synthetic file only: GRID x GRID scan positions (default 8)")
    p.add_argument("--probe-size", type=int, default=32,
                   help="synthetic file only: pattern size (default 32)")
    p.add_argument("--keep", action="store_true",
                   help="synthetic file only: keep the temporary directory and print its path")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ a synthetic CXI file

def write_synthetic_cxi(path: str, workdir: str, grid: int, probe_size: int):
    """Simulate a scan with daskpty and store it with CXI names and units. Returns the data set."""
    import h5py

    import daskpty
    from distributed import Client, LocalCluster

    # an in-process cluster starts in a fraction of a second; its HTTP server stays on loopback
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        sim = daskpty.simulate(os.path.join(workdir, "simulated.zarr"), grid=(grid, grid),
                               probe_size=probe_size, client=client, overwrite=True)
    meta = sim.metadata
    wavelength, distance, pixel = (meta["wavelength_m"], meta["detector_distance_m"],
                                   meta["detector_pixel_size_m"])
    dx = wavelength * distance / (probe_size * pixel)
    n = sim.n_patterns
    # positions (y, x) in object pixels -> CXI sample translation (x, y, z) in metres; the beam
    # moves over the sample opposite to the sample's own motion
    translation = np.zeros((n, 3))
    translation[:, 0] = -sim.positions[:, 1] * dx
    translation[:, 1] = -sim.positions[:, 0] * dx
    bad = np.zeros((probe_size, probe_size), dtype=np.uint32)
    bad[3, 5] = bad[probe_size - 4, 7] = 1       # two dead pixels ("invalid" bit)
    patterns = np.asarray(sim.intensities).copy()
    patterns[:, bad != 0] = 65535                  # ... that read nonsense
    with h5py.File(path, "w") as f:
        f["cxi_version"] = 150
        det = f.create_group("entry_1/instrument_1/detector_1")
        det.create_dataset("data", data=patterns, chunks=(min(n, 16), probe_size, probe_size),
                           compression="gzip")
        det["distance"] = distance
        det["x_pixel_size"] = pixel
        det["y_pixel_size"] = pixel
        det["mask"] = bad
        f["entry_1/instrument_1/source_1/energy"] = HC_J_M / wavelength          # joules
        f["entry_1/sample_1/geometry_1/translation"] = translation
        f["entry_1/data_1/data"] = h5py.SoftLink("/entry_1/instrument_1/detector_1/data")
        f["entry_1/data_1/translation"] = h5py.SoftLink("/entry_1/sample_1/geometry_1/translation")
    return sim


# ------------------------------------------------------------------------------ the conversion

def _first(f, *names):
    for name in names:
        if name in f:
            return f[name]
    return None


def _scalar(f, name, override=None, what=""):
    if override is not None:
        return float(override)
    if name not in f:
        raise SystemExit(f"from_hdf5: {name} ({what}) is missing; give it on the command line")
    return float(np.asarray(f[name][()]).ravel()[0])


def _target_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind in "ui":
        return np.dtype("uint16") if dtype.itemsize <= 2 else np.dtype("uint32")
    return np.dtype("float32")


def convert(path: str, output: str, *, crop=None, center=None, sign=-1, energy_ev=None,
            distance_m=None, pixel_size_m=None, overwrite=False):
    """Stream ``path`` (CXI layout) into a daskpty store at ``output``; return the opened store."""
    import dask.array as da
    import h5py

    import daskpty
    from daskpty.io.store import shard_layout

    with h5py.File(path, "r") as f:
        data = _first(f, "entry_1/data_1/data", "entry_1/instrument_1/detector_1/data")
        if data is None or data.ndim != 3:
            raise SystemExit(f"from_hdf5: {path} has no (N, H, W) entry_1/data_1/data")
        n_patterns, height, width = data.shape
        size = crop or min(height, width)
        cy, cx = center if center is not None else (height // 2, width // 2)
        y0, x0 = cy - size // 2, cx - size // 2
        if size % 2 or y0 < 0 or x0 < 0 or y0 + size > height or x0 + size > width:
            raise SystemExit(f"from_hdf5: an even {size} x {size} window around ({cy}, {cx}) does "
                             f"not fit the {height} x {width} detector; adjust --crop / --center")

        # geometry: CXI stores the photon energy in joules
        energy_j = energy_ev * EV_J if energy_ev is not None else _scalar(
            f, "entry_1/instrument_1/source_1/energy", what="photon energy, J")
        wavelength = HC_J_M / energy_j
        distance = _scalar(f, "entry_1/instrument_1/detector_1/distance", distance_m, "m")
        px = _scalar(f, "entry_1/instrument_1/detector_1/x_pixel_size", pixel_size_m, "m")
        py = _scalar(f, "entry_1/instrument_1/detector_1/y_pixel_size", pixel_size_m, "m")
        if not np.isclose(px, py, rtol=1e-6):
            raise SystemExit(f"from_hdf5: detector pixels are {py} x {px} m; daskpty needs square "
                             "pixels (resample the patterns first)")
        dx = wavelength * distance / (size * px)                     # object pixel, metres

        # positions: CXI translation (x, y, z) in metres -> daskpty (y, x) in object pixels
        t = _first(f, "entry_1/sample_1/geometry_1/translation", "entry_1/data_1/translation")
        if t is None:
            raise SystemExit(f"from_hdf5: {path} has no entry_1/sample_1/geometry_1/translation")
        t = np.asarray(t[...], dtype=np.float64)
        positions = sign * t[:, [1, 0]] / dx
        positions += size / 2 - positions.min(axis=0)                # first window at pixel 0

        # mask: CXI marks bad pixels with non-zero bits; daskpty wants True = valid
        m = _first(f, "entry_1/instrument_1/detector_1/mask", "entry_1/data_1/mask")
        valid = (np.ones((height, width), bool) if m is None else np.asarray(m[...]) == 0)
        valid = valid[y0:y0 + size, x0:x0 + size]

        # the patterns, lazily: one dask block per future shard, read only when written
        target = _target_dtype(data.dtype)
        shard, _ = shard_layout((n_patterns, size, size), target)
        raw = da.from_array(data, chunks=(shard, height, width))
        x = raw[:, y0:y0 + size, x0:x0 + size]
        x = da.where(valid, x, 0)                                    # bad pixels -> 0, masked
        if data.dtype.kind == "f":
            x = da.clip(da.where(da.isfinite(x), x, 0), 0, None)     # no NaN, no negative counts
        elif data.dtype.kind == "i" or data.dtype.itemsize > target.itemsize:
            x = da.clip(x, 0, np.iinfo(target).max)                  # fits the unsigned type
        x = x.astype(target)

        ptycho = daskpty.from_arrays(
            x, positions, mask=valid, wavelength_m=wavelength, detector_distance_m=distance,
            detector_pixel_size_m=px, object_pixel_size_m=dx,
            provenance=f"converted from {os.path.abspath(path)} by examples/from_hdf5.py",
            metadata={"source": {"file": os.path.abspath(path), "crop": [int(y0), int(x0), int(size)],
                                 "position_sign": sign}})
        # the file must stay open while the blocks are read
        return ptycho.to_zarr(output, overwrite=overwrite)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import h5py  # noqa: F401
    except ImportError:
        print("from_hdf5: h5py is not installed, so there is nothing to convert; "
              "install it with 'pip install h5py' and run again")
        return 0
    from daskpty.cli import main as daskpty_cli

    workdir = None
    sim = None
    if args.input is None:
        workdir = tempfile.mkdtemp(prefix="daskpty-hdf5-")
        args.input = os.path.join(workdir, "scan.cxi")
        sim = write_synthetic_cxi(args.input, workdir, args.grid, args.probe_size)
        print(f"wrote synthetic CXI file {args.input}: {sim.n_patterns} patterns of "
              f"{args.probe_size}x{args.probe_size}")
        args.output = args.output or os.path.join(workdir, "converted.zarr")
    elif args.output is None:
        raise SystemExit("from_hdf5: give the store to write with -o OUT.zarr")

    converted = convert(args.input, args.output, crop=args.crop, center=args.center, sign=args.sign,
                        energy_ev=args.energy_ev, distance_m=args.distance_m,
                        pixel_size_m=args.pixel_size_m, overwrite=args.overwrite)
    print(f"converted {args.input} -> {converted.path}")
    code = daskpty_cli(["info", converted.path])

    if sim is not None:   # the synthetic round trip: same scan, same counts on valid pixels
        shift = converted.positions - sim.positions
        err = float(np.abs(shift - shift.mean(axis=0)).max())
        valid = converted.mask
        same = bool(np.array_equal(np.asarray(converted.intensities)[:, valid],
                                   np.asarray(sim.intensities)[:, valid]))
        print(f"round trip: positions agree to {err:.2e} px (up to a constant offset), "
              f"counts on valid pixels identical: {same}")
        if args.keep:
            print(f"kept {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        if err > 1e-6 or not same:
            return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
