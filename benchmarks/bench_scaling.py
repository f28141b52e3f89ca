"""Speed-up of W worker processes over one, measured in alternating runs on the same data.

Usage (not run in CI):

    python benchmarks/bench_scaling.py [--preset medium] [--compare-workers 1 2] [--pairs 3]
        [--epochs 10] [--rounds-per-epoch auto|R] [bench_epoch's data and run options]

A shared machine's speed drifts by ±10 % over minutes, more than the effect measured; so the
worker counts take turns (1, 2, 1, 2, ...), each run on a fresh cluster, and the figure is the
ratio of the medians over ``--pairs`` runs per count. Each run's s/epoch is the median of its
epochs after the warm-up (``--skip``). Prints every run, the medians, the speed-up per pair and
overall, and a one-line JSON summary.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import add_cluster_arguments, add_data_arguments, dataset, print_json  # noqa: E402
from bench_epoch import add_run_arguments, measure  # noqa: E402


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_arguments(ap, default_preset="medium")
    add_cluster_arguments(ap)
    add_run_arguments(ap)
    g = ap.add_argument_group("scaling")
    g.add_argument("--compare-workers", type=int, nargs=2, default=(1, 2), metavar=("A", "B"),
                   help="the two worker counts to alternate (default 1 2)")
    g.add_argument("--pairs", type=int, default=3, help="runs per worker count (default 3)")
    ap.set_defaults(epochs=10)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    counts = tuple(args.compare_workers)
    runs = {w: [] for w in counts}
    with dataset(args) as (data, path):
        for p in range(args.pairs):
            for w in counts:
                args.workers = w
                summary = measure(args, data, path, log=lambda *a: None)
                if summary.get("error"):
                    print(f"run {p + 1}, {w} worker(s): ERROR {summary['error']}")
                    return 1
                runs[w].append(summary["seconds_per_epoch"])
                print(f"run {p + 1}, {w} worker(s): {summary['seconds_per_epoch']:.4f} s/epoch "
                      f"(rounds/epoch {summary['rounds_per_epoch']}, {summary['n_chunks']} chunks)", flush=True)
    a, b = counts
    pairs = [x / y for x, y in zip(runs[a], runs[b])]
    med = {w: float(np.median(v)) for w, v in runs.items()}
    print(f"median s/epoch: {a} worker(s) {med[a]:.4f}, {b} worker(s) {med[b]:.4f}")
    print(f"speed-up {b} vs {a} worker(s): {med[a] / med[b]:.2f}x (ratio of medians); "
          f"per pair {', '.join(f'{r:.2f}' for r in pairs)}")
    print_json({"benchmark": "bench_scaling", "workers": counts, "seconds_per_epoch": runs,
                "median": med, "speedup": med[a] / med[b], "pair_speedups": pairs,
                "rounds_per_epoch": args.rounds_per_epoch, "n_patterns": int(data.intensities.shape[0]),
                "n": int(data.intensities.shape[-1])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
