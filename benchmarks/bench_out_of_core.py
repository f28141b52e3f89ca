"""Out-of-core reconstruction: a data set several times larger than the workers' memory.

Usage (not run in CI):

    python benchmarks/bench_out_of_core.py [--data STORE | --grid 384x384 --probe-size 128 --overlap 0.9]
        [--workers 2] [--memory-limit 768MiB] [--epochs 4] [--rounds-per-epoch 1]
        [--chunk-length auto|L] [--shard-mib S] [--malloc-tune on|off] [--no-in-memory] [--timeout 3600]

1. Simulates (or opens) the data set; by default 384 × 384 patterns of 128² uint16 = 4.5 GiB,
   3 × the total worker memory (2 × 768 MiB; at 512 MiB the 2,151² object's state alone no longer
   fits daskpty's memory rule).
2. Reconstructs it out of core: ``persist=False`` (every round re-reads the chunks from the Zarr
   store) on ``LocalCluster(n_workers=2, threads_per_worker=1, memory_limit="768MiB")``, sampling
   every worker's RSS every 0.5 s from a background thread (``client.run`` + psutil) and the
   kernel's high-water mark (VmHWM) at the end.
3. When host RAM allows, reconstructs the same data with the same chunking, rounds and seed on a
   LocalCluster of the same shape without memory limit, data persisted in worker memory.

Prints both NRMSEs (and the relative difference of the two objects, which should be at float32
rounding level: the reduction order does not depend on where the data live), both s/epoch, and
the peak RSS per worker against its limit; last, a one-line JSON summary.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import (MemorySampler, add_data_arguments, bench_cluster, data_line, dataset, fmt_bytes,  # noqa: E402
                   median_after_warmup, parse_memory, print_json)


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeoutError in the main thread after ``seconds`` (a paused worker can hang a run)."""
    if not seconds:
        yield
        return

    def handler(signum, frame):
        raise TimeoutError(f"no result after {seconds} s (workers paused or killed at their memory limit?)")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def memory_estimate(data, chunk_length: int, modes: int, split_every: int) -> dict:
    """Rough per-worker needs (bytes) of one round, from daskpty's data layout.

    payload: the object broadcast to every worker each round (complex64).
    root: the tree reduce's last combine: partials hold the object numerator (complex64) and the
    illumination (float32) on the union of their boxes, i.e. the whole object at the root; the
    left-to-right BoxedArray additions keep the inputs plus two growing unions alive (~3 × 12 B/px).
    chunk: one chunk step's working set, WORKING_BYTES_PER_PIXEL (80 B) × patterns × modes × n².
    shard_read: out of core every round reads whole Zarr shards (the dask chunks of the store)
    and cuts them into chunks: about the shard plus its decoded/sliced copies (~2 × shard).
    """
    from daskpty.engines.initial import object_frame
    from daskpty.execution.data import WORKING_BYTES_PER_PIXEL

    n = int(data.intensities.shape[-1])
    shape, _ = object_frame(np.asarray(data.positions), n)
    px = int(shape[0]) * int(shape[1])
    shard = int(max(data.intensities.chunks[0])) * n * n * data.intensities.dtype.itemsize
    return {"object_shape": [int(s) for s in shape], "payload": 8 * px, "root_combine": 3 * 12 * px,
            "chunk_step": WORKING_BYTES_PER_PIXEL * chunk_length * modes * n * n,
            "chunk_data": chunk_length * n * n * data.intensities.dtype.itemsize,
            "shard": shard, "shard_read": 2 * shard}


