"""Helpers shared by bench_epoch.py, bench_fft_floor.py and bench_out_of_core.py.

Not part of the package and not run in CI. Nothing here changes how daskpty runs: clusters are
started with daskpty's own helpers (``start_local_cluster`` / ``cuda_cluster``) and the worker
measurements are read with ``client.run`` (psutil, /proc, CuPy's memory pool) or, for per-thread
state such as CuPy's cuFFT plan cache, with a task pinned to each worker.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

MiB = 2**20
GiB = 2**30


# --------------------------------------------------------------------------- formatting

def fmt_bytes(n) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "n/a"
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_grid(text):
    if text is None:
        return None
    parts = re.split(r"[x×,]", str(text).lower())
    if len(parts) == 1:
        parts = parts * 2
    return tuple(int(p) for p in parts)


def parse_bool_auto(text):
    t = str(text).lower()
    if t in ("auto",):
        return "auto"
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected auto|true|false, got {text!r}")


def parse_memory(text):
    """'512MiB' / '2GB' / 'auto' / 'none' → what LocalCluster accepts (bytes, 'auto' or None)."""
    if text is None:
        return "auto"
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    if t in ("none", "0", "unlimited"):
        return None
    from dask.utils import parse_bytes

    return parse_bytes(text)


def jsonable(obj):
    """Recursively turn NumPy scalars / tuples into JSON-friendly values (NaN → None)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def print_json(summary: dict):
    print(json.dumps(jsonable(summary), sort_keys=False), flush=True)


def median_after_warmup(seconds, skip: int = 2) -> float:
    """Median of the epoch times after the first ``skip`` (fewer skipped when there are few)."""
    s = [float(x) for x in seconds]
    if not s:
        return float("nan")
    skip = min(skip, len(s) - 1)
    return float(np.median(s[skip:]))


# --------------------------------------------------------------------------- data

