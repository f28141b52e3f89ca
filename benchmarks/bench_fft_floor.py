"""FFT floor of an LSQML epoch: the bare batched 2-D FFTs daskpty's chunk steps perform, timed alone.

Usage (not run in CI):

    python benchmarks/bench_fft_floor.py [--data STORE | --preset P --grid RxC | --n-patterns N]
        [--probe-size n] [--modes M] [--backend cpu|gpu] [--workers W] [--threads-per-worker T]
        [--rounds-per-epoch auto|R] [--chunk-length L] [--repeat 5] [--compare [--epochs 6 ...]]

For N patterns of n×n and M probe modes, cut into chunks exactly as daskpty cuts them
(``default_chunk_length``, or --chunk-length; rounds take subset r of every chunk, as many as ``r::R``), this
times on the same backend (SciPy's pocketfft through daskpty.physics.backend, or cuFFT through
CuPy), on a cluster of the same shape (W worker processes x T threads, chunks dealt round-robin
to the workers, each worker running its share on T threads):

  (a) the two propagation FFTs per pattern and mode (forward fft2 of the exit waves, inverse
      ifft2 of the corrected far field): 2·N·M transforms per epoch;
  (b) every FFT ``lsqml.chunk_step`` performs: per pattern and mode the probe-shift ifft2, the
      forward fft2, the inverse ifft2, the adjoint-shift fft2 and the step-length probe-shift
      ifft2 (5·N·M), plus per chunk step the probe fft2 and the ifft2 of the summed probe-gradient
      spectra (2·M). Without probe update: 3·N·M + M per step.
      Per-pattern transforms run in place (overwrite=True), as chunk_step runs them.

The floor of an epoch is the slowest worker's time; the median over --repeat epochs (after one
warm-up) is printed in s/epoch. With --compare the same data set is also reconstructed with
bench_epoch's measurement and the ratio s/epoch ÷ floor is printed for both definitions.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_epoch  # noqa: E402
from _util import (add_cluster_arguments, add_data_arguments, bench_cluster, chunk_plan, dataset,  # noqa: E402
                   print_json, resolved_shape, round_slices, worker_names)


def _fft_floor_task(batches, n, modes, repeats, threads, update_probe, seed, gpu=False):
    """Runs inside one worker: time its share of an epoch's FFTs, (a) and (b), ``repeats`` + 1
    times (the first is a warm-up: plans, page faults). Returns per-epoch seconds."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from daskpty.execution.tuning import tune_allocator
    from daskpty.physics.backend import fft2, get_fft_workers, ifft2

    tune_allocator()  # as daskpty's chunk tasks do (honours DASKPTY_MALLOC_TUNE=0, --malloc-tune off)
    xp = np
    sync = lambda: None  # noqa: E731
    if gpu:
        import cupy

        xp = cupy
        sync = lambda: cupy.cuda.Device().synchronize()  # noqa: E731
    longest = max(batches) if batches else 0
    local = threading.local()

    def buffers():
        if not hasattr(local, "buf"):
            rng = np.random.default_rng(seed)
            shape = (longest, modes, n, n)
            host = (rng.standard_normal(shape, dtype=np.float32)
                    + 1j * rng.standard_normal(shape, dtype=np.float32)).astype(np.complex64)
            local.buf = xp.asarray(host)
            local.pbuf = xp.asarray(host[0].copy())
        return local.buf, local.pbuf

    # As lsqml.chunk_step: every per-pattern transform works in place on a temporary
    # (overwrite=True; CuPy ignores it and allocates), the per-chunk probe transforms do not.
    def propagation(b):
        buf, _ = buffers()
        far = fft2(buf[:b], overwrite=True)       # Ψ = F ψ
        ifft2(far, overwrite=True)                # F⁻¹ Ψ'

    def all_ffts(b):
        buf, pbuf = buffers()
        x = buf[:b]
        fft2(pbuf)                                # shift_probe: F P                     (M)
        x = ifft2(x, overwrite=True)              # shift_probe: F⁻¹(ramp · F P)          (B·M)
        x = fft2(x, overwrite=True)               # Ψ = F ψ                               (B·M)
        x = ifft2(x, overwrite=True)              # χ: F⁻¹ Ψ'                             (B·M)
        if update_probe:
            x = fft2(x, overwrite=True)           # probe gradient spectra G_j = F(O* χ)  (B·M)
            ifft2(pbuf)                           # ΔP = F⁻¹ Σ_j conj(ramp_j) G_j         (M)
            ifft2(x, overwrite=True)              # S_f ΔP̂ = F⁻¹(ramp · F ΔP̂)           (B·M)

    times = {"a": [], "b": []}
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for name, fn in (("a", propagation), ("b", all_ffts)):
            for _ in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                list(pool.map(fn, batches))
                sync()
                times[name].append(time.perf_counter() - t0)
    return {"a": times["a"][1:], "b": times["b"][1:], "gpu": gpu, "fft_workers": get_fft_workers(),
            "batches": len(batches), "patterns": int(sum(batches))}


