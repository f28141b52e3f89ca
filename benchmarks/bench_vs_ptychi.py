"""daskpty LSQML vs Pty-Chi LSQML on the same simulated data, start and epochs.

Usage (Pty-Chi in its own virtualenv, see README_ptychi.md):

    python benchmarks/bench_vs_ptychi.py [--preset small] [--epochs 10,30,100] [--workers 2]
        [--rounds-per-epoch 6] [--peer-python /work/peer-venv/bin/python] [--peer-batch 100]

Prints NRMSE of the object against the ground truth after each listed epoch count and the
seconds per epoch of both codes. Both start from the same object (ones) and probe (daskpty's
data-derived initial probe, already scaled to the data).

Position-error case (``--position-errors RMS,SCALE,ROT_DEG``, e.g. ``1.0,0.015,0.5``): both codes
get the same nominal positions (true ones scaled by 1 + SCALE and rotated ROT_DEG about the scan
centre, plus N(0, RMS) px per axis; see _positions.py); daskpty LSQML refines them
(``refine_positions``, ``--refine`` JSON, default: PositionOptions defaults), Pty-Chi LSQML uses its
gradient position correction plus its affine transform constraint from the same start epoch
(``ptychi_peer.py --refine-positions``). References: both codes with the true positions and with the
nominal positions unrefined. ``--with-ad`` adds daskpty AD and Pty-Chi Autodiff (Adam on the
positions) with refinement, at ``--ad-factor`` times the epochs. Prints object NRMSE vs truth
(offset-registered, and [affine-registered]), position error (offset removed, [affine removed])
and s/epoch side by side.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import object_nrmse_in_truth_frame, simulated  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--data", default=None, help="existing data store (default: simulate the preset)")
    ap.add_argument("--epochs", default="10,30,100")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds-per-epoch", type=int, default=3)
    ap.add_argument("--noise", default="gaussian")
    ap.add_argument("--engine", default="lsqml", choices=["lsqml", "ad"],
                    help="lsqml: both LSQML; ad: daskpty AD (defaults) vs Pty-Chi Autodiff with Adam")
    ap.add_argument("--peer-lr", type=float, default=0.01, help="Pty-Chi Adam step size (engine ad)")
    ap.add_argument("--peer-python", default="/work/peer-venv/bin/python")
    ap.add_argument("--peer-batch", type=int, default=100)
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--position-errors", default=None, metavar="RMS,SCALE,ROT_DEG",
                    help="run the position-error case instead (see the module docstring)")
    ap.add_argument("--refine", default="{}", help="daskpty PositionOptions (JSON) for the position case")
    ap.add_argument("--peer-position-args", default="",
                    help="extra ptychi_peer.py options for its refined runs, e.g. '--position-limit 0.3'")
    ap.add_argument("--with-ad", action="store_true", help="position case: also AD in both codes")
    ap.add_argument("--ad-factor", type=int, default=3, help="AD epochs = this x the LSQML epochs")
    ap.add_argument("--peer-ad-position-args", default="--position-optimizer adam --position-step-size 0.05",
                    help="ptychi_peer.py position options of its Autodiff refined run")
    ap.add_argument("--refine-alt", default=None,
                    help="position case: a second daskpty LSQML refined run with these PositionOptions (JSON)")
    ap.add_argument("--perturb-seed", type=int, default=1)
    ap.add_argument("--skip-references", action="store_true",
                    help="position case: leave out the Pty-Chi true/nominal reference runs")
    args = ap.parse_args()
    if args.position_errors:
        return position_case(args)
    checkpoints = [int(e) for e in args.epochs.split(",")]
    epochs = max(checkpoints)

    import daskpty
    from daskpty.engines.initial import object_frame, probe_diameter_from_scan, probe_from_mean_pattern
    from distributed import Client, LocalCluster

    tmp = tempfile.mkdtemp(prefix="daskpty-bench-")
    data = simulated(args.data or os.path.join(tmp, f"{args.preset}.zarr"), preset=args.preset)
    intensities = np.asarray(data.intensities.compute(), dtype=np.float32)
    n = intensities.shape[-1]
    shape, origin = object_frame(data.positions, n)
    positions = data.positions + origin
    probe = probe_from_mean_pattern(intensities.mean(axis=0), diameter=probe_diameter_from_scan(data.positions, n))
    obj = np.ones(shape, np.complex64)
    print(f"data: {len(positions)} patterns of {n}x{n}, object {shape}, {args.noise} model, engine {args.engine}")

    # --- Pty-Chi ------------------------------------------------------------------------------
    peer_in, peer_out = os.path.join(tmp, "peer_in.npz"), os.path.join(tmp, "peer_out.npz")
    np.savez(peer_in, intensities=intensities, positions=positions, probe=probe, object=obj)
    peer = None
    if os.path.exists(args.peer_python):
        cmd = [args.peer_python, os.path.join(os.path.dirname(__file__), "ptychi_peer.py"), peer_in, peer_out,
               "--engine", args.engine, "--epochs-list", args.epochs, "--batch-size", str(args.peer_batch),
               "--noise", args.noise, "--threads", str(args.peer_threads)]
        if args.engine == "ad":
            cmd += ["--lr", str(args.peer_lr)]
        # distributed writes MALLOC_TRIM_THRESHOLD_=65536 into this process's environment when it
        # starts a LocalCluster (the simulation above); inherited, it pins glibc's mmap threshold
        # and makes torch fault in every large array: Pty-Chi measured 0.55 instead of 0.25 s/epoch.
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 0:
            peer = np.load(peer_out)
        else:
            print("Pty-Chi run failed:\n" + proc.stderr[-3000:])
    else:
        print(f"Pty-Chi virtualenv not found at {args.peer_python}; see benchmarks/README_ptychi.md")

    # --- daskpty ------------------------------------------------------------------------------
    objects = {}

    def keep(epoch, state, metrics):  # gets daskpty's EpochState: fetch only the epochs compared
        if epoch in checkpoints:
            state = state.get()
            objects[epoch] = (state.object.copy(), state.illumination.copy())

    keep.takes_epoch_state = True

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True) as cluster, \
            Client(cluster) as client:
        rec = daskpty.reconstruct(_shifted(data, origin), engine=args.engine, epochs=epochs, object=obj,
                                  probe=probe, client=client, rounds_per_epoch=args.rounds_per_epoch,
                                  noise=args.noise, callback=keep, rescale_probe=False)
    seconds = np.array([h["seconds"] for h in rec.history])
    ours_spe = float(np.median(seconds[1:] if len(seconds) > 1 else seconds))

    print(f"\n{'epochs':>7} {'daskpty NRMSE':>14} {'Pty-Chi NRMSE':>14}")
    for e in checkpoints:
        o, illum = objects[e]
        ours = object_nrmse_in_truth_frame(o, positions, data.truth, illum)
        theirs = float("nan")
        if peer is not None:
            theirs = object_nrmse_in_truth_frame(peer[f"object_{e}"], positions, data.truth, illum)
        print(f"{e:>7} {ours:>14.4f} {theirs:>14.4f}")
    print(f"\nseconds/epoch: daskpty {ours_spe:.4f} ({args.workers} worker processes, "
          f"{args.rounds_per_epoch} rounds/epoch)", end="")
    if peer is not None:
        theirs_spe = float(peer["seconds_per_epoch"])
        print(f"   Pty-Chi {theirs_spe:.4f} (batch {args.peer_batch}, {args.peer_threads} threads)"
              f"   speed-up {theirs_spe / ours_spe:.2f}x")
    else:
        print()


def _run_peer(args, case, tmp, tag, positions, engine, epochs_list, extra=()):
    """Pty-Chi on the case's start with ``positions``; returns the loaded OUT.npz or None."""
    import shlex

    peer_in, peer_out = os.path.join(tmp, f"peer_in_{tag}.npz"), os.path.join(tmp, f"peer_out_{tag}.npz")
    np.savez(peer_in, intensities=case.intensities, positions=positions, probe=case.probe, object=case.object)
    cmd = [args.peer_python, os.path.join(os.path.dirname(__file__), "ptychi_peer.py"), peer_in, peer_out,
           "--engine", engine, "--epochs-list", ",".join(str(e) for e in epochs_list),
           "--batch-size", str(args.peer_batch), "--noise", args.noise, "--threads", str(args.peer_threads)]
    if engine == "ad":
        cmd += ["--lr", str(args.peer_lr)]
    cmd += [str(c) for c in extra]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}  # see main()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"Pty-Chi run {tag} failed ({shlex.join(cmd)}):\n" + proc.stderr[-3000:])
        return None
    with np.load(peer_out) as z:
        return {k: z[k] for k in z.files}


