"""The real near-field scan (PETRA III P25, ../shared/data) with and without position refinement.

Usage (not run in CI)::

    python benchmarks/bench_near_field_positions.py [--epochs 100] [--workers 2] [--cxi PATH]

Imports the CXI file as a new user would (``daskpty import ... --focus-to-sample 3.65e-3``, the
near-field recipe of docs/howto/own-data.md), then reconstructs it with the defaults (LSQML) with
the nominal positions and with ``refine_positions`` (LSQML's position refinement, start epoch
``--start``), and for each prints:

* the data misfit (the last epoch's loss, the amplitude least squares over all 200 patterns);
* the half-set FRC (``daskpty.workflows.half_set_frc``: two checkerboard halves reconstructed
  apart with the same settings, registered, mean FRC over 0.1-0.6 Nyquist, the 1/2-bit crossing);
* the rms and largest move of the refined positions from the nominal ones (px), and s/epoch.

Nothing in the file is ground truth: lower misfit and higher half-set FRC are the evidence.
Last line: a one-line JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CXI = os.path.join(HERE, "..", "..", "shared", "data", "PETRAIII_P25_Near_Field_Ptycho.cxi")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=100, help="default: 100")
    p.add_argument("--workers", type=int, default=2, help="default: 2")
    p.add_argument("--start", type=int, default=20, help="first epoch of position refinement (default: 20)")
    p.add_argument("--cxi", default=DEFAULT_CXI, help="the P25 file (default: ../shared/data)")
    return p.parse_args(argv)


def import_store(cxi: str, path: str) -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "daskpty")
    subprocess.run([exe, "import", cxi, "-o", path, "--focus-to-sample", "3.65e-3", "--quiet"], check=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import daskpty
    from daskpty.workflows import half_set_frc
    from distributed import Client, LocalCluster

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "p25.zarr")
        import_store(args.cxi, store)
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            for name, positions in (("nominal", None),
                                    ("refined", {"start_epoch": args.start})):
                t0 = time.perf_counter()
                rec = daskpty.reconstruct(store, epochs=args.epochs, client=client, refine_positions=positions,
                                          progress=False)
                seconds = time.perf_counter() - t0
                frc = half_set_frc(store, epochs=args.epochs, client=client, refine_positions=positions)
                row = {"misfit": rec.history[-1]["loss"], "frc_mean": frc.mean_frc, "half_bit": frc.resolution,
                       "s_per_epoch": float(np.median([h["seconds"] for h in rec.history])),
                       "seconds": seconds}
                if rec.nominal_positions is not None:
                    move = np.hypot(*(rec.positions - rec.nominal_positions).T)
                    row.update(move_rms=float(np.sqrt((move ** 2).mean())), move_max=float(move.max()))
                rows[name] = row
                print(f"{name:8s} misfit {row['misfit']:.6g}  half-set FRC {row['frc_mean']:.3f} "
                      f"(1/2-bit {row['half_bit'] if row['half_bit'] is not None else '-'})  "
                      f"{row['s_per_epoch']:.2f} s/epoch"
                      + (f"  positions moved {row['move_rms']:.2f} px rms, {row['move_max']:.2f} max"
                         if "move_rms" in row else ""), flush=True)
    print(json.dumps({"epochs": args.epochs, "workers": args.workers, **rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
