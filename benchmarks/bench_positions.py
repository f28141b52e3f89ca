"""daskpty position refinement on a simulated scan with known position errors (daskpty only).

Usage:

    python benchmarks/bench_positions.py [--preset small] [--position-errors 1.0,0.015,0.5]
        [--epochs 50] [--ad-epochs 150] [--refine '{"start_epoch": 5}'] [--sweep default|none|JSON]
        [--timing-repeats 2] [--workers 2] [--rounds-per-epoch 3] [--no-ad]

Every run starts from the same object (ones) and daskpty's data-derived probe. Prints

* the chunk step alone with and without refinement (one process, one BLAS thread, 25 rounds of
  calls in shuffled order on ``--chunk`` patterns of ``--n``², the median ratio within a round; LSQML with the default window
  correction and with ``window_scale``, AD likewise, with its position gradients): the engines' own extra
  cost, free of the scheduler's and of a shared machine's noise (``--skip-chunk-cost``);
* s/epoch of LSQML with fixed (nominal) positions and with refinement, alternated back to back
  ``--timing-repeats`` times (median over the epochs from the refinement's start epoch on; the
  epochs before it do not refine) and the refinement's extra cost (target ≤ 25 %);
* every ``--every`` epochs: object NRMSE of the true-position run, the nominal run without
  refinement and the refined run, the ratio refined ÷ true (target ≤ 1.15 within ``--epochs``
  ≤ 50), and the position error (offset removed; target ≤ 0.35 px), see _positions.py for the
  metrics;
* the final affine parameters (daskpty's fit nominal → refined, and the fit true → refined);
* a sweep of PositionOptions settings (``--sweep``) and which one is best;
* AD with refinement against AD with the true positions (target: the same figures within 3× the
  LSQML epochs, ``--ad-epochs``), and the two runs' s/epoch (one run each, so noisier than
  LSQML's alternated repeats).

Last line: a one-line JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _positions import Case, fastest_seconds, median_seconds, parse_errors, run_daskpty  # noqa: E402

TARGET_POSITION = 0.35
TARGET_RATIO = 1.15
TARGET_COST = 0.25

# PositionOptions defaults: start_epoch 5, max_step 0.5, momentum 0.5, affine_gain 3,
# affine_blend 0.02 (so affine_gain 3 and affine_blend 0.02 alone are the default run).
DEFAULT_SWEEP = [
    {"start_epoch": 2}, {"start_epoch": 5}, {"start_epoch": 10}, {"start_epoch": 20},
    {"affine_gain": 1}, {"affine_blend": 0}, {"affine_blend": 0.1},
    {"max_step": 0.1}, {"max_step": 0.1, "momentum": 0},
    {"start_epoch": 10, "max_step": 0.1, "momentum": 0},
    {"start_epoch": 20, "max_step": 0.1, "momentum": 0},
    {"start_epoch": 20, "max_step": 0.05, "momentum": 0},
    {"start_epoch": 20, "max_step": 0.1, "momentum": 0, "affine_gain": 1},
    {"start_epoch": 20, "max_step": 0.1, "momentum": 0, "affine_blend": 0.1},
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--data", default=None, help="existing simulated store (default: simulate the preset)")
    ap.add_argument("--position-errors", default="1.0,0.015,0.5", metavar="RMS,SCALE,ROT_DEG")
    ap.add_argument("--perturb-seed", type=int, default=1)
    ap.add_argument("--start-probe", default="data", choices=("data", "mean-pattern", "reference"),
                    help="start probe of every run: the store's guess (default), a mean-pattern aperture, "
                         "or the probe of a calibration scan (_positions.reference_probe)")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--ad-epochs", type=int, default=None, help="default 3 x --epochs")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--refine", default="{}", help="PositionOptions of the main refined run (JSON)")
    ap.add_argument("--ad-refine", default="{}", help="PositionOptions of the AD refined run (JSON)")
    ap.add_argument("--sweep", default="default",
                    help="'default' (the built-in list), 'none', or a JSON list of PositionOptions dicts")
    ap.add_argument("--timing-repeats", type=int, default=2)
    ap.add_argument("--ad-timing-repeats", type=int, default=3,
                    help="alternated AD runs (true vs refined positions, --ad-timing-epochs each) for the cost")
    ap.add_argument("--ad-timing-epochs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds-per-epoch", default=3, type=lambda v: v if v == "auto" else int(v))
    ap.add_argument("--noise", default="gaussian")
    ap.add_argument("--no-ad", action="store_true")
    ap.add_argument("--n", type=int, default=64, help="probe size of the chunk-step timing")
    ap.add_argument("--chunk", type=int, default=256, help="patterns of the chunk-step timing")
    ap.add_argument("--skip-chunk-cost", action="store_true")
    ap.add_argument("--chunk-cost-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chunk_cost_only:
        chunk_cost(args.n, args.chunk)
        return
    if not args.skip_chunk_cost:  # a subprocess, so that one BLAS thread holds whatever numpy loads
        import subprocess

        one = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        subprocess.run([sys.executable, __file__, "--chunk-cost-only", "--n", str(args.n), "--chunk", str(args.chunk)],
                       env={**os.environ, **one}, check=True)
    epochs = args.epochs
    ad_epochs = args.ad_epochs or 3 * epochs
    refine = json.loads(args.refine)
    ad_refine = json.loads(args.ad_refine)
    sweep = (DEFAULT_SWEEP if args.sweep == "default" else [] if args.sweep == "none" else json.loads(args.sweep))
    track = list(range(args.every, epochs + 1, args.every))
    if epochs not in track:
        track.append(epochs)

    from daskpty.engines.positions import PositionOptions
    from distributed import Client, LocalCluster

    tmp = tempfile.mkdtemp(prefix="daskpty-bench-")
    case = Case(args.data or os.path.join(tmp, f"{args.preset}.zarr"), preset=args.preset,
                errors=parse_errors(args.position_errors), seed=args.perturb_seed,
                start_probe=args.start_probe)
    print(case.describe())
    main_opts = PositionOptions.from_argument(refine, "lsqml")
    summary = {"errors": args.position_errors, "epochs": epochs, "refine": refine}

    def rows(result):
        rec = result["rec"]
        return {e: (case.nrmse(o, p), case.nrmse_affine(o, p), *case.pos_errors(p - rec.origin))
                for e, (o, p) in result["track"].items()}

    common = dict(rounds_per_epoch=args.rounds_per_epoch, noise=args.noise)
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True) as cluster, \
            Client(cluster) as client:
        # --- LSQML: truth reference, then fixed vs refined alternated (timing + tracking) -------
        true = rows(run_daskpty(case, client, case.true, epochs=epochs, track=track, **common))
        start = max(main_opts.start_bounds()[1], 1)  # refinement has started by then
        spe = {"fixed": [], "refined": []}
        fast = {"fixed": [], "refined": []}
        fixed = refined = None
        for _ in range(max(1, args.timing_repeats)):
            r = run_daskpty(case, client, case.nominal, epochs=epochs, track=track, **common)
            spe["fixed"].append(median_seconds(r["seconds"], start))
            fast["fixed"].append(fastest_seconds(r["seconds"], start))
            fixed = fixed or rows(r)
            r = run_daskpty(case, client, case.nominal, epochs=epochs, refine=refine, track=track, **common)
            spe["refined"].append(median_seconds(r["seconds"], start))
            fast["refined"].append(fastest_seconds(r["seconds"], start))
            if refined is None:
                refined, main_run = rows(r), r
        cost = [b / a - 1 for a, b in zip(spe["fixed"], spe["refined"])]
        print(f"\nLSQML s/epoch (median over epochs {start + 1}..{epochs}; {args.workers} worker processes, "
              f"R = {args.rounds_per_epoch}), runs alternated back to back:")
        print(f"{'repeat':>7} {'fixed':>8} {'refined':>8} {'extra':>7}")
        for i, (a, b, c) in enumerate(zip(spe["fixed"], spe["refined"], cost)):
            print(f"{i + 1:>7} {a:>8.4f} {b:>8.4f} {100 * c:>6.1f}%")
        print(f"extra cost: median {100 * np.median(cost):.1f}% (target <= {100 * TARGET_COST:.0f}%)")
        fast_cost = [b / a - 1 for a, b in zip(fast["fixed"], fast["refined"])]
        print("extra cost of the fastest fifth of the epochs: " + ", ".join(f"{100 * c:+.1f}%" for c in fast_cost)
              + f"; median {100 * np.median(fast_cost):+.1f}%")
        summary.update(spe_fixed=spe["fixed"], spe_refined=spe["refined"], cost=cost, fast_cost=fast_cost)

        print(f"\nLSQML, refine_positions={refine or 'True'}: object NRMSE (offset-registered; "
              f"[affine-registered]) and position error px (offset removed; [affine removed])")
        print(f"{'epoch':>6} {'true pos':>9} {'nominal':>9} {'refined':>16} {'ratio':>6} {'pos err':>15}")
        first_ok = None
        for e in track:
            t, f, r_ = true[e], fixed[e], refined[e]
            ratio = r_[0] / t[0]
            ok = r_[2] <= TARGET_POSITION and ratio <= TARGET_RATIO
            first_ok = first_ok or (e if ok else None)
            print(f"{e:>6} {t[0]:>9.4f} {f[0]:>9.4f} {r_[0]:>8.4f} [{r_[1]:.4f}] {ratio:>6.2f} "
                  f"{r_[2]:>6.3f} [{r_[3]:.3f}]")
        print(f"targets (pos err <= {TARGET_POSITION} px and NRMSE <= {TARGET_RATIO} x true) "
              f"{'first met at epoch ' + str(first_ok) if first_ok else 'NOT met within ' + str(epochs) + ' epochs'}")
        summary.update(true=true[epochs], fixed=fixed[epochs], refined=refined[epochs], first_ok=first_ok)

        h = main_run["rec"].history[-1]
        rms, scale, rot = case.errors
        print("\nfinal affine, daskpty's fit nominal -> refined: "
              + ", ".join(f"{k[7:]} {h[k]:+.5f}" for k in h if k.startswith("affine_"))
              + f"\n  (a perfect refinement: scale {1 / (1 + scale):.5f}, rotation {-rot:+.3f} deg)")
        from _positions import affine_vs_truth

        a = affine_vs_truth(main_run["positions"] - main_run["rec"].origin, case.truth_positions)
        print("  residual map true -> refined: " + ", ".join(f"{k[7:]} {v:+.5f}" for k, v in a.items()))
        summary["affine"] = {k: h[k] for k in h if k.startswith("affine_")}

        # --- sweep ------------------------------------------------------------------------------
        if sweep:
            print(f"\nsweep ({epochs} epochs each; 'ok at' = first tracked epoch meeting both targets)")
            print(f"{'settings':<48} {'pos err':>8} {'NRMSE':>7} {'ratio':>6} {'ok at':>6} {'best ratio':>11}")
            results = []
            for cfg in sweep:
                got = rows(run_daskpty(case, client, case.nominal, epochs=epochs, refine=cfg, track=track,
                                       **common))
                end = got[epochs]
                ratios = {e: got[e][0] / true[e][0] for e in track}
                ok = next((e for e in track if got[e][2] <= TARGET_POSITION and ratios[e] <= TARGET_RATIO), None)
                best_e = min(ratios, key=ratios.get)
                results.append((cfg, end, ratios[epochs], ok))
                print(f"{json.dumps(cfg):<48} {end[2]:>8.3f} {end[0]:>7.4f} {ratios[epochs]:>6.2f} "
                      f"{str(ok or '-'):>6} {ratios[best_e]:>6.2f}@{best_e}", flush=True)
            best = min(results, key=lambda x: (x[3] is None, x[2], x[1][2]))
            print(f"best: {json.dumps(best[0])}: position error {best[1][2]:.3f} px, NRMSE ratio {best[2]:.2f} "
                  f"at epoch {epochs}")
            summary["sweep"] = [{"settings": c, "pos_err": e[2], "nrmse": e[0], "ratio": r, "ok_at": o}
                                for c, e, r, o in results]
            summary["best"] = best[0]

        # --- AD ---------------------------------------------------------------------------------
        if not args.no_ad:
            ad_track = list(range(ad_epochs // 5, ad_epochs + 1, ad_epochs // 5))
            ad_true_run = run_daskpty(case, client, case.true, engine="ad", epochs=ad_epochs, track=ad_track,
                                      **common)
            ad_true = rows(ad_true_run)
            ad_ref_run = run_daskpty(case, client, case.nominal, engine="ad", epochs=ad_epochs, refine=ad_refine,
                                     track=ad_track, **common)
            ad_ref = rows(ad_ref_run)
            print(f"\nAD (daskpty defaults), refine_positions={ad_refine or 'True'}")
            print(f"{'epoch':>6} {'true pos':>9} {'refined':>16} {'ratio':>6} {'pos err':>15}")
            for e in ad_track:
                t, r_ = ad_true[e], ad_ref[e]
                print(f"{e:>6} {t[0]:>9.4f} {r_[0]:>8.4f} [{r_[1]:.4f}] {r_[0] / t[0]:>6.2f} {r_[2]:>6.3f} [{r_[3]:.3f}]")
            ad_start = max(PositionOptions.from_argument(ad_refine, "ad").start_bounds()[1], 1)
            spe_true = median_seconds(ad_true_run["seconds"], ad_start)
            spe_ref = median_seconds(ad_ref_run["seconds"], ad_start)
            print(f"AD s/epoch (median over epochs {ad_start + 1}..{ad_epochs}, one run each): true positions "
                  f"{spe_true:.4f}, refined {spe_ref:.4f}, extra {100 * (spe_ref / spe_true - 1):+.1f} % "
                  f"(target <= {100 * TARGET_COST:.0f} %)")
            summary.update(ad_spe_true=spe_true, ad_spe_refined=spe_ref)
            if args.ad_timing_repeats > 0:   # the cost, as for LSQML: alternated shorter runs
                ad_cost, ad_fast = [], []
                for _ in range(args.ad_timing_repeats):
                    a = run_daskpty(case, client, case.true, engine="ad", epochs=args.ad_timing_epochs, **common)
                    b = run_daskpty(case, client, case.nominal, engine="ad", epochs=args.ad_timing_epochs,
                                    refine=ad_refine, **common)
                    ad_cost.append(median_seconds(b["seconds"], ad_start) / median_seconds(a["seconds"], ad_start) - 1)
                    ad_fast.append(fastest_seconds(b["seconds"], ad_start) / fastest_seconds(a["seconds"], ad_start) - 1)
                for what, values in (("median epochs", ad_cost), ("fastest fifth of the epochs", ad_fast)):
                    print(f"AD extra s/epoch ({what}), {args.ad_timing_repeats} alternated pairs of "
                          f"{args.ad_timing_epochs}-epoch runs: " + ", ".join(f"{100 * c:+.1f} %" for c in values)
                          + f"; median {100 * np.median(values):+.1f} % (target <= {100 * TARGET_COST:.0f} %)")
                summary.update(ad_cost=ad_cost, ad_fast_cost=ad_fast)
            summary.update(ad_true=ad_true[ad_epochs], ad_refined=ad_ref[ad_epochs])
    print(json.dumps(summary, default=float))


def chunk_cost(n: int, patterns: int, calls: int = 25) -> None:
    """The chunk step with and without position refinement in this process (run with one BLAS
    thread): LSQML's shift terms, AD's position gradients and (default, and ``window_scale``) the
    window sums of each, on a refining epoch: ``calls`` rounds of one call each in shuffled order, and the
    median over rounds of each ratio within a round (robust to a machine whose speed drifts)."""
    import time

    from daskpty.engines import lsqml
    from daskpty.engines.ad import ADOptions
    from daskpty.engines.ad.gradient import chunk_gradient, refining_chunk_gradient
    from daskpty.engines.positions import PositionOptions, initial_local
    from daskpty.execution.tuning import tune_allocator
    from daskpty.simulate.variable_probe import simulate_variable_probe

    tune_allocator()  # glibc's thresholds as in a worker process (see daskpty.execution.tuning)

    grid = int(np.ceil(np.sqrt(patterns)))
    ds = simulate_variable_probe(n=n, grid=grid, step=n / 8, photons=1e7, constant=True)
    y = np.fft.ifftshift(ds.intensities[:patterns], axes=(-2, -1))
    pos, obj, probe = ds.positions[:patterns], ds.truth.object, ds.truth.probe
    lo, ao = lsqml.LSQMLOptions(), ADOptions()
    refine = PositionOptions(start_epoch=0)
    scaled = PositionOptions(start_epoch=0, window_scale=True)
    local = initial_local(pos, refine)
    steps = {
        "lsqml": lambda: lsqml.chunk_step(obj, probe, y, pos, options=lo),
        "lsqml refined": lambda: lsqml.refining_chunk_step(obj, probe, y, pos, local, options=lo, positions=refine,
                                                           epoch=1),
        "lsqml refined, window_scale": lambda: lsqml.refining_chunk_step(obj, probe, y, pos, local, options=lo,
                                                                         positions=scaled, epoch=1),
        "ad": lambda: chunk_gradient(obj, probe, y, pos, options=ao),
        "ad refined": lambda: refining_chunk_gradient(obj, probe, y, pos, initial_local(pos, refine, gradient_based=True),
                                                      options=ao, positions=refine, epoch=1),
        "ad refined, window_scale": lambda: refining_chunk_gradient(obj, probe, y, pos,
                                                                    initial_local(pos, scaled, gradient_based=True),
                                                                    options=ao, positions=scaled, epoch=1),
    }
    times = {name: [] for name in steps}
    for f in steps.values():
        f()
    order = np.random.default_rng(0)
    for _ in range(calls):  # in a new order every time: what ran before a call changes its time
        for name in order.permutation(list(steps)):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    t = {name: np.asarray(v) for name, v in times.items()}
    print(f"chunk step, {len(y)} patterns of {n}², one thread, {calls} rounds of calls in shuffled order; "
          f"extra = median over rounds of the ratio within a round (target <= {100 * TARGET_COST:.0f}%):")
    for name, base in (("lsqml refined", "lsqml"), ("lsqml refined, window_scale", "lsqml"), ("ad refined", "ad"),
                       ("ad refined, window_scale", "ad")):
        ratio = t[name] / t[base]
        print(f"  {name:<28} {1e3 * t[name].min():7.1f} ms against {1e3 * t[base].min():7.1f} ms (fastest); "
              f"extra {100 * (np.median(ratio) - 1):+.0f} % (quartiles {100 * (np.quantile(ratio, 0.25) - 1):+.0f} … "
              f"{100 * (np.quantile(ratio, 0.75) - 1):+.0f} %)", flush=True)


if __name__ == "__main__":
    main()
