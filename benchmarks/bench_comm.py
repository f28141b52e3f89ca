"""Compute and exchange time per round of a reconstruction, and the model that projects them.

Usage (not run in CI):

    python benchmarks/bench_comm.py [--backend cpu|gpu] [--workers 2] [--sizes 1024x64,4096x64]
        [--rounds 1,4] [--epochs 5] [--engine lsqml|ad|rpie] [--project] [--json]
    python benchmarks/bench_comm.py --project-only [--compute-s S --bytes-per-round B]

For every configuration (patterns x probe size, workers, rounds per epoch) a data set is simulated
(once per size), reconstructed on a fresh cluster (LocalCluster of worker processes, or
dask-cuda workers with ``--backend gpu``; ``--workers`` more than the GPUs puts several workers
on one device), and per round it reports, after ``--skip`` warm-up epochs:

- wall s/round: epoch seconds / rounds;
- compute s/round: the slowest worker's round task (finish the previous round: sum + apply;
  then this round's chunk steps), from the scheduler's task stream;
- exchange s/round: the slowest worker's transfers of the other workers' partial sums (task
  stream "transfer" spans on the epoch graph's tasks; they wait for the data, not for CPU);
- other s/round: the rest (scheduler hops, imbalance, (de)serialisation outside transfers);
- bytes/round: the partial sums one worker received (the epoch graph's ``exchanged_bytes``
  scalar, exact) and what the workers' incoming transfer logs counted for those keys;
- bandwidth: log bytes / log seconds of those transfers.

``--project`` then prints the model of daskpty.execution.comm_model (docs/gpu.md) for MIG
slices, whole GPUs and several nodes, from the measured figures scaled to the scenario and from
the scenario's stated assumptions.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import bench_cluster, dataset, fmt_bytes, jsonable  # noqa: E402
from daskpty.execution.cluster import live_workers  # noqa: E402

# the epoch graph's round and end tasks, and the tile graph's (chunks, pieces, totals, shares)
_ROUND_KEY = re.compile(r"daskpty-(?:tile-)?(round|end|end-share|chunks|piece|total|share)-(?:(\d+)-)?(?:\d+-)?"
                        r"(\d+)-([0-9a-f]{32})")


def _sizes(text):
    out = []
    for item in str(text).split(","):
        n_patterns, _, n = item.strip().lower().partition("x")
        if not n:
            raise argparse.ArgumentTypeError(f"expected PATTERNSxPROBE items, got {item!r}")
        out.append((int(n_patterns), int(n)))
    return out


def _ints(text):
    return [int(t) for t in str(text).split(",") if t.strip()]


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--workers", type=_ints, default=[2], help="worker counts, e.g. 2 or 1,2")
    ap.add_argument("--sizes", type=_sizes, default=[(1024, 64), (4096, 64)],
                    help="simulated data sets PATTERNSxPROBE, comma-separated")
    ap.add_argument("--data", default=None, help="an existing data-set store instead of --sizes")
    ap.add_argument("--rounds", type=_ints, default=[1, 4], help="rounds per epoch, e.g. 1,4")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2, help="warm-up epochs left out")
    ap.add_argument("--engine", choices=("lsqml", "ad", "rpie"), default="lsqml")
    ap.add_argument("--layouts", type=lambda t: [x for x in t.split(",") if x], default=["replicas"],
                    metavar="L,L", help="replicas (a whole state on every worker) and/or tiles (a row tile "
                                        "each), e.g. replicas,tiles")
    ap.add_argument("--chunk-length", type=int, default=None, help="passed to reconstruct")
    ap.add_argument("--refine-positions", type=int, default=None, metavar="EPOCH",
                    help="refine positions from this epoch on (window correction included; on tiles the "
                         "halos widen by max_displacement and are refreshed after each resampling)")
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--memory-limit", default="auto")
    ap.add_argument("--tmpdir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--project", action="store_true", help="also print the model's projection")
    ap.add_argument("--project-only", action="store_true", help="print the projection only (no run)")
    ap.add_argument("--compute-s", type=float, default=None,
                    help="projection: seconds of one round's chunk steps on one whole A100 (scenario)")
    ap.add_argument("--bytes-per-round", type=float, default=None,
                    help="projection: bytes of all workers' partial sums of one round (scenario)")
    ap.add_argument("--tcp-bandwidth", type=float, default=None,
                    help="projection: bytes/s of the dask TCP stage in the *-tcp links (default: the "
                         "preset's assumption); e.g. the bandwidth measured with --backend gpu")
    ap.add_argument("--scenario-rounds", type=int, default=SCENARIO["rounds"],
                    help="projection: rounds per epoch of the scenario (compute per round = epoch / rounds)")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="projection from the JSON lines of an earlier --json run (no new run)")
    ap.add_argument("--probe-bytes", type=lambda t: [int(float(x)) for x in t.split(",") if x],
                    default=[], metavar="B,B,...",
                    help="after each run also time one worker-to-worker transfer of arrays of these sizes")
    ap.add_argument("--json", action="store_true", help="print one JSON line per configuration")
    return ap


def _data_args(args, n_patterns, n):
    return argparse.Namespace(data=None, preset="small", grid=None, n_patterns=n_patterns, probe_size=n,
                              modes=None, overlap=None, dose=None, no_noise=False, seed=args.seed,
                              tmpdir=args.tmpdir, keep_data=False, sim_workers=None, shard_mib=None)


def _register_partial_sizeof():
    """Let dask's ``sizeof`` count a Partial's arrays (it sees only the Python object otherwise),
    so that the transfer logs report the bytes that travel. Benchmark instrument only."""
    from dask.sizeof import sizeof

    from daskpty.engines.partials import Partial

    if Partial not in sizeof._lookup:
        sizeof.register(Partial)(lambda p: int(p.nbytes) + 1024)
    return True


def _incoming_logs(dask_worker):
    return [{"start": e["start"], "stop": e["stop"], "total": e["total"], "who": e["who"],
             "keys": [str(k) for k in e["keys"]]} for e in dask_worker.transfer_incoming_log]


def _parse_key(key: str):
    m = _ROUND_KEY.search(str(key))
    if m is None:
        return None
    kind, round_index, epoch, token = m.groups()
    return kind, int(round_index) if round_index is not None else None, int(epoch), token


def per_round_figures(stream, logs, rounds: int, skip: int) -> dict:
    """Compute and exchange seconds per round (slowest worker) and the logged transfer bytes."""
    compute = defaultdict(lambda: defaultdict(float))    # (token, epoch) -> worker -> s
    exchange = defaultdict(lambda: defaultdict(float))
    began = {}
    for rec in stream:
        parsed = _parse_key(rec.get("key"))
        if parsed is None:
            continue
        epoch = (parsed[3], parsed[2])
        for ss in rec.get("startstops", ()):
            d = ss["stop"] - ss["start"]
            began[epoch] = min(began.get(epoch, ss["start"]), ss["start"])
            if ss["action"] == "compute":
                compute[epoch][rec["worker"]] += d
            elif ss["action"] == "transfer":
                exchange[epoch][rec["worker"]] += d
    epochs = sorted(began, key=began.get)
    kept = epochs[min(skip, max(len(epochs) - 1, 0)):]
    comp = [max(compute[e].values(), default=0.0) / rounds for e in kept]
    exch = [max(exchange[e].values(), default=0.0) / rounds for e in kept]
    log_bytes = defaultdict(lambda: defaultdict(float))
    log_secs = defaultdict(lambda: defaultdict(float))
    for worker, entries in logs.items():
        for e in entries:
            epochs_here = {(p[3], p[2]) for p in map(_parse_key, e["keys"]) if p is not None}
            if len(epochs_here) != 1:
                continue
            epoch = epochs_here.pop()
            log_bytes[epoch][worker] += e["total"]
            log_secs[epoch][worker] += e["stop"] - e["start"]
    lb = [max(log_bytes[e].values(), default=0.0) / rounds for e in kept]
    total_b = sum(sum(log_bytes[e].values()) for e in kept)
    total_s = sum(sum(log_secs[e].values()) for e in kept)
    return {"compute_s": float(np.median(comp)) if comp else float("nan"),
            "exchange_s": float(np.median(exch)) if exch else float("nan"),
            "log_bytes": float(np.median(lb)) if lb else float("nan"),
            "log_bandwidth": total_b / total_s if total_s > 0 else float("nan"),
            "epochs_seen": len(epochs)}


def _make_block(nbytes: int, gpu: bool, seed: int):
    xp = __import__("cupy") if gpu else np
    return xp.full(int(nbytes) // 4, seed, dtype=np.float32)


def _nbytes(x) -> int:
    return int(x.nbytes)


def transfer_probe(client, sizes, gpu: bool, repeat: int = 3, log=print) -> list:
    """Worker-to-worker transfer of one array of each size (CuPy on GPU workers: the host-staged
    path of MIG slices), from the receiving worker's incoming transfer log: [(bytes, s, B/s)]."""
    workers = sorted(live_workers(client))
    if len(workers) < 2:
        return []
    out = []
    for size in sizes:
        best = None
        for i in range(repeat):
            block = client.submit(_make_block, size, gpu, i, workers=[workers[0]], pure=False)
            got = client.submit(_nbytes, block, workers=[workers[1]], pure=False).result()
            logs = client.run(_incoming_logs, workers=[workers[1]])[workers[1]]
            entry = [e for e in logs if str(block.key) in e["keys"]]
            block.release()
            if entry and got:
                s = entry[-1]["stop"] - entry[-1]["start"]
                best = s if best is None else min(best, s)
        if best:
            out.append((int(size), best, size / best))
            log(f"transfer probe: {fmt_bytes(size)} {'CuPy' if gpu else 'NumPy'} array worker -> worker in "
                f"{best * 1e3:.1f} ms (best of {repeat}): {size / best / 1e9:.2f} GB/s")
    return out


