"""The PIE family (rPIE, ePIE) in minibatch rounds: the paper's update for one pattern, ground truth
through ``reconstruct``, 2 workers = 1 worker, bit-identical resume, and features it refuses."""
from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.engines import pie
from daskpty.engines.lsqml import LSQMLState
from daskpty.metrics import nrmse
from daskpty.physics import fft2, ifft2
from daskpty.physics.shifts import shift_probe, shift_ramps, split_positions

from synthetic import make_dataset


@pytest.fixture(scope="module")
def threads_client():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        yield client


def _maiden_rpie(obj, probe, y, position, alpha, probe_alpha):
    """Maiden, Johnson & Li (2017), table 1, for one pattern, written out with NumPy (one mode)."""
    n = probe.shape[-1]
    corner, fraction = split_positions(position[None], n)
    (r, c), p = corner[0], shift_probe(probe, shift_ramps(fraction, n))[0, 0]
    o = obj[r:r + n, c:c + n]
    far = fft2(p * o)
    corrected = far * np.sqrt(y) / np.sqrt(np.abs(far) ** 2 + 1e-6)
    chi = ifft2(corrected) - p * o
    new_obj = obj.copy()
    new_obj[r:r + n, c:c + n] += np.conj(p) * chi / ((1 - alpha) * np.abs(p) ** 2 + alpha * (np.abs(p) ** 2).max())
    dp = np.conj(o) * chi / ((1 - probe_alpha) * np.abs(o) ** 2 + probe_alpha * (np.abs(o) ** 2).max())
    # the probe's update is shifted back onto the unshifted probe (adjoint of the sub-pixel shift)
    dp = ifft2(fft2(dp) * np.conj(shift_ramps(fraction, n)[0]))
    return new_obj, probe[0] + dp


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_one_pattern_per_round_is_maidens_rpie(alpha):
    ds = make_dataset(n=16, grid=3, step=5.0, seed=3)
    rng = np.random.default_rng(0)
    obj = (ds.truth.object * np.exp(0.3j * rng.normal(size=ds.truth.object.shape))).astype(np.complex64)
    probe = (ds.truth.probe * 0.8).astype(np.complex64)
    options = pie.PIEOptions(alpha=alpha, probe_alpha=alpha, probe_start_epoch=0)
    j = 4
    y = np.fft.ifftshift(ds.intensities[j:j + 1], axes=(-2, -1))
    part = pie.chunk_step(obj, probe, y, ds.positions[j:j + 1], options=options)
    state = pie.apply(LSQMLState(object=obj.copy(), probe=probe.copy()), part, options)
    ref_obj, ref_probe = _maiden_rpie(obj, probe, y[0], ds.positions[j], alpha, alpha)
    np.testing.assert_allclose(state.object, ref_obj, rtol=0, atol=2e-5 * np.abs(ref_obj).max())
    np.testing.assert_allclose(state.probe[0], ref_probe, rtol=0, atol=2e-5 * np.abs(ref_probe).max())
    assert np.abs(state.object - obj).max() > 1e-3      # the step did move the object


def _errors(ds, client, engine, epochs, **kw):
    errors = []

    def record(epoch, state, metrics):
        lit = state.illumination > 0.3 * state.illumination.max()
        errors.append(nrmse(state.object, ds.truth.object, mask=lit))

    rec = daskpty.reconstruct(ds, engine=engine, epochs=epochs, object=np.ones_like(ds.truth.object),
                              client=client, callback=record, **kw)
    return rec, errors


@pytest.mark.slow
@pytest.mark.parametrize("engine,modes,threshold", [("rpie", 1, 0.05), ("epie", 1, 0.10), ("rpie", 2, 0.08)])
def test_ground_truth_through_reconstruct(threads_client, engine, modes, threshold):
    ds = make_dataset(grid=10, modes=modes, seed=11)
    rec, errors = _errors(ds, threads_client, engine, 24, rounds_per_epoch=4, probe_modes=modes)
    assert errors[-1] < threshold
    assert errors[-1] < 0.5 * errors[0]
    assert rec.history[-1]["loss"] < rec.history[0]["loss"]
    assert rec.options["engine"] == engine


@pytest.mark.slow
def test_two_workers_equal_one_and_resume_is_bit_identical(tmp_path):
    ds = make_dataset(grid=8, seed=5)
    common = dict(engine="rpie", object=np.ones_like(ds.truth.object), rounds_per_epoch=2, chunk_length=16,
                  split_every=2)
    results = {}
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=False,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
            results[workers] = daskpty.reconstruct(ds, epochs=4, client=client, **common)
            if workers == 1:
                path = str(tmp_path / "pie.zarr")
                daskpty.reconstruct(ds, epochs=2, client=client, checkpoint=path, **common)
                resumed = daskpty.reconstruct(ds, epochs=4, client=client, resume=path, **common)
    assert np.linalg.norm(results[2].object - results[1].object) <= 1e-5 * np.linalg.norm(results[1].object)
    np.testing.assert_array_equal(resumed.object, results[1].object)
    np.testing.assert_array_equal(resumed.probe, results[1].probe)


@pytest.mark.parametrize("arguments,feature", [
    (dict(refine_positions=True), "position refinement"),
    (dict(opr_modes=2), "a varying probe"),
    (dict(fit_intensity=True), "a varying probe"),
])
def test_features_pie_does_not_take_are_one_line(threads_client, arguments, feature):
    ds = make_dataset(grid=6, seed=1)
    with pytest.raises(ValueError, match=rf"engine 'rpie' does not take {feature}.*use engine 'ad' or 'lsqml'"):
        daskpty.reconstruct(ds, engine="rpie", epochs=1, client=threads_client, **arguments)


def test_options_are_checked_and_engines_named():
    with pytest.raises(ValueError, match=r"alpha must lie in \(0, 1\]"):
        pie.PIEOptions(alpha=0)
    with pytest.raises(ValueError, match="no far-field correction"):
        pie.PIEOptions(noise="intensity")
    from daskpty.execution.engine_registry import engine_spec

    with pytest.raises(ValueError, match="did you mean 'rpie'"):
        engine_spec("rpei")
    options, adapter = engine_spec("epie").make("gaussian", engine_options={"object_step": 0.5})
    assert (options.alpha, options.probe_alpha, options.object_step, adapter.name) == (1.0, 1.0, 0.5, "epie")
    with pytest.raises(TypeError, match="apply to engine='ad' only"):
        engine_spec("rpie").make("gaussian", loss="poisson")
    with pytest.raises(TypeError, match="'alfa' \\(did you mean 'alpha'\\?\\) for engine 'rpie'"):
        engine_spec("rpie").make("gaussian", engine_options={"alfa": 0.2})
