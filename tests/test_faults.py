"""Faults with real worker processes: every worker killed at once mid-run, with data that can be
read again (a Zarr store: the run ends bit-identically) and data that cannot (in-memory arrays:
the run ends in one line, in bounded time, instead of hanging)."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.execution.watchdog import ReconstructionStalled, Watchdog
from dask_processes import dask_process, free_port
from synthetic import make_dataset


@pytest.fixture(scope="module")
def process_client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def _kill_every_worker_at(client, epoch_to_kill: int, killed: list):
    """An epoch callback that SIGKILLs every worker process (0.1 s apart) after ``epoch_to_kill``;
    their nannies start new ones."""

    def callback(epoch, state, metrics):
        if epoch == epoch_to_kill and not killed:
            killed.append(time.monotonic())
            for pid in client.run(os.getpid).values():
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)

    callback.takes_epoch_state = True  # the state stays on the workers: the kill loses it
    return callback


@pytest.mark.slow
def test_losing_every_worker_recovers_bit_identically(process_client, tmp_path, monkeypatch):
    monkeypatch.setenv("DASKPTY_STALL_SECONDS", "20")
    ds = make_dataset(grid=10, seed=3)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr")
    data = daskpty.open_data(tmp_path / "s.zarr")
    kw = dict(epochs=8, client=process_client, chunk_length=25, check_data=False,
              refine_positions={"start_epoch": 2})
    undisturbed = daskpty.reconstruct(data, **kw)
    killed = []
    start = time.monotonic()
    rec = daskpty.reconstruct(data, callback=_kill_every_worker_at(process_client, 3, killed), **kw)
    assert killed, "the workers were not killed"
    assert time.monotonic() - start < 60
    np.testing.assert_array_equal(rec.object, undisturbed.object)
    np.testing.assert_array_equal(rec.positions, undisturbed.positions)
    assert [h["loss"] for h in rec.history] == [h["loss"] for h in undisturbed.history]


@pytest.mark.slow
def test_losing_in_memory_data_ends_in_one_line(process_client, monkeypatch, tmp_path):
    """In-memory data die with the workers: no hang, one line naming what happened and the kept
    checkpoint, within the restarts' bounded time."""
    monkeypatch.setenv("DASKPTY_STALL_SECONDS", "4")
    ds = make_dataset(grid=10, seed=4)
    killed = []
    start = time.monotonic()
    with pytest.raises(ReconstructionStalled) as info:
        daskpty.reconstruct(ds, epochs=30, client=process_client, chunk_length=25, check_data=False,
                            checkpoint=tmp_path / "c.zarr", checkpoint_every=2,
                            callback=_kill_every_worker_at(process_client, 3, killed))
    assert killed
    assert time.monotonic() - start < 90
    message = str(info.value)
    assert "\n" not in message and "no progress" in message and "epoch 2 is kept" in message
    assert daskpty.Reconstruction.from_zarr(tmp_path / "c.zarr").epochs == 2


def test_watchdog_bound_follows_the_slowest_epoch(monkeypatch):
    monkeypatch.setenv("DASKPTY_STALL_SECONDS", "30")
    dog = Watchdog()
    assert dog.bound() == 30
    assert Watchdog(data_bytes=2 * 10**9).bound() == 30 + 100  # the first epoch reads the data
    dog.observe(0.5)
    assert dog.bound() == 30
    dog.observe(4.0)
    dog.observe(float("nan"))
    assert dog.bound() == 80
    monkeypatch.setenv("DASKPTY_STALL_SECONDS", "soon")
    with pytest.raises(ValueError, match="DASKPTY_STALL_SECONDS"):
        Watchdog()


