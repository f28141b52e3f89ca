"""Electron multislice with scan errors: daskpty vs Pty-Chi on abTEM's thick-crystal scan.

Data: benchmarks/electron_abtem.py (abTEM, its own virtualenv) writes DATA.npz: SrTiO3 in 3 slabs,
Poisson noise, true and nominal positions (scale, rotation and random errors). Usage::

    /work/abtem-venv/bin/python benchmarks/electron_abtem.py -o electron.npz [--slices-per-slab 1]
    python benchmarks/bench_electron.py electron.npz [--epochs 10,30,50] [--rounds auto] [--workers 2]
        [--runs true,nominal,refined,peer] [--peer-batch 96] [--refine JSON]
    python benchmarks/bench_electron.py electron.npz --rounds-sweep 2,4,8 --epochs 30 --subset 20

Runs (all from the same start: K slabs of ones, the aperture probe of the nominal optics with
the defocus ``--start-defocus-error`` off, scaled to the data, or ``--true-probe`` abTEM's; either
carried dz/2 from the entrance surface to the first slab's screen, docs/physics.md): daskpty
multislice LSQML, AD or rPIE (``--engine``; ``slices=K, slice_spacing_m`` = the slab thickness)
with the true positions, with the nominal ones fixed, with the nominal ones refined
(``refine_positions``); Pty-Chi's multislice LSQML with its position correction and affine
constraint from the nominal positions (``ptychi_peer.py --refine-positions``, from epoch
``--peer-position-start``, Pty-Chi's default 5).

Figures: per-slab NRMSE against abTEM's slab transmissions (``daskpty.metrics.nrmse`` after
``metrics.truth_frame``: complex scale, sub-pixel shift and phase ramp removed) on the region the
true probe at the true positions lights above 30 % of its maximum, and their mean; the phase
NRMSE per slab as in bench_vs_ptychi's multislice case (mean shown); position error vs the true
scan (rms px, global offset removed [global affine removed]); s/epoch (daskpty: median of epochs
2..; Pty-Chi: mean over its run) and total seconds. ``--rounds-sweep``: daskpty with the true
positions at each rounds-per-epoch (``--subset G``: the central G x G patterns, e.g. 20 -> 400).
A table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _positions import _chunk_to_user, affine_fit, median_seconds, position_error, position_error_affine  # noqa: E402
from bench_vs_ptychi import _phase_nrmse  # noqa: E402


class Electron:
    """The abTEM scan, its truth and the common reconstruction frame."""

    def __init__(self, path, subset=None, defocus_error=0.1, true_probe=False, sub_slices=1):
        from daskpty.engines.initial import object_frame
        from daskpty.metrics import illumination_map
        from daskpty.physics.probes import electron_probe

        z = np.load(path)
        self.settings = json.loads(str(z["settings"]))
        self.abtem_version = str(z["abtem_version"])
        self.intensities = z["intensities"].astype(np.float32)
        self.clean = z["clean_intensities"]
        true, nominal = z["positions_true"].astype(np.float64), z["positions_nominal"].astype(np.float64)
        if subset:
            grid = int(round(np.sqrt(len(true))))
            lo = (grid - subset) // 2
            keep = np.zeros((grid, grid), bool)
            keep[lo:lo + subset, lo:lo + subset] = True
            keep = keep.ravel()
            self.intensities, self.clean, true, nominal = (self.intensities[keep], self.clean[keep],
                                                           true[keep], nominal[keep])
        self.truth = z["truth_slabs"]
        self.truth_probe = z["truth_probe"]
        self.truth_positions = true
        self.n = n = self.intensities.shape[-1]
        self.k = len(self.truth)
        self.dx, self.lam = float(z["pixel_size_m"]), float(z["wavelength_m"])
        self.dz, self.alpha = float(z["slab_thickness_m"]), float(z["semiangle_rad"])
        self.voltage = float(z["energy_ev"])
        self.shape, origin = object_frame(np.vstack([true, nominal]), n)
        self.true, self.nominal = true + origin, nominal + origin
        illum = illumination_map(self.truth_probe, true, self.truth.shape[1:])
        self.mask = illum > 0.3 * illum.max()
        power = float(self.intensities.sum(axis=(1, 2), dtype=np.float64).mean())
        # abTEM's defocus is -C1; electron_probe's defocus_m is C1 (overlap with the true probe
        # 0.999 with this sign, 0.04 with the other)
        # a defocus is measured at the entrance surface; the K-slab model's probe lives at its
        # first screen, half a slab in (where abTEM's finely sliced slab acts, forward_check)
        # (S slices per slab: the first screen is dz / 2S in); a set sliced as the model slices
        # (electron_abtem.py --slices-per-slab 1) has its first screen at the entrance
        first = 0.0 if self.settings.get("slices_per_slab") == 1 else self.dz / (2 * sub_slices)
        c1 = -float(z["defocus_m"]) * (1 + defocus_error) + first
        self.probe = electron_probe(n, self.dx, self.lam, self.alpha, defocus_m=c1, power=power)
        self.probe = (self.first_screen_probe(first) if true_probe else self.probe).astype(np.complex64)
        self.object = np.ones((self.k,) + tuple(self.shape), np.complex64)

    def data(self, positions):
        import daskpty

        return daskpty.from_arrays(self.intensities, positions, wavelength_m=self.lam, object_pixel_size_m=self.dx,
                                   electron_voltage_v=self.voltage, convergence_semiangle_rad=self.alpha)

    def slab_errors(self, obj, positions):
        """Per-slab complex NRMSE and phase NRMSE, in the truth's frame (an object of S slices
        per slab is scored by the products of each slab's S slices)."""
        from daskpty import metrics

        obj = np.asarray(obj)
        if obj.shape[0] != self.k:
            sub = obj.shape[0] // self.k
            obj = np.stack([np.prod(obj[i * sub:(i + 1) * sub], axis=0) for i in range(self.k)])

        nr, ph = [], []
        for k in range(self.k):
            est, cover, _ = metrics.truth_frame(np.asarray(obj)[k], positions, np.ones(self.shape, bool),
                                                self.truth[k], self.truth_positions)
            m = self.mask & cover
            nr.append(float(metrics.nrmse(est, self.truth[k], mask=m)))
            ph.append(_phase_nrmse(est, self.truth[k], m))
        return nr, ph

    def pos_errors(self, positions):
        return (position_error(positions, self.truth_positions),
                position_error_affine(positions, self.truth_positions))

    def global_map(self, positions):
        """Scale - 1 and rotation (deg) of the affine map true -> positions (what is left of the
        nominal scan's global errors)."""
        m = affine_fit(self.truth_positions, positions)[:2].T
        return float(np.sqrt(abs(np.linalg.det(m))) - 1), float(np.degrees(np.arctan2(m[1, 0] - m[0, 1], m[0, 0] + m[1, 1])))

    def first_screen_probe(self, distance=None):
        """abTEM's probe (given at the entrance surface) carried ``distance`` (default dz/2) to the
        first screen."""
        from daskpty.physics.propagation import angular_spectrum_kernel

        distance = self.dz / 2 if distance is None else distance
        half = angular_spectrum_kernel(self.n, self.dx, self.lam, distance, band_limit=False)
        return np.fft.ifft2(np.fft.fft2(self.truth_probe) * half).astype(np.complex64)

    def forward_check(self):
        """daskpty's K-slab model on the truth vs abTEM's noise-free patterns (relative error):
        (probe at the entrance, probe carried dz/2 into the first slab, one projected slab). The
        first fits data sliced as daskpty slices (``--slices-per-slab 1``), the second abTEM's
        finer slicing, whose slabs act about at their middles."""
        from daskpty.physics.multislice import SliceGeometry, multislice_intensities

        kernel = SliceGeometry(self.k, self.dz, self.lam, self.dx).kernel(self.n)
        carried = self.first_screen_probe()
        sel = slice(0, min(64, len(self.clean)))
        clean = self.clean[sel].astype(np.float64)

        def err(slices, p, kern):
            m = np.fft.fftshift(multislice_intensities(slices, p, self.truth_positions[sel], kern), axes=(-2, -1))
            return float(np.linalg.norm(m - clean) / np.linalg.norm(clean))

        return (err(self.truth, self.truth_probe.astype(np.complex64), kernel), err(self.truth, carried, kernel),
                err(np.prod(self.truth, axis=0), carried, None))

    def describe(self):
        s = self.settings
        e0, e0a = self.pos_errors(self.nominal)
        return (f"abTEM {self.abtem_version} SrTiO3: {len(self.true)} patterns of {self.n}x{self.n} ({s['detector']} "
                f"detector), {self.k} slabs of {self.dz * 1e9:.3f} nm ({s['slices']} abTEM slices), object "
                f"{self.shape} px of {self.dx * 1e10:.4f} Å, {s['energy'] / 1e3:.0f} keV, {s['semiangle']:g} mrad, "
                f"defocus {s['defocus']:g} Å, {s['dose']:.3g} e/Å² ({self.intensities.sum((1, 2)).mean():.3g} "
                f"e/pattern); nominal = true x (1 + {s['scale']:g}), rotated {s['rotation']:g} deg, + N(0, "
                f"{s['noise_rms']:g} px) per axis: {e0:.3f} px rms (offset removed), {e0a:.3f} (affine removed)")


