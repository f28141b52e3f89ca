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

Multislice case (``--multislice K``, K = 2 or 3; ``--ms-n``, ``--ms-grid``, ``--ms-spacing``):
daskpty multislice LSQML vs Pty-Chi multislice LSQML on daskpty's simulated K-slice electron set,
with Pty-Chi's forward model checked on the truth first; per-slice NRMSE and s/epoch. Variable-probe
case (``--variable-probe``, ``--opr-modes 3``, ``--opr-start``): both codes' OPR on the drifting-
probe scan of daskpty.simulate.variable_probe; object NRMSE, weight-flux correlation, s/epoch.
See the docstrings of ``multislice_case`` and ``variable_probe_case``.
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
    ap.add_argument("--engine", default="lsqml", choices=["lsqml", "ad", "rpie", "epie"],
                    help="lsqml: both LSQML; ad: daskpty AD (defaults) vs Pty-Chi Autodiff with Adam; "
                         "rpie / epie: both codes' rPIE (alpha 0.1) / ePIE, step 1")
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
    ap.add_argument("--start-probe", default="data", choices=("data", "mean-pattern", "reference"),
                    help="start probe of every run: the store's guess (default), a mean-pattern aperture, "
                         "or the probe of a calibration scan (_positions.reference_probe)")
    ap.add_argument("--skip-references", action="store_true",
                    help="position case: leave out the Pty-Chi true/nominal reference runs")
    ap.add_argument("--multislice", type=int, default=None, metavar="K",
                    help="run the multislice case instead: K slices (2 or 3; see the module docstring)")
    ap.add_argument("--ms-n", type=int, default=32, help="multislice case: pattern size")
    ap.add_argument("--ms-grid", type=int, default=20, help="multislice case: grid x grid scan positions")
    ap.add_argument("--ms-spacing", type=float, default=2e-9, help="multislice case: slice spacing, m")
    ap.add_argument("--ms-rounds", type=int, default=1,
                    help="multislice case: daskpty rounds per epoch (default 1, compact LSQML: with the "
                         "minibatch R = 3 the per-slice error grows again after ~10 epochs on this set)")
    ap.add_argument("--variable-probe", action="store_true",
                    help="run the variable-probe (OPR) case instead (see the module docstring)")
    ap.add_argument("--opr-modes", type=int, default=3, help="variable-probe case: OPR modes K (both codes)")
    ap.add_argument("--opr-start", type=int, default=10,
                    help="variable-probe case: first epoch (from 0) of the OPR updates (both codes)")
    ap.add_argument("--vp-grid", type=int, default=14, help="variable-probe case: grid x grid positions")
    ap.add_argument("--vp-n", type=int, default=32, help="variable-probe case: pattern size")
    args = ap.parse_args()
    if args.position_errors:
        return position_case(args)
    if args.multislice:
        return multislice_case(args)
    if args.variable_probe:
        return variable_probe_case(args)
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
    # the peer starts where LSQML has started at the latest ("auto" decides between 3 and 10)
    start = PositionOptions.from_argument(refine, "lsqml").start_bounds()[1]
    tmp = tempfile.mkdtemp(prefix="daskpty-bench-")
    case = Case(args.data or os.path.join(tmp, f"{args.preset}.zarr"), preset=args.preset,
                errors=parse_errors(args.position_errors), seed=args.perturb_seed,
                start_probe=args.start_probe)
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


def _peer_env():
    # see main(): without distributed's MALLOC_TRIM_THRESHOLD_
    return {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}


def _peer(args, args_list, what):
    """Run ptychi_peer.py with ``args_list``; its stdout, or None (printing why) on failure."""
    import shlex

    cmd = [args.peer_python, os.path.join(os.path.dirname(__file__), "ptychi_peer.py")] + [str(a) for a in args_list]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_peer_env())
    if proc.returncode != 0:
        print(f"Pty-Chi {what} failed ({shlex.join(cmd)}):\n" + proc.stderr[-3000:])
        return None
    return proc.stdout