def test_data_store_replaced_under_a_run_stops_it(tmp_path):
    """A shard rewritten during the run (as `simulate --overwrite` would) stops it at the next
    epoch with one line; the checkpoint of the last epoch before the change is kept."""
    from distributed import Client, LocalCluster

    from daskpty.io.identity import DataChanged

    ds = make_dataset(grid=8, seed=5)
    path = tmp_path / "s.zarr"
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(path)
    shard = next(p for p in sorted((path / "intensities").rglob("*")) if p.is_file() and p.name != "zarr.json")

    def rewrite(epoch, state, metrics):
        if epoch == 3:
            shard.write_bytes(shard.read_bytes())  # same bytes, new file times: the store changed

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        with pytest.raises(DataChanged) as info:
            daskpty.reconstruct(daskpty.open_data(path), epochs=20, client=c, callback=rewrite,
                                checkpoint=tmp_path / "r.zarr", checkpoint_every=1, persist=False)
    message = str(info.value)
    assert "\n" not in message and "changed during the reconstruction" in message
    assert "epoch 3 is kept" in message
    assert daskpty.Reconstruction.from_zarr(tmp_path / "r.zarr").epochs == 3


def test_sigterm_before_the_first_epoch_is_one_line(tmp_path):
    """SIGTERM while the cluster starts (a batch job's wall time) ends like Ctrl-C: exit 130,
    one line, nothing left behind (it used to exit -15 silently)."""
    import subprocess
    import sys

    ds = make_dataset(grid=6, seed=1)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr")
    out = tmp_path / "r.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "daskpty", "reconstruct", str(tmp_path / "s.zarr"), "-o",
                             str(out), "--epochs", "50", "--workers", "1", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{out}.lock") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # the lock is taken once the command runs (its SIGTERM handler is set)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("daskpty:")]
    assert lines and "interrupted" in lines[-1] and "Traceback" not in err
    assert not out.exists()


def test_a_handled_stale_round_is_not_reported_as_an_error(caplog):
    """distributed's ERROR "Compute Failed" report of a StaleRoundState (handled by the driver,
    which logs one WARNING) is dropped; other task failures are still reported."""
    import logging

    import daskpty.execution.epoch_graph  # noqa: F401  (installs the filter, as on the workers)

    log = logging.getLogger("distributed.worker")
    template = "Compute Failed\nKey:       %s\nState:     %s\nTask:  %s\nException: %r\nTraceback: %r\n"
    with caplog.at_level(logging.ERROR, logger="distributed.worker"):
        log.error(template, "k1", "executing", "t", "StaleRoundState('round 1 did not find ...')", "tb")
        log.error(template, "k2", "executing", "t", "ValueError('a real failure')", "tb")
    keys = [r.args[0] for r in caplog.records if r.name == "distributed.worker"]
    assert keys == ["k2"]


# --- issue 32: out of core, external clusters, clusters without workers ---------------------------

@pytest.mark.slow
def test_out_of_core_losing_every_worker_recovers_bit_identically(process_client, tmp_path, monkeypatch, caplog):
    """Round by round (persist=False) the state lives on the client: a round whose workers all
    die runs again once the nannies' new workers are there, from the same state; the checkpoint
    and the result equal an undisturbed run (it crashed with FutureCancelledError)."""
    monkeypatch.setenv("DASKPTY_STALL_SECONDS", "20")
    ds = make_dataset(grid=10, seed=6)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr")
    data = daskpty.open_data(tmp_path / "s.zarr")
    kw = dict(epochs=7, client=process_client, chunk_length=25, check_data=False, persist=False,
              checkpoint_every=5)
    undisturbed = daskpty.reconstruct(data, checkpoint=tmp_path / "u.zarr", **kw)
    killed = []
    start = time.monotonic()
    rec = daskpty.reconstruct(data, checkpoint=tmp_path / "k.zarr",
                              callback=_kill_every_worker_in_the_next_round(process_client, 3, killed), **kw)
    assert killed and time.monotonic() - start < 90
    assert "restarting round" in caplog.text  # the loss was seen and handled
    assert not rec.options["persist"]
    np.testing.assert_array_equal(rec.object, undisturbed.object)
    np.testing.assert_array_equal(rec.probe, undisturbed.probe)
    assert [h["loss"] for h in rec.history] == [h["loss"] for h in undisturbed.history]
    np.testing.assert_array_equal(daskpty.Reconstruction.from_zarr(tmp_path / "k.zarr").object, undisturbed.object)


