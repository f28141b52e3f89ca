"""Following a live scan: the lag from a frame's commit to the first snapshot that includes it.

Usage (not run in CI):

    python benchmarks/bench_live.py [--grid 80x80] [--probe-size 64] [--rate 100] [--epochs 10]
        [--snapshot-every 3] [--min-frames N] [--workers 2] [--refine-positions] [--tiles] [--no-offline] [--json]

The acquisition stand-in (``daskpty simulate OUT --rate HZ``, its own process) writes the scan
while :func:`daskpty.workflows.follow` reconstructs it in this process on ``--workers`` local
workers. A thread polls the store's commit record (``live.json``) every 10 ms and records when
each block's frames became visible; ``on_snapshot`` records when each snapshot was in the result
store and how many frames it used. Printed: the p50 / p95 lag from a frame's commit to the end of
the first snapshot holding it (over every frame committed before the scan's end), the interval
between snapshots, the writer's achieved rate, the final NRMSE against the truth and that of an
offline run on the finished store with the same ``--epochs`` (the follower runs them after the
scan's end), and the load average (the machine is shared: quote it with the figures).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def _poll_commits(path: str, stop: threading.Event, out: list) -> None:
    """(unix time, frames committed) every time the count grows, polled every 10 ms."""
    from daskpty.io.live_format import read_record

    last = 0
    while not stop.is_set():
        try:
            record = read_record(path)
        except Exception:  # not created yet
            time.sleep(0.01)
            continue
        n = int(record["frames_committed"])
        if n > last:
            out.append((time.time(), n))
            last = n
        if record.get("ended"):
            return
        time.sleep(0.01)


def lags(commits, snapshots, n_frames: int) -> np.ndarray:
    """Seconds from each frame's commit to the first snapshot (written after it) that used it."""
    frame_commit = np.full(n_frames, np.nan)
    start = 0
    for t, n in commits:
        frame_commit[start:n] = t
        start = n
    out = np.full(n_frames, np.nan)
    for t, used in snapshots:  # in time order: the first that covers a frame wins
        todo = np.isnan(out[:used]) & (frame_commit[:used] <= t)
        out[:used][todo] = t - frame_commit[:used][todo]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", default="80x80")
    p.add_argument("--probe-size", type=int, default=64)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--snapshot-every", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--refine-positions", action="store_true")
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--min-frames", type=int, default=None, help="frames before the first snapshot")
    p.add_argument("--no-offline", action="store_true", help="skip the offline run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import daskpty
    from daskpty.execution.cluster import client_context
    from daskpty.metrics import nrmse_vs_truth
    from daskpty.workflows import follow

    options = {"seed": 1, "progress": False}
    if args.refine_positions:
        options["refine_positions"] = True
    if args.tiles:
        options["tiles"] = True
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_live_") as tmp:
        data, out = os.path.join(tmp, "scan.zarr"), os.path.join(tmp, "r.zarr")
        commits, snapshots, stop = [], [], threading.Event()
        poller = threading.Thread(target=_poll_commits, args=(data, stop, commits), daemon=True)
        poller.start()
        writer = subprocess.Popen([sys.executable, "-m", "daskpty", "simulate", data, "--grid", args.grid,
                                   "--probe-size", str(args.probe_size), "--rate", str(args.rate), "--quiet"],
                                  stderr=subprocess.PIPE, text=True)
        with client_context(None, n_workers=args.workers) as client:
            t0 = time.time()
            rec = follow(data, out, args.epochs, snapshot_every=args.snapshot_every, client=client, timeout=120,
                         min_frames=args.min_frames, on_snapshot=lambda r: snapshots.append(
                             (time.time(), r.live["frames_used"], "final_from_epoch" in r.live, r.epochs,
                              [h.get("seconds", 0.0) for h in r.history])), **options)
            t_end = time.time()
            _, werr = writer.communicate()
            stop.set()
            poller.join()
            d = daskpty.open_data(data)
            n = d.n_patterns
            live_err = nrmse_vs_truth(rec.object, rec.positions, rec.illumination, d.truth)
            offline_err, offline_s = None, None
            if not args.no_offline:
                t1 = time.time()
                off = daskpty.reconstruct(d, epochs=args.epochs, client=client, **options)
                offline_s = time.time() - t1
                offline_err = nrmse_vs_truth(off.object, off.positions, off.illumination, d.truth)
        scan_end = commits[-1][0]
        growing = [(t, u) for t, u, final, _, _ in snapshots if not final]
        lag = lags(commits, [(t, u) for t, u, *_ in snapshots], n)
        times = np.array([t for t, _ in growing])
        first_used = growing[0][1] if growing else n
        overhead = [(t1 - t0_) - sum(h1[e0:]) for (t0_, _, _, e0, _), (t1, _, f1, _, h1)
                    in zip(snapshots[:-1], snapshots[1:]) if not f1]
        report = {
            "grid": args.grid, "probe_size": args.probe_size, "rate_hz": args.rate, "workers": args.workers,
            "refine_positions": args.refine_positions, "tiles": args.tiles, "epochs_after_end": args.epochs,
            "snapshot_every_s": args.snapshot_every, "frames": n,
            "writer_rate_hz": n / (scan_end - commits[0][0]) if len(commits) > 1 else None,
            "writer_warnings": [line for line in werr.splitlines() if "Warning" in line],
            "first_snapshot_s": (growing[0][0] - commits[0][0]) if growing else None,
            "snapshots_before_end": len(growing),
            "snapshot_interval_s": {"p50": float(np.median(np.diff(times))) if len(times) > 1 else None,
                                    "max": float(np.max(np.diff(times))) if len(times) > 1 else None},
            "lag_s": {"p50": float(np.nanpercentile(lag, 50)), "p95": float(np.nanpercentile(lag, 95)),
                      "max": float(np.nanmax(lag))},
            "frames_in_first_snapshot": first_used,
            "lag_after_first_snapshot_s": {"p50": float(np.nanpercentile(lag[first_used:], 50)),
                                           "p95": float(np.nanpercentile(lag[first_used:], 95))}
            if first_used < n else None,
            "cycle_overhead_s_p50": float(np.median(overhead)) if overhead else None,
            "final_after_end_s": t_end - scan_end, "follow_total_s": t_end - t0,
            "final_epochs": rec.epochs, "final_from_epoch": rec.live.get("final_from_epoch"),
            "nrmse_follow": float(live_err), "nrmse_offline": None if offline_err is None else float(offline_err),
            "offline_s": offline_s,
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
        }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