def run_one(label, data, args, *, memory_limit, persist, chunk_length, log=print) -> dict:
    import daskpty

    out = {"label": label, "persist": persist, "error": None}
    with bench_cluster("cpu", args.workers, 1, memory_limit, args.malloc_tune) as (client, what):
        log(f"[{label}] cluster: {what}; persist={persist}")
        sampler = MemorySampler(client)
        sampler.sample()
        idle = dict(sampler.peak)
        sampler.start(args.sample_interval)
        t0 = time.perf_counter()
        rec = None
        try:
            with time_limit(args.timeout):
                rec = daskpty.reconstruct(data, epochs=args.epochs, client=client, persist=persist,
                                          rounds_per_epoch=args.rounds_per_epoch, chunk_length=chunk_length,
                                          seed=args.seed, split_every=args.split_every, probe_modes=args.probe_modes,
                                          callback=sampler.callback)
        except BaseException as exc:  # noqa: BLE001 - report and go on (KeyboardInterrupt too)
            out["error"] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, KeyboardInterrupt):
                raise
        out["wall_seconds"] = time.perf_counter() - t0
        sampler.stop()
    seconds = [h["seconds"] for h in rec.history] if rec is not None else []
    out.update({"epoch_seconds": seconds, "seconds_per_epoch": median_after_warmup(seconds, args.skip),
                "idle_worker_rss": idle, **sampler.summary()})
    if rec is not None:
        out["chunk_length"] = int(rec.options.get("chunk_length") or chunk_length or 0)
        out["reduced_bytes_per_round"] = float(np.median([h["reduced_bytes_per_round"] for h in rec.history]))
        if data.truth is not None and data.truth.object is not None:
            from common import object_nrmse_in_truth_frame

            out["nrmse"] = object_nrmse_in_truth_frame(rec.object, rec.positions, data.truth, rec.illumination)
        out["_object"] = rec.object
    for line in sampler.rss_lines(parse_memory(memory_limit) if memory_limit not in (None, "auto") else None):
        log(f"[{label}] {line}")
    if out["error"]:
        log(f"[{label}] ERROR after {out['wall_seconds']:.1f} s: {out['error']}")
        if os.environ.get("DASKPTY_MALLOC_TUNE", "1") != "0":
            log(f"[{label}] hint: daskpty's malloc tuning lets each worker keep up to 256 MiB of freed heap "
                f"(RSS stays above dask's pause threshold on small workers); --malloc-tune off tells the two apart")
    log(f"[{label}] s/epoch: {out['seconds_per_epoch']:.3f} (all: {', '.join(f'{s:.2f}' for s in seconds)}); "
        f"wall {out['wall_seconds']:.1f} s; NRMSE {out.get('nrmse', float('nan')):.4f}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_arguments(ap)
    ap.set_defaults(grid="384x384", probe_size=128, overlap=0.9, preset="medium")
    g = ap.add_argument_group("run")
    g.add_argument("--workers", type=int, default=2)
    g.add_argument("--memory-limit", default="768MiB", help="per worker, out-of-core run")
    g.add_argument("--epochs", type=int, default=4)
    g.add_argument("--rounds-per-epoch", type=int, default=1)
    g.add_argument("--chunk-length", default="auto",
                   help="'auto': daskpty's own choice for the out-of-core cluster (the in-memory run "
                        "then uses the same); or an integer")
    g.add_argument("--split-every", type=int, default=None,
                   help="fan-in of the reduction tree (default: daskpty's rule, 4 up to 16 chunks, else 8)")
    g.add_argument("--sample-interval", type=float, default=0.5, help="RSS sampling period (s)")
    g.add_argument("--skip", type=int, default=2, help="epochs left out of the s/epoch median")
    g.add_argument("--timeout", type=int, default=3600, help="seconds per reconstruction (0: none)")
    g.add_argument("--no-in-memory", action="store_true", help="skip the in-memory comparison run")
    from _util import add_malloc_argument

    add_malloc_argument(g)
    g.add_argument("--min-ratio", type=float, default=3.0,
                   help="warn when data bytes < this × total worker memory")
    args = ap.parse_args(argv)
    limit = parse_memory(args.memory_limit)
    if not isinstance(limit, int):
        ap.error("--memory-limit must be a size (e.g. 512MiB) for the out-of-core run")

    import psutil
    from daskpty.execution.data import WORKING_BYTES_PER_PIXEL, default_chunk_length

    summary = {"benchmark": "bench_out_of_core", "workers": args.workers, "memory_limit_per_worker": limit}
    with dataset(args) as (data, path):
        n_patterns, n = int(data.intensities.shape[0]), int(data.intensities.shape[-1])
        modes = args.modes or (data.probe.shape[0] if data.probe is not None and data.probe.ndim == 3 else 1)
        args.probe_modes = modes
        nbytes = int(data.intensities.nbytes)
        total = limit * args.workers
        print(data_line(data, modes) + f", store {path}")
        ratio = nbytes / total
        print(f"data / total worker memory: {fmt_bytes(nbytes)} / {fmt_bytes(total)} = {ratio:.2f}x"
              + ("" if ratio >= args.min_ratio else f"  (WARNING: below {args.min_ratio}x; fine for a smoke run)"))
        default_len = default_chunk_length(n_patterns, n, modes)
        if args.chunk_length == "auto":
            cap = max(1, (limit // 4) // (WORKING_BYTES_PER_PIXEL * modes * n * n))
            chunk_length = int(min(default_len, cap))
        else:
            chunk_length = int(args.chunk_length)
        est = memory_estimate(data, chunk_length, modes, args.split_every)
        guess = " (this estimate's; daskpty picks the run's)" if args.chunk_length == "auto" else ""
        print(f"chunks{guess}: {math.ceil(n_patterns / chunk_length)} of {chunk_length} patterns "
              f"(daskpty's default would be {default_len}); rounds/epoch {args.rounds_per_epoch}")
        worst = est["payload"] + max(est["root_combine"], est["chunk_step"] + est["chunk_data"] + est["shard_read"])
        print(f"estimate per worker: object {est['object_shape'][0]}x{est['object_shape'][1]} → payload "
              f"{fmt_bytes(est['payload'])}, root combine ~{fmt_bytes(est['root_combine'])}, chunk step "
              f"~{fmt_bytes(est['chunk_step'])} + data {fmt_bytes(est['chunk_data'])}, shard read "
              f"~{fmt_bytes(est['shard_read'])} (shards of {fmt_bytes(est['shard'])}); worst ≈ worker baseline "
              f"(~130 MiB) + {fmt_bytes(worst)} vs limit {fmt_bytes(limit)} (pause at 80 %, restart at 95 %)")
        summary.update({"n_patterns": n_patterns, "n": n, "modes": modes, "data_bytes": nbytes,
                        "data_over_worker_memory": ratio, "chunk_length": chunk_length,
                        "rounds_per_epoch": args.rounds_per_epoch, "epochs": args.epochs, "estimate": est})

        ooc = run_one("out-of-core", data, args, memory_limit=args.memory_limit, persist=False,
                      chunk_length=None if args.chunk_length == "auto" else chunk_length)
        if ooc.get("chunk_length"):  # what daskpty chose ("auto"): the in-memory run takes the same
            chunk_length = summary["chunk_length"] = ooc["chunk_length"]
            print(f"[out-of-core] chunks the run used: {chunk_length} patterns")
        mem = None
        available = psutil.virtual_memory().available
        if args.no_in_memory:
            print("[in-memory] skipped (--no-in-memory)")
        elif available < 2.5 * nbytes:
            print(f"[in-memory] skipped: {fmt_bytes(available)} RAM available < 2.5 × data {fmt_bytes(nbytes)}")
        else:
            mem = run_one("in-memory", data, args, memory_limit="none", persist=True, chunk_length=chunk_length)

    print(f"NRMSE: out-of-core {ooc.get('nrmse', float('nan')):.4f}, in-memory "
          f"{(mem or {}).get('nrmse', float('nan')):.4f}")
    if mem is not None and "_object" in ooc and "_object" in mem:
        a, b = ooc["_object"], mem["_object"]
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        print(f"object difference out-of-core vs in-memory: {rel:.2e} (relative L2; same chunks, rounds, seed)")
        summary["object_relative_difference"] = rel
    print(f"s/epoch: out-of-core {ooc['seconds_per_epoch']:.3f}, in-memory "
          f"{(mem or {}).get('seconds_per_epoch', float('nan')):.3f}")
    hwm = ooc.get("workers_peak_rss_hwm", {})
    print("peak RSS per worker vs limit (out-of-core): " + ", ".join(
        f"{k} {fmt_bytes(v)} = {100 * v / limit:.0f} %" for k, v in sorted(hwm.items()))
        + f" of {fmt_bytes(limit)}; restarts {ooc.get('worker_restarts', 0)}")
    if mem is not None:
        print("peak RSS per worker (in-memory, no limit): " + ", ".join(
            f"{k} {fmt_bytes(v)}" for k, v in sorted(mem.get("workers_peak_rss_hwm", {}).items())))
    for run in (ooc, mem):
        if run is not None:
            run.pop("_object", None)
    summary.update({"out_of_core": ooc, "in_memory": mem})
    print_json(summary)
    return 1 if ooc.get("error") or (mem or {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
