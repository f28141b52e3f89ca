"""What each FFT-level optimisation buys, on its own and together: the ablation table.

Usage (not run in CI):

    python benchmarks/bench_ablation.py [--backend cpu|gpu] [--grid 48x48 --probe-size 64]
        [--workers 2] [--epochs 4] [--rounds-per-epoch 1] [--only cumulative|alone|both]

Six switches, each on by default in daskpty and turned off here through the worker processes'
environment (every configuration runs a whole ``reconstruct`` on a fresh cluster):

=============  =========================================================  ======================
switch         off means                                                  environment
=============  =========================================================  ======================
batched        one 2-D FFT call per pattern instead of one per batch      DASKPTY_FFT_BATCHED=0
plan cache     cuFFT plan cache emptied: a new plan for every call (GPU)  DASKPTY_CUFFT_PLAN_CACHE=0
fixed grid     the last chunk half as long instead of all equal           (chunk length choice)
in place       transforms never reuse their input's memory                DASKPTY_FFT_INPLACE=0
fused          the NumPy-expression chains instead of fused CuPy kernels  DASKPTY_FUSED_KERNELS=0
device state   object/probe on the host, copied to the device each round  DASKPTY_DEVICE_STATE=0
=============  =========================================================  ======================

On the CPU, plan cache, fused and device state select the same code path either way (scipy's
pocketfft keeps its own plan cache; the fused kernels and device memory are CuPy's), so those
rows are printed as "same code on CPU" and not run. Prints one table: s/epoch (median after the
first epoch), wall seconds of the whole call (cluster start excluded, data load and first-epoch
rescale included), speed-up against the configuration with every switch off, and the NRMSE as
a check that every configuration reconstructs the same object.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import add_cluster_arguments, add_data_arguments, dataset  # noqa: E402
from bench_epoch import measure  # noqa: E402

SWITCHES = ("batched", "plan cache", "fixed grid", "in place", "fused", "device state")
ENV = {"batched": "DASKPTY_FFT_BATCHED", "plan cache": "DASKPTY_CUFFT_PLAN_CACHE",
       "in place": "DASKPTY_FFT_INPLACE", "fused": "DASKPTY_FUSED_KERNELS",
       "device state": "DASKPTY_DEVICE_STATE"}
GPU_ONLY = ("plan cache", "fused", "device state")


@contextlib.contextmanager
def environment(values: dict):
    """Set environment variables for the clusters started inside (their worker processes)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def chunk_lengths(n_patterns: int, chunks: int) -> tuple[int, int]:
    """(equal, ragged) chunk lengths, both giving ``chunks`` chunks: ceil(N / chunks), and
    ceil(N / (chunks − ½)), whose last chunk is about half as long (on the GPU a batch shape,
    so a cuFFT plan, of its own)."""
    return math.ceil(n_patterns / chunks), math.ceil(n_patterns / (chunks - 0.5))


def configurations(backend: str, only: str) -> list[tuple[str, set]]:
    """(name, switches on) in the order run: all off; then one switch on at a time (alone); then
    the switches added one after the other (cumulative), ending with daskpty's default."""
    usable = [s for s in SWITCHES if backend == "gpu" or s not in GPU_ONLY]
    out = [("all off", set())]
    if only in ("alone", "both"):
        out += [(f"{s} alone", {s}) for s in usable]
    if only in ("cumulative", "both"):
        on: set = set()
        for s in usable:
            on = on | {s}
            if only == "both" and len(on) == 1:
                continue  # the same run as "<first> alone"
            out.append((f"+ {s}", set(on)))
    return out


def _median_run(summaries: list) -> dict:
    """The run whose s/epoch is the median of a configuration's runs (the lower middle one)."""
    ordered = sorted(summaries, key=lambda s: s["seconds_per_epoch"])
    return ordered[(len(ordered) - 1) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_arguments(ap)
    add_cluster_arguments(ap)
    ap.add_argument("--engine", choices=("lsqml", "ad"), default="lsqml")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds-per-epoch", default="1")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the fixed grid (default 8)")
    ap.add_argument("--only", choices=("cumulative", "alone", "both"), default="both")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every configuration, interleaved (the table shows their median)")
    args = ap.parse_args(argv)
    # What bench_epoch.measure reads besides the data and cluster arguments.
    args.persist, args.probe_modes, args.noise, args.split_every = "auto", None, "gaussian", None
    args.sample_interval, args.plan_cache, args.skip = 0.0, args.backend == "gpu", 1
    configs = configurations(args.backend, args.only)
    runs: dict = {name: [] for name, _ in configs}
    with dataset(args) as (data, _):
        n_patterns = int(data.intensities.shape[0])
        equal, ragged = chunk_lengths(n_patterns, args.chunks)
        for repeat in range(max(1, args.repeat)):  # interleaved, so slow spells of the machine spread out
            for name, on in configs:
                env = {ENV[s]: ("1" if s in on else "0") for s in ENV}
                args.chunk_length = equal if "fixed grid" in on else ragged
                print(f"--- {name} (run {repeat + 1}): on = {sorted(on) or 'none'}; chunk length "
                      f"{args.chunk_length}", flush=True)
                with environment(env):
                    summary = measure(args, data, log=lambda line: print("    " + line, flush=True))
                runs[name].append(summary)
                print(f"    row: {name}: {summary['seconds_per_epoch']:.4f} s/epoch", flush=True)  # (for a timeout)
    rows = [(name, _median_run(runs[name])) for name, _ in configs]
    base = rows[0][1]["seconds_per_epoch"]
    print()
    print(f"ablation: {args.engine}, {n_patterns} x {data.intensities.shape[-1]}^2, backend {args.backend}, "
          f"median of {max(1, args.repeat)} interleaved run(s), "
          f"{rows[0][1]['workers']} worker(s), {args.epochs} epochs, rounds/epoch {args.rounds_per_epoch}; "
          f"chunks of {equal} (fixed grid) or {ragged} (ragged)")
    print(f"{'configuration':<22} {'s/epoch':>9} {'speed-up':>9} {'wall s':>8} {'NRMSE':>8}")
    for name, s in rows:
        spe = s["seconds_per_epoch"]
        nrmse = s.get("nrmse")
        print(f"{name:<22} {spe:>9.4f} {base / spe:>8.2f}x {s['wall_seconds']:>8.2f} "
              f"{'n/a' if nrmse is None else f'{nrmse:.4f}':>8}" + (f"  ERROR {s['error']}" if s.get("error") else ""))
    if args.backend != "gpu":
        for s in GPU_ONLY:
            print(f"{s:<22} {'same code on CPU (GPU only)':>38}")
    return 1 if any(s.get("error") for _, s in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
