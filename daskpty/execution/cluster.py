"""Cluster helpers: use the caller's client, the current one, or start the embedded default.

Algorithm code never creates a cluster itself; it asks :func:`client_context` for a client.
The embedded default is a ``LocalCluster`` of worker processes listening on 127.0.0.1, or a
dask-cuda ``LocalCUDACluster`` (one worker per GPU / MIG slice) when GPUs are present and
dask-cuda is installed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import warnings

from distributed import Client, LocalCluster


def current_client():
    """The active ``distributed.Client`` or None."""
    try:
        from distributed import get_client

        return get_client()
    except ValueError:
        return None


def gpu_count() -> int:
    """Number of visible CUDA devices (0 when CuPy or a GPU is missing)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


#: Transports the embedded clusters offer: dask's TCP, or UCX through distributed-ucxx.
PROTOCOLS = ("tcp", "ucx")
#: dask-cuda ``LocalCUDACluster`` switches of the UCX transports (protocol="ucx" only).
UCX_SWITCHES = ("enable_tcp_over_ucx", "enable_infiniband", "enable_nvlink", "enable_rdmacm")


def comm_options(protocol: str | None = None, *, gpu: bool = False, **switches) -> dict:
    """Cluster keyword arguments for ``protocol`` ("tcp", "ucx" or None: dask's default, TCP) and
    the UCX switches of :data:`UCX_SWITCHES` (None entries dropped; GPU clusters only).

    Raises ValueError for a bad protocol or switch, ImportError for "ucx" without distributed-ucxx.
    """
    unknown = sorted(set(switches) - set(UCX_SWITCHES))
    if unknown:
        raise ValueError(f"unknown transport option(s) {', '.join(unknown)}; known: {', '.join(UCX_SWITCHES)}")
    switches = {k: bool(v) for k, v in switches.items() if v is not None}
    if protocol is None and not switches:
        return {}
    if switches and protocol != "ucx":
        raise ValueError(f"{', '.join(sorted(switches))} need protocol='ucx'")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if switches and not gpu:
        raise ValueError(f"{', '.join(sorted(switches))} are dask-cuda options: GPU clusters only")
    if protocol == "ucx":
        import importlib.util

        if importlib.util.find_spec("distributed_ucxx") is None:
            raise ImportError("protocol='ucx' needs distributed-ucxx: pip install 'daskpty[gpu-ucx]' "
                              "(or distributed-ucxx-cu12 / -cu13 for your CUDA)")
    return {"protocol": protocol, **switches}


def start_local_cluster(n_workers: int | None = None, threads_per_worker: int = 1,
                        memory_limit="auto", processes: bool = True, dashboard: bool = True,
                        gpu: bool | None = None, protocol: str | None = None, **kwargs) -> LocalCluster:
    """Start the embedded default cluster on this machine.

    CPU: ``n_workers`` processes (default: one per core) with ``threads_per_worker`` threads.
    GPU (``gpu=None`` auto-detects): a ``LocalCUDACluster``, one worker per GPU; see
    :func:`daskpty.execution.gpu.cuda_cluster` for MIG slices. ``protocol``: "tcp" (dask's
    default) or "ucx" (needs distributed-ucxx); on GPUs the UCX switches of dask-cuda
    (``enable_nvlink=True``, ...; see :func:`comm_options`) may be passed too.
    """
    if gpu is None:
        gpu = gpu_count() > 0 and _has_dask_cuda()
    switches = {k: kwargs.pop(k) for k in UCX_SWITCHES if k in kwargs}
    kwargs.update(comm_options(protocol, gpu=bool(gpu), **switches))
    # Always bind to loopback: dashboard_address=None would make distributed listen on all
    # interfaces (0.0.0.0:8787). dashboard=False keeps a loopback-only, random-port dashboard.
    address = "127.0.0.1:0"
    if gpu:
        from dask_cuda import LocalCUDACluster

        if "interface" not in kwargs:  # an interface (e.g. ib0 for UCX) names the address itself
            kwargs.setdefault("ip", "127.0.0.1")
        return LocalCUDACluster(n_workers=n_workers, dashboard_address=address, **kwargs)
    if n_workers is None:
        n_workers = max(1, (os.cpu_count() or 1) // threads_per_worker)
    if processes and not main_module_importable():
        warnings.warn("daskpty: this script has no file that worker processes could import "
                      "(python - <<EOF); the local cluster runs its workers as threads "
                      "in this process instead. Save the script to a file for worker processes.",
                      RuntimeWarning, stacklevel=2)
        processes = False
    if processes:
        kwargs.setdefault("host", "127.0.0.1")
    return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                        processes=processes, memory_limit=memory_limit,
                        dashboard_address=address, **kwargs)


