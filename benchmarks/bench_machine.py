"""How much slower the same kernel runs when W processes run it at once (this machine's limits).

Usage (not run in CI):

    python benchmarks/bench_machine.py [--processes 2] [--repeats 200]

Three kernels, each timed in one process alone and then in ``--processes`` processes at once:

* ``fft``: batched 2-D FFTs of 8 × 128² complex64 (scipy.fft), in cache — the compute-bound
  core of a chunk step;
* ``stream``: a 64 MiB complex64 multiply into another 64 MiB array — memory bandwidth;
* ``alu``: ``sin`` of 64 Ki float64 — pure arithmetic.

A worker's chunk step mixes in-cache FFTs with passes over arrays larger than the caches, so the
slowdown of ``stream`` bounds how well W worker processes can scale on this machine.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np

KERNELS = ("fft", "stream", "alu")


def _kernel(kind: str):
    import scipy.fft

    if kind == "fft":
        a = np.ones((8, 128, 128), np.complex64)
        return lambda: scipy.fft.fft2(a, overwrite_x=True)
    if kind == "stream":
        a = np.ones(64 * 2**20 // 8, np.complex64)
        b = np.empty_like(a)
        return lambda: np.multiply(a, np.float32(1.0001), out=b)
    a = np.ones(2**16, np.float64)
    return lambda: np.sin(a)


def _time(kind: str, repeats: int, start, queue) -> None:
    f = _kernel(kind)
    f()
    start.wait()  # all processes begin together
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    queue.put(float(np.median(times)))


def run(kind: str, processes: int, repeats: int) -> list[float]:
    ctx = mp.get_context("spawn")
    queue, start = ctx.Queue(), ctx.Barrier(processes)
    procs = [ctx.Process(target=_time, args=(kind, repeats, start, queue)) for _ in range(processes)]
    for p in procs:
        p.start()
    out = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    summary = {"benchmark": "bench_machine", "processes": args.processes, "kernels": {}}
    for kind in KERNELS:
        alone = run(kind, 1, args.repeats)[0]
        together = run(kind, args.processes, args.repeats)
        slower = float(np.mean(together) / alone - 1)
        print(f"{kind}: alone {alone * 1e3:.3f} ms, {args.processes} at once "
              f"{', '.join(f'{t * 1e3:.3f}' for t in together)} ms: {100 * slower:+.0f} %")
        summary["kernels"][kind] = {"alone_s": alone, "together_s": together, "slowdown": slower}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