def fft_backend_name() -> str:
    """The CPU transform library the workers use (they follow DASKPTY_FFT_BACKEND, as here)."""
    from daskpty.physics.fftw import fft_backend

    return {"fftw": "FFTW (pyFFTW)", "scipy": "scipy.fft (pocketfft)"}[fft_backend()]


def count_chunk_step_ffts(batch: int = 5, modes: int = 2, n: int = 16, update_probe: bool = True) -> int:
    """2-D transforms one CPU ``lsqml.chunk_step`` really performs (counted by wrapping the
    backend's transform, whichever library runs it), to check the formula against the engine."""
    from daskpty.engines import lsqml
    from daskpty.physics import backend

    count = [0]
    original = backend._transform

    def counting(fn):
        def wrapped(x, *a, **k):
            count[0] += int(np.prod(np.shape(x)[:-2], dtype=np.int64))
            return fn(x, *a, **k)
        return wrapped

    rng = np.random.default_rng(0)
    probe = (rng.standard_normal((modes, n, n)) + 1j * rng.standard_normal((modes, n, n))).astype(np.complex64)
    positions = np.stack([np.arange(batch) * 2.3 + n, np.arange(batch) * 1.7 + n], axis=1)
    obj = np.ones((4 * n + 4 * batch, 4 * n + 4 * batch), np.complex64)
    y = rng.poisson(5.0, size=(batch, n, n)).astype(np.uint16)
    try:
        backend._transform = counting(original)
        lsqml.chunk_step(obj, probe, y, positions, options=lsqml.LSQMLOptions(), update_probe=update_probe)
    finally:
        backend._transform = original
    return count[0]


def fft_counts(lengths, rounds, modes, update_probe=True):
    steps = [b for per_round in round_slices(lengths, rounds) for b in per_round if b > 0]
    n_patterns = sum(lengths)
    a = 2 * n_patterns * modes
    if update_probe:
        b = 5 * n_patterns * modes + 2 * modes * len(steps)
    else:
        b = 3 * n_patterns * modes + modes * len(steps)
    return a, b, len(steps)


def floor(args, n_patterns, n, modes, chunk_length, rounds, log=print) -> dict:
    plan = chunk_plan(n_patterns, n, modes, chunk_length)
    slices = round_slices(plan["lengths"], rounds)
    with bench_cluster(args.backend, args.workers, args.threads_per_worker, args.memory_limit,
                       args.malloc_tune) as (client, what):
        names = worker_names(client)
        addrs = sorted(names, key=lambda a: names[a])
        w = len(addrs)
        share = {a: [] for a in addrs}
        for r in range(rounds):
            for c, b in enumerate(slices[r]):
                if b > 0:
                    share[addrs[c % w]].append(b)
        futures = {names[a]: client.submit(_fft_floor_task, share[a], n, modes, args.repeat,
                                           args.threads_per_worker, not args.no_probe_update, args.seed, args.backend == "gpu",
                                           workers=[a], allow_other_workers=False, pure=False)
                   for a in addrs}
        results = {k: f.result() for k, f in futures.items()}
    a_count, b_count, steps = fft_counts(plan["lengths"], rounds, modes, not args.no_probe_update)
    per_epoch = {}
    for kind in ("a", "b"):
        reps = min(len(r[kind]) for r in results.values())
        slowest = [max(r[kind][i] for r in results.values()) for i in range(reps)]
        per_epoch[kind] = float(np.median(slowest))
    any_res = next(iter(results.values()))
    log(f"floor setup: {n_patterns} patterns of {n}x{n}, {modes} mode(s); {plan['n_chunks']} chunks of "
        f"{plan['chunk_length']} (last {plan['last_chunk']}); {rounds} round(s)/epoch = {steps} chunk steps; "
        f"{what}; backend {'cuFFT (CuPy)' if any_res['gpu'] else fft_backend_name()}"
        + ("" if any_res["gpu"] else f", {any_res['fft_workers']} FFT thread(s) per call"))
    log(f"FFTs per epoch ({n}x{n} complex64): (a) {a_count} = 2·N·M; (b) {b_count} = "
        + ("5·N·M + 2·M·steps" if not args.no_probe_update else "3·N·M + M·steps"))
    for kind, label in (("a", "propagation FFTs only (fwd + inv per pattern-mode)"),
                        ("b", "all FFTs of chunk_step")):
        per_worker = ", ".join(f"{k} {np.median(r[kind]):.4f}" for k, r in sorted(results.items()))
        count = a_count if kind == "a" else b_count
        log(f"floor ({kind}) {label}: {per_epoch[kind]:.4f} s/epoch "
            f"({count / per_epoch[kind] / 1e3:.1f}k FFT/s; median of {args.repeat}; per worker: {per_worker})")
    return {"n_patterns": n_patterns, "n": n, "modes": modes, "chunk_length": plan["chunk_length"],
            "n_chunks": plan["n_chunks"], "rounds_per_epoch": rounds, "chunk_steps": steps,
            "workers": len(results), "threads_per_worker": args.threads_per_worker, "backend": args.backend,
            "ffts_a": a_count, "ffts_b": b_count, "floor_a_seconds_per_epoch": per_epoch["a"],
            "floor_b_seconds_per_epoch": per_epoch["b"],
            "per_worker": {k: {"a": r["a"], "b": r["b"], "patterns": r["patterns"]} for k, r in results.items()}}


