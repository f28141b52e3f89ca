"""Reconstruction on a real dask cluster: worker-count equivalence, ground truth, flat task count."""
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.execution.cluster import client_context, live_workers
from daskpty.metrics import nrmse, probe_error

from synthetic import make_dataset


@pytest.fixture(scope="module")
def threads_client():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        yield client


def _run(ds, client, epochs, **kw):
    return daskpty.reconstruct(ds, epochs=epochs, object=np.ones_like(ds.truth.object), client=client, **kw)


def _relative_difference(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
def test_n_workers_equal_one_worker():
    """1, 2 and 4 worker processes give the same object and probe (same chunks, same reduction tree)."""
    ds = make_dataset(grid=10, seed=5)
    results = {}
    for workers in (1, 2, 4):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
            results[workers] = _run(ds, client, epochs=4, rounds_per_epoch=2, chunk_length=16, split_every=3)
    for workers in (2, 4):
        assert _relative_difference(results[workers].object, results[1].object) <= 1e-5
        assert _relative_difference(results[workers].probe, results[1].probe) <= 1e-5
    # and the run did something
    assert _relative_difference(results[1].object, np.ones_like(results[1].object)) > 1e-2


@pytest.mark.parametrize("noise,modes,rounds,epochs,threshold", [
    ("gaussian", 1, 1, 40, 0.05),
    ("poisson", 1, 1, 60, 0.08),
    ("gaussian", 2, 4, 40, 0.06),
    ("poisson", 2, 4, 40, 0.08),
])
@pytest.mark.slow
def test_ground_truth_convergence(threads_client, noise, modes, rounds, epochs, threshold):
    """Poisson-noise data: object NRMSE falls in trend and reaches a documented threshold."""
    ds = make_dataset(grid=14, modes=modes, seed=11)
    errors = []

    def record(epoch, state, metrics):
        lit = state.illumination > 0.3 * state.illumination.max()
        errors.append(nrmse(state.object, ds.truth.object, mask=lit))

    rec = _run(ds, threads_client, epochs, noise=noise, probe_modes=modes, rounds_per_epoch=rounds, callback=record)
    assert errors[-1] < threshold
    assert errors[-1] < 0.5 * errors[0]
    thirds = np.array_split(np.array(errors), 3)
    assert thirds[2].mean() < thirds[1].mean() < thirds[0].mean()
    losses = [h["loss"] for h in rec.history]
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_probe_recovered_up_to_ambiguities(threads_client):
    ds = make_dataset(grid=14, seed=2)
    initial = daskpty.reconstruct(ds, epochs=0, object=np.ones_like(ds.truth.object), client=threads_client)
    rec = _run(ds, threads_client, 40, rounds_per_epoch=8)
    assert probe_error(rec.probe, ds.truth.probe) < 0.1
    assert probe_error(rec.probe, ds.truth.probe) < 0.5 * probe_error(initial.probe, ds.truth.probe)


@pytest.mark.slow
def test_scheduler_task_count_stays_flat(threads_client):
    """Lineage is cut every epoch: the scheduler holds no more tasks after 200 epochs than after 50."""
    ds = make_dataset(n=16, grid=6, step=3, seed=1)
    counts = []

    def count(epoch, state, metrics):
        if epoch % 50 == 0:  # released tasks are forgotten asynchronously: take the settled count
            samples = []
            for _ in range(20):
                samples.append(threads_client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)))
                time.sleep(0.05)
            counts.append(min(samples))

    daskpty.reconstruct(ds, epochs=200, object=np.ones_like(ds.truth.object), client=threads_client,
                        callback=count, chunk_length=9)
    assert len(counts) == 4
    # persisted data (4 chunks + 4 positions chunks), at most the next epoch's graph, which is
    # submitted before the callback runs (4 chunks, 1 round: 14 tasks with its summary), and the
    # finished epoch's state copies (one per worker) kept as restart points; 200 epochs of
    # lineage would be thousands.
    workers = len(live_workers(threads_client))
    assert max(counts) <= 2 * 4 + 14 + workers