def _kill_every_worker_in_the_next_round(client, epoch_to_kill: int, killed: list):
    """An epoch callback that, after ``epoch_to_kill``, SIGKILLs every worker process as soon as
    the next round's tasks are running (from a thread: the callback must return first)."""
    import threading

    pids = list(client.run(os.getpid).values())

    def kill_when_busy():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(client.processing().values()):
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())
                return
            time.sleep(0.005)

    def callback(epoch, state, metrics):
        if epoch == epoch_to_kill and not killed:
            threading.Thread(target=kill_when_busy, daemon=True).start()

    callback.takes_epoch_state = True
    return callback


@pytest.mark.slow
def test_a_cluster_without_workers_is_a_bounded_wait_and_one_line(monkeypatch, tmp_path):
    """client= on LocalCluster(n_workers=0) used to hang forever in the first gather."""
    from daskpty.execution.cluster import ClusterUnavailable

    monkeypatch.setenv("DASKPTY_WORKER_WAIT_SECONDS", "2")
    ds = make_dataset(grid=6, seed=1)
    lines = []
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster) as c:
        start = time.monotonic()
        with pytest.raises(ClusterUnavailable) as info:
            daskpty.reconstruct(ds, epochs=2, client=c, checkpoint=tmp_path / "r.zarr")
        took = time.monotonic() - start
        from daskpty.execution.cluster import wait_for_workers

        with pytest.raises(ClusterUnavailable):
            wait_for_workers(c, timeout=1.5, say=lines.append)
    assert 2 <= took < 60   # a bound, not a timing: it ended instead of hanging (2 s wait; loaded CI)
    message = str(info.value)
    assert "\n" not in message and "no dask worker joined the scheduler" in message and "within 2 s" in message
    assert lines and "has no workers; waiting up to 2 s" in lines[0]
    assert not (tmp_path / "r.zarr").exists()


def test_scheduler_addresses_that_are_no_scheduler_are_one_line():
    """A closed port and an HTTP server (a dashboard's port) are refused within seconds (a closed
    port gave a traceback after 32 s, an HTTP port hung)."""
    import http.server
    import socket
    import threading

    from daskpty.execution.cluster import ClusterUnavailable, connect

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ClusterUnavailable, match="cannot connect to a dask scheduler at 127.0.0.1:"):
        connect(f"tcp://127.0.0.1:{closed}")
    assert time.monotonic() - start < 5
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(ClusterUnavailable, match="is an HTTP server .* not a dask scheduler"):
            connect(f"127.0.0.1:{server.server_address[1]}")
        assert time.monotonic() - start < 10
    finally:
        server.shutdown()
    with pytest.raises(ClusterUnavailable, match="bad scheduler address"):
        connect("tcp://:x")


def test_too_many_local_workers_are_refused_with_the_maximum():
    from daskpty.execution.cluster import check_worker_count

    cores = os.cpu_count() or 1
    check_worker_count(max(4 * cores, 8))
    with pytest.raises(ValueError, match=f"at most {max(4 * cores, 8)} .4 per core"):
        check_worker_count(1000)


def test_chunk_length_longer_than_the_data_is_the_data(client):
    """--chunk-length 100000 on a few hundred patterns was refused for memory it never needs."""
    ds = make_dataset(grid=6, seed=2)
    with pytest.warns(UserWarning, match="longer than the data set .36 patterns.; using one chunk of 36"):
        rec = daskpty.reconstruct(ds, epochs=2, client=client, chunk_length=100_000, check_data=False)
    same = daskpty.reconstruct(ds, epochs=2, client=client, chunk_length=36, check_data=False)
    assert rec.options["chunk_length"] == 36
    np.testing.assert_array_equal(rec.object, same.object)


@contextlib.contextmanager
def _records_of(name: str, level: int):
    """The records that reach logger ``name`` (set to ``level``) within the block, as a list."""
    import logging

    log, records = logging.getLogger(name), []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    keep, old = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(level)
    try:
        yield records
    finally:
        log.removeHandler(keep)
        log.setLevel(old)


