#!/usr/bin/env python
"""Pty-Chi beside daskpty on one simulated store: the peer's LSQML on a GPU, scored like ours.

Exports a daskpty store (simulated, with ``truth/``) to ``ptychi_peer.py``'s IN.npz with the
same initial object and probe daskpty starts from (``object_frame``, ``probe_from_mean_pattern``),
runs Pty-Chi there (``--device cuda`` by default) and prints its s/epoch and its object NRMSE
against the truth, measured as daskpty's benchmarks measure theirs
(``common.object_nrmse_in_truth_frame``)::

    python benchmarks/gpu_peer.py /tmp/gpu_check_16384.zarr --epochs 3 [--batch-size 100]

``--peer-python`` is the interpreter that imports ``ptychi`` (default: this one).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import object_nrmse_in_truth_frame  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--peer-python", default=sys.executable)
    args = ap.parse_args(argv)

    import daskpty
    from daskpty.engines.initial import object_frame, probe_diameter_from_scan, probe_from_mean_pattern
    from daskpty.metrics.frc import illumination_map

    data = daskpty.open_data(args.store)
    intensities = np.asarray(data.intensities.compute(scheduler="threads"), dtype=np.float32)
    n = intensities.shape[-1]
    shape, origin = object_frame(data.positions, n)
    positions = data.positions + origin
    probe = probe_from_mean_pattern(intensities.mean(axis=0),
                                    diameter=probe_diameter_from_scan(data.positions, n))
    tmp = tempfile.mkdtemp(prefix="daskpty-peer-")
    peer_in, peer_out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
    np.savez(peer_in, intensities=intensities, positions=positions, probe=probe,
             object=np.ones(shape, np.complex64))
    del intensities
    print(f"Pty-Chi on {len(positions)} patterns of {n}x{n}, object {shape}, LSQML, batch "
          f"{args.batch_size}, {args.epochs} epochs, {args.device}", flush=True)
    cmd = [args.peer_python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptychi_peer.py"),
           peer_in, peer_out, "--engine", "lsqml", "--epochs-list", str(args.epochs),
           "--batch-size", str(args.batch_size), "--device", args.device]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}
    proc = subprocess.run(cmd, text=True, env=env)
    if proc.returncode != 0:
        print(f"Pty-Chi failed (exit {proc.returncode})")
        return 1
    out = np.load(peer_out)
    obj = out[f"object_{args.epochs}"]
    illum = illumination_map(out[f"probe_{args.epochs}"], positions, shape)
    nrmse = object_nrmse_in_truth_frame(obj, positions, data.truth, illum)
    print(f"Pty-Chi {out['ptychi_version']} LSQML: {float(out['seconds_per_epoch']):.3f} s/epoch "
          f"(setup {float(out['setup_seconds']):.1f} s), NRMSE {nrmse:.4f} after {args.epochs} epochs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
