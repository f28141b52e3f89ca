"""One round per epoch once the probe is seen to vary (daskpty.execution.round_switch)."""
from __future__ import annotations

import numpy as np
import pytest

import daskpty
from daskpty.engines import probe_model as pm
from daskpty.execution.adapter import adapter_class
from daskpty.execution.round_switch import OneRoundOnceVarying, may_switch
from daskpty.engines.specs import engine_spec
from daskpty.metrics import nrmse_vs_truth
from daskpty.simulate.variable_probe import simulate_variable_probe

#: the weights fit from epoch 4; 24 × 24 patterns of 32² take R = 3 rounds when "auto"
OPR = dict(opr_modes=2, probe_model={"start_epoch": 4})


def _run(ds, client, **kw):
    kw.setdefault("chunk_length", 48)
    return daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), client=client,
                               check_data=False, progress=False, **kw)


def _rounds(rec):
    return [h["rounds"] for h in rec.history]


@pytest.fixture(scope="module")
def drifting():
    return simulate_variable_probe(grid=24)


def _shared(rms):
    return {"opr_eigen_rms": 2 * rms, "opr_eigen_shared_rms": rms}


def test_the_watch_switches_once_on_shared_weights_that_hold():
    seen = []
    watch = OneRoundOnceVarying(lambda epoch, rms: seen.append((epoch, rms)), threshold=0.02, after=3)
    assert not watch(1, {"loss": 1.0})                      # no weights fitted yet
    assert not watch(2, _shared(0.03))                      # too early: the 1st fitting epoch
    assert not watch(3, _shared(0.10))
    assert not watch(4, _shared(0.05))                      # the 3rd, but falling
    assert not watch(5, _shared(0.019))                     # below the threshold
    assert watch(6, _shared(0.06))
    assert not watch(7, _shared(0.5))                       # once
    assert seen == [(6, 0.06)] and watch.switched_after == 6


def test_a_resumed_watch_counts_the_epochs_behind_it():
    behind = [{"loss": 1.0}, _shared(0.06), _shared(0.07)]
    resumed = OneRoundOnceVarying(threshold=0.05, after=3, history=behind)
    assert resumed(4, _shared(0.08))
    fresh = OneRoundOnceVarying(threshold=0.05, after=3)
    assert not fresh(4, _shared(0.08))


def test_only_auto_minibatch_rounds_with_eigen_probes_watch():
    def adapter(**model):
        return adapter_class(engine_spec("lsqml"))(probe_model=pm.ProbeModelOptions(**model) if model else None)

    assert may_switch(adapter(opr_modes=2), 3, auto=True)
    assert not may_switch(adapter(opr_modes=2), 3, auto=False)     # rounds given: kept
    assert not may_switch(adapter(opr_modes=2), 1, auto=True)      # one round already
    assert not may_switch(adapter(opr_modes=1), 3, auto=True)      # no eigen-probes
    assert not may_switch(adapter(fit_intensity=True), 3, auto=True)
    assert not may_switch(adapter(), 3, auto=True)


def test_a_watching_run_flattens_its_intensity_factors_only_after_the_watch():
    """While a run watches for the switch to one round per epoch its intensity factors keep
    their smooth part over the scan (a run that switches must not have left a drifting
    brightness to the object); after the watch, at minibatch rounds, they are flattened."""
    model = pm.ProbeModelOptions(opr_modes=3, fit_intensity=True)
    watching = model.for_rounds(3, watching=True)
    assert watching.flat_brightness and watching.flat_from_epoch == model.start_epoch + pm.VARYING_AFTER
    assert model.for_rounds(3).flat_from_epoch is None                     # rounds given: from the start
    assert not model.for_rounds(1, watching=True).flat_brightness          # switched: off
    assert pm.ProbeModelOptions(opr_modes=3, flat_from_epoch=4).for_rounds(3, watching=True).flat_from_epoch == 4
    rng = np.random.default_rng(0)
    positions = rng.uniform(0, 160, (400, 2))
    smooth = {"intensity_scale": (1.0 + 0.004 * positions[:, :1])}           # a brightness ramp over the scan
    first = watching.flat_from_epoch
    kept = pm.flatten_model_local(smooth, positions, watching, 32, epoch=first - 1)
    np.testing.assert_array_equal(kept["intensity_scale"], smooth["intensity_scale"])
    flat = pm.flatten_model_local(smooth, positions, watching, 32, epoch=first)["intensity_scale"]
    assert np.std(np.log(flat)) < 0.25 * np.std(np.log(smooth["intensity_scale"]))