def test_loss_noise_goes_to_info_and_other_errors_pass():
    """distributed's ERROR tracebacks after a handled loss are routed to INFO (hidden at
    distributed's WARNING level); unrelated errors are untouched."""
    import logging

    from daskpty.execution.watchdog import quiet_handled_losses

    log = logging.getLogger("distributed.worker")
    with _records_of("distributed.worker", logging.WARNING) as records:
        with quiet_handled_losses():
            log.error("failed during get data with %s -> %s", "tcp://a", "tcp://b", exc_info=(OSError, OSError(), None))
            log.error("Couldn't gather keys: %s", {"daskpty-round-1": "waiting"})  # dozens of lines a loss
            log.error("Compute Failed\nKey: %s\nException: %r", "k", "CancelledError('lost')")
            log.error("Compute Failed\nKey: %s\nException: %r", "k2", "ValueError('a real failure')")
            logging.getLogger("asyncio").error("Task exception was never retrieved",
                                               exc_info=(ValueError, ValueError("real"), None))
        log.error("failed during get data with %s -> %s", "tcp://a", "tcp://b")  # filter removed
    assert [r.getMessage()[:20] for r in records] == ["Compute Failed\nKey: ", "failed during get da"]
    assert "k2" in records[0].getMessage()


def test_a_loss_reported_at_info_keeps_its_line_and_loses_its_traceback():
    """distributed logs "Batched Comm Closed" at INFO with the CommClosedError's traceback when
    the scheduler dies (the CLI then printed a traceback above its one-line error): the line
    stays, the traceback goes; an INFO record with an unrelated exception keeps its traceback."""
    import logging

    from distributed.comm.core import CommClosedError

    from daskpty.execution.watchdog import quiet_handled_losses

    log = logging.getLogger("distributed.batched")
    with _records_of("distributed.batched", logging.INFO) as records:
        with quiet_handled_losses():
            log.info("Batched Comm Closed %r", "<TCP (closed)>", exc_info=(CommClosedError, CommClosedError(), None))
            log.info("something else", exc_info=(ValueError, ValueError("real"), None))
    assert [r.getMessage()[:19] for r in records] == ["Batched Comm Closed", "something else"]
    assert records[0].exc_info is None and records[0].levelno == logging.INFO
    assert records[1].exc_info is not None


def test_an_interrupt_before_a_sync_call_started_leaves_no_traceback():
    """Ctrl-C or SIGTERM reaching distributed's ``sync`` before the coroutine it waits for has
    started makes its ``cancel`` callback raise NameError on the loop thread, which tornado logs
    as a traceback (CI once saw ten lines after the one 'interrupted' line). Reproduced here with
    distributed's own ``sync``: the loop is kept busy while the main thread is interrupted."""
    import logging
    import threading

    from distributed.utils import LoopRunner, sync

    from daskpty.execution.watchdog import quiet_handled_losses

    runner = LoopRunner(asynchronous=False)
    runner.start()
    main = threading.get_ident()  # the signal goes to this thread, as the kernel's Ctrl-C may

    async def nothing():
        return None

    def interrupted_sync():
        busy, done = threading.Event(), threading.Event()
        runner.loop.add_callback(lambda: (busy.set(), time.sleep(0.5)))  # the loop is busy
        busy.wait(5)
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            sync(runner.loop, nothing)
        runner.loop.add_callback(done.set)  # after the callbacks sync left behind
        assert done.wait(5)

    try:
        # INFO on the logger, so the demoted record still shows here
        with _records_of("tornado.application", logging.INFO) as records, quiet_handled_losses():
            interrupted_sync()
        seen = [r for r in records if "sync.<locals>.cancel" in r.getMessage()]
        assert seen and all(r.levelno == logging.INFO and r.exc_info is None for r in seen)
        with _records_of("tornado.application", logging.INFO) as records:  # without the filter:
            interrupted_sync()                                           # an ERROR with its traceback
        assert any(r.levelno == logging.ERROR and r.exc_info for r in records)
    finally:
        runner.stop()


# --- the command line against an external scheduler and workers (real processes) -----------------

