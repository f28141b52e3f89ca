"""A tiled run whose workers die while its tiles are being sent to them (all workers lost, then
coming back one by one): the start of the epoch is tried again on the workers there are then,
and the result is the bits of an undisturbed run. The scatter to a worker that had just died
ended the run with a ``CommClosedError`` or ``KeyError: 'tcp://…'`` traceback."""
from __future__ import annotations

import numpy as np
import psutil
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.execution.tile_graph import TileGraph
from synthetic import make_dataset

pytestmark = pytest.mark.slow


def _kill_worker_processes() -> int:
    """SIGKILL every worker process of this test's cluster (their nannies start new ones)."""
    killed = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                child.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def _tiled(client, ds, epochs=4):
    return daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), "lsqml", epochs, client=client,
                               tiles=True, rounds_per_epoch=2, chunk_length=25, progress=False,
                               probe=ds.truth.probe.copy())


def test_workers_dying_while_the_tiles_are_sent_restart_the_start(monkeypatch):
    ds = make_dataset(grid=10, seed=5)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        undisturbed = _tiled(client, ds)
        scatter = TileGraph.scatter_tiles
        calls = []

        def dying_scatter(self, state):
            calls.append(self.workers)
            if len(calls) == 1:  # the workers the layout names die just before their tiles go out
                assert _kill_worker_processes() == 2
            return scatter(self, state)

        monkeypatch.setattr(TileGraph, "scatter_tiles", dying_scatter)
        disturbed = _tiled(client, ds)
    assert len(calls) >= 2, "the start was not tried again"
    assert disturbed.epochs == undisturbed.epochs == 4
    np.testing.assert_array_equal(disturbed.object, undisturbed.object)
    np.testing.assert_array_equal(disturbed.probe, undisturbed.probe)


def test_a_tile_sent_to_a_worker_that_does_not_answer_gives_up_within_its_bound(monkeypatch):
    """A tile scattered to a worker that takes no connection (stopped here; in a run, killed just
    before its tile goes out, not yet known dead) waited for distributed's connect timeout (30 s)
    before the tile loop could try again; it gives up within the scatter's bound."""
    import os
    import signal
    import time

    from daskpty.engines import lsqml
    from daskpty.execution import scatter
    from daskpty.execution.data import prepare_data
    from daskpty.execution.engine_registry import engine_spec

    monkeypatch.setattr(scatter, "SCATTER_FLOOR_SECONDS", 1.0)
    ds = make_dataset(grid=10, seed=5)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        data = prepare_data(client, ds.intensities, ds.positions, chunk_length=25, persist=True, row_bands=True)
        adapter = engine_spec("lsqml").adapter(lsqml.LSQMLOptions())
        state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
        graph = TileGraph(client, data, adapter, ds.truth.object.shape[-2])
        assert len(graph.workers) == 2
        stopped = graph.workers[1]
        pid = client.run(os.getpid, workers=[stopped])[stopped]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                graph.scatter_tiles(state)
            assert time.monotonic() - start < 8
        finally:
            os.kill(pid, signal.SIGCONT)
        graph.close()
