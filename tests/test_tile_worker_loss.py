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
