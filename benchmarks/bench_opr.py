"""OPR (a probe varying over the scan): time per epoch with and without it, and the object
NRMSE figures of the ground-truth scan of tests/test_opr.py.

    python benchmarks/bench_opr.py [--workers 2] [--epochs 40] [--timing-grid 24] [--n 64]

Timing: a drifting-probe scan of --timing-grid² patterns of --n² pixels, s/epoch (median of
the epochs after the first two) without OPR and with K = 3 (target: ≤ 30 % extra). Figures: the
32² scan whose defocus drifts along the scan and whose flux varies ±20 %: NRMSE of the same scan
with a constant probe, of the drifting scan without OPR and with OPR (K = 2), and the
correlation of the recovered weights with the true flux and defocus, for LSQML and AD.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _multiple_r(features, target):
    x = np.c_[features, np.ones(len(features))]
    coef, *_ = np.linalg.lstsq(x, target, rcond=None)
    return float(np.corrcoef(x @ coef, target)[0, 1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--timing-grid", type=int, default=24)
    parser.add_argument("--timing-epochs", type=int, default=8)
    parser.add_argument("--n", type=int, default=64)
    args = parser.parse_args(argv)

    from distributed import Client, LocalCluster

    import daskpty
    from daskpty.metrics import nrmse_vs_truth
    from daskpty.simulate_variable_probe import simulate_variable_probe

    def run(ds, client, **kw):
        return daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), client=client,
                                   check_data=False, **kw)

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        big = simulate_variable_probe(n=args.n, grid=args.timing_grid, step=args.n / 8, photons=1e7)
        print(f"timing: {len(big.positions)} patterns of {args.n}², {args.workers} workers")
        for engine in ("lsqml", "ad"):
            seconds = {}
            for label, kw in (("no OPR", {}), ("OPR K=3", dict(opr_modes=3, probe_model={"start_epoch": 0}))):
                rec = run(big, client, engine=engine, epochs=args.timing_epochs, **kw)
                seconds[label] = float(np.median([h["seconds"] for h in rec.history[2:]]))
            extra = seconds["OPR K=3"] / seconds["no OPR"] - 1
            print(f"  {engine}: {seconds['no OPR']:.3f} s/epoch without OPR, {seconds['OPR K=3']:.3f} with "
                  f"K=3 ({100 * extra:+.0f} %)", flush=True)

        varying, constant = simulate_variable_probe(), simulate_variable_probe(constant=True)
        print(f"ground truth: {len(varying.positions)} patterns of 32², {args.epochs} epochs")
        for engine in ("lsqml", "ad"):
            start = time.perf_counter()
            kw = dict(engine=engine, epochs=args.epochs, chunk_length=48)
            e_const = nrmse_vs_truth(*_parts(run(constant, client, **kw)), constant.truth)
            e_plain = nrmse_vs_truth(*_parts(run(varying, client, **kw)), varying.truth)
            rec = run(varying, client, opr_modes=2, probe_model={"start_epoch": 10}, **kw)
            e_opr = nrmse_vs_truth(*_parts(rec), varying.truth)
            w = rec.probe_weights
            r_flux = np.corrcoef(w[:, 0] ** 2, varying.truth.flux)[0, 1]
            r_defocus = _multiple_r(w[:, 1:], varying.truth.defocus)
            print(f"  {engine}: NRMSE constant probe {e_const:.4f} | drifting, no OPR {e_plain:.4f} | OPR K=2 "
                  f"{e_opr:.4f} ({e_opr / e_const:.2f}x constant); r(w0², flux) {r_flux:.3f}, "
                  f"R(w1, defocus) {r_defocus:.3f} [{time.perf_counter() - start:.0f} s]", flush=True)


def _parts(rec):
    return rec.object, rec.positions, rec.illumination


if __name__ == "__main__":
    main()