def test_result_store_round_trip(tmp_path, threads_client):
    ds = make_dataset(grid=5, seed=4)
    rec = daskpty.reconstruct(ds, epochs=2, client=threads_client)
    path = rec.to_zarr(tmp_path / "rec.zarr")
    back = daskpty.Reconstruction.from_zarr(path)
    np.testing.assert_array_equal(back.object, rec.object)
    np.testing.assert_array_equal(back.probe, rec.probe)
    np.testing.assert_array_equal(back.positions, rec.positions)
    np.testing.assert_array_equal(back.origin, rec.origin)
    assert [h["loss"] for h in back.history] == [h["loss"] for h in rec.history]
    assert back.options["noise"] == "gaussian"
    with pytest.raises(FileExistsError):
        rec.to_zarr(path)
    # positions: object frame = data positions + origin, inside the object
    np.testing.assert_allclose(rec.positions, ds.positions + rec.origin)


def test_bad_arguments_give_clear_errors(threads_client):
    ds = make_dataset(grid=4)
    with pytest.raises(ValueError, match="engine"):
        daskpty.reconstruct(ds, engine="ePIE", client=threads_client)
    with pytest.raises(ValueError, match="rounds_per_epoch"):
        daskpty.reconstruct(ds, rounds_per_epoch=0, client=threads_client)
    with pytest.raises(TypeError, match="unknown option"):
        daskpty.reconstruct(ds, betta=0.5, client=threads_client)
    with pytest.raises(ValueError, match="outside the object"):
        daskpty.reconstruct(ds, object=np.ones((20, 20), np.complex64), client=threads_client)
    with pytest.raises(ValueError, match="probe shape"):
        daskpty.reconstruct(ds, probe=np.ones((8, 8), np.complex64), client=threads_client)


def test_embedded_default_cluster_starts_and_closes():
    ds = make_dataset(grid=4)
    with client_context(None, n_workers=1, processes=False, dashboard=False) as client:
        rec = daskpty.reconstruct(ds, epochs=1, client=client)
    assert np.isfinite(rec.object).all()


def test_ad_engine_through_the_public_api(threads_client):
    ds = make_dataset(grid=8, seed=6)
    rec = daskpty.reconstruct(ds, engine="ad", epochs=6, object=np.ones_like(ds.truth.object),
                              client=threads_client, rounds_per_epoch=2, optimizer="adam", lr=0.05)
    losses = [h["loss"] for h in rec.history]
    assert losses[-1] < losses[0]
    assert rec.options["optimizer"] == "adam" and rec.options["engine"] == "ad"
    with pytest.raises(TypeError, match="engine='ad' only"):
        daskpty.reconstruct(ds, engine="lsqml", optimizer="adam", client=threads_client)


def test_a_client_that_is_not_the_default_is_used():
    ds = make_dataset(grid=4, seed=8)
    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        client = Client(cluster, set_as_default=False)
        try:
            rec = daskpty.reconstruct(ds, epochs=2, client=client)
        finally:
            client.close()
    assert len(rec.history) == 2 and np.isfinite(rec.object).all()


@pytest.mark.slow
def test_progress_is_off_when_not_interactive_and_a_resumed_run_counts_on(tmp_path, threads_client, capsys):
    """progress=None (the default) prints nothing under pytest (stderr is no terminal); a resumed
    run with progress=True counts from the stored epoch ("epoch 3/4") and names the Poisson loss
    as a negative log-likelihood up to a constant; the history per key spans all four epochs."""
    ds = make_dataset(grid=6, seed=3)
    store = str(tmp_path / "rec.zarr")
    _run(ds, threads_client, 2, noise="poisson", checkpoint=store)
    assert "epoch" not in capsys.readouterr().err
    rec = _run(ds, threads_client, 4, noise="poisson", checkpoint=store, resume=store, progress=True)
    err = capsys.readouterr().err
    assert "epoch 3/4  loss (Poisson NLL + const) " in err, err
    assert "epoch 4/4  loss (Poisson NLL + const) " in err, err
    assert "epoch 1/" not in err and "epoch 2/" not in err
    arrays = rec.history_arrays()
    assert np.array_equal(arrays["epoch"], [1, 2, 3, 4])
    assert np.array_equal(arrays["loss"], [h["loss"] for h in rec.history])


