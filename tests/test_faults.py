"""Faults with real worker processes: every worker killed at once mid-run, with data that can be
read again (a Zarr store: the run ends bit-identically) and data that cannot (in-memory arrays:
the run ends in one line, in bounded time, instead of hanging)."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.execution.watchdog import ReconstructionStalled, Watchdog
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