def _auto_rounds(args, n_patterns, n, modes, nbytes):
    """daskpty's rounds_per_epoch='auto' rule (api.reconstruct) for this cluster shape."""
    if str(args.rounds_per_epoch) != "auto":
        return int(args.rounds_per_epoch)
    from _util import parse_bool_auto

    persist = parse_bool_auto(args.persist)
    if persist == "auto":
        from _util import parse_memory

        mem = parse_memory(args.memory_limit)
        if mem in (None,):
            persist = True
        elif mem == "auto":
            import psutil

            persist = nbytes <= 0.5 * psutil.virtual_memory().total
        else:
            persist = nbytes <= 0.5 * mem * (args.workers or 2)
    from daskpty.execution.data import auto_rounds

    return auto_rounds(n_patterns, n, modes, bool(persist))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_arguments(ap)
    add_cluster_arguments(ap)
    bench_epoch.add_run_arguments(ap)
    g = ap.add_argument_group("floor")
    g.add_argument("--repeat", type=int, default=5, help="timed epochs (after one warm-up)")
    g.add_argument("--no-probe-update", action="store_true", help="count (b) without the probe-update FFTs")
    g.add_argument("--compare", action="store_true",
                   help="also reconstruct the same set (bench_epoch) and print s/epoch ÷ floor")
    args = ap.parse_args(argv)
    up = not args.no_probe_update
    counted = count_chunk_step_ffts(5, 2, 16, up)
    expected = fft_counts([5], 1, 2, up)[1]
    print(f"check: one lsqml.chunk_step (B=5, M=2) performs {counted} 2-D FFTs; the formula gives {expected}"
          + ("" if counted == expected else "  <-- MISMATCH: update bench_fft_floor.py to the engine"))
    if args.compare and args.engine != "lsqml":
        ap.error("the floor is that of an LSQML epoch: --compare needs --engine lsqml")
    summary = {"benchmark": "bench_fft_floor"}
    if not args.compare:
        n_patterns, n, modes = resolved_shape(args)
        modes = args.probe_modes or modes
        itemsize = 4 if args.no_noise else 2
        rounds = _auto_rounds(args, n_patterns, n, modes, n_patterns * n * n * itemsize)
        summary.update(floor(args, n_patterns, n, modes, args.chunk_length, rounds))
        print_json(summary)
        return 0
    with dataset(args) as (data, path):
        measured = bench_epoch.measure(args, data, path)
    rounds = measured["rounds_per_epoch"]
    summary.update(floor(args, measured["n_patterns"], measured["n"], measured["modes"],
                         measured["chunk_length"], int(rounds)))
    spe = measured["seconds_per_epoch"]
    ra, rb = spe / summary["floor_a_seconds_per_epoch"], spe / summary["floor_b_seconds_per_epoch"]
    print(f"measured: {spe:.4f} s/epoch (bench_epoch, {measured['workers']} worker(s), rounds/epoch {rounds})")
    print(f"ratio s/epoch ÷ floor: (a) {ra:.2f}x   (b) {rb:.2f}x")
    summary.update({"measured_seconds_per_epoch": spe, "ratio_a": ra, "ratio_b": rb,
                    "measured": {k: v for k, v in measured.items() if k not in ("epoch_seconds", "loss")}})
    print_json(summary)
    return 1 if measured.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