@pytest.fixture
def external_cluster():
    """``dask scheduler`` and one ``dask worker --nworkers 2`` process of 300 MiB workers (a node);
    yields (address, scheduler process, worker process); both are killed at the end."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [dask_process("scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", ":0")]
    procs.append(dask_process("worker", address, "--nworkers", "2", "--nthreads", "1", "--memory-limit", "300MiB",
                       "--no-dashboard"))
    try:
        with Client(address, timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
        yield address, procs[0], procs[1]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the process and the workers it spawned
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def _cli_run_until_checkpoint(tmp_path, address, env):
    """A ``daskpty reconstruct --scheduler`` subprocess, returned once its first checkpoint exists."""
    import subprocess
    import sys

    ds = make_dataset(grid=10, seed=7)
    # an explicit client: the current one may be another test's, whose workers were killed
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr", client=c)
    out = tmp_path / "r.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "daskpty", "reconstruct", str(tmp_path / "s.zarr"), "-o",
                             str(out), "--scheduler", address, "--epochs", "400", "--checkpoint-every", "2",
                             "--chunk-length", "25", "--quiet"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    deadline = time.monotonic() + 120
    while not (out / "zarr.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()
    return proc, out


def _ends_in_one_line(proc, out, expect: str, bound: float):
    start = time.monotonic()
    _, err = proc.communicate(timeout=bound + 60)
    took = time.monotonic() - start
    errors = [line for line in err.splitlines() if line.startswith("daskpty: error:")]
    assert proc.returncode == 2, err
    assert len(errors) == 1 and expect in errors[0], err
    assert "Traceback" not in err, err
    assert took < bound, (took, err)
    kept = int(errors[0].split(" of epoch ")[1].split()[0])
    assert daskpty.Reconstruction.from_zarr(out).epochs == kept  # the checkpoint named is intact
    return err


@pytest.mark.slow
def test_a_lost_node_ends_in_one_line_with_the_checkpoint(tmp_path, external_cluster):
    """The external ``dask worker`` process dies with its workers and none comes back: after the
    watchdog's wait, one line, exit 2, the checkpoint named in it intact."""
    address, _, node = external_cluster
    proc, out = _cli_run_until_checkpoint(tmp_path, address, {"DASKPTY_STALL_SECONDS": "8"})
    os.killpg(node.pid, signal.SIGKILL)
    err = _ends_in_one_line(proc, out, "was lost and none came back", bound=90)
    assert "is kept" in err


@pytest.mark.slow
def test_a_killed_scheduler_ends_in_one_line_with_the_checkpoint(tmp_path, external_cluster):
    """It gave KeyError: 'workers' from the restart path, exit 1."""
    address, scheduler, _ = external_cluster
    proc, out = _cli_run_until_checkpoint(tmp_path, address, {"DASKPTY_STALL_SECONDS": "30"})
    os.killpg(scheduler.pid, signal.SIGKILL)
    _ends_in_one_line(proc, out, f"the dask scheduler at {address} is gone", bound=90)


def _damaged_chunk(intensities, positions, payload):
    raise FileNotFoundError("intensities/c/3/0/0 is missing")


def test_an_error_of_a_chunk_task_is_not_taken_for_a_lost_worker(client):
    """Rounds restart after losses of the cluster (comms, cancelled tasks), never after an OSError
    a chunk task raised itself (a damaged store): that one reaches the caller unchanged, at once."""
    from daskpty.execution.data import prepare_data
    from daskpty.execution.rounds import map_reduce

    ds = make_dataset(grid=4, seed=1)
    data = prepare_data(client, ds.intensities, ds.positions, chunk_length=8, persist=False)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="intensities/c/3/0/0 is missing"):
        map_reduce(client, data, _damaged_chunk, None)
    assert time.monotonic() - start < 10


def _payload_sum_chunk(intensities, positions, payload):
    from daskpty.engines.partials import Partial

    return Partial(scalars={"sum": float(intensities.sum()) + float(payload[:4].sum())})


def _worker_pids(client, n: int, timeout: float = 60.0) -> list:
    """The process ids of ``n`` live workers: after a SIGKILL the scheduler may still list the
    dead worker for a moment (a run on it is refused), so ask again until ``n`` answer."""
    deadline = time.monotonic() + timeout
    while True:
        client.wait_for_workers(n, timeout=timeout)
        pids = list(client.run(os.getpid, on_error="ignore").values())
        if len(pids) >= n or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


