"""Several GPUs on one machine: one dask-cuda worker per GPU (``LocalCUDACluster``).

Simulates a scan (or opens yours with ``--data``), reconstructs it with the data chunks held as
CuPy arrays on the GPUs, and prints the throughput and — for simulated data — the object NRMSE
against the truth::

    python examples/local_cuda_cluster.py                         # every visible GPU, medium preset
    python examples/local_cuda_cluster.py --devices 0,1 --epochs 50
    python examples/local_cuda_cluster.py --data scan.zarr --output recon.zarr

Needs an NVIDIA GPU and the ``gpu`` extra (``pip install -e ".[gpu]"``: CuPy and dask-cuda).
Without a GPU, or without CuPy / dask-cuda, it prints why ("no GPU available: ...") and exits
with status 0, so it can run anywhere, CI included.

One worker per GPU, one thread each; ``device_memory_limit`` (a fraction of each whole GPU) is
where dask-cuda starts spilling chunks to host memory. Everything listens on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default=None,
                   help="comma-separated GPU indices or UUIDs (default: all visible GPUs)")
    p.add_argument("--data", default=None, help="data-set store to reconstruct (default: simulate one)")
    p.add_argument("--preset", default="medium", choices=["small", "medium", "large"],
                   help="simulation preset when --data is not given (default medium)")
    p.add_argument("--output", default=None, help="reconstruction store to write (default: none)")
    p.add_argument("--epochs", type=int, default=30, help="LSQML epochs (default 30)")
    p.add_argument("--rounds-per-epoch", type=int, default=4, help="updates per epoch (default 4)")
    p.add_argument("--device-memory-limit", default="0.8",
                   help="per-GPU spill threshold: a fraction of the GPU or bytes such as 30GB (default 0.8)")
    return p.parse_args(argv)


def gpu_unavailable() -> str | None:
    """Why the GPU path cannot run here, or None when it can."""
    from daskpty.execution.gpu import list_cuda_devices

    if not list_cuda_devices():
        return "nvidia-smi lists no NVIDIA GPU"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # ImportError, or a CUDA driver/runtime error
        return f"CuPy is not usable ({type(exc).__name__}: {exc}); pip install -e '.[gpu]'"
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return "dask-cuda is not installed; pip install -e '.[gpu]'"
    return None


def main(argv=None) -> int:
    from daskpty.execution.cluster import live_workers
    from daskpty.metrics import nrmse_vs_truth

    args = parse_args(argv)
    why = gpu_unavailable()
    if why:
        print(f"local_cuda_cluster: no GPU available: {why}. Nothing to do; "
              "examples/cpu_quickstart.py runs the same reconstruction on CPUs.")
        return 0

    import numpy as np

    import daskpty
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    limit = args.device_memory_limit
    limit = float(limit) if limit.replace(".", "", 1).isdigit() else limit
    devices = args.devices.split(",") if args.devices else None
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES=devices, threads_per_worker=1, ip="127.0.0.1",
                          dashboard_address="127.0.0.1:0", device_memory_limit=limit) as cluster, \
            Client(cluster) as client:
        n_gpus = len(live_workers(client))
        print(f"{n_gpus} GPU worker(s); dashboard {client.dashboard_link}")
        tmp = None
        if args.data:
            data = daskpty.open_data(args.data)
        else:
            tmp = tempfile.mkdtemp(prefix="daskpty-gpu-")
            data = daskpty.simulate(os.path.join(tmp, "scan.zarr"), preset=args.preset, client=client)
        print(f"data: {data.n_patterns} patterns of {data.pattern_shape[0]}x{data.pattern_shape[1]} {data.dtype}")
        t0 = time.perf_counter()
        rec = daskpty.reconstruct(data, epochs=args.epochs, rounds_per_epoch=args.rounds_per_epoch,
                                  noise="poisson", client=client, device="gpu", progress=True)
        seconds = time.perf_counter() - t0
        rate = np.median([h["patterns_per_second"] for h in rec.history]) if rec.history else float("nan")
        print(f"{args.epochs} epochs in {seconds:.1f} s, median {rate:,.0f} patterns/s on {n_gpus} GPU(s)")
        if args.output:
            rec.to_zarr(args.output, overwrite=True)
            print(f"wrote {args.output}")
    if data.truth is not None:
        print(f"object NRMSE vs truth: {nrmse_vs_truth(rec.object, rec.positions, rec.illumination, data.truth):.4f}")
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
