"""The end phase of ``daskpty reconstruct`` at scale: the client's peak RSS and seconds after the epochs.

Usage (not run in CI)::

    python benchmarks/bench_end_phase.py --preset medium            # store under /tmp/daskpty-bench
    python benchmarks/bench_end_phase.py --preset large --dir /tmp/h5bench --epochs 2

1. Simulates the preset into ``DIR/PRESET.zarr`` unless it exists (``daskpty simulate``; extra
   ``--grid`` is passed on, e.g. ``--preset medium --grid 256x256`` for an intermediate scale).
2. Runs ``daskpty reconstruct DATA -o DIR/PRESET-recon.zarr --epochs E --overwrite`` in a child
   process (the CLI's defaults otherwise) and samples the child's own RSS (the client; the
   workers are its children and counted apart) every 0.1 s with psutil.
3. Reads the child's progress lines on stderr: the moment ``epoch E/E`` appears ends the epochs;
   the end phase is the time from there to the child's exit (gathering the state, writing the
   result store, the NRMSE against truth/, the summary line).

Prints the client's peak RSS over the whole run and within the end phase, the workers' peak RSS,
the end phase's seconds, the CLI's summary line, and a one-line JSON summary. The reconstruction
store is removed afterwards unless ``--keep``; the data store is kept for the next run (delete it
yourself: the large preset takes ~17 GB).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium", choices=["small", "medium", "large"], help="default: medium")
    p.add_argument("--grid", default=None, help="scan grid passed to simulate, e.g. 256x256 (default: the preset's)")
    p.add_argument("--step", default=None, help="scan step (px) passed to simulate: with a sparser --grid, "
                   "e.g. --preset large --grid 128x128 --step 58.6, the large preset's 7,593² object "
                   "from 16,384 patterns (the end phase's cost follows the object, not the patterns)")
    p.add_argument("--epochs", type=int, default=2, help="default: 2")
    p.add_argument("--dir", default="/tmp/daskpty-bench", help="where the stores go (default /tmp/daskpty-bench)")
    p.add_argument("--workers", type=int, default=None, help="passed to reconstruct (default: the CLI's)")
    p.add_argument("--rounds-per-epoch", default=None, help="passed to reconstruct (default: the CLI's auto)")
    p.add_argument("--keep", action="store_true", help="keep the reconstruction store")
    p.add_argument("--reconstruct-args", default="",
                   help="more options for daskpty reconstruct, one string, e.g. '--tiles --persist no'")
    return p.parse_args(argv)


def daskpty_cmd():
    exe = os.path.join(os.path.dirname(sys.executable), "daskpty")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "daskpty"]


def simulate(path, preset, grid, step=None):
    if os.path.exists(path):
        print(f"using {path}", flush=True)
        return 0.0
    cmd = daskpty_cmd() + ["simulate", path, "--preset", preset, "--quiet"]
    if grid:
        cmd += ["--grid", grid]
    if step:
        cmd += ["--step", str(step)]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


class RssSampler:
    """Samples a process's RSS and that of its descendants every ``interval`` s (psutil)."""

    def __init__(self, pid, interval=0.1):
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.client_peak = 0
        self.workers_peak = 0
        self.end_phase_peak = 0
        self.in_end_phase = False
        self.timeline = []  # (seconds since start, client RSS) every ~1 s
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        while not self._stop.is_set():
            try:
                rss = self.proc.memory_info().rss
                kids = self.proc.children(recursive=True)
            except psutil.Error:
                return
            self.client_peak = max(self.client_peak, rss)
            now = time.perf_counter() - self._start
            if not self.timeline or now - self.timeline[-1][0] >= 1.0:
                self.timeline.append((round(now, 1), round(rss / MiB)))
            if self.in_end_phase:
                self.end_phase_peak = max(self.end_phase_peak, rss)
            for kid in kids:
                try:
                    self.workers_peak = max(self.workers_peak, kid.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join()


def reconstruct(data, out, epochs, workers, rounds=None, extra=()):
    cmd = daskpty_cmd() + ["reconstruct", data, "-o", out, "--epochs", str(epochs), "--overwrite", *extra]
    if workers:
        cmd += ["--workers", str(workers)]
    if rounds:
        cmd += ["--rounds-per-epoch", str(rounds)]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    sampler = RssSampler(child.pid)
    last_epoch = re.compile(rf"^epoch {epochs}/{epochs}\b")
    epochs_done = None
    stdout = []

    def read_stdout():
        stdout.extend(child.stdout)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    for line in child.stderr:
        rss = sampler.timeline[-1][1] if sampler.timeline else 0
        sys.stderr.write(f"[{time.perf_counter() - start:7.1f} s, client ~{rss:5d} MiB] {line}")
        for part in line.split("\r"):
            if epochs_done is None and last_epoch.match(part.strip()):
                epochs_done = time.perf_counter()
                sampler.in_end_phase = True
    rc = child.wait()
    end = time.perf_counter()
    reader.join()
    sampler.stop()
    return {"rc": rc, "total_s": end - start,
            "end_phase_s": None if epochs_done is None else end - epochs_done,
            "epochs_s": None if epochs_done is None else epochs_done - start,
            "client_peak_rss_mib": sampler.client_peak / MiB,
            "end_phase_peak_rss_mib": sampler.end_phase_peak / MiB,
            "workers_peak_rss_mib": sampler.workers_peak / MiB,
            "end_phase_timeline": [(t, m) for t, m in sampler.timeline
                                   if epochs_done is not None and t >= epochs_done - start - 1],
            "summary": "".join(stdout).strip()}


def run_history(out) -> list:
    """The per-epoch history the run stored with its result (seconds, bytes per round), or []."""
    try:
        from daskpty.io.results import Reconstruction

        return [{k: v for k, v in h.items() if isinstance(v, (int, float, str))}
                for h in Reconstruction.from_zarr(out, lazy=True).history]
    except Exception as exc:  # a failed run wrote no result: say so, keep the other figures
        print(f"(no history: {type(exc).__name__}: {exc})")
        return []


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    name = args.preset + (f"-{args.grid}" if args.grid else "") + (f"-step{args.step}" if args.step else "")
    data = os.path.join(args.dir, f"{name}.zarr")
    out = os.path.join(args.dir, f"{name}-recon.zarr")
    sim_s = simulate(data, args.preset, args.grid, args.step)
    result = reconstruct(data, out, args.epochs, args.workers, args.rounds_per_epoch,
                         shlex.split(args.reconstruct_args))
    result["history"] = run_history(out)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    result.update(preset=args.preset, grid=args.grid, step=args.step, rounds_per_epoch=args.rounds_per_epoch,
                  epochs=args.epochs, simulate_s=sim_s, reconstruct_args=args.reconstruct_args)
    print(f"\n{result['summary']}")
    print(f"exit code {result['rc']}; epochs {result['epochs_s'] or float('nan'):.1f} s, "
          f"end phase {result['end_phase_s'] or float('nan'):.1f} s")
    for h in result["history"]:
        print(f"epoch {h.get('epoch')}: {h.get('seconds', float('nan')):.1f} s, "
              f"{h.get('exchanged_bytes_per_round', 0) / MiB:.2f} MiB received per round by the busiest worker")
    print(f"client peak RSS {result['client_peak_rss_mib']:.0f} MiB "
          f"(end phase {result['end_phase_peak_rss_mib']:.0f} MiB); "
          f"workers' peak RSS {result['workers_peak_rss_mib']:.0f} MiB each at most")
    timeline = result["end_phase_timeline"]
    if timeline:
        print("end phase, client RSS (s: MiB): " + ", ".join(f"{t:.0f}: {m}" for t, m in timeline[::max(len(timeline) // 40, 1)]))
    print(json.dumps(result))
    return 0 if result["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
