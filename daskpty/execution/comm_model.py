"""A model of one round's time on W workers: compute split W ways plus the exchange of partial sums.

Pure Python, no dask. It describes the epoch graph's replicated apply (``epoch_graph``): in every
round each worker sends its partial sums to every other worker, so one worker receives
``B (W - 1) / W`` bytes and the cluster moves ``B (W - 1)``, ``B`` being the bytes of all
workers' partials together (they cover the scanned object area, so ``B`` follows the object's
size, not the data's, and is the same for every round of an epoch). A :class:`Link` says how
fast those bytes move: stages every worker has for itself (its TCP stream, its PCIe link, its
NVLink port, its NIC), taken one after the other, and optionally one path all workers share
(MIG slices of one GPU share that GPU's PCIe link to host memory). See docs/gpu.md.

With tiles (``tile_graph``: each worker holds a row tile of the object) a worker receives only
the border of its neighbours' partial sums: ``border_bytes`` from each of its at most two
neighbours, whatever the number of workers, and the cluster moves ``2 border_bytes (W - 1)``;
:func:`tile_border_bytes` estimates a border from the object's width and the rows two tiles
both hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GB = 1e9


@dataclass(frozen=True)
class Link:
    """How partial sums travel between workers.

    worker_bandwidths: bytes/s of each stage every worker has to itself, in series (a transfer
    pays ``bytes / bw`` for each); shared_bandwidth: bytes/s (one direction) of one path every
    worker's transfers cross, or None; latency_s: fixed cost per round (message set-up, dask's
    handling of the transfer); source: where the figures come from.
    """

    name: str
    worker_bandwidths: tuple = ()
    shared_bandwidth: float | None = None
    latency_s: float = 0.0
    description: str = ""
    source: str = ""

    def __post_init__(self):
        if any(not (b > 0) for b in self.worker_bandwidths):
            raise ValueError(f"link {self.name!r}: every worker bandwidth must be > 0 bytes/s")
        if self.shared_bandwidth is not None and not self.shared_bandwidth > 0:
            raise ValueError(f"link {self.name!r}: shared_bandwidth must be > 0 bytes/s or None")
        if not self.worker_bandwidths and self.shared_bandwidth is None:
            raise ValueError(f"link {self.name!r}: give worker_bandwidths, shared_bandwidth or both")
        if self.latency_s < 0:
            raise ValueError(f"link {self.name!r}: latency_s must be >= 0")

    def with_tcp(self, bandwidth: float) -> "Link":
        """This link with its first worker stage (the dask TCP stream) at a measured bandwidth."""
        if not self.worker_bandwidths:
            raise ValueError(f"link {self.name!r} has no worker stage to replace")
        return replace(self, worker_bandwidths=(float(bandwidth),) + tuple(self.worker_bandwidths[1:]))


# Figures: one direction, sustained, of the hardware named; the dask TCP stage is an assumption
# to be replaced by a measurement (bench_comm.py measures it). Sources in docs/gpu.md.
_TCP = 1.5 * GB          # distributed's TCP comm, one stream, large frames (assumed; measure it)
_SHM = 8.0 * GB          # UCX shared-memory copy between processes of one host
_PCIE4 = 25.0 * GB       # PCIe Gen4 x16, of 31.5 GB/s line rate (A100 host link)
_NVLINK3 = 250.0 * GB    # A100 NVLink 3, 300 GB/s per direction per GPU (12 links x 25 GB/s)
_IB_HDR = 23.0 * GB      # InfiniBand HDR, 200 Gb/s = 25 GB/s per NIC
_IB_NDR = 46.0 * GB      # InfiniBand NDR, 400 Gb/s = 50 GB/s per NIC
_ETH25 = 2.9 * GB        # 25 GbE, 3.1 GB/s line rate
_ETH100 = 11.5 * GB      # 100 GbE, 12.5 GB/s line rate

LINKS: dict[str, Link] = {link.name: link for link in (
    Link("mig-tcp", (_TCP,), _PCIE4, 2e-3,
         "MIG slices of one A100, dask TCP: device -> host over the GPU's one PCIe link (shared by "
         "all slices), TCP on loopback, host -> device", "MIG user guide (no P2P, no CUDA IPC between "
         "GPU instances); A100 datasheet (PCIe Gen4)"),
    Link("mig-ucx", (_SHM,), _PCIE4, 0.5e-3,
         "MIG slices of one A100, UCX: cuda_copy staging through host memory + shared memory "
         "(no cuda_ipc between MIG instances); the PCIe link is shared", "as mig-tcp; UCX transports"),
    Link("gpu-tcp", (_PCIE4, _TCP), None, 2e-3,
         "whole GPUs of one node, dask TCP: each GPU's own PCIe link, TCP on loopback",
         "A100 datasheet (PCIe Gen4)"),
    Link("gpu-ucx-nvlink", (_NVLINK3,), None, 0.3e-3,
         "whole A100 SXM GPUs on NVSwitch, UCX cuda_ipc over NVLink", "A100 datasheet (NVLink 600 GB/s "
         "bidirectional); dask-cuda UCX docs"),
    Link("node-ib-hdr", (_IB_HDR,), None, 0.5e-3,
         "several nodes, UCX over InfiniBand HDR with GPUDirect RDMA, one NIC per GPU (DGX A100)",
         "InfiniBand HDR 200 Gb/s"),
    Link("node-ib-ndr", (_IB_NDR,), None, 0.5e-3,
         "several nodes, UCX over InfiniBand NDR, one NIC per GPU (DGX H100)", "InfiniBand NDR 400 Gb/s"),
    Link("node-eth25-tcp", (_PCIE4, _TCP, _ETH25), None, 3e-3,
         "several nodes, dask TCP over 25 GbE (one NIC per node, one worker per node)", "25 GbE line rate"),
    Link("node-eth100-tcp", (_PCIE4, _TCP, _ETH100), None, 3e-3,
         "several nodes, dask TCP over 100 GbE (one worker per node)", "100 GbE line rate"),
)}


def get_link(link) -> Link:
    """A :class:`Link`, or the preset of that name (see :data:`LINKS`)."""
    if isinstance(link, Link):
        return link
    try:
        return LINKS[str(link)]
    except KeyError:
        raise ValueError(f"unknown link {link!r}; presets: {', '.join(LINKS)}") from None


@dataclass(frozen=True)
class RoundProjection:
    """Projected seconds of one round on ``workers`` workers (compute + exchange, not overlapped:
    a round's apply waits for every partial)."""

    workers: int
    compute_s: float
    exchange_s: float
    received_bytes: float   # by one worker
    moved_bytes: float      # by the whole cluster
    link: str = field(default="")

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exchange_s

    @property
    def exchange_fraction(self) -> float:
        return self.exchange_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def communication_bound(self) -> bool:
        return self.exchange_s >= self.compute_s


def tile_border_bytes(width_px: float, shared_rows: float, bytes_per_px: float = 12.0) -> float:
    """Bytes of one tile border per round: the rows two neighbouring tiles both hold (a chunk's
    slab of rows where they meet plus a window) across the object's width, at the partial sums'
    bytes per pixel (a complex64 numerator and a float32 illumination: 12)."""
    return float(width_px) * float(shared_rows) * float(bytes_per_px)


def exchange_seconds(bytes_per_round: float, workers: int, link,
                     border_bytes: float | None = None) -> tuple[float, float, float]:
    """``(seconds, bytes one worker receives, bytes the cluster moves)`` of one round's exchange:
    replicas (``border_bytes`` None) or tiles (``border_bytes`` per border, see the module)."""
    link = get_link(link)
    workers = _check(0.0, bytes_per_round, workers)
    if workers == 1:
        return 0.0, 0.0, 0.0
    if border_bytes is None:
        received = bytes_per_round * (workers - 1) / workers
        moved = bytes_per_round * (workers - 1)
    else:
        received = border_bytes * min(2, workers - 1)
        moved = border_bytes * 2 * (workers - 1)
    seconds = link.latency_s + sum(received / bw for bw in link.worker_bandwidths)
    if link.shared_bandwidth is not None:
        seconds += moved / link.shared_bandwidth
    return seconds, received, moved


def project_round_time(compute_s: float, bytes_per_round: float, workers: int, link,
                       worker_speed: float = 1.0, border_bytes: float | None = None) -> RoundProjection:
    """One round on ``workers`` workers joined by ``link`` (a :class:`Link` or a preset name).

    compute_s: the seconds one worker of speed 1 needs for the whole round's chunk steps (it
    splits evenly: each of ``workers`` workers of speed ``worker_speed`` takes
    ``compute_s / (workers * worker_speed)``); bytes_per_round: all workers' partial sums of one
    round together (``B``; see the module docstring); border_bytes: with tiles, the bytes of
    one tile border (None: replicas).
    """
    workers = _check(compute_s, bytes_per_round, workers)
    if not worker_speed > 0:
        raise ValueError(f"worker_speed must be > 0, got {worker_speed!r}")
    link = get_link(link)
    seconds, received, moved = exchange_seconds(bytes_per_round, workers, link, border_bytes)
    return RoundProjection(workers, compute_s / (workers * worker_speed), seconds, received, moved, link.name)


def crossover_workers(compute_s: float, bytes_per_round: float, link, max_workers: int = 64,
                      worker_speed: float = 1.0, border_bytes: float | None = None) -> int | None:
    """The fewest workers at which the exchange takes at least as long as the compute (None if
    that does not happen up to ``max_workers``)."""
    for w in range(2, int(max_workers) + 1):
        if project_round_time(compute_s, bytes_per_round, w, link, worker_speed, border_bytes).communication_bound:
            return w
    return None


def best_workers(compute_s: float, bytes_per_round: float, link, max_workers: int = 64,
                 worker_speed: float = 1.0) -> int:
    """The worker count (1 .. max_workers) with the shortest projected round."""
    return min(range(1, int(max_workers) + 1),
               key=lambda w: project_round_time(compute_s, bytes_per_round, w, link, worker_speed).total_s)


#: Compute units (sevenths of an A100) of each slice when an A100 is cut into ``W`` equal MIG
#: slices: 2 x 3g.20gb, 3 x 2g.10gb, 4..7 x 1g.5gb (A100 40 GB) / 1g.10gb (80 GB).
A100_MIG_UNITS = {1: 7, 2: 3, 3: 2, 4: 1, 5: 1, 6: 1, 7: 1}


def _check(compute_s, bytes_per_round, workers) -> int:
    if isinstance(workers, bool) or int(workers) != workers or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    for name, value in (("compute_s", compute_s), ("bytes_per_round", bytes_per_round)):
        try:
            ok = math.isfinite(float(value)) and float(value) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return int(workers)
