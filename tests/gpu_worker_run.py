"""Run by tests/test_gpu.py in a fresh process (needs a GPU, CuPy and dask-cuda).

Reconstructs one simulated Zarr data set three ways and prints a JSON line: on a CPU
LocalCluster, on dask-cuda worker processes (one per GPU / MIG slice, CuPy chunks staged from
Zarr through pinned host memory), and on the same with a ``device_memory_limit`` far below the
data's size, so dask-cuda spills chunks to host memory and brings them back. Also reports
whether this (client) process ever created a CUDA context: it must not.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def compute_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(x) for x in out.split() if x.strip().isdigit()}


def _held_array_kinds(dask_worker) -> list[str]:
    """Top-level modules of the values a worker holds in memory ("cupy" for device chunks).

    Only the in-memory part of a spilling store is read (dask-cuda's ``device_buffer``, zict's
    ``fast``): walking the whole store would read spilled keys back."""
    held = dask_worker.data
    for layer in ("device_buffer", "fast"):  # DeviceHostFile -> its device Buffer -> that one's dict
        held = getattr(held, layer, held)
    try:
        return sorted({type(v).__module__.split(".")[0] for v in list(held.values())})
    except Exception as exc:  # a spilling store may refuse to be walked: say so, do not fail
        return [f"unknown ({type(exc).__name__})"]


def main():
    from distributed import Client, LocalCluster

    import daskpty
    from daskpty.execution.gpu import cuda_cluster

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "scan.zarr")
        daskpty.simulate(path, preset="small", seed=5)
        data = daskpty.open_data(path)
        kwargs = {"epochs": 4, "chunk_length": 64, "progress": False}
        with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address="127.0.0.1:0") as cl, \
                Client(cl) as c:
            cpu = daskpty.reconstruct(data, client=c, device="cpu", **kwargs)
        results = {}
        pids = set()
        stages = {"after the CPU run": compute_pids()}  # where the client's CUDA context, if any, began
        limits = {"gpu": None, "gpu_spilling": 2 * 2**20}  # the data: 4.5 MiB of uint16 in 9 chunks
        for name, limit in limits.items():
            extra = {} if limit is None else {"device_memory_limit": limit}
            with cuda_cluster(**extra) as cl, Client(cl) as c:
                stages[f"{name}: cluster started"] = compute_pids()
                kinds = {}

                def during_the_run(epoch, state, metrics, c=c, kinds=kinds):
                    # the data chunks are released when the run ends: look while they are held
                    for worker, held in c.run(_held_array_kinds).items():
                        kinds.setdefault(worker, set()).update(held)

                rec = daskpty.reconstruct(data, client=c, device="auto", callback=during_the_run, **kwargs)
                stages[f"{name}: reconstructed"] = compute_pids()
                pids |= stages[f"{name}: reconstructed"]
            results[name] = {
                "relative_difference": float(np.linalg.norm(rec.object - cpu.object) / np.linalg.norm(cpu.object)),
                "loss_ratio": rec.history[-1]["loss"] / cpu.history[-1]["loss"],
                "worker_data_types": sorted({k for held in kinds.values() for k in held}),
                "workers": len(kinds)}
    client_context = [stage for stage, seen in stages.items() if os.getpid() in seen]
    print(json.dumps({"client_pid": os.getpid(), "compute_pids": sorted(pids),
                      "client_context_seen": client_context, **results}))


if __name__ == "__main__":
    sys.exit(main())
