"""Half-set FRC of the old and the new ``rounds_per_epoch="auto"`` default on small, sparse scans.

Usage (not run in CI):

    python benchmarks/bench_defaults_frc.py [--epochs 100] [--workers 1] [--scans a,b,...]
        [--real PATH.cxi] [--markdown]

For each scan the patterns are split into two checkerboard halves, each reconstructed apart
(``daskpty.workflows.half_set_frc``: same object frame, registered, FRC over the commonly
illuminated region); the rounds rule applies to a half, so "N half" is what it sees. "old R" is
the rule before issue 15 (:func:`old_auto_rounds`, kept here), "new R" what ``reconstruct``
picks today with ``rounds_per_epoch="auto"`` (read back from the result). Everything else is
left at its default, as a new user would: LSQML, Gaussian noise model, ``--epochs`` epochs,
initial probe from the mean diffraction pattern (the simulated stores' probe guess is dropped,
as a measured file has none). FRC = mean over 0.1–0.6 Nyquist; "½-bit" = the crossing in
cycles/pixel (searched from 0.1 Nyquist up; "–" = none). s/epoch = median wall time of an epoch
of one half on this (shared) machine. Last line: a one-line JSON summary of the rows.

Simulated scans (``daskpty.simulate``, 'small' preset: 64² patterns unless said): the full
scan's linear overlap is given; a checkerboard half has the step × √2, so less. The real set
(``--real``, default the P25 file in ../shared/data) is a *near-field* scan; daskpty models the
far field only, so its figures say how the defaults behave on those counts, not what a correct
reconstruction would give. It is read with h5py here (mask non-zero = bad; the probe moves
opposite to the sample translation; positions in pixels of the Fresnel-scaled near-field
sampling, detector pixel × z1 / (z1 + z2) with z1 = 3.65 mm).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

#: The scans measured: name -> simulate() overrides (N = full scan; each half gets ~N/2).
SCANS = {
    "sparse-200": dict(n_patterns=200, overlap=0.2, dose=1e5),
    "sparse-500": dict(n_patterns=500, overlap=0.2, dose=1e5),
    "mid-200": dict(n_patterns=200, overlap=0.45, dose=1e5),
    "mid-500": dict(n_patterns=500, overlap=0.45, dose=1e5),
    "low-dose-500": dict(n_patterns=500, overlap=0.4, dose=1e4),
    "n128-300": dict(n_patterns=300, overlap=0.3, dose=1e6, probe_size=128),
    "n128-516": dict(n_patterns=516, overlap=0.3, dose=1e6, probe_size=128),
    "n128-516-mid": dict(n_patterns=516, overlap=0.5, dose=1e6, probe_size=128),
}

#: Defaults of the real set: detector pixel, sample-to-detector and focus-to-sample distances.
REAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                    "PETRAIII_P25_Near_Field_Ptycho.cxi")
FOCUS_TO_SAMPLE_M = 3.65e-3


def old_auto_rounds(n_patterns: int, n: int, modes: int = 1, persisted: bool = True) -> int:
    """The rounds rule before issue 15 (daskpty.execution.data.auto_rounds as it was)."""
    if not persisted:
        return 1
    by_batch = n_patterns // 150
    by_work = max(3, (n_patterns * n * n * modes) // (6 * 2**20))
    return int(np.clip(min(by_batch, by_work), 1, 16))


def simulated_scan(root: str, name: str, client):
    import daskpty

    spec = SCANS[name]
    data = daskpty.simulate(os.path.join(root, f"{name}.zarr"), "small", client=client, **spec)
    overlap = data.metadata["simulation"]["linear_overlap"]
    plain = daskpty.from_arrays(data.intensities, data.positions)  # no probe guess, no truth
    return plain, overlap


def real_scan(path: str):
    """The near-field CXI file as a PtychoData (positions in near-field object pixels)."""
    import h5py

    import daskpty

    with h5py.File(path, "r") as f:
        det = f["entry_1/instrument_1/detector_1"]
        counts = det["data"][...]
        bad = det["mask"][...] != 0
        z2 = float(det["distance"][()])
        pixel = float(det["x_pixel_size"][()])
        translation = f["entry_1/sample_1/geometry_1/translation"][...].astype(np.float64)
    if counts.min() < 0:
        raise ValueError("negative counts in the file")
    dtype = np.uint16 if counts.max() <= np.iinfo(np.uint16).max else np.uint32
    effective = pixel * FOCUS_TO_SAMPLE_M / (FOCUS_TO_SAMPLE_M + z2)
    # detector rows run along -y and columns along -x of the lab (basis vectors); the probe
    # moves by -translation, so its pixel coordinates are +translation / pixel
    positions = np.stack([translation[:, 1], translation[:, 0]], axis=1) / effective
    positions -= positions.min(axis=0)
    data = daskpty.from_arrays(counts.astype(dtype), positions, mask=~bad)
    return data, None


def scan_overlap(positions, probe) -> float:
    from daskpty.io.scan import linear_overlap, nearest_neighbour_steps, probe_diameter

    return linear_overlap(float(np.median(nearest_neighbour_steps(positions))), probe_diameter(probe))


def measure(name, data, overlap, args, client):
    from daskpty.metrics import split_halves
    from daskpty.workflows import half_set_frc

    n = int(data.intensities.shape[-1])
    half_n = len(split_halves(data.positions)[0])
    old_r = old_auto_rounds(half_n, n)
    options = dict(epochs=args.epochs, client=client, check_data=False)
    runs = {}
    t0 = time.perf_counter()
    runs["new"] = half_set_frc(data, rounds_per_epoch="auto", **options)
    new_r = int(runs["new"].halves[0].options["rounds_per_epoch"])
    runs["old"] = runs["new"] if new_r == old_r else half_set_frc(data, rounds_per_epoch=old_r, **options)
    if overlap is None:  # measured data: from the reconstructed probe
        overlap = scan_overlap(data.positions, runs["new"].halves[0].probe)
    row = dict(scan=name, N=data.n_patterns, half=half_n, n=n, overlap=overlap, old_R=old_r, new_R=new_r,
               frc_old=runs["old"].mean_frc, frc_new=runs["new"].mean_frc,
               res_old=runs["old"].resolution, res_new=runs["new"].resolution,
               spe_old=runs["old"].seconds_per_epoch, spe_new=runs["new"].seconds_per_epoch,
               wall=time.perf_counter() - t0)
    for extra in args.extra_rounds:
        if extra not in (old_r, new_r):
            row[f"frc_R{extra}"] = half_set_frc(data, rounds_per_epoch=extra, **options).mean_frc
    return row


def _res(x):
    return "–" if x is None else f"{x:.3f}"


def table(rows, markdown: bool) -> str:
    head = ["scan", "N (half)", "n", "overlap", "old R", "new R", "FRC old", "FRC new", "½-bit old",
            "½-bit new", "s/epoch old", "s/epoch new"]
    extra = sorted({k for r in rows for k in r if k.startswith("frc_R")}, key=lambda k: int(k[5:]))
    head += [f"FRC R={k[5:]}" for k in extra]
    lines = []
    for r in rows:
        cells = [r["scan"], f"{r['N']} ({r['half']})", str(r["n"]),
                 "–" if r["overlap"] is None or not math.isfinite(r["overlap"]) else f"{r['overlap']:.2f}",
                 str(r["old_R"]), str(r["new_R"]), f"{r['frc_old']:.3f}", f"{r['frc_new']:.3f}",
                 _res(r["res_old"]), _res(r["res_new"]), f"{r['spe_old']:.3f}", f"{r['spe_new']:.3f}"]
        cells += [f"{r[k]:.3f}" if k in r else "" for k in extra]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        out += ["| " + " | ".join(c) + " |" for c in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*c) for c in lines])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--epochs", type=int, default=100, help="epochs per half (reconstruct's default: 100)")
    ap.add_argument("--workers", type=int, default=1, help="worker processes (results do not depend on it)")
    ap.add_argument("--scans", default=",".join(SCANS) + ",real",
                    help=f"comma-separated subset of {', '.join(SCANS)}, real")
    ap.add_argument("--real", default=REAL, help="the near-field CXI file for the 'real' scan")
    ap.add_argument("--extra-rounds", type=int, nargs="*", default=[],
                    help="also measure these fixed rounds per epoch (extra columns)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)

    from distributed import Client

    from daskpty.execution.cluster import start_local_cluster

    names = [s for s in args.scans.split(",") if s]
    unknown = set(names) - set(SCANS) - {"real"}
    if unknown:
        ap.error(f"unknown scans {sorted(unknown)}")
    rows = []
    with tempfile.TemporaryDirectory() as root, start_local_cluster(n_workers=args.workers) as cluster, \
            Client(cluster) as client:
        for name in names:
            if name == "real":
                if not os.path.exists(args.real):
                    print(f"skipping real: {args.real} not found", file=sys.stderr)
                    continue
                data, overlap = real_scan(args.real)
                name = "P25 near-field (real)"
            else:
                data, overlap = simulated_scan(root, name, client)
            row = measure(name, data, overlap, args, client)
            rows.append(row)
            print(f"{name}: R {row['old_R']} -> {row['new_R']}, FRC {row['frc_old']:.3f} -> {row['frc_new']:.3f} "
                  f"({row['wall']:.0f} s)", file=sys.stderr, flush=True)
    print(table(rows, args.markdown))
    worse = [r["scan"] for r in rows if r["frc_new"] < r["frc_old"]]
    print(f"\nnew default below the old one on: {', '.join(worse) if worse else 'none'}")
    print(json.dumps({"epochs": args.epochs, "rows": rows, "worse": worse}))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