def run_daskpty(case, client, positions, *, epochs, marks, rounds, noise, refine=None, engine="lsqml",
                sub_slices=1, settings=None):
    """One daskpty multislice run (``engine``: lsqml or ad; ``settings``: the engine's own, e.g.
    ``{"momentum": 0}``); {epoch: (object, positions)}, seconds per epoch, wall s."""
    import daskpty

    marks = set(marks) | {epochs}
    snaps = {}

    def keep(epoch, state, metrics_):
        if epoch in marks:
            s = state.get()
            local = getattr(s, "chunk_local", None) if refine is not None else None
            pos = None
            if local:
                pos = np.concatenate([local[i]["positions"] for i in sorted(local)])
            snaps[epoch] = (np.array(s.object, copy=True), pos)

    keep.takes_epoch_state = True
    t0 = time.perf_counter()
    obj = np.repeat(case.object, sub_slices, axis=0)   # S slices per slab, dz / S apart
    rec = daskpty.reconstruct(case.data(positions), engine=engine, epochs=epochs, object=obj,
                              probe=case.probe, client=client, slices=case.k * sub_slices,
                              slice_spacing_m=case.dz / sub_slices,
                              rounds_per_epoch=rounds, noise=noise, callback=keep, rescale_probe=False,
                              check_data=False, refine_positions=refine if refine is not None else False,
                              **(settings or {}))
    wall = time.perf_counter() - t0
    assert tuple(np.round(rec.origin)) == (0, 0), rec.origin  # the given object's frame
    final = np.asarray(rec.positions, dtype=np.float64)
    out = {}
    perm = _chunk_to_user(snaps[epochs][1], final) if refine is not None and snaps[epochs][1] is not None else None
    for e, (obj, pos) in sorted(snaps.items()):
        if refine is None:
            pos = positions
        elif pos is None:
            pos = final if e == epochs else None
        else:
            pos = pos[perm]
        out[e] = (obj, pos)
    seconds = np.array([h["seconds"] for h in rec.history])
    return out, median_seconds(seconds, 1), wall


