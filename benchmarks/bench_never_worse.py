"""Never worse than off: each refinement's cost on ideal scans (exact positions, constant beam).

Usage::

    python benchmarks/bench_never_worse.py [--preset small] [--seeds 0,1,2] [--engine lsqml|ad|rpie]
        [--flags positions,opr+intensity,positions+opr+intensity] [--epochs 30,60] [--workers 2]
        [--probe-model JSON] [--positions JSON] [--dose PHOTONS]

For every seed the ``simulate`` preset is reconstructed plainly and with each flag combination
(2 worker processes, the engine's defaults otherwise). Prints, per run, the object NRMSE against
the truth at each of ``--epochs`` and its ratio to the plain run's (the rule: at most 1.05), the
largest rise of the loss from one epoch to the next after epoch 8 (the rule: none), and where
positions were refined, their rms error against the truth [with the best affine map removed]
and the isotropic scale they took. Last line: one JSON summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

COMBINATIONS = {
    "positions": dict(refine_positions=True),
    "intensity": dict(fit_intensity=True),
    "opr": dict(opr_modes=2),
    "opr+intensity": dict(opr_modes=2, fit_intensity=True),
    "positions+intensity": dict(refine_positions=True, fit_intensity=True),
    "positions+opr": dict(refine_positions=True, opr_modes=2),
    "positions+opr+intensity": dict(refine_positions=True, opr_modes=2, fit_intensity=True),
}
#: Epochs before the loss-rise check (the plain run's own momentum overshoots in its first ones).
SETTLED = 8


def _positions_report(rec, truth_positions) -> dict:
    used = np.asarray(rec.positions, np.float64) - np.asarray(rec.origin, np.float64)
    x = np.c_[truth_positions, np.ones(len(truth_positions))]
    coef, *_ = np.linalg.lstsq(x, used, rcond=None)
    d = used - truth_positions
    d -= d.mean(axis=0)
    rest = used - x @ coef
    return {"rms_px": float(np.sqrt((d ** 2).sum(axis=1).mean())),
            "rms_affine_removed_px": float(np.sqrt((rest ** 2).sum(axis=1).mean())),
            "scale": float(np.sqrt(abs(np.linalg.det(coef[:2]))) - 1)}


def run(data, client, truth, epochs, engine, flags) -> dict:
    import daskpty
    from daskpty.metrics import nrmse_vs_truth

    kept = {}

    def keep(epoch, state, metrics):
        if epoch in epochs:   # (a callback's epoch counts the epochs done)
            kept[epoch] = (np.array(state.object), np.array(state.illumination))

    rec = daskpty.reconstruct(data.path, client=client, epochs=max(epochs), progress=False, callback=keep,
                              engine=engine, **flags)
    loss = np.array([h["loss"] for h in rec.history])
    out = {"nrmse": {e: float(nrmse_vs_truth(o, rec.positions, i, truth)) for e, (o, i) in kept.items()},
           "max_rise": float(np.max(loss[SETTLED + 1:] / loss[SETTLED:-1])) if len(loss) > SETTLED + 1 else None}
    if flags.get("refine_positions"):
        out["positions"] = _positions_report(rec, truth.positions)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--engine", default="lsqml", choices=("lsqml", "ad", "rpie", "epie"))
    ap.add_argument("--flags", default="positions,opr+intensity,positions+opr+intensity",
                    help=f"comma-separated, of: {', '.join(COMBINATIONS)}")
    ap.add_argument("--epochs", default="30,60")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dose", type=float, default=None, help="photons per pattern (default: the preset's)")
    ap.add_argument("--probe-model", default="{}", help="JSON: more ProbeModelOptions of the runs with OPR or intensity")
    ap.add_argument("--positions", default="{}", help="JSON: PositionOptions of the runs that refine positions")
    args = ap.parse_args()
    names = args.flags.split(",")
    unknown = sorted(set(names) - set(COMBINATIONS))
    if unknown:
        sys.exit(f"bench_never_worse: unknown --flags {unknown}; choose from {sorted(COMBINATIONS)}")
    epochs = sorted(int(e) for e in args.epochs.split(","))
    extra_model = json.loads(args.probe_model)
    extra_positions = json.loads(args.positions)

    import daskpty
    from distributed import Client, LocalCluster

    summary = []
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        for seed in (int(s) for s in args.seeds.split(",")):
            data = daskpty.simulate(tempfile.mkdtemp() + "/d.zarr", preset=args.preset, seed=seed, n_workers=1,
                                    **({} if args.dose is None else {"dose": args.dose}))
            truth = SimpleNamespace(object=np.asarray(data.truth.object),
                                    positions=np.asarray(data.truth.positions, np.float64))
            plain = run(data, client, truth, epochs, args.engine, {})
            print(f"{args.preset} seed {seed} {args.engine} plain: NRMSE "
                  + " / ".join(f"{plain['nrmse'][e]:.4f}" for e in epochs) + f" at {epochs} epochs", flush=True)
            for name in names:
                try:
                    flags = dict(COMBINATIONS[name])
                    if extra_model and (flags.get("opr_modes") or flags.get("fit_intensity")):
                        flags["probe_model"] = extra_model
                    if extra_positions and flags.get("refine_positions"):
                        flags["refine_positions"] = extra_positions
                    got = run(data, client, truth, epochs, args.engine, flags)
                except ValueError as exc:  # a combination the engine refuses (rPIE: no varying probe)
                    print(f"  {name}: refused: {exc}", flush=True)
                    continue
                ratios = {e: got["nrmse"][e] / plain["nrmse"][e] for e in epochs}
                line = (f"  {name}: ratio " + " / ".join(f"{ratios[e]:.3f}" for e in epochs)
                        + f", largest loss rise after epoch {SETTLED} {got['max_rise']:.3f}")
                if "positions" in got:
                    p = got["positions"]
                    line += (f", positions {p['rms_px']:.3f} [{p['rms_affine_removed_px']:.3f}] px off, "
                             f"scale {p['scale']:+.4%}")
                print(line, flush=True)
                summary.append({"seed": seed, "flags": name, "ratio": ratios, "max_rise": got["max_rise"],
                                **({"positions": got["positions"]} if "positions" in got else {})})
    print(json.dumps({"preset": args.preset, "engine": args.engine, "epochs": epochs, "runs": summary}))


if __name__ == "__main__":
    main()
