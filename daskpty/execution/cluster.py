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

from distributed import Client, LocalCluster, wait

from ..faults import ClusterUnavailable, SchedulerLost, WorkersPaused  # noqa: F401 (also named here)
from .watchdog import seconds_from_env


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
    check_worker_count(n_workers)
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
        with terminal_signals_kept_from_workers():
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
        kwargs.setdefault("preload", ["daskpty.execution.worker_noise"])  # handled losses: INFO there too
    with terminal_signals_kept_from_workers():
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                            processes=processes, memory_limit=memory_limit,
                            dashboard_address=address, **kwargs)


#: what a terminal sends to its whole foreground process group: Ctrl-C and its hang-up
TERMINAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def terminal_signals_kept_from_workers():
    """Start an embedded cluster whose worker processes never see a terminal's Ctrl-C or hang-up.

    A terminal delivers SIGINT (Ctrl-C) and SIGHUP (closed) to its whole foreground process
    group, worker processes included; a worker that dies of it takes the state of the epoch
    with it, and the run cannot write its stop checkpoint. The process that owns the cluster
    handles them (stop checkpoint, then it closes its workers). Here they are blocked in the
    calling thread while the cluster starts: the cluster's event-loop thread, the threads it
    makes later (a nanny restarting a worker) and every process they start inherit the blocked
    set (a signal mask survives fork and exec), and this thread's mask is restored after. SIGTERM
    stays deliverable, as the nannies stop their workers with it.

    multiprocessing's resource tracker is started first, from here: starting it unblocks SIGINT
    in the thread that does so (which would otherwise be the one spawning the workers), and
    started here it inherits SIGHUP blocked (it ignores SIGINT itself)."""
    if not hasattr(signal, "pthread_sigmask") or not TERMINAL_SIGNALS:
        yield
        return
    from multiprocessing import resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
    """Hold back a first Ctrl-C (SIGINT), SIGTERM or SIGHUP until the block ends, then deliver it
    as Python would have; a second one is delivered at once. Around the start of the embedded
    cluster: an interrupt while a worker process is being spawned closes the pipe the child
    reads its start data from, and the child prints an ``EOFError`` or ``Nanny failed to start``
    traceback beside the one-line interrupt message. Started workers are closed quietly.
    Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
    previous = {n: signal.getsignal(n) for n in numbers}
    previous = {n: h for n, h in previous.items() if h is not signal.SIG_IGN and h is not None}
    held = []

    def hold(signum, frame):
        if held:  # the second one: no more waiting
            for n, h in previous.items():
                signal.signal(n, h)
            _deliver(previous[signum], signum, frame)
        held.append((signum, frame))

    for n in previous:
        signal.signal(n, hold)
    try:
        yield
    finally:
        for n, h in previous.items():
            signal.signal(n, h)
    if held:
        _deliver(previous[held[0][0]], *held[0])


def _deliver(handler, signum, frame) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


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


# --- A cluster that is there: workers to run on, a scheduler that answers -------------------------


#: Default wait for a first worker, seconds (``DASKPTY_WORKER_WAIT_SECONDS`` overrides it).
DEFAULT_WORKER_WAIT_SECONDS = 60.0
#: How long a client that lost its scheduler may take to reconnect before the run gives up.
RECONNECT_SECONDS = 10.0
#: Most worker processes the embedded cluster starts per CPU core.
WORKERS_PER_CORE = 4


def worker_wait_seconds() -> float:
    """The wait for a first worker (``DASKPTY_WORKER_WAIT_SECONDS`` or the default, 60 s)."""
    return seconds_from_env("DASKPTY_WORKER_WAIT_SECONDS", DEFAULT_WORKER_WAIT_SECONDS, zero_allowed=True)


def check_worker_count(n_workers: int | None) -> None:
    """Refuse more embedded worker processes than :data:`WORKERS_PER_CORE` per core (1000 on two
    cores spent minutes spawning processes that would only share those cores)."""
    cores = os.cpu_count() or 1
    most = max(WORKERS_PER_CORE * cores, 8)
    if n_workers is not None and n_workers > most:
        raise ValueError(f"{n_workers} workers on this machine's {cores} core(s) is too many: at most {most} "
                         f"({WORKERS_PER_CORE} per core; more only share the same cores and each costs about "
                         "100 MiB); for more workers, start them on other machines and pass --scheduler / client=")


def scheduler_address(client) -> str:
    try:
        return str(client.scheduler.address)
    except Exception:
        return "(unknown address)"


def live_workers(client) -> dict:
    """The scheduler's workers (``{address: info}``), asked of the scheduler now;
    :class:`SchedulerLost` when the client has lost its scheduler (it waits up to
    :data:`RECONNECT_SECONDS` for a reconnection first).

    Not ``client.scheduler_info()``: that returns the client's cached identity, which the client's
    periodic refresh (``distributed.client.scheduler-info-interval``) replaces with one without
    workers (distributed 2025–2026); read just after such a refresh it says that no worker is
    connected, and a run would unpin its chunks or take its workers for lost."""
    import time

    deadline = time.monotonic() + RECONNECT_SECONDS
    while client.status == "connecting" and time.monotonic() < deadline:
        time.sleep(0.1)
    again = "start it and its workers again and continue with --resume (API: resume=)"
    if client.status != "running":
        raise SchedulerLost(f"the dask scheduler at {scheduler_address(client)} is gone (no connection for "
                            f"{RECONNECT_SECONDS:.0f} s); {again}")
    try:
        info = client.sync(client.scheduler.identity, n_workers=-1)
    except OSError as exc:
        raise SchedulerLost(f"the dask scheduler at {scheduler_address(client)} is gone ({exc}); {again}") from None
    if "workers" not in info or client.status != "running":
        raise SchedulerLost(f"the dask scheduler at {scheduler_address(client)} is gone (it no longer answers); "
                            f"{again}")
    return dict(info["workers"])


def paused_workers(client) -> list[str]:
    """Addresses of workers paused at their memory limit (``distributed.worker.memory.pause``)."""
    try:
        workers = live_workers(client)
    except ClusterUnavailable:
        return []
    return sorted(a for a, w in workers.items() if str(w.get("status", "")).endswith("paused"))


def wait_for_workers(client, timeout: float | None = None, *, say=None, lost: bool = False) -> int:
    """Wait until the scheduler has at least one worker; return how many it has.

    Returns at once when workers are there. Otherwise says once (``say``: a function taking one
    line; default stderr) that it waits, polls for up to ``timeout`` seconds (default
    :func:`worker_wait_seconds`) and raises :class:`ClusterUnavailable` naming the scheduler and
    what to start (``lost``: the run had workers and lost them all), so that a cluster without
    workers does not hang the run in its first gather.
    """
    import sys
    import time

    workers = live_workers(client)
    if workers:
        _wait_while_paused(client, workers)
        return len(workers)
    timeout = worker_wait_seconds() if timeout is None else float(timeout)
    address = scheduler_address(client)
    if say is None:
        def say(line):
            print(line, file=sys.stderr, flush=True)
    said = False
    deadline = time.monotonic() + timeout
    while True:
        workers = live_workers(client)
        if workers:
            return len(workers)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if not said and timeout - left >= 1.0:  # (nannies usually bring workers back within a second)
            say(f"daskpty: the dask scheduler at {address} has {'lost all its' if lost else 'no'} workers; "
                f"waiting up to {timeout:.0f} s for one to join")
            said = True
        time.sleep(min(0.25, left))
    if lost:
        raise ClusterUnavailable(f"every dask worker of the scheduler at {address} was lost and none came back "
                                 f"within {timeout:.0f} s (DASKPTY_STALL_SECONDS sets the wait); start workers "
                                 "and continue with --resume (API: resume=)")
    raise ClusterUnavailable(f"no dask worker joined the scheduler at {address} within {timeout:.0f} s; "
                             f"start workers (dask worker {address}) or check that they can reach it "
                             "(DASKPTY_WORKER_WAIT_SECONDS sets the wait)")


def _probe_scheduler(host: str, port: int, timeout: float) -> None:
    """Raise :class:`ClusterUnavailable` quickly when nothing listens at ``host:port`` or what
    listens is not a dask scheduler. A dask scheduler speaks first (its handshake) as soon as a
    connection is accepted; an HTTP server (the dashboard) waits for a request and answers it."""
    import socket

    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise ClusterUnavailable(f"nothing answered at {host}:{port} within {timeout:.0f} s; check the "
                                 "--scheduler address and that a dask scheduler runs there") from None
    except OSError as exc:
        raise ClusterUnavailable(f"cannot connect to a dask scheduler at {host}:{port}: "
                                 f"{exc.strerror or exc}; check the address and that the scheduler "
                                 "runs (dask scheduler)") from None
    with sock:
        sock.settimeout(min(timeout, 3.0))
        try:
            if sock.recv(1):
                return  # it spoke first: a dask comm
        except socket.timeout:
            pass
        except OSError:
            return  # closed at once: let distributed say what it is
        try:
            sock.sendall(b"GET / HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
            reply = sock.recv(5)
        except OSError:
            reply = b""
    if reply.startswith(b"HTTP"):
        raise ClusterUnavailable(f"{host}:{port} is an HTTP server (a dask dashboard?), not a dask "
                                 "scheduler; pass the scheduler's address (tcp://HOST:8786 by default)")
    raise ClusterUnavailable(f"{host}:{port} does not answer like a dask scheduler; pass the scheduler's "
                             "address (tcp://HOST:8786 by default)")


def connect(address: str, timeout: float = 10.0):
    """A ``Client`` of the scheduler at ``address``, or :class:`ClusterUnavailable` within about
    ``timeout`` seconds: a closed port, an HTTP port (the dashboard's) and an address that does
    not answer are each one line (distributed alone gives a traceback after 32 s for a closed
    port and hangs on an HTTP port). TCP addresses are probed first; other protocols go straight
    to distributed."""
    from urllib.parse import urlsplit

    text = str(address)
    scheme = text.split("://", 1)[0] if "://" in text else "tcp"
    if scheme == "tcp":
        parts = urlsplit(text if "://" in text else f"tcp://{text}")
        try:
            host, port = parts.hostname, parts.port or 8786
        except ValueError:
            raise ClusterUnavailable(f"bad scheduler address {address!r}; expected tcp://HOST:PORT") from None
        if not host:
            raise ClusterUnavailable(f"bad scheduler address {address!r}; expected tcp://HOST:PORT")
        _probe_scheduler(host, port, timeout)
    try:
        return Client(address, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        raise ClusterUnavailable(f"cannot connect to a dask scheduler at {address} within {timeout:.0f} s "
                                 f"({' '.join(str(exc).split())})") from None


#: A wait during which every worker stays paused at its memory limit this long ends the run
#: (``DASKPTY_PAUSED_SECONDS`` overrides it).
DEFAULT_PAUSED_SECONDS = 60.0


def _paused(info: dict) -> bool:
    return str(info.get("status", "")).endswith("paused")


def _paused_seconds() -> float:
    return seconds_from_env("DASKPTY_PAUSED_SECONDS", DEFAULT_PAUSED_SECONDS)


def _all_paused_message(workers: dict, seconds: float) -> str:
    smallest = min((w.get("memory_limit") or 0) for w in workers.values())
    return (f"all {len(workers)} workers paused at their memory limit ({smallest / 2**20:.0f} MiB) for "
            f"{seconds:.0f} s, so the round cannot go on; give each worker more memory (memory_limit=, fewer "
            "workers per machine), a shorter chunk_length or persist=False")


def _wait_while_paused(client, workers: dict) -> None:
    """Return once a worker is not paused; :class:`WorkersPaused` when all stay paused for
    ``DASKPTY_PAUSED_SECONDS`` (a scatter to paused workers fails with 'No valid workers')."""
    import time

    limit = _paused_seconds()
    deadline = time.monotonic() + limit
    while workers and all(_paused(w) for w in workers.values()):
        if time.monotonic() >= deadline:
            raise WorkersPaused(_all_paused_message(workers, limit))
        time.sleep(0.25)
        workers = live_workers(client)


def result_unless_paused(client, future, timeout: float | None):
    """``future.result(timeout)``, but a wait during which every worker stays paused at its memory
    limit (dask pauses a worker at 80 % of it) for ``DASKPTY_PAUSED_SECONDS`` (60 s) ends with
    :class:`WorkersPaused`, one line that says so, instead of the watchdog's 5-minute stall that
    did not mention memory. Raises TimeoutError after ``timeout`` like ``future.result``."""
    import time

    limit = _paused_seconds()
    deadline = None if timeout is None else time.monotonic() + timeout
    paused_since = None
    while True:
        now = time.monotonic()
        step = 2.0 if deadline is None else min(2.0, max(deadline - now, 0.0))
        # Wait for the task, not for its result: a ``result(timeout=2)`` that times out while a
        # large result is still on its way cancels that transfer and the next call asks the worker
        # for it again, so a result that takes longer than the step to arrive (a 660 MB object sum)
        # was serialised again and again until the worker ran out of memory.
        try:
            with future.client.as_current():  # (wait() takes the default client, maybe another)
                wait([future], timeout=step)
        except TimeoutError:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise
        else:
            return future.result()
        workers = live_workers(client)
        if not (workers and all(_paused(w) for w in workers.values())):
            paused_since = None
            continue
        paused_since = now if paused_since is None else paused_since
        if now - paused_since >= limit:
            raise WorkersPaused(_all_paused_message(workers, limit))