@pytest.mark.slow
def test_a_worker_killed_while_a_round_payload_travels_costs_no_connect_timeout(process_client):
    """A worker SIGKILLed while a round's payload (40 MB) goes out: the round is run again at once
    and sums as an undisturbed one. A broadcast scatter, hit by the death during its replication,
    raised KeyError (the dead worker's address) or waited on the dead worker for 30 s and more."""
    import threading

    from daskpty.execution.data import prepare_data
    from daskpty.execution.rounds import map_reduce

    ds = make_dataset(grid=6, seed=3)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=9, persist=False)
    payload = np.ones(5_000_000)
    expected = float(np.asarray(ds.intensities).sum()) + 4.0 * data.n_chunks
    for trial in range(6):
        pid = _worker_pids(process_client, 2)[trial % 2]
        killer = threading.Timer(0.02 + 0.03 * trial, os.kill, (pid, signal.SIGKILL))
        start = time.monotonic()
        killer.start()
        total = map_reduce(process_client, data, _payload_sum_chunk, payload, timeout=60)
        killer.join()
        assert time.monotonic() - start < 15, trial
        assert total.scalars["sum"] == pytest.approx(expected, rel=1e-12), trial


def test_a_scatter_to_a_worker_that_does_not_answer_gives_up_within_its_bound(monkeypatch):
    """A round's payload scattered to a worker that takes no connection (stopped here; in a run,
    killed just as the scheduler picked it) waited out distributed's connect timeout (30 s; a
    killed external cluster's round took 30.5 s). ``scatter_within`` gives up within its bound,
    the round's retry goes to the workers there, and the late scatter's data are let go."""
    from daskpty.execution import scatter

    monkeypatch.setattr(scatter, "SCATTER_FLOOR_SECONDS", 1.0)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        pid = _worker_pids(c, 1)[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="did not end within 1 s"):
                scatter.scatter_within(c, np.ones(1000), hash=False)
            assert time.monotonic() - start < 5
        finally:
            os.kill(pid, signal.SIGCONT)
        held = lambda: c.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))  # noqa: E731
        deadline = time.monotonic() + 60
        while held() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held() == 0
        assert scatter.scatter_within(c, np.ones(10), hash=False).result().sum() == 10


def test_a_retried_scatter_goes_past_a_worker_that_does_not_answer(monkeypatch):
    """The epoch graph's start state is scattered with retries: the scheduler hands each scatter
    to the next worker, so with one of two workers not answering every scatter still lands, on
    the other, within a bound per try (it waited distributed's 30 s connect timeout, then ended
    the run with "could not restart epoch")."""
    from daskpty.execution import scatter

    monkeypatch.setattr(scatter, "SCATTER_FLOOR_SECONDS", 1.0)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        _worker_pids(c, 2)
        pid_of = c.run(os.getpid)
        stopped, live = sorted(pid_of)
        os.kill(pid_of[stopped], signal.SIGSTOP)
        try:
            start = time.monotonic()
            futures = [scatter.scatter_retrying(c, np.full(10, float(i)), hash=False) for i in range(4)]
            elapsed = time.monotonic() - start
            where = c.who_has(futures)
        finally:
            os.kill(pid_of[stopped], signal.SIGCONT)
        assert elapsed < 4 * 3, elapsed
        assert all(holders == (live,) for holders in where.values()), where
        assert [f.result().sum() for f in futures] == [10.0 * i for i in range(4)]


def test_a_scatters_bound_counts_the_arrays_inside_an_engines_carry():
    """dask's sizeof counts an epoch carry (or a round's payload) as a few bytes, which would
    give a large object the floor's 5 s however slow the network; the bound counts its arrays."""
    from types import SimpleNamespace

    from daskpty.execution import scatter
    from daskpty.execution.epoch_graph import EpochCarry

    carry = EpochCarry(SimpleNamespace(object=np.zeros((2, 1000, 2000), np.complex64), probe=np.zeros((1, 64, 64))))
    expected = scatter.SCATTER_FLOOR_SECONDS + (32_000_000 + 8 * 64 * 64) / scatter.SCATTER_SLOWEST_RATE
    assert scatter.scatter_seconds(carry) == pytest.approx(expected)
    assert scatter.scatter_seconds(np.zeros(10)) == pytest.approx(scatter.SCATTER_FLOOR_SECONDS, abs=1e-3)