def run_peer(args, case, tmp, positions, marks, extra):
    peer_in, peer_out = os.path.join(tmp, "peer_in.npz"), os.path.join(tmp, "peer_out.npz")
    np.savez(peer_in, intensities=case.intensities, positions=positions, probe=case.probe, object=case.object,
             wavelength_m=case.lam, pixel_size_m=case.dx, slice_spacing_m=case.dz)
    cmd = [args.peer_python, os.path.join(os.path.dirname(__file__), "ptychi_peer.py"), peer_in, peer_out,
           "--engine", "lsqml", "--epochs-list", ",".join(map(str, marks)), "--batch-size", str(args.peer_batch),
           "--noise", args.noise, "--threads", str(args.peer_threads)] + [str(c) for c in extra]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}  # see bench_vs_ptychi.main
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"Pty-Chi failed ({shlex.join(cmd)}):\n" + proc.stderr[-3000:])
        return None
    with np.load(peer_out) as z:
        out = {k: z[k] for k in z.files}
    got = {e: (out[f"object_{e}"], out.get(f"positions_{e}", positions)) for e in marks}
    return got, float(out["seconds_per_epoch"]), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="the .npz of benchmarks/electron_abtem.py")
    ap.add_argument("--epochs", default="10,30,50")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", default="auto", help="daskpty rounds per epoch (an integer or auto, the default's)")
    ap.add_argument("--noise", default="gaussian", choices=("gaussian", "poisson"))
    ap.add_argument("--sub-slices", type=int, default=1,
                    help="daskpty reconstructs S slices per slab, dz / S apart (scored by their products)")
    ap.add_argument("--engine", default="lsqml", choices=("lsqml", "ad", "rpie"),
                    help="daskpty's engine (ad: give --rounds auto and about 3x the epochs)")
    ap.add_argument("--runs", default="true,nominal,refined,peer",
                    help="of: true, nominal, refined (daskpty), peer (Pty-Chi refined), peer-true")
    ap.add_argument("--engine-settings", default="{}", help='the engine\'s own settings (JSON), e.g. {"momentum": 0}')
    ap.add_argument("--refine", default="{}", help="daskpty PositionOptions (JSON) of the refined run")
    ap.add_argument("--peer-python", default="/work/peer-venv/bin/python")
    ap.add_argument("--peer-batch", type=int, default=96)
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--peer-position-start", type=int, default=5,
                    help="Pty-Chi's position correction and affine constraint from this epoch (its default 5)")
    ap.add_argument("--peer-position-args", default="", help="extra ptychi_peer.py options of its refined run")
    ap.add_argument("--start-defocus-error", type=float, default=0.1,
                    help="start probe: the nominal defocus off by this fraction")
    ap.add_argument("--true-probe", action="store_true", help="start from the true probe (abTEM's) instead")
    ap.add_argument("--subset", type=int, default=None, help="only the central G x G patterns of the scan")
    ap.add_argument("--rounds-sweep", default=None, help="e.g. 2,4,8: daskpty, true positions, at each R")
    args = ap.parse_args()

    from daskpty.engines.position_options import PositionOptions
    from distributed import Client, LocalCluster

    marks = sorted(int(e) for e in args.epochs.split(","))
    epochs = marks[-1]
    rounds = args.rounds if args.rounds == "auto" else int(args.rounds)
    refine = json.loads(args.refine)
    settings = json.loads(args.engine_settings)
    PositionOptions.from_argument(refine, args.engine)  # a bad setting stops here, before any run
    case = Electron(args.data, subset=args.subset, defocus_error=args.start_defocus_error, sub_slices=args.sub_slices,
                    true_probe=args.true_probe)
    print(case.describe())
    entrance, ms, one = case.forward_check()
    print(f"forward check on the truth: daskpty's {case.k}-slab model vs abTEM's noise-free patterns: relative "
          f"error {entrance:.3f} with the probe at the entrance, {ms:.3f} carried dz/2 into the first slab "
          f"(one projected slab: {one:.3f})")
    runs = args.runs.split(",")
    rows = []  # (code, label, {e: (nrmse list, phase list, pos, pos_aff)}, s/epoch, wall, note)

    def score(code, label, got, spe, wall, note=""):
        table = {}
        for e, (obj, pos) in got.items():
            nr, ph = case.slab_errors(obj, pos if pos is not None else case.nominal)
            table[e] = (nr, ph, *(case.pos_errors(pos) if pos is not None else (np.nan, np.nan)))
        rows.append((code, label, table, spe, wall, note))
        e, pos = max(got), got[max(got)][1]
        last = table[e]
        extra = ""
        if pos is not None and code != "start":
            scale, rot = case.global_map(pos)
            extra = f" (global scale error {scale * 100:+.2f} %, rotation {rot:+.3f} deg left)"
            rows[-1][2][e] = table[e] + (scale, rot)
        print(f"  {code} {label}: epoch {e} mean NRMSE {np.mean(last[0]):.4f}, phase {np.mean(last[1]):.4f}, "
              f"position error {last[2]:.3f} px{extra}; {spe:.3f} s/epoch, {wall:.0f} s", flush=True)

    score("start", "object of ones", {0: (case.object, None)}, float("nan"), float("nan"), "the floor of 'nothing'")
    tmp = tempfile.mkdtemp(prefix="daskpty-bench-electron-")
    have_peer = os.path.exists(args.peer_python)
    if not have_peer and any(r.startswith("peer") for r in runs):
        print(f"Pty-Chi virtualenv not found at {args.peer_python}; see benchmarks/README_ptychi.md")
    # Pty-Chi first (before this process starts a LocalCluster)
    if have_peer and not args.rounds_sweep:
        peer_pos = (["--refine-positions", "--position-start", str(args.peer_position_start)]
                    + shlex.split(args.peer_position_args))
        if "peer-true" in runs:
            r = run_peer(args, case, tmp, case.true, marks, [])
            if r:
                score("Pty-Chi", "true", *r, note=f"batch {args.peer_batch}")
        if "peer" in runs:
            r = run_peer(args, case, tmp, case.nominal, marks, peer_pos)
            if r:
                score("Pty-Chi", "nominal + refinement", *r, note=f"batch {args.peer_batch}, {shlex.join(peer_pos)}")
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        if args.rounds_sweep:
            for r in (int(v) for v in args.rounds_sweep.split(",")):
                score("daskpty", f"true, R = {r}",
                      *run_daskpty(case, client, case.true, epochs=epochs, marks=marks, rounds=r, noise=args.noise),
                      note=f"R = {r}")
        else:
            for label, pos, ref in (("true", case.true, None), ("nominal", case.nominal, None),
                                    ("nominal + refinement", case.nominal, refine)):
                key = {"true": "true", "nominal": "nominal"}.get(label, "refined")
                if key not in runs:
                    continue
                try:
                    score("daskpty", label, *run_daskpty(case, client, pos, epochs=epochs, marks=marks,
                                                         rounds=rounds, noise=args.noise, refine=ref,
                                                         engine=args.engine, sub_slices=args.sub_slices,
                                                         settings=settings),
                          note=f"{args.engine}, R = {rounds}" + (f", {args.engine_settings}" if settings else "") + (f", {args.sub_slices} slices per slab"
                                                                 if args.sub_slices > 1 else "") + (f", refine_positions={refine or True}" if ref is not None else ""))
                except ValueError as exc:  # e.g. a combination this version refuses
                    print(f"daskpty {label}: refused: {exc}")

    k = case.k
    print(f"\nper-slab NRMSE vs abTEM's slab transmissions (daskpty.metrics.nrmse in the truth frame; region lit "
          f"> 30 % by the true probe at the true positions); phase NRMSE mean; position error px vs the true scan "
          f"(offset removed [affine removed]); s/epoch: daskpty median of epochs 2.. ({args.workers} worker "
          f"processes), Pty-Chi mean over its run ({args.peer_threads} threads)")
    head = "".join(f"{'slab ' + str(i):>7}" for i in range(k))
    print(f"{'':<37}{'NRMSE':^{7 * k + 7}} {'phase NRMSE':^{7 * k + 7}}")
    print(f"{'code':<8} {'positions':<21} {'epoch':>5}{head}{'mean':>7} {head}{'mean':>7} {'pos err':>8} {'[aff]':>7} "
          f"{'s/epoch':>8} {'total s':>8}")
    summary = []
    for code, label, table, spe, wall, note in rows:
        for i, e in enumerate(sorted(table)):
            nr, ph, pe, pea = table[e][:4]
            last = i == len(table) - 1
            print(f"{code:<8} {label:<21} {e:>5}" + "".join(f"{v:>7.4f}" for v in nr) + f"{np.mean(nr):>7.4f} "
                  + "".join(f"{v:>7.4f}" for v in ph) + f"{np.mean(ph):>7.4f} {pe:>8.3f} {pea:>7.3f}"
                  + (f" {spe:>8.3f} {wall:>8.1f}  {note}" if last else ""))
        summary.append({"code": code, "positions": label, "note": note, "s_per_epoch": spe, "total_s": wall,
                        "by_epoch": {str(e): {"slab_nrmse": t[0], "mean_nrmse": float(np.mean(t[0])),
                                              "phase_nrmse": t[1], "pos_err": t[2], "pos_err_affine": t[3],
                                              **({"scale_left": t[4], "rotation_left_deg": t[5]} if len(t) > 4 else {})}
                                     for e, t in table.items()}})
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(json.dumps({"case": "electron", "data": os.path.basename(args.data), "patterns": len(case.true),
                      "forward_check": [entrance, ms], "runs": summary}))


if __name__ == "__main__":
    main()
