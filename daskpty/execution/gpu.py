"""GPU clusters: one dask-cuda worker per GPU or per MIG slice.

dask-cuda's memory *fractions* refer to the parent GPU, so on MIG slices every limit must be
absolute bytes: :func:`cuda_cluster` converts them from the slice's own memory.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

_GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9a-fA-F-]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9a-zA-Z/-]+)\)")


@dataclass(frozen=True)
class CudaDevice:
    """A schedulable CUDA device: a whole GPU or one MIG slice."""

    uuid: str
    name: str
    parent: str
    memory_bytes: int | None = None

    @property
    def is_mig(self) -> bool:
        return self.uuid.startswith("MIG-")


def _mig_memory_bytes(profile: str) -> int | None:
    """Memory of a MIG profile such as ``3g.20gb`` or ``1g.10gb`` (bytes), from its name."""
    m = re.search(r"(\d+)gb", profile)
    return int(m.group(1)) * 10**9 if m else None


def parse_nvidia_smi_list(text: str) -> list[CudaDevice]:
    """Devices from ``nvidia-smi -L`` output: MIG slices where a GPU has them, else the GPU."""
    devices: list[CudaDevice] = []
    current = None
    migs: list[CudaDevice] = []

    def flush():
        if current is not None:
            devices.extend(migs if migs else [CudaDevice(current[1], current[0], current[1])])

    for line in text.splitlines():
        g = _GPU_LINE.match(line)
        if g:
            flush()
            current, migs = (g.group(2), g.group(3)), []
            continue
        m = _MIG_LINE.match(line)
        if m and current is not None:
            migs.append(CudaDevice(m.group(3), f"{current[0]} MIG {m.group(1)}", current[1],
                                   _mig_memory_bytes(m.group(1))))
    flush()
    return devices


def list_cuda_devices() -> list[CudaDevice]:
    """Visible GPUs / MIG slices via ``nvidia-smi -L`` (empty list when there is none)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return parse_nvidia_smi_list(out)


def worker_memory_settings(device: CudaDevice, device_fraction: float = 0.8,
                           rmm_fraction: float | None = None) -> dict:
    """Absolute ``device_memory_limit`` (spill threshold) and optional RMM pool size for a device."""
    if device.memory_bytes is None:
        return {"device_memory_limit": device_fraction}  # whole GPU: fractions are fine
    settings = {"device_memory_limit": int(device.memory_bytes * device_fraction)}
    if rmm_fraction:
        settings["rmm_pool_size"] = int(device.memory_bytes * rmm_fraction)
    return settings


def cuda_cluster(devices=None, *, device_fraction: float = 0.8, rmm_fraction: float | None = None,
                 dashboard_address: str = "127.0.0.1:0", protocol: str | None = None,
                 enable_tcp_over_ucx: bool | None = None, enable_infiniband: bool | None = None,
                 enable_nvlink: bool | None = None, enable_rdmacm: bool | None = None, **kwargs):
    """Start a dask-cuda ``LocalCUDACluster`` with one worker per GPU or MIG slice.

    devices: None (all from ``nvidia-smi -L``; MIG slices when enabled), or a list of UUIDs /
    indices. A device listed k times gets k workers (two workers on one GPU stand in for two MIG
    slices): see :func:`shared_device_cluster`. On MIG all slices must share one profile (one
    absolute memory limit for all workers). protocol: "tcp" (default) or "ucx" (needs
    distributed-ucxx); the ``enable_*`` switches are dask-cuda's UCX transport flags (None: let
    UCX choose). Other keyword arguments go to ``LocalCUDACluster`` and override the computed
    settings (e.g. an explicit ``device_memory_limit="2GiB"``).
    """
    from .cluster import comm_options

    transport = comm_options(protocol, gpu=True, enable_tcp_over_ucx=enable_tcp_over_ucx,
                             enable_infiniband=enable_infiniband, enable_nvlink=enable_nvlink,
                             enable_rdmacm=enable_rdmacm)
    found = list_cuda_devices()
    if devices is None:
        chosen = found
    else:
        by_id = {d.uuid: d for d in found}
        chosen = [by_id.get(str(d), CudaDevice(str(d), str(d), str(d))) for d in devices]
    if not chosen:
        raise RuntimeError("no CUDA device found (nvidia-smi -L lists none); use the CPU cluster")
    uuids = [d.uuid for d in chosen]
    if len(set(uuids)) < len(uuids):
        if len(transport) > 1:
            raise ValueError("workers sharing a device take protocol= only, not dask-cuda's UCX switches")
        return shared_device_cluster(uuids, protocol=protocol, dashboard_address=dashboard_address, **kwargs)
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise ImportError("GPU clusters need the gpu extra: pip install 'daskpty[gpu]'") from exc
    settings = {**worker_memory_settings(chosen[0], device_fraction, rmm_fraction), **transport, **kwargs}
    if "interface" not in settings:  # an interface (e.g. ib0 for UCX) names the address itself
        settings["ip"] = "127.0.0.1"
    return LocalCUDACluster(CUDA_VISIBLE_DEVICES=uuids, dashboard_address=dashboard_address, **settings)


#: Keyword arguments :func:`shared_device_cluster` takes (the rest are dask-cuda's).
SHARED_DEVICE_OPTIONS = ("threads_per_worker", "memory_limit", "local_directory")


def shared_device_cluster(devices, *, protocol: str | None = None, dashboard_address: str = "127.0.0.1:0",
                          threads_per_worker: int = 1, memory_limit="auto", **kwargs):
    """A cluster of one worker process per entry of ``devices`` (UUIDs or indices, repeats
    allowed), each seeing only its device (``CUDA_VISIBLE_DEVICES``): several workers on one GPU.

    dask-cuda names its workers by device and so cannot put two on one; these are plain dask
    workers (distributed ``SpecCluster`` of nannies on 127.0.0.1), without dask-cuda's device
    spilling, RMM pool or CPU affinity. memory_limit: host bytes per worker, or "auto" (the
    machine's memory split evenly). dashboard_address None: no dashboard.
    """
    from distributed import Nanny, Scheduler, SpecCluster
    from distributed.system import MEMORY_LIMIT

    from .cluster import comm_options

    other = sorted(set(kwargs) - set(SHARED_DEVICE_OPTIONS))
    if other:
        raise ValueError(f"workers sharing a device are plain dask workers: {', '.join(other)} "
                         f"(dask-cuda options) do not apply")
    devices = [str(d) for d in devices]
    if not devices:
        raise ValueError("shared_device_cluster needs at least one device")
    if memory_limit == "auto":
        memory_limit = int(MEMORY_LIMIT / len(devices))
    transport = comm_options(protocol)
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": dashboard_address is not None,
                                               "dashboard_address": dashboard_address or "127.0.0.1:0",
                                               **transport}}
    workers = {i: {"cls": Nanny, "options": {"host": "127.0.0.1", "nthreads": int(threads_per_worker),
                                             "memory_limit": memory_limit, "env": {"CUDA_VISIBLE_DEVICES": d},
                                             **transport, **kwargs}}
               for i, d in enumerate(devices)}
    return SpecCluster(workers=workers, scheduler=scheduler)