def _rss():
    import psutil

    return int(psutil.Process().memory_info().rss)


class WorkerMemory:
    """Samples every worker's resident memory and status every ``every`` s while running: the
    peak per worker, whether any paused, and whether any was replaced (restarted) meanwhile."""

    def __init__(self, client, every: float = 0.5):
        import threading

        self.client, self.every = client, every
        self.start_workers = set(live_workers(client))
        self.limits = {a: w.get("memory_limit") or 0 for a, w in
                       live_workers(client).items()}
        self.peak, self.paused = {}, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.every):
            try:
                for a, rss in self.client.run(_rss).items():
                    self.peak[a] = max(self.peak.get(a, 0), rss)
                for a, w in live_workers(self.client).items():
                    if str(w.get("status", "")).endswith("paused"):
                        self.paused.add(a)
            except Exception:
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end_workers = set(live_workers(self.client))

    def figures(self) -> dict:
        return {"peak_rss_per_worker": max(self.peak.values(), default=0),
                "memory_limit": min(self.limits.values(), default=0),
                "paused_workers": len(self.paused),
                "restarted_workers": len(self.start_workers - self.end_workers)}


def _refinement(args):
    """``--refine-positions EPOCH``: the options for reconstruct (False: fixed positions)."""
    if getattr(args, "refine_positions", None) is None:
        return False
    from daskpty.engines.positions import PositionOptions

    return PositionOptions(start_epoch=args.refine_positions)