def _phase_nrmse(estimate, truth, mask):
    """Phase NRMSE after alignment (shift, ramp, complex scale): ||dphi|| / ||phi - mean phi|| on
    the mask (the measure of tests/test_multislice_reconstruct.py; weak-phase slices make the
    complex NRMSE small for any estimate near 1)."""
    from daskpty import metrics

    a = metrics.align(estimate, truth, mask=mask)
    pa, pt = np.angle(a), np.angle(truth)
    pa, pt = pa - pa[mask].mean(), pt - pt[mask].mean()
    return float(np.sqrt(((pa - pt)[mask] ** 2).sum() / (pt[mask] ** 2).sum()))


def multislice_case(args):
    """daskpty multislice LSQML vs Pty-Chi multislice LSQML on one simulated K-slice set.

    daskpty's simulator (daskpty.simulate.multislice: 300 kV electrons, lambda = 1.97 pm, 0.25 A
    pixels, weak-phase slices ``--ms-spacing`` apart, Poisson noise), both codes from the same
    start: K slices of ones in the truth's frame and daskpty's aperture probe from the data's
    geometry (defocus 6 nm, scaled to the data). Pty-Chi's forward model is first checked on the
    true slices and probe against daskpty's noise-free intensities. Prints per-slice phase and
    complex NRMSE (and of the projected object, the product of the slices) after each listed
    epoch, and s/epoch of both codes.
    """
    import daskpty
    from daskpty import metrics
    from daskpty.physics.multislice import multislice_intensities
    from daskpty.engines.sample_options import aperture_probe
    from daskpty.simulate.multislice import simulate_multislice
    from distributed import Client, LocalCluster

    if args.engine != "lsqml":
        raise SystemExit("the multislice case compares LSQML (--engine lsqml)")
    k = int(args.multislice)
    checkpoints = sorted(int(e) for e in args.epochs.split(","))
    epochs = checkpoints[-1]
    tmp = tempfile.mkdtemp(prefix="daskpty-bench-ms-")
    ds = simulate_multislice(n=args.ms_n, n_slices=k, grid=args.ms_grid, spacing_m=args.ms_spacing,
                             noise=True, seed=2)
    g = ds.geometry
    n = args.ms_n
    truth = ds.truth.slices
    clean = np.fft.fftshift(multislice_intensities(truth, ds.truth.probe, ds.positions, ds.kernel), axes=(-2, -1))
    intensities = ds.intensities.astype(np.float32)
    data = daskpty.from_arrays(intensities, ds.positions, wavelength_m=g.wavelength_m,
                               object_pixel_size_m=g.pixel_size_m, electron_voltage_v=300e3,
                               convergence_semiangle_rad=25e-3)
    power = float(intensities.sum(axis=(1, 2), dtype=np.float64).mean())
    probe = aperture_probe(data.metadata, n, power=power, positions=ds.positions,
                           aperture={"defocus_m": 6e-9})
    obj = np.ones(truth.shape, np.complex64)
    print(f"multislice: {len(ds.positions)} patterns of {n}x{n}, {k} slices of {truth.shape[1:]} px, "
          f"lambda {g.wavelength_m:.4g} m, pixel {g.pixel_size_m:.3g} m, spacing {g.spacing_m:.3g} m "
          f"(Fresnel number lambda dz / dx^2 = {g.fresnel_number:.2f}), Poisson noise; {epochs} epochs")

    # --- Pty-Chi: forward check on the truth, then the reconstruction ---------------------------
    peer = None
    geometry = dict(wavelength_m=g.wavelength_m, pixel_size_m=g.pixel_size_m, slice_spacing_m=g.spacing_m)
    if os.path.exists(args.peer_python):
        check_in = os.path.join(tmp, "peer_check.npz")
        np.savez(check_in, intensities=intensities, clean_intensities=clean, positions=ds.positions,
                 probe=ds.truth.probe, object=truth, true_object=truth, true_probe=ds.truth.probe, **geometry)
        out = _peer(args, [check_in, "--check-forward"], "forward check")
        if out:
            print("forward check: " + out.strip().replace("\n", "; "))
        peer_in, peer_out = os.path.join(tmp, "peer_in.npz"), os.path.join(tmp, "peer_out.npz")
        np.savez(peer_in, intensities=intensities, positions=ds.positions, probe=probe, object=obj, **geometry)
        if _peer(args, [peer_in, peer_out, "--engine", "lsqml", "--epochs-list", args.epochs,
                        "--batch-size", args.peer_batch, "--noise", "poisson" if args.noise == "poisson" else "gaussian",
                        "--threads", args.peer_threads], "multislice LSQML") is not None:
            with np.load(peer_out) as z:
                peer = {key: z[key] for key in z.files}
    else:
        print(f"Pty-Chi virtualenv not found at {args.peer_python}; see benchmarks/README_ptychi.md")

    # --- daskpty ------------------------------------------------------------------------------
    objects = {}

    def keep(epoch, state, metrics_):
        if epoch in checkpoints:
            objects[epoch] = np.array(state.get().object)

    keep.takes_epoch_state = True
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        rec = daskpty.reconstruct(data, engine="lsqml", epochs=epochs, object=obj, probe=probe, client=client,
                                  slices=k, slice_spacing_m=g.spacing_m, rounds_per_epoch=args.ms_rounds,
                                  noise=args.noise, callback=keep, rescale_probe=False, check_data=False)
        one = daskpty.reconstruct(data, engine="lsqml", epochs=epochs, object=obj[0], probe=probe, client=client,
                                  rounds_per_epoch=args.ms_rounds, noise=args.noise, rescale_probe=False,
                                  check_data=False)
    assert tuple(np.round(rec.origin)) == (0, 0), rec.origin  # the given object's frame = the truth's
    seconds = np.array([h["seconds"] for h in rec.history])
    ours_spe = float(np.median(seconds[1:]))
    illum = np.asarray(rec.illumination)[0]
    lit = illum > 0.3 * illum.max()
    projected_truth = np.prod(truth, axis=0)

    def errors(o):
        o = np.asarray(o)
        per = [(_phase_nrmse(o[i], truth[i], lit), float(metrics.nrmse(o[i], truth[i], mask=lit))) for i in range(k)]
        p = np.prod(o, axis=0)
        return per, (_phase_nrmse(p, projected_truth, lit), float(metrics.nrmse(p, projected_truth, mask=lit)))

    print("\nper-slice phase NRMSE [complex NRMSE] vs truth, illuminated region (> 0.3 max, entrance slice); "
          "'proj' = product of the slices vs the true product")
    head = "".join(f"{'slice ' + str(i):>16}" for i in range(k)) + f"{'proj':>16}"
    print(f"{'code':<8} {'epochs':>6}{head}")
    for code in ("daskpty", "Pty-Chi"):
        for e in checkpoints:
            if code == "daskpty":
                o = objects[e]
            elif peer is not None:
                o = peer[f"object_{e}"]
            else:
                continue
            per, proj = errors(o)
            cells = "".join(f"{a:>8.4f} [{c:.4f}]" for a, c in per + [proj])
            print(f"{code:<8} {e:>6}{cells}")
    p1 = _phase_nrmse(one.object, projected_truth, lit)
    print(f"(daskpty 1-slice fit of the same data, {epochs} epochs: projected phase NRMSE {p1:.4f}; "
          f"per slice {' '.join(f'{_phase_nrmse(one.object, truth[i], lit):.4f}' for i in range(k))})")
    print(f"\nseconds/epoch: daskpty {ours_spe:.4f} (median of epochs 2.., {args.workers} worker processes, "
          f"{args.ms_rounds} rounds/epoch)", end="")
    if peer is not None:
        theirs_spe = float(peer["seconds_per_epoch"])
        last = float(peer["segment_seconds"][-1]) / (checkpoints[-1] - ([0] + checkpoints)[-2])
        print(f"   Pty-Chi {theirs_spe:.4f} (mean over the run; {last:.4f} over epochs "
              f"{([0] + checkpoints)[-2] + 1}..{checkpoints[-1]}; batch {args.peer_batch}, {args.peer_threads} threads)"
              f"   speed-up {theirs_spe / ours_spe:.2f}x (mean) / {last / ours_spe:.2f}x (last segment)")
    else:
        print()
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def _multiple_r(features, target):
    x = np.c_[features, np.ones(len(features))]
    coef, *_ = np.linalg.lstsq(x, target, rcond=None)
    return float(np.corrcoef(x @ coef, target)[0, 1])


