"""OPR (a probe varying over the scan): time per epoch with and without it, and the object
NRMSE figures of the ground-truth scan of tests/test_opr.py.

    python benchmarks/bench_opr.py [--workers 2] [--epochs 40] [--timing-grid 24] [--n 64]
        [--repeats 3] [--opr-modes 2] [--start-epoch 10] [--skip-timing] [--skip-quality]
        [--scan step=2.5,grid=22,defocus=1.9,defocus_drift=2,flux_jitter=0.2,seed=0] [--at 30,50]

Timing: a drifting-probe scan of --timing-grid² patterns of --n² pixels, s/epoch (median of
the epochs after the first two) without OPR and with K = 3 at the same rounds per epoch
(target: ≤ 30 % extra), and with K = 3 and "auto" rounds (one per epoch with OPR); the runs
alternate --repeats times and the fastest median of each counts (the machine is shared). Then
the chunk step alone (one process, one BLAS thread, the fastest of 15 alternating calls on
--chunk patterns): the engines' own extra cost, free of the scheduler's. Figures: the 32² scan
whose defocus drifts along the scan and whose flux varies ±20 %: NRMSE of the same scan with a
constant probe, of the drifting scan without OPR and with OPR (K = --opr-modes, weights from
--start-epoch), and the correlation of the recovered weights with the true flux and defocus,
for LSQML and AD. ``--scan`` changes the ground-truth scan (the keywords of
``daskpty.simulate.variable_probe``): ``step=2.5,grid=22`` overlaps far more, ``defocus=5``
spreads the probe (half its power within 4.1 px of its centre instead of 1.4 px);
``n=64,grid=16,defocus_drift=1.14`` is issue 33's strongly drifting beam (64² patterns, 256
positions, defocus 1.9 ± 30 %, flux ± 20 %). ``--at 30,50`` also prints the NRMSE ratios (to the constant-probe run and to no OPR) at
those epochs of the same runs (``--epochs`` is then their largest).
"""
from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--opr-modes", type=int, default=2)
    parser.add_argument("--start-epoch", type=int, default=15)
    parser.add_argument("--scan", default="", help="KEY=VALUE,... for simulate_variable_probe")
    parser.add_argument("--at", default="", help="EPOCH,... : also the NRMSE after these epochs")
    parser.add_argument("--probe-model", default="{}", help="JSON: more ProbeModelOptions of the OPR runs")
    parser.add_argument("--engines", default="lsqml,ad", help="engines of the quality runs")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--chunk-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.chunk_only:
        chunk_timing(args.n, args.chunk)
        return
    if not args.skip_timing:
        import os
        import subprocess
        import sys

        one = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        subprocess.run([sys.executable, __file__, "--chunk-only", "--n", str(args.n), "--chunk", str(args.chunk)],
                       env={**os.environ, **one}, check=True)

    from distributed import Client, LocalCluster

    import daskpty
    from daskpty.execution.data import auto_rounds
    from daskpty.metrics import nrmse_vs_truth
    from daskpty.simulate.variable_probe import simulate_variable_probe

    at = sorted({int(e) for e in args.at.split(",") if e})
    if at:
        args.epochs = max(at)

    def run(ds, client, snapshots=None, **kw):
        def keep(epoch, state, metrics):   # object and illumination after the epochs of --at
            if epoch in at:   # (a callback's epoch counts the epochs done)
                snapshots[epoch] = (np.array(state.object), np.array(state.illumination))
        return daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), client=client,
                                   check_data=False, callback=None if snapshots is None else keep, **kw)

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        if not args.skip_timing:
            big = simulate_variable_probe(n=args.n, grid=args.timing_grid, step=args.n / 8, photons=1e7)
            print(f"timing: {len(big.positions)} patterns of {args.n}², {args.workers} workers, "
                  f"best of {args.repeats}")
            opr = dict(opr_modes=3, probe_model={"start_epoch": 0})
            # "auto" rounds differ with OPR (one round per epoch): the cost at the plain run's rounds
            # is the engine's, the one at "auto" what a user waits for
            plain_rounds = auto_rounds(len(big.positions), args.n)
            for engine in ("lsqml", "ad"):
                seconds, rounds = {}, {}
                for _ in range(args.repeats):
                    for label, kw in (("no OPR", {}), ("OPR K=3", dict(opr, rounds_per_epoch=plain_rounds)),
                                      ("OPR K=3 auto", opr)):
                        rec = run(big, client, engine=engine, epochs=args.timing_epochs, **kw)
                        rounds[label] = rec.options["rounds_per_epoch"]
                        median = float(np.median([h["seconds"] for h in rec.history[2:]]))
                        seconds[label] = min(seconds.get(label, np.inf), median)
                extra = {label: 100 * (seconds[label] / seconds["no OPR"] - 1) for label in seconds}
                print(f"  {engine}: {seconds['no OPR']:.3f} s/epoch without OPR (R = {rounds['no OPR']}), "
                      f"{seconds['OPR K=3']:.3f} with K=3 at the same R ({extra['OPR K=3']:+.0f} %), "
                      f"{seconds['OPR K=3 auto']:.3f} with K=3 and 'auto' (R = {rounds['OPR K=3 auto']}, "
                      f"{extra['OPR K=3 auto']:+.0f} %)", flush=True)
        if args.skip_quality:
            return

        scan = {k: (int(v) if k in ("grid", "seed", "n") else float(v))
                for k, v in (item.split("=", 1) for item in args.scan.split(",") if item)}
        varying, constant = simulate_variable_probe(**scan), simulate_variable_probe(constant=True, **scan)
        size = varying.intensities.shape[-1]
        print(f"ground truth: {len(varying.positions)} patterns of {size}², {args.epochs} epochs, scan {scan or 'default'}")
        extra_model = json.loads(args.probe_model)
        for engine in args.engines.split(","):
            start = time.perf_counter()
            kw = dict(engine=engine, epochs=args.epochs, chunk_length=48)
            snaps_const, snaps_plain, snaps_opr = {}, {}, {}
            rec_const = run(constant, client, snaps_const, **kw)
            e_const = nrmse_vs_truth(*_parts(rec_const), constant.truth)
            rec_plain = run(varying, client, snaps_plain, **kw)
            e_plain = nrmse_vs_truth(*_parts(rec_plain), varying.truth)
            rec = run(varying, client, snaps_opr, opr_modes=args.opr_modes, probe_model={"start_epoch": args.start_epoch, **extra_model}, **kw)
            e_opr = nrmse_vs_truth(*_parts(rec), varying.truth)
            if at:
                ratios = [nrmse_vs_truth(snaps_opr[e][0], rec.positions, snaps_opr[e][1], varying.truth)
                          / nrmse_vs_truth(snaps_const[e][0], rec_const.positions, snaps_const[e][1], constant.truth)
                          for e in at]
                versus_plain = [nrmse_vs_truth(snaps_opr[e][0], rec.positions, snaps_opr[e][1], varying.truth)
                                / nrmse_vs_truth(snaps_plain[e][0], rec_plain.positions, snaps_plain[e][1], varying.truth)
                                for e in at]
                print(f"  {engine}: OPR / constant-probe NRMSE " + ", ".join(
                    f"{r:.2f}x at {e}" for e, r in zip(at, ratios)) + "; OPR / no-OPR " + ", ".join(
                    f"{r:.2f}x at {e}" for e, r in zip(at, versus_plain)) + f" (R = {rec_const.options['rounds_per_epoch']} / "
                    f"{rec.options['rounds_per_epoch']} rounds per epoch)", flush=True)
            w = rec.probe_weights
            r_flux = np.corrcoef(w[:, 0] ** 2, varying.truth.flux)[0, 1]
            # a pattern's probe power is Σ_k w_jk² ‖U_0‖² (orthonormal eigen-probes), not w_j0² alone
            r_power = np.corrcoef((w ** 2).sum(axis=1), varying.truth.flux)[0, 1]
            r_defocus = _multiple_r(w[:, 1:], varying.truth.defocus)
            print(f"  {engine}: NRMSE constant probe {e_const:.4f} | drifting, no OPR {e_plain:.4f} | OPR K={args.opr_modes} "
                  f"{e_opr:.4f} ({e_opr / e_const:.2f}x constant, {e_opr / e_plain:.2f}x no OPR); r(w0², flux) {r_flux:.3f}, "
                  f"r(|w|², flux) {r_power:.3f}, "
                  f"R(w1, defocus) {r_defocus:.3f} [{time.perf_counter() - start:.0f} s]", flush=True)


