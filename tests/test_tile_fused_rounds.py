"""Fused tile rounds (two tasks per worker and round, what stays on a worker kept there) give the
bits of split rounds (every step a task result), on two workers (each receives the other's round
result whole) and three (each receives its own pieces); a fused round that does not find its
state restarts the epoch on split rounds and ends with the same bits."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.engines import lsqml
from daskpty.engines.probe_model import ProbeModelOptions
from daskpty.execution import tile_epochs, tile_round_tasks
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from daskpty.execution.engine_registry import engine_spec
from daskpty.execution.tile_graph import TileGraph
from daskpty.faults import StaleRoundState
from synthetic import make_dataset

LSQMLAdapter = engine_spec("lsqml").adapter
OPTIONS = lsqml.LSQMLOptions(noise="poisson", momentum=0.5, normalize_every=2)
VARYING = ProbeModelOptions(opr_modes=2, fit_intensity=True, start_epoch=1)


def _run(client, ds, monkeypatch, fused: bool, model=None, picked: bool = False):
    """A tiled run on fused (or split) rounds, each worker receiving its own pieces (``picked``) or
    the others' whole round results; asserts every epoch ran as asked."""
    graphs = []
    row_bytes = {"piece_row_bytes": float("inf")} if picked else {}
    monkeypatch.setattr(tile_epochs, "TileGraph",
                        lambda *a, **k: TileGraph(*a, **{**k, "fused": fused, **row_bytes}))
    submit = TileGraph.submit
    monkeypatch.setattr(TileGraph, "submit",
                        lambda self, starts: graphs.append((self.fused, self.picked)) or submit(self, starts))
    with client.as_current():
        data = prepare_data(client, ds.intensities, ds.positions, chunk_length=24, persist=True, row_bands=True)
    adapter = LSQMLAdapter(OPTIONS, probe_model=model)
    start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    out = run_epochs(client, data, adapter, start, epochs=3, rounds_per_epoch=3, split_every=2, tiles=True)
    assert graphs == [(fused, picked)] * 3, graphs
    return out


def _assert_same(a, b):
    (sa, ha), (sb, hb) = a, b
    np.testing.assert_array_equal(sa.object, sb.object)
    np.testing.assert_array_equal(sa.probe, sb.probe)
    for i, local in sa.chunk_local.items() if sa.chunk_local else ():
        for name, value in local.items():
            np.testing.assert_array_equal(value, sb.chunk_local[i][name])
    assert [h["loss"] for h in ha] == [h["loss"] for h in hb]
    assert [h["exchanged_bytes_per_round"] for h in ha] == [h["exchanged_bytes_per_round"] for h in hb]


@pytest.mark.parametrize("model", [None, VARYING], ids=["plain", "OPR"])
def test_fused_tile_rounds_give_the_split_rounds_bits_on_two_workers(client, monkeypatch, caplog, model):
    ds = make_dataset(grid=10, seed=4)
    fused = _run(client, ds, monkeypatch, True, model)
    assert "restarting" not in caplog.text
    _assert_same(fused, _run(client, ds, monkeypatch, False, model))
    from daskpty.metrics import nrmse

    assert nrmse(fused[0].object, ds.truth.object) < nrmse(np.ones_like(ds.truth.object), ds.truth.object)


def test_fused_tile_rounds_give_the_split_rounds_bits_on_three_workers(three_workers, monkeypatch):
    ds = make_dataset(grid=12, seed=3)
    split = _run(three_workers, ds, monkeypatch, False)
    for picked in (False, True):  # whole round results (this object's pieces are small), own pieces
        _assert_same(_run(three_workers, ds, monkeypatch, True, picked=picked), split)


def test_a_fused_round_that_misses_its_state_restarts_on_split_rounds(client, monkeypatch):
    ds = make_dataset(grid=10, seed=4)
    split = _run(client, ds, monkeypatch, False)
    kept = tile_round_tasks._kept
    misses = []

    def forgetful(token, w, tag, round_index, what):
        if not misses and round_index == 1:  # once: as if the task ran on a worker without its state
            misses.append(tag)
            raise StaleRoundState("a stand-in for a task run away from its state")
        return kept(token, w, tag, round_index, what)

    monkeypatch.setattr(tile_round_tasks, "_kept", forgetful)
    made = []
    monkeypatch.setattr(tile_epochs, "TileGraph",
                        lambda *a, **k: made.append(k["fused"]) or TileGraph(*a, **k))
    with client.as_current():
        data = prepare_data(client, ds.intensities, ds.positions, chunk_length=24, persist=True, row_bands=True)
    adapter = LSQMLAdapter(OPTIONS)
    start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    restarted = run_epochs(client, data, adapter, start, epochs=3, rounds_per_epoch=3, split_every=2, tiles=True)
    assert misses and made == [True, False], made
    _assert_same(restarted, split)
