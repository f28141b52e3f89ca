"""One data set on the MIG slices of one GPU: one dask-cuda worker per slice.

A GPU in MIG mode (A100, H100, H200) is cut into slices, each with its own memory and compute;
one CUDA process can use only one slice, so daskpty runs one dask-cuda worker per slice.
``daskpty.execution.gpu.cuda_cluster`` finds the slices with ``nvidia-smi -L`` and gives every
worker *absolute* memory limits computed from its slice's size (dask-cuda's fractions would refer
to the whole parent GPU). For example, a 16 GB data set on an A100 80GB cut into 3 × 2g.20gb::

    python examples/mig_slices.py --list                     # the slices, as daskpty reads them
    python examples/mig_slices.py                            # all slices, a simulated medium scan
    python examples/mig_slices.py --slices 3 --data big.zarr --output big-recon.zarr --epochs 50

Needs MIG slices, CuPy and dask-cuda (``pip install -e ".[gpu]"``). Without a GPU, without MIG
slices, or without CuPy / dask-cuda it prints why ("no GPU available: ..." or "no MIG slices:
...") and exits with status 0, so it can run anywhere, CI included.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the GPUs / MIG slices and exit")
    p.add_argument("--slices", type=int, default=None, help="use the first K slices (default: all)")
    p.add_argument("--devices", default=None, help="comma-separated MIG UUIDs to use instead")
    p.add_argument("--data", default=None, help="data-set store (default: simulate one)")
    p.add_argument("--preset", default="medium", choices=["small", "medium", "large"],
                   help="simulation preset when --data is not given (default medium)")
    p.add_argument("--output", default=None, help="reconstruction store (also the checkpoint)")
    p.add_argument("--epochs", type=int, default=30, help="LSQML epochs (default 30)")
    p.add_argument("--rounds-per-epoch", type=int, default=4, help="updates per epoch (default 4)")
    p.add_argument("--device-fraction", type=float, default=0.8,
                   help="spill to host memory above this fraction of a slice's memory (default 0.8)")
    p.add_argument("--rmm-fraction", type=float, default=None,
                   help="pre-allocate an RMM pool of this fraction of a slice for CuPy (needs rmm)")
    p.add_argument("--persist", choices=["auto", "yes", "no"], default="auto",
                   help="keep the data on the slices (yes), re-read the store each round (no), "
                        "or decide from memory (auto, default)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from daskpty.metrics import nrmse_vs_truth

    args = parse_args(argv)
    from daskpty.execution.gpu import list_cuda_devices, worker_memory_settings

    devices = list_cuda_devices()
    if not devices:
        print("mig_slices: no GPU available: nvidia-smi lists no NVIDIA GPU. Nothing to do; "
              "examples/cpu_quickstart.py runs the same reconstruction on CPUs.")
        return 0
    if args.list:
        for d in devices:
            size = f"{d.memory_bytes / 1e9:.0f} GB" if d.memory_bytes else "whole GPU"
            print(f"{d.uuid}  {d.name}  ({size})")
        return 0
    slices = [d for d in devices if d.is_mig]
    if args.devices:
        wanted = args.devices.split(",")
        slices = [d for d in slices if d.uuid in wanted]
    if args.slices:
        slices = slices[:args.slices]
    if not slices:
        print("mig_slices: no MIG slices: nvidia-smi -L lists whole GPUs only (or none of --devices). "
              "Use examples/local_cuda_cluster.py for whole GPUs, or ask an administrator to enable "
              "MIG (nvidia-smi -i 0 -mig 1; nvidia-smi mig -cgi 2g.20gb,2g.20gb,2g.20gb -C).")
        return 0
    try:
        import cupy  # noqa: F401
        import dask_cuda  # noqa: F401
    except ImportError as exc:
        print(f"mig_slices: no GPU available: {exc.name} is not installed; pip install -e '.[gpu]'")
        return 0

    import daskpty
    from daskpty.execution.gpu import cuda_cluster
    from distributed import Client

    # cuda_cluster gives every worker the limits of the first device: put the smallest slice first
    slices.sort(key=lambda d: d.memory_bytes or 0)
    limits = worker_memory_settings(slices[0], args.device_fraction, args.rmm_fraction)
    for d in slices:
        print(f"worker on {d.uuid} ({d.name})")
    print("per-worker limits: " + ", ".join(
        f"{k} = {v / 1e9:.1f} GB" if v > 1 else f"{k} = {v:.0%} of the GPU" for k, v in limits.items()))
    extra = {"rmm_allocator_external_lib_list": ["cupy"]} if args.rmm_fraction else {}
    with cuda_cluster([d.uuid for d in slices], device_fraction=args.device_fraction,
                      rmm_fraction=args.rmm_fraction, **extra) as cluster, Client(cluster) as client:
        tmp = None
        if args.data:
            data = daskpty.open_data(args.data)
        else:
            tmp = tempfile.mkdtemp(prefix="daskpty-mig-")
            data = daskpty.simulate(os.path.join(tmp, "scan.zarr"), preset=args.preset, client=client)
        per_slice = data.intensities.nbytes / len(slices)
        print(f"data: {data.n_patterns} patterns of {data.pattern_shape[0]}x{data.pattern_shape[1]} "
              f"{data.dtype}, {data.intensities.nbytes / 1e9:.2f} GB = {per_slice / 1e9:.2f} GB per slice")
        persist = {"auto": "auto", "yes": True, "no": False}[args.persist]
        rec = daskpty.reconstruct(data, epochs=args.epochs, rounds_per_epoch=args.rounds_per_epoch,
                                  noise="poisson", client=client, device="gpu", persist=persist,
                                  checkpoint=args.output, progress=True)
    if args.output:
        print(f"wrote {args.output}")
    if data.truth is not None:
        print(f"object NRMSE vs truth: {nrmse_vs_truth(rec.object, rec.positions, rec.illumination, data.truth):.4f}")
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