def add_data_arguments(ap, default_preset: str = "small"):
    g = ap.add_argument_group("data (an existing store, or simulated into a temporary folder)")
    g.add_argument("--data", default=None, help="existing daskpty data-set store (.zarr)")
    g.add_argument("--preset", default=default_preset, help="simulate preset: small|medium|large")
    g.add_argument("--grid", default=None, help="raster grid ROWSxCOLS (overrides the preset's)")
    g.add_argument("--n-patterns", type=int, default=None, help="pattern count (instead of --grid)")
    g.add_argument("--probe-size", type=int, default=None, help="pattern / probe size n")
    g.add_argument("--modes", type=int, default=None, help="simulated incoherent probe modes")
    g.add_argument("--overlap", type=float, default=None, help="linear overlap of the scan (default 0.72)")
    g.add_argument("--dose", type=float, default=None, help="photons per pattern (default: preset's, 1e6)")
    g.add_argument("--no-noise", action="store_true", help="noise-free float32 data")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tmpdir", default=None, help="where to simulate (default: the system's temp dir)")
    g.add_argument("--keep-data", action="store_true", help="keep the simulated store (its path is printed)")
    g.add_argument("--sim-workers", type=int, default=None,
                   help="worker processes for the simulation (default: all cores)")
    g.add_argument("--shard-mib", type=float, default=None,
                   help="Zarr shard size of the simulated store in MiB (default: daskpty's, 64)")
    return g


def simulate_kwargs(args) -> dict:
    kw = {"preset": args.preset, "seed": args.seed}
    if getattr(args, "n_patterns", None) is not None:
        kw["n_patterns"] = args.n_patterns
    elif args.grid is not None:
        kw["grid"] = parse_grid(args.grid)
    for name in ("probe_size", "modes", "overlap"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if getattr(args, "shard_mib", None):
        kw["shard_bytes"] = int(args.shard_mib * MiB)
    if getattr(args, "no_noise", False):
        kw["dose"] = None
    elif getattr(args, "dose", None) is not None:
        kw["dose"] = args.dose
    return kw


def resolved_shape(args):
    """(N, n, M) of the data the arguments describe, without simulating."""
    if args.data:
        import daskpty

        d = daskpty.open_data(args.data, validate=None)
        modes = d.probe.shape[0] if d.probe is not None and d.probe.ndim == 3 else 1
        if getattr(args, "modes", None):
            modes = args.modes
        return int(d.intensities.shape[0]), int(d.intensities.shape[-1]), int(modes)
    from daskpty.simulate import DEFAULTS, PRESETS

    p = {**DEFAULTS, **PRESETS[args.preset]}
    if getattr(args, "n_patterns", None):
        n_patterns = args.n_patterns
    else:
        rows, cols = parse_grid(args.grid) if args.grid else p["grid"]
        n_patterns = rows * cols
    n = args.probe_size or p["probe_size"]
    return int(n_patterns), int(n), int(args.modes or p["modes"])


@contextlib.contextmanager
def dataset(args, log=print):
    """Yield ``(PtychoData, path)``: ``--data``, or a simulation into a temporary folder that is
    removed afterwards (unless ``--keep-data``). The simulation runs on its own LocalCluster
    (all cores) that is closed before any benchmark cluster starts."""
    import daskpty

    if args.data:
        yield daskpty.open_data(args.data), args.data
        return
    base = tempfile.mkdtemp(prefix="daskpty-bench-", dir=args.tmpdir)
    path = os.path.join(base, "data.zarr")
    kw = simulate_kwargs(args)
    t0 = time.perf_counter()
    from daskpty.execution.cluster import start_local_cluster
    from distributed import Client

    workers = args.sim_workers or os.cpu_count() or 1
    import dask

    with dask.config.set({"distributed.worker.profile.enabled": False}):
        cluster = start_local_cluster(n_workers=workers, threads_per_worker=1, dashboard=False, gpu=False)
    try:
        with Client(cluster) as c:
            daskpty.simulate(path, client=c, **kw)
    finally:
        cluster.close()
    log(f"simulated: {path} ({', '.join(f'{k}={v}' for k, v in kw.items())}) "
        f"in {time.perf_counter() - t0:.1f} s on {workers} processes")
    try:
        yield daskpty.open_data(path), path
    finally:
        if args.keep_data:
            log(f"kept: {path}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def data_line(data, modes: int) -> str:
    x = data.intensities
    n_patterns, n = x.shape[0], x.shape[-1]
    return (f"data: {n_patterns} patterns of {n}x{n} {x.dtype}, {modes} probe mode(s), "
            f"{fmt_bytes(x.nbytes)} ({x.nbytes} bytes)")


def chunk_plan(n_patterns: int, n: int, modes: int, chunk_length=None) -> dict:
    """The chunking daskpty will use (daskpty.execution.data.default_chunk_length)."""
    from daskpty.execution.data import default_chunk_length

    length = int(chunk_length or default_chunk_length(n_patterns, n, modes))
    count = math.ceil(n_patterns / length)
    last = n_patterns - (count - 1) * length
    return {"chunk_length": length, "n_chunks": count, "last_chunk": last,
            "lengths": [length] * (count - 1) + [last]}


def round_slices(lengths, rounds: int):
    """Patterns per chunk in each round (subset r of every chunk, ``round_rows``: as many as ``r::rounds``)."""
    return [[len(range(r, L, rounds)) for L in lengths] for r in range(rounds)]


# --------------------------------------------------------------------------- clusters

def add_cluster_arguments(ap, workers_default=None):
    g = ap.add_argument_group("cluster")
    g.add_argument("--backend", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: LocalCluster of processes; gpu: dask-cuda LocalCUDACluster, one worker per GPU/MIG")
    g.add_argument("--workers", type=int, default=workers_default,
                   help="worker processes (cpu default: 2; gpu default: every GPU / MIG slice)")
    g.add_argument("--threads-per-worker", type=int, default=1)
    g.add_argument("--memory-limit", default="auto",
                   help="host memory limit per worker, e.g. 512MiB; 'auto' (dask's share) or 'none'")
    add_malloc_argument(g)
    return g


def add_malloc_argument(g):
    g.add_argument("--malloc-tune", choices=("on", "off"), default=None,
                   help="daskpty's glibc malloc tuning in the workers (sets DASKPTY_MALLOC_TUNE; default: "
                        "as the environment says, i.e. on as shipped)")


@contextlib.contextmanager
def bench_cluster(backend: str, workers, threads_per_worker: int = 1, memory_limit="auto", malloc_tune=None,
                  profile: bool = False):
    """Yield ``(client, description)`` for a fresh cluster made the way daskpty makes its own.

    ``malloc_tune`` "on"/"off" sets DASKPTY_MALLOC_TUNE for the worker processes (inherited at
    their start); None leaves the environment alone. ``profile``: keep dask's statistical
    profiler on in the workers (off by default: it costs a little time)."""
    import dask
    from distributed import Client

    if malloc_tune is not None:
        os.environ["DASKPTY_MALLOC_TUNE"] = "1" if malloc_tune in ("on", True) else "0"

    memory = parse_memory(memory_limit) if isinstance(memory_limit, str) or memory_limit is None else memory_limit
    with dask.config.set({"distributed.worker.profile.enabled": profile}):
        if backend == "gpu":
            from daskpty.execution.gpu import cuda_cluster, list_cuda_devices

            devices = list_cuda_devices()
            if workers and devices:  # more workers than devices: several share one (a MIG stand-in)
                devices = [devices[i % len(devices)] for i in range(workers)]
            kw = {"threads_per_worker": threads_per_worker}
            if memory != "auto":
                kw["memory_limit"] = memory
            cluster = cuda_cluster([d.uuid for d in devices] if devices else None, dashboard_address=None, **kw)
            what = (f"gpu: {len(cluster.workers)} dask-cuda worker(s) [{', '.join(d.name for d in devices)}] "
                    f"x {threads_per_worker} thread(s)")
        else:
            from daskpty.execution.cluster import start_local_cluster

            cluster = start_local_cluster(n_workers=workers or 2, threads_per_worker=threads_per_worker,
                                          memory_limit=memory, dashboard=False, gpu=False)
            what = f"cpu: {workers or 2} worker process(es) x {threads_per_worker} thread(s)"
    client = Client(cluster)
    try:
        client.wait_for_workers(len(cluster.workers), timeout=120)
        from daskpty.execution.cluster import live_workers

        limits = sorted({w.get("memory_limit") for w in live_workers(client).values()},
                        key=lambda v: v or 0)
        what += ", memory limit/worker " + "/".join(fmt_bytes(v) if v else "none" for v in limits)
        what += ", malloc tuning " + ("off" if os.environ.get("DASKPTY_MALLOC_TUNE", "1") == "0" else "on")
        yield client, what
    finally:
        with contextlib.suppress(Exception):
            client.close()
        with contextlib.suppress(Exception):
            cluster.close()


def worker_names(client) -> dict:
    """{address: name} of the current workers."""
    from daskpty.execution.cluster import live_workers

    return {addr: str(w.get("name", addr)) for addr, w in live_workers(client).items()}


# --------------------------------------------------------------------------- memory sampling

def _proc_memory():
    """(current RSS, peak RSS) of this process in bytes; peak from the kernel (VmHWM)."""
    import psutil

    rss = psutil.Process().memory_info().rss
    peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss": int(rss), "hwm": int(peak), "pid": os.getpid()}


def _gpu_memory():
    """CuPy default memory pool (used / held bytes) and the device's used bytes (cudaMemGetInfo)."""
    try:
        import cupy
    except ImportError:
        return None
    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    dev = cupy.cuda.Device()
    try:
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        name = f"device {dev.id}"
    return {"pool_used": int(pool.used_bytes()), "pool_held": int(pool.total_bytes()),
            "device_used": int(total - free), "device_total": int(total), "device": name}


_PLAN_RE = {
    "size": re.compile(r"current / max size\s*:\s*(\d+)\s*/\s*(\S+)"),
    "memsize": re.compile(r"current / max memsize\s*:\s*(\d+)\s*/\s*(\S+)"),
    "hits": re.compile(r"hits / misses\s*:\s*(\d+)\s*/\s*(\d+)"),
}


def _plan_cache_info():
    """The cuFFT plan cache of the calling thread (CuPy keeps one per thread and device).

    CuPy exposes hits and misses only through the cache's text form (``show_info`` prints it),
    so it is parsed here."""
    import threading as _t

    try:
        import cupy
    except ImportError:
        return None
    cache = cupy.fft.config.get_plan_cache()
    text = repr(cache)
    out = {"thread": _t.current_thread().name, "text": text}
    m = _PLAN_RE["size"].search(text)
    if m:
        out["plans"], out["max_plans"] = int(m.group(1)), m.group(2)
    m = _PLAN_RE["memsize"].search(text)
    if m:
        out["plan_bytes"] = int(m.group(1))
    m = _PLAN_RE["hits"].search(text)
    if m:
        out["hits"], out["misses"] = int(m.group(1)), int(m.group(2))
    return out


def plan_cache_report(client) -> dict:
    """{worker name: plan-cache info} read *in each worker's task thread*: the cache is per
    thread, so ``client.run`` (the worker's event-loop thread) would see an empty one. With
    ``threads_per_worker`` > 1 only one of the task threads is read."""
    names = worker_names(client)
    futures = {names[a]: client.submit(_plan_cache_info, workers=[a], allow_other_workers=False, pure=False)
               for a in names}
    return {name: f.result(timeout=60) for name, f in futures.items()}


class MemorySampler:
    """Peak RSS per worker (by worker name, so a restarted worker keeps its row), of the
    client process (which also hosts a LocalCluster's scheduler), and GPU memory per worker.

    ``sample()`` takes one reading (call it from an epoch callback); ``start(interval)`` also
    samples from a background thread every ``interval`` seconds until ``stop()``. Readings that
    fail (a worker restarting) are skipped and counted.
    """

    def __init__(self, client, gpu: bool = False):
        self.client = client
        self.gpu = gpu
        self.peak = {}            # name -> max sampled RSS
        self.hwm = {}             # name -> max kernel high-water mark seen
        self.gpu_peak = {}        # name -> dict of maxima
        self.gpu_last = {}
        self.pids = {}            # name -> set of pids seen (more than one: the worker restarted)
        self.client_peak = 0
        self.samples = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()

    def sample(self):
        try:
            names = worker_names(self.client)
            mem = self.client.run(_proc_memory, on_error="return")
            gpu = self.client.run(_gpu_memory, on_error="return") if self.gpu else {}
        except Exception:
            with self._lock:
                self.failures += 1
            return
        own = _proc_memory()
        with self._lock:
            self.samples += 1
            self.client_peak = max(self.client_peak, own["rss"])
            for addr, m in mem.items():
                if isinstance(m, BaseException) or not isinstance(m, dict):
                    self.failures += 1
                    continue
                name = names.get(addr, addr)
                self.peak[name] = max(self.peak.get(name, 0), m["rss"])
                self.hwm[name] = max(self.hwm.get(name, 0), m["hwm"], m["rss"])
                self.pids.setdefault(name, set()).add(m["pid"])
            for addr, g in (gpu or {}).items():
                if not isinstance(g, dict):
                    continue
                name = names.get(addr, addr)
                p = self.gpu_peak.setdefault(name, {})
                for k in ("pool_used", "pool_held", "device_used"):
                    p[k] = max(p.get(k, 0), g[k])
                p["device_total"], p["device"] = g["device_total"], g["device"]
                self.gpu_last[name] = g

    def callback(self, epoch, state, metrics):
        self.sample()

    callback.takes_epoch_state = True  # reads no state: it stays on the workers

    def _loop(self, interval):
        while not self._stop.wait(interval):
            self.sample()

    def start(self, interval: float):
        if interval and interval > 0:
            self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True,
                                            name="bench-memory-sampler")
            self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sample()  # a last reading: also picks up the kernel high-water marks at the end

    def restarts(self) -> int:
        return sum(max(0, len(p) - 1) for p in self.pids.values())

    def client_hwm(self) -> int:
        return max(_proc_memory()["hwm"], self.client_peak)

    def summary(self) -> dict:
        return {"workers_peak_rss_sampled": dict(sorted(self.peak.items())),
                "workers_peak_rss_hwm": dict(sorted(self.hwm.items())),
                "client_peak_rss_sampled": self.client_peak,
                "client_peak_rss_hwm": self.client_hwm(),
                "worker_restarts": self.restarts(), "samples": self.samples,
                "failed_samples": self.failures,
                "gpu": {k: {kk: vv for kk, vv in v.items()} for k, v in sorted(self.gpu_peak.items())}}

    def rss_lines(self, limit=None) -> list[str]:
        lim = f" (limit {fmt_bytes(limit)} each)" if limit else ""
        per = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(self.peak.items()))
        hwm = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(self.hwm.items()))
        lines = [f"peak RSS per worker (sampled): {per}{lim}",
                 f"peak RSS per worker (kernel high-water mark, whole worker life): {hwm}",
                 f"peak RSS client+scheduler process: {fmt_bytes(self.client_peak)} sampled, "
                 f"{fmt_bytes(self.client_hwm())} high-water mark"]
        if self.restarts():
            lines.append(f"WARNING: {self.restarts()} worker restart(s) seen (memory limit exceeded?)")
        return lines

    def gpu_lines(self) -> list[str]:
        out = []
        for name, p in sorted(self.gpu_peak.items()):
            last = self.gpu_last.get(name, {})
            out.append(f"GPU memory worker {name} ({p.get('device')}): CuPy pool peak used "
                       f"{fmt_bytes(p['pool_used'])}, pool held {fmt_bytes(p['pool_held'])} (≈ peak; the pool "
                       f"keeps freed blocks), device in use peak {fmt_bytes(p['device_used'])} of "
                       f"{fmt_bytes(p['device_total'])}; at the end: used {fmt_bytes(last.get('pool_used'))}")
        return out


def memory_limits(client) -> dict:
    from daskpty.execution.cluster import live_workers

    names = worker_names(client)
    workers = live_workers(client)
    return {names[a]: w.get("memory_limit") for a, w in workers.items()}


def eprint(*a):
    print(*a, file=sys.stderr, flush=True)
