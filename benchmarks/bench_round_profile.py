"""Where a round's time goes: dask's statistical profiler on the workers during a reconstruction.

Runs ``reconstruct`` on a fresh cluster (CPU worker processes or dask-cuda workers), profiles the
workers after the first epoch, and prints the lines with the most own time and the daskpty
functions with the most time in all (samples every 10 ms, in every worker thread). Use it when
s/epoch grows with rounds per epoch more than the chunk steps explain.

    python benchmarks/bench_round_profile.py --n-patterns 16384 --probe-size 128 --rounds-per-epoch 16
    python benchmarks/bench_round_profile.py --backend gpu --data /tmp/gpu_check_16384.zarr
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _util import add_data_arguments, bench_cluster, dataset  # noqa: E402


def _walk(node, stack, own, inclusive):
    """Own and inclusive sample counts per frame of a ``client.profile()`` tree."""
    ident = node.get("description") or {}
    frame = f"{ident.get('name', '?')} ({os.path.basename(ident.get('filename', '?'))}:{ident.get('line_number', '?')})"
    count = node.get("count", 0)
    children = node.get("children", {}).values()
    own[frame] += count - sum(c.get("count", 0) for c in children)
    if frame not in stack:  # recursion counts once
        inclusive[frame] += count
    for child in children:
        _walk(child, stack | {frame}, own, inclusive)


def summarise(tree: dict, top: int) -> str:
    own, inclusive = collections.Counter(), collections.Counter()
    for child in tree.get("children", {}).values():
        _walk(child, frozenset(), own, inclusive)
    total = max(tree.get("count", 0), 1)
    lines = [f"samples: {tree.get('count', 0)} (every thread of every worker, 10 ms apart)", "own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines.append("daskpty functions, time in all:")
    ours = [(f, n) for f, n in inclusive.most_common() if "daskpty" in f or f.split(" (")[1].startswith(
        ("epoch_graph", "rounds", "lsqml", "partials", "device_state", "adapter", "patches", "kernels"))]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in ours[:top]]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(ap)
    ap.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds-per-epoch", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)

    import daskpty

    with dataset(args) as (data, _), bench_cluster(args.backend, args.workers, profile=True) as (client, what):
        if True:
            marks = []

            def mark(epoch, state, metrics):
                marks.append((time.time(), metrics.get("seconds")))

            t0 = time.perf_counter()
            daskpty.reconstruct(data, epochs=args.epochs, rounds_per_epoch=args.rounds_per_epoch, client=client,
                                device="gpu" if args.backend == "gpu" else "cpu", progress=False, callback=mark)
            wall = time.perf_counter() - t0
            print(f"cluster: {what}")
            print(f"reconstruct: {wall:.2f} s for {args.epochs} epochs of {args.rounds_per_epoch} rounds; "
                  f"s/epoch {[round(s, 3) for _, s in marks]}")
            tree = client.profile(start=marks[0][0]) if marks else client.profile()
            profiled = sum(s for _, s in marks[1:])
            busy = tree.get("count", 0) * 0.01 / max(args.workers, 1)
            print(f"task threads busy {busy:.2f} s per worker of the {profiled:.2f} s the profiled epochs took "
                  f"({100 * busy / max(profiled, 1e-9):.0f}%; the rest: scheduling, transfers, waiting)")
            print(summarise(tree, args.top))


if __name__ == "__main__":
    main()