def measure(args, data, n_patterns, n, workers, rounds, layout: str = "replicas") -> dict:
    import daskpty
    from distributed import get_task_stream

    row = {"backend": args.backend, "patterns": n_patterns, "n": n, "workers": workers, "rounds": rounds,
           "engine": args.engine, "layout": layout, "refine_positions": getattr(args, "refine_positions", None)}
    with bench_cluster(args.backend, workers, args.threads_per_worker, args.memory_limit) as (client, what):
        row["cluster"] = what
        row["workers"] = len(live_workers(client))
        _register_partial_sizeof()
        client.run(_register_partial_sizeof)
        t0 = time.perf_counter()
        with get_task_stream(client) as ts, WorkerMemory(client) as memory:
            rec = daskpty.reconstruct(data, engine=args.engine, epochs=args.epochs, client=client,
                                      rounds_per_epoch=rounds, persist=True, device=args.backend,
                                      seed=args.seed, tiles=layout == "tiles", chunk_length=args.chunk_length,
                                      refine_positions=_refinement(args))
        row["reconstruct_s"] = time.perf_counter() - t0
        row.update(memory.figures())
        logs = client.run(_incoming_logs)
        if args.probe_bytes:
            row["transfer_probe"] = transfer_probe(client, args.probe_bytes, args.backend == "gpu")
    history = rec.history
    kept = history[min(args.skip, max(len(history) - 1, 0)):]
    wall = float(np.median([h["seconds"] for h in kept])) / rounds
    exchanged = [h.get("exchanged_bytes_per_round") for h in kept]
    exchanged = [x for x in exchanged if x is not None]
    figures = per_round_figures(ts.data, logs, rounds, args.skip)
    row.update(figures)
    row["wall_s"] = wall
    row["other_s"] = wall - figures["compute_s"] - figures["exchange_s"]
    row["exchanged_bytes"] = float(np.median(exchanged)) if exchanged else float("nan")
    row["bandwidth"] = row["exchanged_bytes"] / row["exchange_s"] if row["exchange_s"] > 0 else float("nan")
    row["object_pixels"] = int(np.prod(rec.object.shape[-2:]))
    row["object_bytes"] = int(np.prod(rec.object.shape)) * 8  # complex64
    if getattr(data, "truth", None) is not None:
        from daskpty.metrics import nrmse

        try:
            row["nrmse"] = float(nrmse(rec.object, data.truth.object))
        except Exception:
            row["nrmse"] = float("nan")
    row["data_bytes"] = int(data.intensities.nbytes)
    row["seconds_per_epoch"] = wall * rounds
    w = row["workers"]
    # all workers' partials together (B of the model): one worker received B (W - 1) / W
    row["partial_bytes"] = row["exchanged_bytes"] * w / (w - 1) if w > 1 else float("nan")
    return row