def test_eigen_weight_sums_skip_the_mean_probes_weight():
    w = np.array([[1.1, 0.2, -0.1], [0.9, -0.3, 0.0]])
    sums = pm.eigen_weight_sums({"opr_weights": w})
    assert sums["opr_eigen_terms"] == 4
    assert sums["opr_eigen_sq"] == pytest.approx(0.04 + 0.01 + 0.09)
    assert pm.eigen_weight_sums({"opr_weights": w[:, :1]}) == {}
    assert pm.eigen_weight_sums({"intensity_scale": np.ones((2, 1))}) == {}


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
def test_a_drifting_probe_goes_on_with_one_round_and_ends_closer_to_the_truth(client, drifting, engine):
    """The weights' rms crosses the threshold in the first epochs that fit them; the run then
    goes on with one round per epoch and ends nearer the truth than the same run kept at the
    rounds "auto" chose (the stall of minibatch OPR on a probe that varies)."""
    auto = _run(drifting, client, engine=engine, epochs=24, **OPR)
    rounds = _rounds(auto)
    switch = rounds.index(1)
    assert rounds[:switch] == [3] * switch and set(rounds[switch:]) == {1}
    first_fit = OPR["probe_model"]["start_epoch"]
    assert first_fit + pm.VARYING_AFTER <= switch <= first_fit + pm.VARYING_AFTER + 2
    assert auto.history[switch - 1]["opr_eigen_shared_rms"] >= pm.VARYING_SHARED_RMS
    assert auto.history[switch - 1]["rounds_next"] == 1
    assert not any(h.get("opr_eigen_dropped") for h in auto.history)   # the data support them
    assert auto.options["rounds_per_epoch"] == 1
    assert auto.options["one_round_from_epoch"] == switch + 1           # counted from 1, as printed
    kept = _run(drifting, client, engine=engine, epochs=24, rounds_per_epoch=3, **OPR)
    assert set(_rounds(kept)) == {3} and "one_round_from_epoch" not in kept.options
    e_auto = nrmse_vs_truth(auto.object, auto.positions, auto.illumination, drifting.truth)
    e_kept = nrmse_vs_truth(kept.object, kept.positions, kept.illumination, drifting.truth)
    print(f"{engine}: NRMSE switched {e_auto:.4f}, kept at R = 3 {e_kept:.4f}")
    assert e_auto < 0.9 * e_kept


@pytest.mark.parametrize("photons", [1e6, 1e4])
def test_a_constant_probe_keeps_its_minibatch_rounds(client, photons):
    """The weights of a constant beam first take up what the young object leaves, then fall
    back; at a low dose they fit noise, which neighbouring patterns do not share."""
    steady = simulate_variable_probe(grid=24, constant=True, photons=photons)
    rec = _run(steady, client, epochs=22, opr_modes=2, probe_model={"start_epoch": 10})
    assert set(_rounds(rec)) == {3}
    shared = np.array([h["opr_eigen_shared_rms"] for h in rec.history if "opr_eigen_shared_rms" in h])
    late = shared[pm.VARYING_AFTER - 1:]
    assert len(late) >= 4 and (np.all(np.diff(shared[pm.VARYING_AFTER - 2:]) < 0) or late.max() < pm.VARYING_SHARED_RMS)
    assert rec.options["rounds_per_epoch"] == 3 and rec.options["one_round_once_varying"] is True


@pytest.mark.parametrize("first", [7, 14], ids=["before the switch", "after it"])
def test_resume_across_the_switch_is_bit_identical(client, drifting, tmp_path, first):
    straight = _run(drifting, client, epochs=16, **OPR)
    switch = straight.options["one_round_from_epoch"]
    assert (first < switch) == (first == 7)
    _run(drifting, client, epochs=first, checkpoint=tmp_path / "c.zarr", **OPR)
    resumed = _run(drifting, client, epochs=16, resume=tmp_path / "c.zarr", **OPR)
    assert _rounds(resumed) == _rounds(straight)
    np.testing.assert_array_equal(resumed.object, straight.object)
    np.testing.assert_array_equal(resumed.probe_weights, straight.probe_weights)
    assert resumed.options["one_round_from_epoch"] == switch


def test_tiles_switch_where_the_replicas_do(client, drifting):
    """The switch restarts the epochs on the tiles' layout too (the object in row tiles, one per
    worker, whose chunks are row bands) and comes at the replicas' epoch."""
    replicas = _run(drifting, client, epochs=13, tiles=False, **OPR)
    tiles = _run(drifting, client, epochs=13, tiles=True, **OPR)
    assert 1 in _rounds(replicas) and _rounds(tiles) == _rounds(replicas)
    assert tiles.options["one_round_from_epoch"] == replicas.options["one_round_from_epoch"]


def test_the_switch_is_said_once_after_its_epochs_progress_line(client, drifting, capsys):
    rec = daskpty.reconstruct(daskpty.from_arrays(drifting.intensities, drifting.positions), client=client,
                              check_data=False, progress=True, chunk_length=48, epochs=12, **OPR)
    switch = rec.options["one_round_from_epoch"]
    err = capsys.readouterr().err
    said = f"one round per epoch from epoch {switch} on"
    assert err.count(said) == 1
    assert err.index("epoch 1/12") < err.index(said) < err.index("epoch 12/12")
    if (switch - 1) % 10 == 0:   # (off a terminal the progress line comes every 10 epochs)
        assert err.index(f"epoch {switch - 1}/12") < err.index(said)
