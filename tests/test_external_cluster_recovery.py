"""An external cluster (``dask scheduler`` and ``dask worker`` with nannies, real processes) whose
worker processes are SIGKILLed while ``daskpty reconstruct --scheduler ... --persist yes`` runs:
the data held in the workers' memory are read again from the store onto the workers the nannies
start, and the run goes on within seconds, to the result of an undisturbed run. It stalled for
the watchdog's whole wait (300 s by default) on every try; with AD's CG optimiser (rounds run
from the client, persisted data) it never went on."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from dask_processes import dask_process, free_port
from synthetic import make_dataset

#: the watchdog's floor for these runs: a stall waits this long, a recovery must not
STALL_SECONDS = 60
#: a run that takes longer than this has stalled (an undisturbed one takes about 10 s)
RUN_SECONDS = 150


@pytest.fixture
def nanny_cluster():
    """A scheduler and one ``dask worker --nworkers 2`` (two nanny-managed worker processes);
    yields the scheduler's address; everything is killed at the end."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [dask_process("scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", ":0"),
             dask_process("worker", address, "--nworkers", "2", "--nthreads", "1", "--memory-limit", "500MiB",
                   "--no-dashboard")]
    try:
        with Client(address, timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the process and the workers it spawned
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def _reconstruct(store, out, address, engine: list, kill_after_checkpoint: bool):
    """``daskpty reconstruct --scheduler --persist yes``; with ``kill_after_checkpoint``, every
    worker process is SIGKILLed once the first checkpoint is written. Returns (stderr, killed)."""
    with Client(address, timeout=30, set_as_default=False) as c:
        pids = list(c.run(os.getpid).values())
    proc = subprocess.Popen([sys.executable, "-m", "daskpty", "reconstruct", str(store), "-o", str(out),
                             "--scheduler", address, "--persist", "yes", "--epochs", "60",
                             "--checkpoint-every", "2", "--chunk-length", "32", "--quiet", *engine],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DASKPTY_STALL_SECONDS": str(STALL_SECONDS)})
    killed = False
    if kill_after_checkpoint:
        deadline = time.monotonic() + 120
        while not (out / "zarr.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed = True
    try:
        _, err = proc.communicate(timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run did not end within {RUN_SECONDS} s: {err}")
    assert proc.returncode == 0, err
    return err, killed


def _epoch_seconds(out) -> list:
    with open(out / "zarr.json") as f:
        return [h["seconds"] for h in json.load(f)["attributes"]["history"]]


@pytest.mark.slow
@pytest.mark.parametrize("engine", [[], ["--engine", "ad", "--optimizer", "cg"]], ids=["lsqml", "ad-cg"])
def test_killed_workers_with_persisted_data_recover_in_seconds(tmp_path, nanny_cluster, engine):
    ds = make_dataset(grid=16, seed=7)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr", client=c)
    _reconstruct(tmp_path / "s.zarr", tmp_path / "u.zarr", nanny_cluster, engine, kill_after_checkpoint=False)
    err, killed = _reconstruct(tmp_path / "s.zarr", tmp_path / "k.zarr", nanny_cluster, engine,
                               kill_after_checkpoint=True)
    assert killed, "the run ended before its workers were killed"
    assert "restarting" in err  # the loss was seen and handled (an epoch, or a round from the client)
    slowest = max(_epoch_seconds(tmp_path / "k.zarr"))  # the epoch that waited for the recovery
    assert slowest < 20, (slowest, err)  # a stall waits STALL_SECONDS (60 s) at least
    undisturbed = daskpty.Reconstruction.from_zarr(tmp_path / "u.zarr")
    recovered = daskpty.Reconstruction.from_zarr(tmp_path / "k.zarr")
    assert recovered.epochs == undisturbed.epochs == 60
    np.testing.assert_array_equal(recovered.object, undisturbed.object)
    np.testing.assert_array_equal(recovered.probe, undisturbed.probe)