def print_table(rows, log=print):
    log("")
    log("| patterns | n | workers | rounds/epoch | layout | wall s/round | compute s/round | exchange s/round | "
        "other s/round | bytes/round received (scalar) | bytes/round (transfer log) | bandwidth | "
        "partials B/object px |")
    log("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        px = r["partial_bytes"] / r["object_pixels"] if r.get("object_pixels") else float("nan")
        bw = r["bandwidth"]
        log(f"| {r['patterns']} | {r['n']} | {r['workers']} | {r['rounds']} | {r.get('layout', 'replicas')} | {r['wall_s']:.4f} | "
            f"{r['compute_s']:.4f} | {r['exchange_s']:.4f} | {r['other_s']:.4f} | "
            f"{fmt_bytes(r['exchanged_bytes'])} | {fmt_bytes(r['log_bytes'])} | "
            f"{bw / 1e6:.0f} MB/s | {px:.1f} |" if np.isfinite(bw) else
            f"| {r['patterns']} | {r['n']} | {r['workers']} | {r['rounds']} | {r.get('layout', 'replicas')} | {r['wall_s']:.4f} | "
            f"{r['compute_s']:.4f} | {r['exchange_s']:.4f} | {r['other_s']:.4f} | "
            f"{fmt_bytes(r['exchanged_bytes'])} | {fmt_bytes(r['log_bytes'])} | n/a | {px:.1f} |")


# --------------------------------------------------------------------------- projection

#: The scenario the projection describes (docs/gpu.md): the user's ~16 GB data set.
SCENARIO = {
    "patterns": 262144, "n": 128, "dtype_bytes": 4,     # a 512 x 512 scan of 128^2 float32: 17.2 GB
    "step_over_n": 0.12,   # simulate's default (0.28 x the probe diameter): 2048 x 64^2 gave a 417^2 object
    # complex64 numerator + float32 illumination (12 B/px) + ~8% for the workers' overlapping box margins:
    # measured 12.7-13.5 B/px at 1024 x 128^2 on 2 workers (22-23 B/px at 64^2, where a 417^2 object
    # makes the probe-wide margins weigh more)
    "partial_bytes_per_px": 13.0,
    "rounds": 4,                                         # rounds per epoch
    # one round's chunk steps on one whole A100: the H200 target (0.5 s/epoch for 65,536 x 128^2)
    # x 4 (patterns) x 2.4 (A100 40 GB's 1.56 TB/s HBM vs the H200's 4.8 TB/s: memory-bound) / rounds
    "compute_epoch_s_a100": 0.5 * 4 * 2.4,
}


def scenario_figures(args, rows=()) -> dict:
    """(compute_s of one round on one whole A100, B) of the scenario, stated or derived."""
    sc = dict(SCENARIO)
    sc["rounds"] = args.scenario_rounds
    sc["compute_s_a100"] = sc["compute_epoch_s_a100"] / sc["rounds"]
    side = (sc["patterns"] ** 0.5) * sc["step_over_n"] * sc["n"] + sc["n"]
    per_px = sc["partial_bytes_per_px"]
    sc["object_pixels"] = side * side
    sc["side"] = side
    # rows two neighbouring tiles both hold: a chunk's slab (patterns by rows: ~1,000 patterns
    # = 2 scan rows of 512) where they meet plus a window; measured at 65,536 x 64^2 (bench_comm
    # --layouts tiles): 4.29 MiB per border = 72 rows of a 5,172 px wide object at 12 B/px
    sc["tile_shared_rows"] = 2 * sc["step_over_n"] * sc["n"] + sc["n"]
    sc["partial_bytes_per_px"] = per_px
    sc["bytes_per_round"] = args.bytes_per_round if args.bytes_per_round is not None else per_px * side * side
    sc["compute_s_a100"] = args.compute_s if args.compute_s is not None else sc["compute_s_a100"]
    sc["data_bytes"] = sc["patterns"] * sc["n"] ** 2 * sc["dtype_bytes"]
    return sc


def print_projection(args, rows=(), log=print):
    from daskpty.execution.comm_model import A100_MIG_UNITS, LINKS, Link, project_round_time, tile_border_bytes

    for r in rows:  # this cluster, projected to more workers of the same kind
        if not (r["workers"] > 1 and np.isfinite(r.get("bandwidth", float("nan")))):
            continue
        here = Link("measured", (r["bandwidth"],))
        total = r["compute_s"] * r["workers"]  # the round's chunk steps on one worker
        cells = []
        for w in (1, 2, 4, 8, 16):
            p = project_round_time(total, r["partial_bytes"], w, here)
            cells.append(f"{w}: {p.total_s:.3f}{'*' if p.communication_bound else ''}")
        log(f"this cluster, {r['patterns']} x {r['n']}^2, {r['rounds']} round(s)/epoch (compute {total:.3f} s on "
            f"one worker, B {fmt_bytes(r['partial_bytes'])}, {r['bandwidth'] / 1e6:.0f} MB/s) -> s/round by "
            f"workers: " + ", ".join(cells))
    sc = scenario_figures(args, rows)
    c, b = sc["compute_s_a100"], sc["bytes_per_round"]
    tcp = args.tcp_bandwidth
    log("")
    log(f"Projection (daskpty.execution.comm_model): {sc['patterns']} x {sc['n']}^2 patterns "
        f"({sc['data_bytes'] / 1e9:.1f} GB), object ~{sc['object_pixels'] / 1e6:.0f} Mpx, partial sums "
        f"B = {b / 1e9:.2f} GB per round ({sc['partial_bytes_per_px']:.1f} B/px), {sc['rounds']} rounds/epoch, compute {c:.3f} s per "
        f"round on one whole A100, dask TCP stage {tcp / 1e9 if tcp else LINKS['gpu-tcp'].worker_bandwidths[1] / 1e9:.2f}"
        f" GB/s")

    def link(name):
        lk = LINKS[name]
        if tcp and name.endswith("-tcp"):  # the dask TCP stage at the bandwidth given
            stages = tuple(tcp if bw == LINKS["mig-tcp"].worker_bandwidths[0] else bw for bw in lk.worker_bandwidths)
            lk = Link(lk.name, stages, lk.shared_bandwidth, lk.latency_s)
        return lk

    border = tile_border_bytes(sc["side"], sc["tile_shared_rows"], sc["partial_bytes_per_px"])

    def table(title, names, counts, units=None, tiles=False):
        log("")
        what = (f"tiles, {border / 1e6:.0f} MB per border ({sc['tile_shared_rows']:.0f} rows shared)" if tiles
                else "replicas")
        log(f"{title}, {what}: s/round = compute + exchange (exchange share); '*' = communication-bound; "
            f"= t/t(one whole A100)")
        log("| workers | " + " | ".join(names) + " |")
        log("|---:|" + "---:|" * len(names))
        first = {}
        for w in counts:
            cells = []
            for name in names:
                # MIG: compute_s is one 1g slice's (7 x the GPU's); a slice of the W-way split has units[w]
                edge = border if tiles else None
                p = project_round_time(c * 7, b, w, link(name), worker_speed=units[w], border_bytes=edge) if units \
                    else project_round_time(c, b, w, link(name), border_bytes=edge)
                cells.append(f"{p.compute_s:.3f} + {p.exchange_s:.3f} ({100 * p.exchange_fraction:.0f}%)"
                             f"{'*' if p.communication_bound else ''} = {p.total_s / c:.2f}x")
                if p.communication_bound:
                    first.setdefault(name, w)
            log(f"| {w} | " + " | ".join(cells) + " |")
        for name in names:
            log(f"  {name}: exchange >= compute from {first[name]} workers" if name in first else
                f"  {name}: compute-bound up to {max(counts)} workers")

    for tiles in (False, True):
        table("MIG slices of one A100 (host-staged exchange, shared PCIe)", ["mig-tcp", "mig-ucx"],
              range(2, 8), units=A100_MIG_UNITS, tiles=tiles)
        table("Whole GPUs of one node", ["gpu-tcp", "gpu-ucx-nvlink"], range(2, 9), tiles=tiles)
        table("Several nodes (one worker per node / NIC)", ["node-eth25-tcp", "node-eth100-tcp", "node-ib-hdr",
                                                             "node-ib-ndr"], (2, 4, 8, 16, 32), tiles=tiles)
    # gpu_check.sh's stand-in for 2 MIG slices: 2 workers on one H200 (PCIe Gen5 host link), its
    # 65,536 x 128^2 case at the target of 0.5 s/epoch for 1 worker
    side = 65536 ** 0.5 * sc["step_over_n"] * 128 + 128
    b_h200 = sc["partial_bytes_per_px"] * side * side
    log("")
    log(f"2 workers on one H200, 65,536 x 128^2 (B = {b_h200 / 1e6:.0f} MB per round), 1 worker at the target "
        f"0.5 s/epoch: slowdown of 2 workers by rounds/epoch (exchange through host memory)")
    for name, lk in (("tcp", Link("h200-tcp", (tcp or _tcp_default(),), 50e9, LINKS["mig-tcp"].latency_s)),
                     ("ucx", Link("h200-ucx", LINKS["mig-ucx"].worker_bandwidths, 50e9, LINKS["mig-ucx"].latency_s))):
        cells = []
        for r in (1, 2, 4, 8):
            p = project_round_time(0.5 / r, b_h200, 2, lk, worker_speed=0.5)
            cells.append(f"R={r}: +{100 * (p.total_s * r / 0.5 - 1):.0f}%")
        log(f"  {name}: " + ", ".join(cells))
    return sc


def _tcp_default() -> float:
    from daskpty.execution.comm_model import LINKS

    return LINKS["mig-tcp"].worker_bandwidths[0]


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.project_only or args.from_json:
        rows = []
        if args.from_json:
            with open(args.from_json) as f:
                rows = [json.loads(line) for line in f if line.startswith("{")]
            rows = [{k: (float("nan") if v is None else v) for k, v in r.items()} for r in rows]
            print_table(rows)
        print_projection(args, rows)
        return 0
    rows = []
    stores = [(None, None)] if args.data else args.sizes
    for n_patterns, n in stores:
        spec = _data_args(args, n_patterns, n)
        spec.data = args.data
        with dataset(spec) as (data, _):
            n_patterns, n = int(data.intensities.shape[0]), int(data.intensities.shape[-1])
            for workers in args.workers:
                for rounds in args.rounds:
                    for layout in args.layouts:
                        t0 = time.perf_counter()
                        row = measure(args, data, n_patterns, n, workers, rounds, layout)
                        print(f"{n_patterns} x {n}^2, {row['workers']} worker(s), {rounds} round(s)/epoch, {layout}: "
                              f"{row['seconds_per_epoch']:.3f} s/epoch, received {fmt_bytes(row['exchanged_bytes'])}"
                              f"/round ({row['exchanged_bytes'] / row['object_bytes']:.1%} of the object), peak "
                              f"RSS/worker {fmt_bytes(row['peak_rss_per_worker'])} (limit "
                              f"{fmt_bytes(row['memory_limit'])}, {row['paused_workers']} paused, "
                              f"{row['restarted_workers']} restarted), reconstruct {row['reconstruct_s']:.1f} s, "
                              f"measured in {time.perf_counter() - t0:.1f} s; {row['cluster']}", flush=True)
                        if args.json:
                            print(json.dumps(jsonable(row)), flush=True)
                        rows.append(row)
    print_table(rows)
    if args.project:
        print_projection(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
