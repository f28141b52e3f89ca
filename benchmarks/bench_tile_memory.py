"""What a tiled run's workers hold at their peak: RSS against the keys in each worker's data store.

Usage (not run in CI)::

    daskpty simulate /tmp/tiles27.zarr --grid 256x256 --step 20 --probe-size 64
    python benchmarks/bench_tile_memory.py /tmp/tiles27.zarr --workers 4 --memory-limit 800MiB
    python benchmarks/bench_tile_memory.py /tmp/tiles27.zarr --lazy-bytes 0 --checkpoint /tmp/out.zarr

Runs ``reconstruct(..., tiles=True)`` on a fresh cluster of worker processes. Every 0.3 s it asks
each worker for its RSS and the sizes of the values in its data store, grouped by key name (the
part before the token). For each worker it keeps the sample at its highest RSS. It prints that
sample per worker, the client's own peak RSS, and whether any worker paused or restarted.

The tile graph's states and partial sums are dask keys, but dask's ``sizeof`` counts such an
object as its header (they are "unmanaged" memory to dask, never spilled); they are counted here
by their arrays (``state_sizes.held_bytes``, each array once). RSS minus that is the process
(~100 MiB), the running tasks' temporaries and the allocator's free lists. ``--lazy-bytes 0`` returns
even a small object lazily (``DASKPTY_LAZY_OBJECT_BYTES``), so the end phase is the tile-by-tile
write (``_field_of`` keys: the workers' own rows; ``concatenate``: the store chunks that straddle a
tile border).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

MiB = 2**20


def held(dask_worker):
    """On a worker: (RSS, {key name: bytes}) of its data store."""
    import psutil
    from dask.sizeof import sizeof

    from daskpty.execution.state_sizes import held_bytes

    by, seen = collections.Counter(), set()
    # only the keys in memory: iterating the whole store (a zict buffer) would read the spilled
    # ones back from disk, a spike of this sampler's own that restarted workers at their limit
    store = getattr(dask_worker.data, "fast", dask_worker.data)
    for key, value in list(store.items()):
        name = key[0] if isinstance(key, tuple) else key
        parts = str(name).split("-")
        kept = [p for p in parts if not (p.isdigit() or (len(p) >= 16 and all(c in "0123456789abcdef" for c in p)))]
        # (dask's sizeof counts a tile state or partial sum as its object header: count their arrays,
        # each array once however many keys share it)
        by["-".join(kept)] += held_bytes(value, seen) if hasattr(value, "__dict__") or isinstance(value, dict) \
            else sizeof(value)
    running = sorted({"-".join(p for p in str(ts.key[0] if isinstance(ts.key, tuple) else ts.key).split("-")
                               if not (p.isdigit() or len(p) >= 16)) for ts in dask_worker.state.executing})
    by["(running: " + ", ".join(running) + ")"] += 0
    return psutil.Process().memory_info().rss, dict(by)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a daskpty data-set store")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--memory-limit", default="auto", help="per worker, e.g. 800MiB (default: dask's share)")
    ap.add_argument("--engine", default="lsqml")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds-per-epoch", type=int, default=4)
    ap.add_argument("--chunk-length", type=int, default=None)
    ap.add_argument("--persist", choices=("yes", "no"), default="yes",
                    help="keep the data in worker memory (yes) or read each chunk from the store in its round (no)")
    ap.add_argument("--checkpoint", default=None, help="reconstruction store to write (replaced if there)")
    ap.add_argument("--lazy-bytes", type=int, default=None, help="DASKPTY_LAZY_OBJECT_BYTES for this run")
    args = ap.parse_args(argv)
    if args.lazy_bytes is not None:
        os.environ["DASKPTY_LAZY_OBJECT_BYTES"] = str(args.lazy_bytes)

    import psutil

    import daskpty
    from _util import bench_cluster
    from bench_comm import WorkerMemory

    if args.checkpoint and os.path.isdir(args.checkpoint):
        import shutil

        shutil.rmtree(args.checkpoint)
    data = daskpty.open_data(args.data)
    me, client_peak = psutil.Process(), [0]
    with bench_cluster("cpu", args.workers, 1, args.memory_limit) as (client, what):
        peaks, stop = {}, threading.Event()

        def sample():
            while not stop.wait(0.3):
                client_peak[0] = max(client_peak[0], me.memory_info().rss)
                try:
                    for address, (rss, by) in client.run(held).items():
                        if rss > peaks.get(address, (0,))[0]:
                            peaks[address] = (rss, by)
                except Exception:  # a worker restarting: the next sample
                    pass

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        rec, failure = None, None
        with WorkerMemory(client) as memory:
            started = time.perf_counter()
            try:
                rec = daskpty.reconstruct(data, args.engine, args.epochs, client=client, tiles=True,
                                          persist=args.persist == "yes",
                                          rounds_per_epoch=args.rounds_per_epoch, chunk_length=args.chunk_length,
                                          checkpoint=args.checkpoint, progress=False)
            except Exception as exc:  # (a run that fails still shows where its memory was)
                failure = f"{type(exc).__name__}: {exc}"
            wall = time.perf_counter() - started
        stop.set()
        thread.join()
        figures = memory.figures()
    print(f"cluster: {what}" + (f"; FAILED: {failure}" if failure else ""))
    for address, (rss, by) in sorted(peaks.items()):
        total = sum(by.values())
        top = ", ".join(f"{k} {v / MiB:.0f}" if v else k for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:8])
        print(f"{address}: peak RSS {rss / MiB:.0f} MiB, of which data store {total / MiB:.0f} MiB ({top})")
    seconds = [round(h["seconds"], 1) for h in rec.history] if rec is not None else []
    print(f"s/epoch {seconds}; whole reconstruct call {wall:.1f} s")
    print(f"client peak RSS {client_peak[0] / MiB:.0f} MiB; result lazy: {rec is not None and rec.is_lazy}; "
          f"paused workers {figures['paused_workers']}, restarted {figures['restarted_workers']}")
    print(json.dumps({"client_peak_rss": client_peak[0], "workers_peak_rss": {a: p[0] for a, p in peaks.items()},
                      **figures, "lazy": rec is not None and rec.is_lazy, "seconds_per_epoch": seconds,
                      "reconstruct_s": wall,
                      "chunk_length": None if rec is None else rec.options.get("chunk_length"), "failure": failure}))


if __name__ == "__main__":
    main()
