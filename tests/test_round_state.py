"""A fused epoch graph keeps each worker's copy of the state in that worker's memory between its
round tasks, so those tasks must run there: a worker paused at its memory limit (real memory,
real worker processes) while its round task finishes must not send the next round task to the
other worker, where it found no state and the epoch was restarted with every worker alive."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster, get_worker

from daskpty.engines import lsqml
from daskpty.execution.cluster import live_workers
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from daskpty.execution.adapter import chunk as lsqml_chunk
from daskpty.execution.engine_registry import engine_spec

from synthetic import make_dataset

LSQMLAdapter = engine_spec("lsqml").adapter

MEMORY_LIMIT = 1024 * 2**20


def _pause_this_worker(worker, seconds: float) -> None:
    """Hold memory until the worker's memory monitor pauses it (dask pauses at 80 % of the limit),
    and free it ``seconds`` later (the monitor resumes the worker)."""
    import psutil
    from distributed.core import Status

    rss = psutil.Process().memory_info().rss
    hog = np.ones(max(int(0.88 * MEMORY_LIMIT) - rss, 0), dtype=np.uint8)
    deadline = time.monotonic() + 10
    while worker.status != Status.paused and time.monotonic() < deadline:
        time.sleep(0.02)
    worker.daskpty_test_paused = worker.status == Status.paused
    threading.Timer(seconds, hog.resize, (0,), {"refcheck": False}).start()


def pausing_chunk(intensities, positions, payload, local=None):
    """LSQML's chunk step; once asked to (``daskpty_test_pause``), it pauses its worker first."""
    worker = get_worker()
    if getattr(worker, "daskpty_test_pause", False):
        worker.daskpty_test_pause = False
        _pause_this_worker(worker, 1.5)
    return lsqml_chunk(intensities, positions, payload, local)


class PausingAdapter(LSQMLAdapter):
    chunk_function = staticmethod(pausing_chunk)


def _ask(dask_worker=None):
    dask_worker.daskpty_test_pause = True


def _paused(dask_worker=None):
    return getattr(dask_worker, "daskpty_test_paused", False)


@pytest.fixture(scope="module")
def limited_workers():
    import cloudpickle

    import test_round_state

    cloudpickle.register_pickle_by_value(test_round_state)  # the workers need not import tests/
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=MEMORY_LIMIT) as cluster, Client(cluster) as client:
        yield client
    cloudpickle.unregister_pickle_by_value(test_round_state)


@pytest.mark.slow
def test_a_paused_worker_keeps_its_round_tasks(limited_workers, caplog):
    client = limited_workers
    ds = make_dataset(grid=10, seed=3)
    data = prepare_data(client, ds.intensities, ds.positions, chunk_length=25, persist=True)
    adapter = PausingAdapter(lsqml.LSQMLOptions(noise="poisson"))

    def run(callbacks=()):
        state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
        return run_epochs(client, data, adapter, state, epochs=6, rounds_per_epoch=3, callbacks=callbacks)

    undisturbed, _ = run()
    worker = sorted(live_workers(client))[0]

    def pause_after_epoch_2(epoch, state, metrics):
        if epoch == 2:
            client.run(_ask, workers=[worker])

    pause_after_epoch_2.takes_epoch_state = True
    with caplog.at_level(logging.WARNING, logger="daskpty"):
        paused, history = run([pause_after_epoch_2])
    assert client.run(_paused, workers=[worker])[worker], "the worker was not paused"
    assert "restarting epoch" not in caplog.text
    assert len(history) == 6
    np.testing.assert_array_equal(paused.object, undisturbed.object)
    np.testing.assert_array_equal(paused.probe, undisturbed.probe)


@pytest.mark.slow
def test_a_lost_worker_restarts_the_epoch_at_once(limited_workers, caplog, monkeypatch):
    """One worker process SIGKILLed between epochs (its nanny starts a new one): the fused tasks
    pinned to it are run elsewhere, find no state and restart the epoch within seconds (they
    waited for the watchdog's whole floor), to the result of an undisturbed run."""
    import os
    import signal

    monkeypatch.setenv("DASKPTY_STALL_SECONDS", "60")
    client = limited_workers
    ds = make_dataset(grid=10, seed=5)
    data = prepare_data(client, ds.intensities, ds.positions, chunk_length=25, persist=True)
    adapter = LSQMLAdapter(lsqml.LSQMLOptions(noise="poisson"))

    def run(callbacks=()):
        state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
        return run_epochs(client, data, adapter, state, epochs=6, rounds_per_epoch=3, callbacks=callbacks)

    undisturbed, _ = run()
    worker, pid = sorted(client.run(os.getpid).items())[1]
    killed = []

    def kill_after_epoch_2(epoch, state, metrics):
        if epoch == 2 and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(worker)

    kill_after_epoch_2.takes_epoch_state = True
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="daskpty"):
        recovered, history = run([kill_after_epoch_2])
    took = time.monotonic() - start
    assert killed and "restarting epoch" in caplog.text  # the loss was seen
    assert took < 30, (took, caplog.text)  # a stall waits 60 s at least
    assert len(history) == 6
    np.testing.assert_array_equal(recovered.object, undisturbed.object)
    np.testing.assert_array_equal(recovered.probe, undisturbed.probe)
