"""CPU quick start: simulate a small scan, reconstruct it on a local dask cluster, score it.

What it does
    1. ``daskpty.simulate`` writes a small simulated data set (with its ground truth under
       ``truth/``) into a Zarr v3 store, streamed shard by shard on the cluster;
    2. ``daskpty.reconstruct`` runs LSQML on a ``distributed.LocalCluster`` of worker processes
       bound to 127.0.0.1;
    3. the object is compared with the true object (NRMSE after removing the global phase,
       scale, sub-pixel shift and phase ramp) on the well-lit region.

The defaults finish in well under a minute on two cores::

    python examples/cpu_quickstart.py
    python examples/cpu_quickstart.py --grid 24 --probe-size 64 --epochs 100 --workers 4
    python examples/cpu_quickstart.py --out /tmp/quickstart      # keep the stores

Every 10 epochs it prints the data loss (with ``--noise poisson``, the default, the negative
log-likelihood up to a constant of the data: 0 for a model equal to the counts; it should fall). The last line is
``object NRMSE vs truth: <value>`` (0 is perfect, about 1 is an unrelated image; the defaults
give about 1 %).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", type=int, default=12, help="scan grid is GRID x GRID positions (default 12)")
    p.add_argument("--probe-size", type=int, default=32, help="pattern / probe size in pixels (default 32)")
    p.add_argument("--epochs", type=int, default=40, help="LSQML epochs (default 40)")
    p.add_argument("--rounds-per-epoch", type=int, default=4,
                   help="object/probe updates per epoch (minibatch LSQML; default 4)")
    p.add_argument("--noise", choices=["gaussian", "poisson"], default="poisson",
                   help="noise model of the reconstruction (default poisson)")
    p.add_argument("--dose", type=float, default=1e6, help="mean photons per pattern (default 1e6)")
    p.add_argument("--workers", type=int, default=2, help="dask worker processes (default 2)")
    p.add_argument("--out", default=None,
                   help="directory for scan.zarr and recon.zarr (default: a temporary directory)")
    p.add_argument("--dashboard", action="store_true",
                   help="publish the run on the dashboard's /daskpty page (127.0.0.1 only); "
                        "the link is printed at the start")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from daskpty.metrics import nrmse_vs_truth

    args = parse_args(argv)
    import daskpty
    from distributed import Client, LocalCluster

    workdir = args.out or tempfile.mkdtemp(prefix="daskpty-quickstart-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    # everything listens on 127.0.0.1 only (dashboard_address="127.0.0.1:0" would bind 0.0.0.0:8787)
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        data = daskpty.simulate(os.path.join(workdir, "scan.zarr"), preset="small",
                                grid=(args.grid, args.grid), probe_size=args.probe_size,
                                dose=args.dose, client=client, overwrite=True)
        print(f"simulated {data.n_patterns} patterns of {data.pattern_shape[0]}x{data.pattern_shape[1]} "
              f"{data.dtype} into {data.path}")

        def report(epoch, state, metrics):
            if epoch % 10 == 0 or epoch == args.epochs:
                print(f"epoch {epoch:4d}  loss {metrics['loss']:.5g}")

        rec = daskpty.reconstruct(data, epochs=args.epochs, rounds_per_epoch=args.rounds_per_epoch,
                                  noise=args.noise, client=client, callback=report,
                                  dashboard=args.dashboard)
        rec.to_zarr(os.path.join(workdir, "recon.zarr"), overwrite=True)
    error = nrmse_vs_truth(rec.object, rec.positions, rec.illumination, data.truth)
    print(f"wrote {os.path.join(workdir, 'recon.zarr')}: object {rec.object.shape}, "
          f"probe {rec.probe.shape}, {time.perf_counter() - t0:.1f} s in total")
    if args.out is None:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    print(f"object NRMSE vs truth: {error:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