def chunk_timing(n: int, patterns: int, modes: int = 3, calls: int = 15) -> None:
    """The chunk step with and without OPR K = ``modes`` in this process (run with one BLAS
    thread: ``main`` starts it as a subprocess with OPENBLAS/OMP/MKL_NUM_THREADS=1)."""
    from daskpty.engines import lsqml, lsqml_opr
    from daskpty.engines import probe_model as pm
    from daskpty.engines.eigen_probes import initial_eigen_probes
    from daskpty.engines.ad import ADOptions, opr as ad_opr
    from daskpty.engines.ad.gradient import chunk_gradient
    from daskpty.simulate.variable_probe import simulate_variable_probe

    grid = int(np.ceil(np.sqrt(patterns)))
    ds = simulate_variable_probe(n=n, grid=grid, step=n / 8, photons=1e7)
    y = np.fft.ifftshift(ds.intensities[:patterns], axes=(-2, -1))
    pos, obj, probe = ds.positions[:patterns], ds.truth.object, ds.truth.probe
    model = pm.ProbeModelOptions(opr_modes=modes, start_epoch=0)
    eigen = initial_eigen_probes(probe[0], modes - 1)
    local = pm.initial_local(len(y), model)
    local["opr_weights"][:, 1:] = 0.01
    lo, ao = lsqml.LSQMLOptions(), ADOptions()
    common = dict(eigen=eigen, transform=None, background=None, epoch=1)
    steps = {
        "lsqml": lambda: lsqml.chunk_step(obj, probe, y, pos, options=lo),
        "lsqml OPR": lambda: lsqml_opr.variable_chunk_step(obj, probe, y, pos, local, options=lo, update_probe=True,
                                                           model=model.for_engine("lsqml"), **common),
        "ad": lambda: chunk_gradient(obj, probe, y, pos, options=ao),
        "ad OPR": lambda: ad_opr.variable_chunk_gradient(obj, probe, y, pos, local, options=ao,
                                                         model=model.for_engine("ad"), **common),
    }
    best = dict.fromkeys(steps, np.inf)
    for f in steps.values():
        f()
    for _ in range(calls):
        for name, f in steps.items():
            start = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"chunk step, {len(y)} patterns of {n}², one thread, fastest of {calls}: "
          f"LSQML {1e3 * best['lsqml']:.1f} ms, with OPR K={modes} {1e3 * best['lsqml OPR']:.1f} ms "
          f"({100 * (best['lsqml OPR'] / best['lsqml'] - 1):+.0f} %); AD {1e3 * best['ad']:.1f} ms, with OPR "
          f"{1e3 * best['ad OPR']:.1f} ms ({100 * (best['ad OPR'] / best['ad'] - 1):+.0f} %)", flush=True)


def _parts(rec):
    return rec.object, rec.positions, rec.illumination


if __name__ == "__main__":
    main()
