"""Import benchmark: peak memory and wall time of ``daskpty import`` on a large HDF5 file.

Writes an HDF5 file of about ``--gib`` GiB (uint16 Poisson counts, chunked one frame per chunk,
gzip or bitshuffle/LZ4 compressed, or uncompressed) into ``--dir``, then runs ``daskpty import``
on it in a child process and reports the child's wall time and peak resident memory (the
import must stream: the target is well under 1 GiB for any file size)::

    python benchmarks/bench_import.py                   # 4 GiB in /tmp
    python benchmarks/bench_import.py --gib 1 --crop 192 --compression lz4

The file and the store are removed afterwards unless ``--keep``.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0, help="size of the HDF5 data (default 4)")
    p.add_argument("--size", type=int, default=256, help="detector frame size (default 256)")
    p.add_argument("--crop", type=int, default=None, help="pass --crop N to the import")
    p.add_argument("--compression", choices=["none", "gzip", "lz4"], default="none",
                   help="HDF5 compression of the detector data (default none: fastest to write)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the file and the store")
    return p.parse_args(argv)


def write_file(path, n, size, compression):
    """(n, size, size) uint16 frames written 256 at a time; positions on a raster in µm."""
    import h5py

    kwargs = {}
    if compression == "gzip":
        kwargs = {"compression": "gzip", "compression_opts": 1}
    elif compression == "lz4":
        import hdf5plugin

        kwargs = dict(hdf5plugin.Bitshuffle(cname="lz4"))
    rng = np.random.default_rng(0)
    cols = int(np.ceil(np.sqrt(n)))
    iy, ix = np.divmod(np.arange(n), cols)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("entry/data/data", shape=(n, size, size), dtype=np.uint16,
                              chunks=(1, size, size), **kwargs)
        block = rng.poisson(3.0, size=(256, size, size)).astype(np.uint16)
        for a in range(0, n, 256):
            b = min(n, a + 256)
            ds[a:b] = block[: b - a]
            block = np.roll(block, 1, axis=0)
        pos = f.create_dataset("entry/sample/positions", data=np.stack([iy, ix], 1) * 0.05)
        pos.attrs["units"] = "um"
        det = f.create_group("entry/instrument/detector")
        det["distance"], det["x_pixel_size"] = 2.0, 75e-6
        f["entry/instrument/beam/incident_wavelength"] = 1.5e-10


def run_import(src, out, crop):
    """Run ``daskpty import`` in a child; return (wall seconds, child peak RSS in bytes)."""
    cmd = [sys.executable, "-m", "daskpty", "import", src, "-o", out, "--data", "/entry/data/data",
           "--positions", "/entry/sample/positions", "--quiet"]
    if crop:
        cmd += ["--crop", str(crop), "--center", "128", "128"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"import failed ({proc.returncode}): {proc.stderr.strip()}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # kilobytes on Linux
    return wall, peak_kib * 1024


def main(argv=None) -> int:
    args = parse_args(argv)
    n = max(1, int(args.gib * GiB // (args.size * args.size * 2)))
    work = tempfile.mkdtemp(prefix="daskpty-bench-import-", dir=args.dir)
    src, out = os.path.join(work, "scan.h5"), os.path.join(work, "scan.zarr")
    try:
        t0 = time.perf_counter()
        write_file(src, n, args.size, args.compression)
        written = time.perf_counter() - t0
        size = os.path.getsize(src)
        wall, peak = run_import(src, out, args.crop)
        raw = n * args.size * args.size * 2
        print(f"file      {src}: {n:,} frames of {args.size}x{args.size} uint16, "
              f"{raw / GiB:.2f} GiB of data, {size / GiB:.2f} GiB on disk ({args.compression}), "
              f"written in {written:.1f} s")
        print(f"import    wall {wall:.1f} s ({raw / GiB / wall * 1024:.0f} MiB/s of frames), "
              f"peak RSS {peak / 2**20:.0f} MiB "
              f"({'under' if peak < GiB else 'OVER'} the 1 GiB target)")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
