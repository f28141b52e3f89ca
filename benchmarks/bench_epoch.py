"""Seconds per epoch, throughput and memory of one daskpty reconstruction.

Usage (not run in CI):

    python benchmarks/bench_epoch.py [--data STORE | --preset P --grid RxC --probe-size n ...]
        [--engine lsqml|ad] [--backend cpu|gpu] [--workers W] [--threads-per-worker T]
        [--memory-limit 512MiB] [--epochs 6] [--rounds-per-epoch auto|R] [--persist auto|true|false]
        [--chunk-length L] [--sample-interval 0.5] [--plan-cache]

Without --data the set is simulated (daskpty.simulate) into a temporary folder first, on its own
LocalCluster, and removed at the end. Prints one line per figure (data, chunks, s/epoch,
patterns/s, peak RSS per worker and of the client+scheduler process, GPU memory, reduced bytes
per round, NRMSE when the store has truth/) and, last, a one-line JSON summary.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import (MemorySampler, add_cluster_arguments, add_data_arguments, bench_cluster,  # noqa: E402
                   chunk_plan, data_line, dataset, fmt_bytes, median_after_warmup, memory_limits,
                   parse_bool_auto, plan_cache_report, print_json)
from daskpty.execution.cluster import live_workers  # noqa: E402


def add_run_arguments(ap):
    g = ap.add_argument_group("reconstruction")
    g.add_argument("--engine", choices=("lsqml", "ad"), default="lsqml")
    g.add_argument("--epochs", type=int, default=6)
    g.add_argument("--rounds-per-epoch", default="auto", help="'auto' (daskpty's rule) or an integer")
    g.add_argument("--persist", default="auto", help="auto|true|false")
    g.add_argument("--chunk-length", type=int, default=None, help="patterns per chunk (default: daskpty's rule)")
    g.add_argument("--probe-modes", type=int, default=None, help="probe modes to reconstruct (default: the store's)")
    g.add_argument("--noise", default="gaussian", choices=("gaussian", "poisson"))
    g.add_argument("--slices", type=int, default=1,
                   help="object slices K (multislice; the PtyRAD paper's heavy case is 12 modes x 6 slices)")
    g.add_argument("--slice-spacing", type=float, default=2e-6, help="slice spacing in metres (with --slices)")
    g.add_argument("--split-every", type=int, default=None,
                   help="fan-in of the reduction tree (default: daskpty's rule, 4 up to 16 chunks, else 8)")
    g.add_argument("--sample-interval", type=float, default=0.0,
                   help="also sample worker RSS every this many seconds from a thread (0: only at epoch ends)")
    g.add_argument("--layout", choices=("auto", "replicas", "tiles"), default="auto",
                   help="the object on every worker (replicas) or a row tile each (tiles); auto: daskpty's "
                        "rule (tiles where the object does not fit whole, or where several workers share a GPU)")
    g.add_argument("--plan-cache", action="store_true",
                   help="report CuPy's cuFFT plan cache per worker after the run (gpu; on by default there)")
    g.add_argument("--skip", type=int, default=2, help="epochs left out of the median (warm-up)")
    return g


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_arguments(ap)
    add_cluster_arguments(ap)
    add_run_arguments(ap)
    return ap


def rounds_value(text):
    return "auto" if str(text) == "auto" else int(text)


def measure(args, data, store_path=None, log=print) -> dict:
    """Run one reconstruction on a fresh cluster and return the summary dict (and print lines)."""
    import daskpty

    n_patterns, n = int(data.intensities.shape[0]), int(data.intensities.shape[-1])
    # reconstruct as many modes as asked, else as simulated (--modes), else as the store's probe has
    modes = args.probe_modes or (None if args.data else getattr(args, "modes", None)) or (
        data.probe.shape[0] if getattr(data, "probe", None) is not None and data.probe.ndim == 3 else 1)
    plan = chunk_plan(n_patterns, n, modes, args.chunk_length)
    log(data_line(data, modes) + (f", store {store_path}" if store_path else ""))
    persist = parse_bool_auto(args.persist)
    gpu = args.backend == "gpu"
    summary = {"benchmark": "bench_epoch", "engine": args.engine, "backend": args.backend,
               "n_patterns": n_patterns, "n": n, "modes": modes, "dtype": str(data.intensities.dtype),
               "data_bytes": int(data.intensities.nbytes), "threads_per_worker": args.threads_per_worker}
    with bench_cluster(args.backend, args.workers, args.threads_per_worker, args.memory_limit,
                       args.malloc_tune) as (client, what):
        n_workers = len(live_workers(client))
        log(f"cluster: {what}")
        limits = memory_limits(client)
        sampler = MemorySampler(client, gpu=gpu)
        sampler.sample()  # baseline (idle workers)
        idle = dict(sampler.peak)
        sampler.start(args.sample_interval)
        t0 = time.perf_counter()
        error = None
        rec = None
        try:
            rec = daskpty.reconstruct(
                data, engine=args.engine, epochs=args.epochs, client=client,
                rounds_per_epoch=rounds_value(args.rounds_per_epoch), persist=persist,
                device=args.backend, chunk_length=args.chunk_length, probe_modes=modes,
                noise=args.noise, split_every=args.split_every, callback=sampler.callback, seed=args.seed,
                **({"sample": {"slices": args.slices, "slice_spacing_m": args.slice_spacing}}
                   if getattr(args, "slices", 1) > 1 else {}),
                **({} if args.layout == "auto" else {"tiles": args.layout == "tiles"}))
        except Exception as exc:  # report what was measured up to the failure
            error = f"{type(exc).__name__}: {exc}"
        wall = time.perf_counter() - t0
        sampler.stop()
        plan_info = None
        if gpu or args.plan_cache:
            try:
                plan_info = plan_cache_report(client)
            except Exception as exc:
                plan_info = {"error": f"{type(exc).__name__}: {exc}"}
    history = rec.history if rec is not None else []
    seconds = [h["seconds"] for h in history]
    spe = median_after_warmup(seconds, args.skip)
    rounds = rec.options.get("rounds_per_epoch") if rec is not None else args.rounds_per_epoch
    persisted = rec.options.get("persist") if rec is not None else persist
    layout = ("tiles" if rec.options.get("tiles") else "replicas") if rec is not None else args.layout
    summary["layout"] = layout
    if rec is not None and rec.options.get("chunk_length"):  # what the run used (on GPUs: R slices per chunk)
        plan = chunk_plan(n_patterns, n, modes, rec.options["chunk_length"])
    log(f"chunks: {plan['n_chunks']} of {plan['chunk_length']} patterns (last {plan['last_chunk']}), "
        f"{fmt_bytes(plan['chunk_length'] * n * n * data.intensities.dtype.itemsize)} per chunk; "
        f"rounds/epoch {rounds}; persisted {persisted}; {n_workers} worker(s), {layout}")
    if error:
        log(f"ERROR: reconstruction failed after {wall:.1f} s: {error}")
    log(f"s/epoch: {spe:.4f} (median of epochs {min(args.skip, max(len(seconds) - 1, 0)) + 1}..{len(seconds)}; "
        f"all: {', '.join(f'{s:.3f}' for s in seconds)})")
    pps = n_patterns / spe if spe > 0 else float("nan")
    log(f"patterns/s: {pps:.1f} ({pps / max(n_workers, 1):.1f} per worker)")
    setup = wall - sum(seconds)
    log(f"wall: {wall:.2f} s for {len(seconds)} epoch(s), of which {setup:.2f} s outside epochs "
        f"(load/persist, initial probe, first-epoch rescale)")
    for line in sampler.rss_lines():
        log(line)
    log("idle worker RSS before the run: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(idle.items())))
    if gpu:
        for line in sampler.gpu_lines():
            log(line)
    if plan_info:
        for name, info in sorted(plan_info.items()):
            if isinstance(info, dict) and "hits" in info:
                log(f"cuFFT plan cache worker {name} (thread {info['thread']}): {info['plans']}/{info['max_plans']} "
                    f"plans, {fmt_bytes(info.get('plan_bytes'))} work areas, hits {info['hits']}, "
                    f"misses {info['misses']}")
            else:
                log(f"cuFFT plan cache worker {name}: {info}")
    exchanged = [h.get("exchanged_bytes_per_round") for h in history]
    exchanged = [x for x in exchanged if x is not None]
    exchanged_med = float(np.median(exchanged)) if exchanged else float("nan")
    reduced = [h.get("reduced_bytes_per_round", float("nan")) for h in history]
    reduced_med = float(np.median(reduced)) if reduced else float("nan")
    log(f"reduced bytes per round: {fmt_bytes(reduced_med)} ({reduced_med:.0f} B; sum of every chunk partial "
        f"and every tree-combine output)")
    if exchanged:
        log(f"exchanged bytes per round: {fmt_bytes(exchanged_med)} ({exchanged_med:.0f} B; partial sums one "
            f"worker received from the others)")
    else:
        log("exchanged bytes per round: n/a (round by round: each round's root goes to the client)")
    nrmse = None
    if rec is not None and np.ndim(rec.object) == 3:
        log("NRMSE: n/a (K slices against the store's one-slice truth)")
    elif rec is not None and getattr(data, "truth", None) is not None and data.truth.object is not None:
        from common import object_nrmse_in_truth_frame

        nrmse = object_nrmse_in_truth_frame(rec.object, rec.positions, data.truth, rec.illumination)
        log(f"NRMSE: {nrmse:.4f} (object vs truth after {rec.epoch} epochs)")
    else:
        log("NRMSE: n/a (no truth/ in the store)")
    summary.update({
        "workers": n_workers, "memory_limit_per_worker": limits, "chunk_length": plan["chunk_length"],
        "n_chunks": plan["n_chunks"], "last_chunk": plan["last_chunk"], "rounds_per_epoch": rounds,
        "persisted": persisted, "epochs": len(seconds), "seconds_per_epoch": spe,
        "epoch_seconds": seconds, "patterns_per_second": pps, "wall_seconds": wall,
        "setup_seconds": setup, "reduced_bytes_per_round": reduced_med,
        "exchanged_bytes_per_round": exchanged_med, "nrmse": nrmse,
        "loss": [h.get("loss") for h in history], "error": error,
        "idle_worker_rss": idle, **sampler.summary()})
    if plan_info:
        summary["plan_cache"] = {k: {kk: vv for kk, vv in v.items() if kk != "text"} if isinstance(v, dict) else v
                                 for k, v in plan_info.items()}
    return summary


def main(argv=None):
    args = build_parser().parse_args(argv)
    with dataset(args) as (data, path):
        summary = measure(args, data, path)
    print_json(summary)
    return 1 if summary.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