def variable_probe_case(args):
    """daskpty LSQML with OPR vs Pty-Chi LSQML with OPR on the drifting-probe scan.

    daskpty.simulate.variable_probe (defocus drifting linearly along the scan, flux +-20 %
    random, Poisson noise; the scan of benchmarks/bench_opr.py and tests/test_opr.py), both codes
    from the same start (object ones, daskpty's probe from the mean pattern), OPR with
    ``--opr-modes`` modes from epoch ``--opr-start`` in both (Pty-Chi: eigenmode weights and the
    intensity variation (weight of mode 0) optimised). References: daskpty without OPR on the same
    scan and on the constant-probe scan. Prints object NRMSE, r(w0^2, flux) and the multiple
    correlation R(w1.., defocus) of the recovered weights, and s/epoch.
    """
    import daskpty
    from daskpty.engines.initial import object_frame, probe_diameter_from_scan, probe_from_mean_pattern
    from daskpty.metrics import nrmse_vs_truth
    from daskpty.simulate.variable_probe import simulate_variable_probe
    from distributed import Client, LocalCluster

    if args.engine != "lsqml":
        raise SystemExit("the variable-probe case compares LSQML (--engine lsqml)")
    checkpoints = sorted(int(e) for e in args.epochs.split(","))
    epochs = checkpoints[-1]
    K = args.opr_modes
    tmp = tempfile.mkdtemp(prefix="daskpty-bench-vp-")
    sims = {"drifting": simulate_variable_probe(n=args.vp_n, grid=args.vp_grid),
            "constant": simulate_variable_probe(n=args.vp_n, grid=args.vp_grid, constant=True)}
    ds = sims["drifting"]
    n = args.vp_n
    shape, origin = object_frame(ds.positions, n)
    positions = ds.positions + origin
    starts = {}
    for label, sim in sims.items():
        inten = np.asarray(sim.intensities, np.float32)
        probe = probe_from_mean_pattern(inten.mean(axis=0), diameter=probe_diameter_from_scan(sim.positions, n))
        starts[label] = (inten, probe)
    obj = np.ones(shape, np.complex64)
    print(f"variable probe: {len(positions)} patterns of {n}x{n}, object {shape}; defocus drift "
          f"{ds.truth.defocus.min():.2f}..{ds.truth.defocus.max():.2f} rad, flux {ds.truth.flux.min():.2f}.."
          f"{ds.truth.flux.max():.2f}; OPR K = {K} from epoch {args.opr_start}; {epochs} epochs")

    rows = []  # (code, run, {epoch: nrmse}, r_flux, R_defocus, s/epoch)

    def correlations(w):
        w = np.asarray(w, np.float64)
        return (float(np.corrcoef(w[:, 0] ** 2, ds.truth.flux)[0, 1]),
                _multiple_r(w[:, 1:], ds.truth.defocus) if w.shape[1] > 1 else float("nan"))

    # --- Pty-Chi first (before this process starts a LocalCluster) ----------------------------
    if os.path.exists(args.peer_python):
        inten, probe = starts["drifting"]
        for label, extra in (("OPR K=%d" % K, ["--opr-modes", K, "--opr-start", args.opr_start]), ("no OPR", [])):
            peer_in = os.path.join(tmp, "peer_in.npz")
            peer_out = os.path.join(tmp, f"peer_out_{len(rows)}.npz")
            np.savez(peer_in, intensities=inten, positions=positions, probe=probe, object=obj)
            if _peer(args, [peer_in, peer_out, "--engine", "lsqml", "--epochs-list", args.epochs,
                            "--batch-size", args.peer_batch, "--noise", args.noise, "--threads",
                            args.peer_threads] + extra, f"LSQML {label}") is None:
                continue
            with np.load(peer_out) as z:
                out = {key: z[key] for key in z.files}
            # no illumination from Pty-Chi: daskpty's mask of the same scan (filled in below)
            r = correlations(out[f"opr_weights_{epochs}"]) if extra else (float("nan"), float("nan"))
            last = float(out["segment_seconds"][-1]) / (checkpoints[-1] - ([0] + checkpoints)[-2])
            rows.append(["Pty-Chi", label + " (drifting)", {e: out[f"object_{e}"] for e in checkpoints}, *r,
                         (float(out["seconds_per_epoch"]), last)])
    else:
        print(f"Pty-Chi virtualenv not found at {args.peer_python}; see benchmarks/README_ptychi.md")

    # --- daskpty ------------------------------------------------------------------------------
    illumination = None
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        for label, scan, kw in (("OPR K=%d" % K, "drifting", dict(opr_modes=K, probe_model={"start_epoch": args.opr_start})),
                                ("no OPR", "drifting", {}), ("no OPR", "constant", {})):
            objects = {}

            def keep(epoch, state, metrics_, objects=objects):
                if epoch in checkpoints:
                    objects[epoch] = np.array(state.get().object)

            keep.takes_epoch_state = True
            inten, probe = starts[scan]
            rec = daskpty.reconstruct(daskpty.from_arrays(inten, positions), engine="lsqml", epochs=epochs,
                                      object=obj, probe=probe, client=client, noise=args.noise,
                                      rounds_per_epoch=args.rounds_per_epoch, callback=keep,
                                      rescale_probe=False, check_data=False, **kw)
            if illumination is None:
                illumination = rec.illumination
            r = correlations(rec.probe_weights) if kw else (float("nan"), float("nan"))
            seconds = np.array([h["seconds"] for h in rec.history])
            rows.append(["daskpty", f"{label} ({scan})", objects, *r,
                         (float(np.median(seconds[max(1, args.opr_start):])), None)])

    print(f"\nobject NRMSE vs truth (daskpty's illuminated region > 0.3 max); r(w0^2, flux): Pearson; "
          f"R(w1.., defocus): multiple correlation; s/epoch: daskpty median over epochs {max(1, args.opr_start) + 1}.. "
          f"({args.workers} worker processes, R = {args.rounds_per_epoch}), Pty-Chi mean over the run "
          f"/ over epochs {([0] + checkpoints)[-2] + 1}..{checkpoints[-1]} (batch {args.peer_batch}, "
          f"{args.peer_threads} threads)")
    head = "".join(f"{'NRMSE@' + str(e):>11}" for e in checkpoints)
    print(f"{'code':<8} {'run':<22}{head} {'r(w0²,flux)':>12} {'R(w,defoc)':>11} {'s/epoch':>8}")
    for code, label, objects, r_flux, r_def, (spe, last) in rows:
        truth = sims["constant" if "constant" in label else "drifting"].truth
        cells = "".join(f"{nrmse_vs_truth(objects[e], positions, illumination, truth):>11.4f}" for e in checkpoints)
        print(f"{code:<8} {label:<22}{cells} {r_flux:>12.3f} {r_def:>11.3f} {spe:>8.4f}"
              + (f" / {last:.4f}" if last is not None else ""))
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def _shifted(data, origin):
    """The data set with positions in the benchmark's object frame."""
    from types import SimpleNamespace

    return SimpleNamespace(intensities=data.intensities, positions=data.positions + origin, mask=data.mask,
                           probe=None)


if __name__ == "__main__":
    main()
