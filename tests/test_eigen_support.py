"""Eigen-probes the data do not support are dropped (``drop_unsupported_eigen``).

At the sixth epoch that fits OPR's eigen-probe weights, a run whose weights' shared rms (the part
neighbouring patterns share) is below ``EIGEN_SUPPORT_RMS`` drops its eigen-probes: on a constant
beam the weights would only take up object structure and noise (the ideal small preset, K = 2
with intensity factors: 1.05-1.06x the plain run's NRMSE at 60 epochs on seeds 5 and 6 with
them kept). A drifting beam keeps them (tests/test_round_switch.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import daskpty
from daskpty.engines import probe_model as pm


def _state(epoch, shared_rms, terms=100.0):
    return SimpleNamespace(epoch=epoch, eigen_probes=np.ones((1, 4, 4), np.complex64),
                           eigen_lag_sums=np.array([shared_rms ** 2 * terms, terms]))


def test_the_rule_looks_once_at_the_sixth_fitting_epoch():
    model = pm.ProbeModelOptions(opr_modes=2, start_epoch=15)
    sixth = 15 + pm.VARYING_AFTER - 1
    low, high = 0.5 * pm.EIGEN_SUPPORT_RMS, 2 * pm.EIGEN_SUPPORT_RMS
    assert pm.eigen_unsupported(_state(sixth, low), model)
    assert not pm.eigen_unsupported(_state(sixth, high), model)
    assert not any(pm.eigen_unsupported(_state(e, low), model) for e in (sixth - 1, sixth + 1, sixth + 10))
    assert not pm.eigen_unsupported(_state(sixth, low), pm.ProbeModelOptions(opr_modes=2, drop_unsupported_eigen=False))
    assert not pm.eigen_unsupported(SimpleNamespace(epoch=sixth, eigen_probes=np.ones(1), eigen_lag_sums=None), model)


def test_the_shared_sums_add_up_over_the_rounds():
    sums = None
    for lag, terms in ((0.2, 10.0), (0.1, 5.0)):
        sums = pm.add_eigen_lag_sums(sums, {"opr_eigen_lag": lag, "opr_eigen_lag_terms": terms, "loss": 1.0})
    np.testing.assert_allclose(sums, [0.3, 15.0])
    assert pm.add_eigen_lag_sums(sums, {"loss": 1.0}) is sums


@pytest.fixture(scope="module")
def ideal(tmp_path_factory):
    """The ``simulate`` small preset (576 × 64², exact positions, constant beam, 10⁶ photons)."""
    return daskpty.simulate(tmp_path_factory.mktemp("ideal") / "d.zarr", preset="small", seed=5, n_workers=1)


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        yield c


@pytest.mark.slow
def test_a_constant_beams_eigen_probes_are_dropped_and_said_once(ideal, client, capsys):
    rec = daskpty.reconstruct(ideal.path, epochs=23, client=client, opr_modes=2, fit_intensity=True, progress=True)
    sixth = 15 + pm.VARYING_AFTER                      # the epoch's number, counted from 1
    dropped = [h["epoch"] for h in rec.history if h.get("opr_eigen_dropped")]
    assert dropped == [sixth, sixth + 1, sixth + 2]
    assert rec.history[sixth - 1]["opr_eigen_shared_rms"] < pm.EIGEN_SUPPORT_RMS
    assert np.all(rec.probe_weights[:, 1:] == 0)       # every pattern: its brightness times the mean probe
    assert np.ptp(rec.probe_weights[:, 0]) > 0         # (the brightness is still fitted)
    err = capsys.readouterr().err
    assert err.count("eigen-probes are dropped") == 1 and f"dropped from epoch {sixth + 1} on" in err
    kept = daskpty.reconstruct(ideal.path, epochs=23, client=client, opr_modes=2, fit_intensity=True,
                               probe_model={"drop_unsupported_eigen": False}, progress=False)
    assert not any(h.get("opr_eigen_dropped") for h in kept.history)
    assert np.abs(kept.probe_weights[:, 1:]).max() > 0


@pytest.mark.slow
def test_tiles_drop_them_at_the_replicas_epoch(ideal, client):
    """Each row tile applies the round's whole scalars, so every tile decides alike."""
    rec = daskpty.reconstruct(ideal.path, epochs=15 + pm.VARYING_AFTER, client=client, opr_modes=2,
                              fit_intensity=True, tiles=True, progress=False)
    assert rec.options["tiles"] is True
    assert [h["epoch"] for h in rec.history if h.get("opr_eigen_dropped")] == [15 + pm.VARYING_AFTER]
    assert np.all(np.asarray(rec.probe_weights)[:, 1:] == 0)


@pytest.mark.slow
def test_a_run_resumed_before_the_drop_ends_bit_identical(ideal, client, tmp_path):
    """The decision comes from the epoch's number and its own rounds: a resumed run makes it
    at the same epoch."""
    epochs = 15 + pm.VARYING_AFTER + 1
    straight = daskpty.reconstruct(ideal.path, epochs=epochs, client=client, opr_modes=2, progress=False)
    daskpty.reconstruct(ideal.path, epochs=18, client=client, opr_modes=2, progress=False,
                        checkpoint=tmp_path / "c.zarr")
    resumed = daskpty.reconstruct(ideal.path, epochs=epochs, client=client, opr_modes=2, progress=False,
                                  resume=tmp_path / "c.zarr")
    assert straight.history[15 + pm.VARYING_AFTER - 1].get("opr_eigen_dropped")
    assert [h.get("opr_eigen_dropped", False) for h in resumed.history] == \
        [h.get("opr_eigen_dropped", False) for h in straight.history]
    np.testing.assert_array_equal(np.asarray(resumed.object), np.asarray(straight.object))
    np.testing.assert_array_equal(np.asarray(resumed.probe_weights), np.asarray(straight.probe_weights))