def test_interactive_means_a_terminal_and_the_printer_redraws_there(tmp_path):
    """interactive(): a real pseudo-terminal is, a file is not; on the terminal the line is redrawn
    in place, in a file one line per reported epoch."""
    import os

    from daskpty.monitor.progress import ProgressPrinter, interactive, make_progress

    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as tty, open(tmp_path / "log", "w+") as log:
            assert interactive(tty) and not interactive(log)
            printer = make_progress(3, 10, stream=log, bar=False, loss="gaussian")
            assert isinstance(printer, ProgressPrinter)
            for epoch in (1, 2, 3):
                printer(epoch, None, {"loss": 1.5, "patterns_per_second": 10.0})
            log.seek(0)
            lines = log.read().splitlines()
            assert [ln.split("  ")[0] for ln in lines] == ["epoch 1/3", "epoch 3/3"]
            assert "loss (amplitude LSQ) 1.5" in lines[0]
            on_tty = ProgressPrinter(2, 10, stream=tty, start_epoch=1)
            on_tty(2, None, {"loss": 1.0, "patterns_per_second": 10.0})
            tty.flush()
            written = os.read(master, 4096).decode()
            assert written.startswith("\r") and "epoch 2/2" in written
    finally:
        os.close(master)


def test_tqdm_bar_counts_from_the_resumed_epoch(tmp_path):
    """With tqdm installed (optional), the bar starts at the resumed epoch and ends at the last."""
    pytest.importorskip("tqdm")
    from daskpty.monitor.progress import TqdmProgress, make_progress

    with open(tmp_path / "bar", "w+") as out:
        bar = make_progress(5, 10, start_epoch=3, stream=out, bar=True, loss="poisson")
        assert isinstance(bar, TqdmProgress) and bar.bar.n == 3
        bar(4, None, {"loss": -1e6, "patterns_per_second": 5.0})
        assert bar.bar.n == 4
        bar(5, None, {"loss": -1e6, "patterns_per_second": 5.0})
        out.seek(0)
        assert "Poisson NLL + const" in out.read()


def test_history_arrays_and_frame():
    """history_arrays(): one array per key over the epochs, NaN where an epoch lacks the key or
    holds None, object arrays for list values; history_frame(): a DataFrame indexed by epoch
    with pandas, else an ImportError naming pandas and history_arrays()."""
    history = [{"epoch": 1, "loss": 3.0, "exchanged": None},
               {"epoch": 2, "loss": 2.0, "exchanged": 5.0, "affine": [1.0, 0.0]},
               {"epoch": 3, "loss": 1.0, "position_start_epoch": 2}]
    rec = daskpty.Reconstruction(object=np.ones((4, 4), np.complex64), probe=np.ones((1, 2, 2), np.complex64),
                                 positions=np.zeros((1, 2)), origin=np.zeros(2), history=history)
    a = rec.history_arrays()
    assert list(a) == ["epoch", "loss", "exchanged", "affine", "position_start_epoch"]
    assert a["loss"].dtype == np.float64 and np.array_equal(a["loss"], [3.0, 2.0, 1.0])
    assert np.isnan(a["exchanged"][0]) and a["exchanged"][1] == 5.0 and np.isnan(a["exchanged"][2])
    assert np.isnan(a["position_start_epoch"][:2]).all() and a["position_start_epoch"][2] == 2
    assert a["affine"].dtype == object and a["affine"][1] == [1.0, 0.0] and a["affine"][0] is None
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs pandas.*history_arrays"):
            rec.history_frame()
    else:
        frame = rec.history_frame()
        assert list(frame.index) == [1, 2, 3] and list(frame["loss"]) == [3.0, 2.0, 1.0]
