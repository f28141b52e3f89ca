"""daskpty LSQML vs Pty-Chi LSQML on the same simulated data, start and epochs.

Usage (Pty-Chi in its own virtualenv, see README_ptychi.md):

    python benchmarks/bench_vs_ptychi.py [--preset small] [--epochs 10,30,100] [--workers 2]
        [--rounds-per-epoch 6] [--peer-python /work/peer-venv/bin/python] [--peer-batch 100]

Prints NRMSE of the object against the ground truth after each listed epoch count and the
seconds per epoch of both codes. Both start from the same object (ones) and probe (daskpty's
data-derived initial probe, already scaled to the data).
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
    args = ap.parse_args()
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


def _shifted(data, origin):
    """The data set with positions in the benchmark's object frame."""
    from types import SimpleNamespace

    return SimpleNamespace(intensities=data.intensities, positions=data.positions + origin, mask=data.mask,
                           probe=None)


if __name__ == "__main__":
    main()