def main_module_importable() -> bool:
    """Whether worker processes can start: multiprocessing's spawn re-imports ``__main__`` from
    its ``__file__``, and a script read from standard input (``python - <<EOF``) has the file
    ``"<stdin>"``, which does not exist (the workers fail with "Nanny failed to start").
    Without a ``__file__`` (``python -c``, interactive sessions, notebooks) spawn skips it."""
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or os.path.exists(path)


def _abandon(clusters, timeout: float = 5) -> None:
    """Close clusters whose start (or close) was interrupted, quietly: distributed's own exit
    handler would close them again and fail an assertion on workers still starting (an
    AssertionError traceback after the one-line interrupt message) or wait on a half-closed
    one. Worker processes left over are daemonic and end with this process."""
    for cluster in clusters:
        with contextlib.suppress(BaseException):
            cluster.close(timeout=timeout)
        cluster.shutdown_on_close = False  # distributed's atexit handler skips it


@contextlib.contextmanager
def interrupts_after_start():
    """Hold back a first Ctrl-C (SIGINT) until the block ends, then deliver it as Python would
    have; a second one is delivered at once. Around the start of the embedded cluster: an
    interrupt while a worker process is being spawned closes the pipe the child reads its start
    data from, and the child prints an ``EOFError`` traceback beside the one-line interrupt
    message. Started workers are closed quietly. Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    held = []

    def hold(signum, frame):
        if held:  # the second Ctrl-C: no more waiting
            signal.signal(signal.SIGINT, previous)
            _deliver(previous, signum, frame)
        held.append((signum, frame))

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        _deliver(previous, *held[0])


def _deliver(handler, signum, frame) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt


def _has_dask_cuda() -> bool:
    try:
        import dask_cuda  # noqa: F401

        return True
    except ImportError:
        return False


@contextlib.contextmanager
def client_context(client: Client | None = None, n_workers: int | None = None, **cluster_kwargs):
    """Yield a client: ``client`` if given, else the current one, else a fresh embedded cluster.

    A cluster started here is closed on exit; a client passed in or found is left alone.
    ``cluster_kwargs`` go to :func:`start_local_cluster` (e.g. ``protocol="ucx"``); with them a
    fresh cluster is always started.
    """
    if client is not None:
        with client.as_current():  # dask calls without an explicit client use this one too
            yield client
        return
    found = current_client() if n_workers is None and not cluster_kwargs else None
    if found is not None:
        yield found
        return
    import dask

    # The embedded cluster runs no statistical profiler in the workers (it costs CPU on small
    # machines); reconstruct() switches any cluster to low-latency messaging (see .latency).
    from distributed.deploy.spec import SpecCluster

    before = set(SpecCluster._instances)
    try:
        with dask.config.set({"distributed.worker.profile.enabled": False}), interrupts_after_start():
            cluster = start_local_cluster(n_workers=n_workers, **cluster_kwargs)
            new_client = Client(cluster)
    except BaseException:  # e.g. Ctrl-C while the workers start
        _abandon(set(SpecCluster._instances) - before)
        raise
    try:
        yield new_client
    finally:
        try:
            new_client.close()
            cluster.close()
        except BaseException:  # a second Ctrl-C while closing: no wait in distributed's exit handler
            _abandon([cluster], timeout=1)
            raise