def position_case(args):
    """daskpty vs Pty-Chi on nominal positions with known errors (``--position-errors``)."""
    import json
    import shlex

    from _positions import Case, median_seconds, parse_errors, run_daskpty
    from daskpty.engines.positions import PositionOptions
    from distributed import Client, LocalCluster

    checkpoints = sorted(int(e) for e in args.epochs.split(","))
    epochs = checkpoints[-1]
    refine = json.loads(args.refine)
    start = PositionOptions.from_argument(refine).start_epoch
    tmp = tempfile.mkdtemp(prefix="daskpty-bench-")
    case = Case(args.data or os.path.join(tmp, f"{args.preset}.zarr"), preset=args.preset,
                errors=parse_errors(args.position_errors), seed=args.perturb_seed)
    print(case.describe())
    have_peer = os.path.exists(args.peer_python)
    if not have_peer:
        print(f"Pty-Chi virtualenv not found at {args.peer_python}; see benchmarks/README_ptychi.md")
    peer_pos = ["--refine-positions", "--position-start", str(start)] + shlex.split(args.peer_position_args)
    rows = []  # (code, engine, positions, {epoch: (nrmse, nrmse_aff, perr, perr_aff)}, s/epoch)

    def ours(label, engine, positions, n_epochs, ref, marks):
        r = run_daskpty(case, client, positions, engine=engine, epochs=n_epochs, refine=ref, track=marks,
                        rounds_per_epoch=args.rounds_per_epoch, noise=args.noise)
        rec = r["rec"]
        got = {e: (case.nrmse(o, p), case.nrmse_affine(o, p), *case.pos_errors(p - rec.origin))
               for e, (o, p) in r["track"].items() if e in marks}
        rows.append(("daskpty", engine, label, got, median_seconds(r["seconds"], max(start, 1))))

    def theirs(label, engine, positions, marks, extra=()):
        if not have_peer:
            return
        out = _run_peer(args, case, tmp, f"{engine}_{label.replace(' ', '_').replace('+', '')}", positions, engine, marks, extra)
        if out is None:
            return
        got = {}
        for e in marks:
            p = out[f"positions_{e}"] if f"positions_{e}" in out else positions
            o = out[f"object_{e}"]
            got[e] = (case.nrmse(o, p), case.nrmse_affine(o, p), *case.pos_errors(p))
        rows.append(("Pty-Chi", engine, label, got, float(out["seconds_per_epoch"])))

    # Pty-Chi first (before this process starts a LocalCluster), then daskpty
    ad_marks = [args.ad_factor * e for e in checkpoints]
    refined_label = "nominal + refinement"
    if not args.skip_references:
        theirs("true", "lsqml", case.true, checkpoints)
        theirs("nominal", "lsqml", case.nominal, checkpoints)
    theirs(refined_label, "lsqml", case.nominal, checkpoints, peer_pos)
    if args.with_ad:
        if not args.skip_references:
            theirs("true", "ad", case.true, ad_marks)
        theirs(refined_label, "ad", case.nominal, ad_marks,
               ["--refine-positions", "--position-start", str(start)] + shlex.split(args.peer_ad_position_args))
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True) as cluster, \
            Client(cluster) as client:
        ours("true", "lsqml", case.true, epochs, None, checkpoints)
        ours("nominal", "lsqml", case.nominal, epochs, None, checkpoints)
        ours(refined_label, "lsqml", case.nominal, epochs, refine, checkpoints)
        if args.refine_alt:
            ours("nominal + refine alt", "lsqml", case.nominal, epochs, json.loads(args.refine_alt), checkpoints)
        if args.with_ad:
            ours("true", "ad", case.true, ad_marks[-1], None, ad_marks)
            ours(refined_label, "ad", case.nominal, ad_marks[-1], refine, ad_marks)

    print(f"\nobject NRMSE vs truth (offset-registered [affine-registered]); position error px (global offset "
          f"removed [global affine removed]); s/epoch: daskpty median over epochs {max(start, 1) + 1}.. "
          f"({args.workers} worker processes, R = {args.rounds_per_epoch}), Pty-Chi mean over the run "
          f"(batch {args.peer_batch}, {args.peer_threads} threads)")
    print(f"daskpty refine_positions={refine or 'True'}"
          + (f", alt {args.refine_alt}" if args.refine_alt else "") + "; "
          f"Pty-Chi: {shlex.join(peer_pos)}"
          + (f"; Pty-Chi AD: {args.peer_ad_position_args}" if args.with_ad else ""))
    print(f"{'code':<8} {'engine':<6} {'positions':<21} {'epochs':>6} {'NRMSE':>8} {'[affine]':>8} "
          f"{'pos err':>8} {'[affine]':>8} {'s/epoch':>8}")
    summary = []
    for code, engine, label, got, spe in rows:
        for i, e in enumerate(sorted(got)):
            g = got[e]
            print(f"{code:<8} {engine:<6} {label:<21} {e:>6} {g[0]:>8.4f} {g[1]:>8.4f} {g[2]:>8.3f} {g[3]:>8.3f} "
                  + (f"{spe:>8.4f}" if i == len(got) - 1 else ""))
        summary.append({"code": code, "engine": engine, "positions": label, "s_per_epoch": spe,
                        "by_epoch": {str(e): list(g) for e, g in got.items()}})
    print(json.dumps(summary))


def _shifted(data, origin):
    """The data set with positions in the benchmark's object frame."""
    from types import SimpleNamespace

    return SimpleNamespace(intensities=data.intensities, positions=data.positions + origin, mask=data.mask,
                           probe=None)


if __name__ == "__main__":
    main()
