"""What one more minibatch round costs: one worker, N workers with replicas, N workers with tiles.

Usage (not run in CI):

    python benchmarks/bench_round_cost.py [--data STORE | --preset small ...] [--backend cpu|gpu]
        [--workers 2] [--rounds 16] [--epochs 6]

For each layout, on a fresh cluster, ``reconstruct`` runs at one round per epoch and at
``--rounds``; s/epoch is the median after the first two epochs. The difference over the extra
rounds is a round's fixed cost (exchanges, scheduling, apply) beside its share of the chunk
steps, which the one-round epoch already holds: a tile round takes two scheduler hops and two
exchanges (pieces, then the shares of whole-object numbers), a replicas round one. Last line:
one JSON summary.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import add_data_arguments, bench_cluster, dataset, print_json  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(ap)
    ap.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--workers", type=int, default=2, help="workers of the replicas and tiles layouts")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args(argv)
    import daskpty

    rows = []
    with dataset(args) as (_, path):
        for workers, tiles in ((1, False), (args.workers, False), (args.workers, True)):
            with bench_cluster(args.backend, workers) as (client, what):
                seconds = {}
                for rounds in (1, args.rounds):
                    rec = daskpty.reconstruct(path, client=client, epochs=args.epochs, progress=False,
                                              rounds_per_epoch=rounds, tiles=tiles, device=args.backend)
                    seconds[rounds] = float(np.median([h["seconds"] for h in rec.history[2:]]))
            per_round = (seconds[args.rounds] - seconds[1]) / max(args.rounds - 1, 1)
            layout = "one worker" if workers == 1 else f"{workers} workers, {'tiles' if tiles else 'replicas'}"
            print(f"{layout:24s} s/epoch {seconds[1]:.3f} at R = 1, {seconds[args.rounds]:.3f} at R = {args.rounds}: "
                  f"{1e3 * per_round:.1f} ms per extra round ({what})", flush=True)
            rows.append({"workers": workers, "tiles": tiles, "s_per_epoch_r1": seconds[1],
                         "s_per_epoch_rounds": seconds[args.rounds], "ms_per_round": 1e3 * per_round})
    print_json({"bench": "round_cost", "rounds": args.rounds, "backend": args.backend, "rows": rows})


if __name__ == "__main__":
    main()
