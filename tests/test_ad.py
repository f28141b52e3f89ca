"""AD engine: finite-difference gradient checks, optimisers, worker-count equivalence, convergence vs LSQML."""
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.engines import ad, forward_model
from daskpty.engines.partials import sum_partials
from daskpty.execution.engine_registry import engine_spec
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from daskpty.metrics import nrmse

from synthetic import make_dataset

ADAdapter = engine_spec("ad").adapter

FD_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def threads_client():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        yield client


def _complex(rng, *shape):
    return rng.normal(size=shape) + 1j * rng.normal(size=shape)


def _central_difference(f, x, direction, h):
    return (f(x + h * direction) - f(x - h * direction)) / (2 * h)


def _relative_error(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def _problem(seed=0):
    """Random complex object 40×40, two 16×16 probe modes, six positions with fractional parts."""
    rng = np.random.default_rng(seed)
    obj = 1.0 + 0.3 * _complex(rng, 40, 40)
    probe = 0.5 * _complex(rng, 2, 16, 16)
    positions = np.floor(rng.uniform(2, 22, (6, 2))) + 8 + rng.uniform(-0.35, 0.35, (6, 2))
    _, fractions = ad._split(positions, 16)
    assert np.all(np.abs(fractions) < 0.4)  # sub-pixel parts, away from the window-rounding jumps at ±0.5
    intensities = rng.uniform(0, 3, (6, 16, 16)) * 40
    valid = rng.random((16, 16)) > 0.1
    return rng, obj, probe, positions, intensities, valid


# ---------------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("loss", ad.LOSS_NAMES)
def test_loss_gradient_matches_finite_differences(loss):
    """δL = Re⟨g, δΨ⟩ for random directions (masked pixels included in the data, excluded from L)."""
    rng = np.random.default_rng(1)
    far = _complex(rng, 3, 2, 8, 8)
    y = rng.uniform(0.2, 4.0, (3, 8, 8))
    y[0, 0, 0] = 0.0
    valid = rng.random((8, 8)) > 0.2
    func = ad.LOSS_GRADIENTS[loss]
    value, grad = func(far, y, valid)
    assert grad.shape == far.shape and grad.dtype == np.complex128
    per, _ = ad.loss_and_gradient(far, y, loss=loss, valid=valid, gradient=False)
    assert per.shape == (3,) and per.sum() == pytest.approx(value, rel=1e-12)
    for _ in range(3):
        d = _complex(rng, *far.shape)
        fd = _central_difference(lambda z: func(z, y, valid)[0], far, d, 1e-6)
        assert _relative_error(fd, np.vdot(grad, d).real) < FD_TOLERANCE
    # masked pixels do not see the data
    y2 = y.copy()
    y2[:, ~valid] += 5.0
    assert func(far, y2, valid)[0] == pytest.approx(value, rel=1e-12)


def test_loss_values_are_the_documented_formulas():
    rng = np.random.default_rng(2)
    far = _complex(rng, 2, 1, 4, 4)
    yhat = np.abs(far[:, 0]) ** 2
    y = rng.uniform(0.5, 2.0, (2, 4, 4))
    eps = 1e-6
    assert ad.gaussian_loss_gradient(far, y, eps=eps)[0] == pytest.approx(((np.sqrt(yhat + eps) - np.sqrt(y)) ** 2).sum())
    expected = yhat - y - y * (np.log(yhat + eps) - np.log(np.maximum(y, 1.0)))   # zero where ŷ = y
    assert ad.poisson_loss_gradient(far, y, eps=eps)[0] == pytest.approx(expected.sum())
    assert ad.intensity_loss_gradient(far, y)[0] == pytest.approx(((yhat - y) ** 2).sum())


# ------------------------------------------------------------------------------------- chunk gradients


@pytest.mark.parametrize("loss", ad.LOSS_NAMES)
def test_chunk_gradients_match_finite_differences(loss):
    """Object, probe and position gradients of the full chunk loss, float64, central differences."""
    rng, obj, probe, positions, y, valid = _problem(3)
    opts = ad.ADOptions(loss=loss)
    part = ad.chunk_gradient(obj, probe, y, positions, options=opts, valid=valid, want_positions=True)
    g_obj = np.zeros(obj.shape, np.complex128)
    part.boxes["object_grad"].add_into(g_obj)
    assert g_obj.dtype == part.boxes["object_grad"].data.dtype == np.complex128
    g_probe = part.arrays["probe_grad"]
    g_pos = part.arrays["position_grad"]
    assert g_probe.dtype == np.complex128 and g_probe.shape == probe.shape and g_pos.shape == (6, 2)

    def loss_of(o=obj, p=probe, x=positions):
        return ad.chunk_loss(o, p, y, x, options=opts, valid=valid).scalars["loss"]

    assert loss_of() == pytest.approx(part.scalars["loss"], rel=1e-12)
    for _ in range(2):
        d = _complex(rng, *obj.shape)
        fd = _central_difference(lambda o: loss_of(o=o), obj, d, 1e-5)
        assert _relative_error(fd, np.vdot(g_obj, d).real) < FD_TOLERANCE
        d = _complex(rng, *probe.shape)
        fd = _central_difference(lambda p: loss_of(p=p), probe, d, 1e-5)
        assert _relative_error(fd, np.vdot(g_probe, d).real) < FD_TOLERANCE
        d = rng.normal(size=positions.shape)
        fd = _central_difference(lambda x: loss_of(x=x), positions, d, 1e-5)
        assert _relative_error(fd, float((g_pos * d).sum())) < FD_TOLERANCE


def test_float32_inputs_stay_single_precision_and_agree_with_float64():
    _, obj, probe, positions, y, _ = _problem(4)
    p64 = ad.chunk_gradient(obj, probe, y, positions)
    p32 = ad.chunk_gradient(obj.astype(np.complex64), probe.astype(np.complex64), y.astype(np.float32), positions)
    assert p32.boxes["object_grad"].data.dtype == np.complex64
    assert p32.arrays["probe_grad"].dtype == np.complex64
    for a, b in ((p32.boxes["object_grad"].data, p64.boxes["object_grad"].data),
                 (p32.arrays["probe_grad"], p64.arrays["probe_grad"])):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4
    assert p32.scalars["loss"] == pytest.approx(p64.scalars["loss"], rel=1e-4)


def test_chunk_partials_add_up_to_the_whole():
    _, obj, probe, positions, y, valid = _problem(5)
    whole = ad.chunk_gradient(obj, probe, y, positions, valid=valid)
    parts = sum_partials(ad.chunk_gradient(obj, probe, y[:2], positions[:2], valid=valid),
                         ad.chunk_gradient(obj, probe, y[2:], positions[2:], valid=valid))
    frame_a, frame_b = np.zeros(obj.shape, complex), np.zeros(obj.shape, complex)
    whole.boxes["object_grad"].add_into(frame_a)
    parts.boxes["object_grad"].add_into(frame_b)
    np.testing.assert_allclose(frame_b, frame_a, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(parts.arrays["probe_grad"], whole.arrays["probe_grad"], rtol=1e-10, atol=1e-8)
    assert parts.scalars["loss"] == pytest.approx(whole.scalars["loss"], rel=1e-12)
    assert parts.scalars["n"] == whole.scalars["n"] == 6


@pytest.mark.parametrize("loss", ["gaussian", "poisson"])
def test_gradient_vanishes_at_the_truth_on_noise_free_data(loss):
    ds = make_dataset(noise=False, grid=5)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    part = ad.chunk_gradient(ds.truth.object, ds.truth.probe, y, ds.positions, options=ad.ADOptions(loss=loss))
    perturbed = ad.chunk_gradient(ds.truth.object * np.complex64(1.05), ds.truth.probe, y, ds.positions,
                                  options=ad.ADOptions(loss=loss))
    for key in ("object_grad",):
        assert np.abs(part.boxes[key].data).max() < 1e-2 * np.abs(perturbed.boxes[key].data).max()
    assert np.abs(part.arrays["probe_grad"]).max() < 1e-2 * np.abs(perturbed.arrays["probe_grad"]).max()


def _reference_chunk_gradient(obj, probe, y, positions, loss, valid, eps=ad.DEFAULT_EPS):
    """chunk_gradient written out directly: the whole chunk at once, complex-exponential ramps, and the
    pixel losses and their derivatives in float64 (then cast to the working precision)."""
    from daskpty.physics import extract_patches, fft2, ifft2, scatter_add_patches

    wide = np.complex128 in (obj.dtype, probe.dtype)
    cdtype, rdtype = (np.complex128, np.float64) if wide else (np.complex64, np.float32)
    n = probe.shape[-1]
    corners, fractions = ad._split(positions, n)
    box0, box1 = corners.min(axis=0), corners.max(axis=0) + n
    box = obj[box0[0]:box1[0], box0[1]:box1[1]].astype(cdtype)
    local = corners - box0
    k = np.fft.fftfreq(n)
    ramps = np.exp(-2j * np.pi * (fractions[:, 0, None, None] * k[None, :, None]
                                  + fractions[:, 1, None, None] * k[None, None, :])).astype(cdtype)
    probe_ft = fft2(probe.astype(cdtype))
    shifted = ifft2(ramps[:, None] * probe_ft[None])
    patches = extract_patches(box, local, n)
    far = fft2(shifted * patches[:, None])
    yhat = (np.abs(far) ** 2).sum(axis=1)
    yh, y64 = yhat.astype(np.float64), y.astype(np.float64)
    mask = np.ones((n, n)) if valid is None else valid
    if loss == "gaussian":
        value, dh = (np.sqrt(yh + eps) - np.sqrt(y64)) ** 2, 1 - np.sqrt(y64 / (yh + eps))
    elif loss == "poisson":
        value = yh - y64 - y64 * (np.log(yh + eps) - np.log(np.maximum(y64, 1.0)))
        dh = 1 - y64 / (yh + eps)
    else:
        value, dh = (yh - y64) ** 2, 2 * (yh - y64)
    g_psi = ifft2((2 * dh * mask)[:, None].astype(rdtype) * far)
    illum = np.zeros(box.shape, rdtype)
    scatter_add_patches(illum, local, (np.abs(shifted) ** 2).sum(axis=1))
    obj_grad = np.zeros(box.shape, cdtype)
    scatter_add_patches(obj_grad, local, (np.conj(shifted) * g_psi).sum(axis=1))
    spectra = fft2(np.conj(patches)[:, None] * g_psi)
    a = (np.conj(spectra) * probe_ft[None]).sum(axis=1) * ramps
    position_grad = np.stack([(a * -2j * np.pi * k[:, None]).real.sum(axis=(1, 2)),
                              (a * -2j * np.pi * k[None, :]).real.sum(axis=(1, 2))], axis=1)
    # the dots' scatter were the spectra white noise of their own power: √(‖G_j‖² ‖D_a‖² / 2N)
    derivative_power = np.array([(np.abs(probe_ft * -2j * np.pi * d) ** 2).sum() for d in (k[:, None], k[None, :])])
    position_noise = np.sqrt((np.abs(spectra) ** 2).sum(axis=(1, 2, 3))[:, None] * derivative_power[None]
                             / (2 * spectra[0].size))
    return {"object_grad": obj_grad, "illumination": illum,
            "probe_grad": ifft2((np.conj(ramps)[:, None] * spectra).sum(axis=0)),
            "probe_illumination": (np.abs(patches) ** 2).sum(axis=0), "position_grad": position_grad,
            "position_noise": position_noise,
            "loss": (value * mask).sum(), "sum_measured": (y64 * mask).sum(), "sum_model": (yh * mask).sum()}


@pytest.mark.parametrize("loss", ad.LOSS_NAMES)
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("modes,masked,n", [(1, False, 32), (2, True, 32), (1, True, 16)])
def test_chunk_gradient_matches_direct_reference(monkeypatch, loss, wide, modes, masked, n):
    """Sub-batched chunk_gradient / chunk_loss (fused losses, in-place FFTs, BLAS dots) = the direct
    computation, for every output, in single and double precision."""
    ds = make_dataset(n=n, grid=5, modes=modes, seed=11)
    rng = np.random.default_rng(0)
    cdtype = np.complex128 if wide else np.complex64
    obj = (ds.truth.object * (1 + 0.1 * rng.standard_normal(ds.truth.object.shape))).astype(cdtype)
    probe = (ds.truth.probe * 0.8).astype(cdtype)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    y = y.astype(np.float64) if wide else y.astype(np.uint16 if loss == "poisson" else np.float32)
    valid = (rng.random((n, n)) > 0.1) if masked else None
    options = ad.ADOptions(loss=loss)
    ref = _reference_chunk_gradient(obj, probe, y, ds.positions, loss, valid)
    # 25 patterns: blocks of 7, 7, 7, 4
    monkeypatch.setattr(forward_model, "CPU_BLOCK_BYTES", 7 * np.dtype(cdtype).itemsize * modes * n * n)
    part = ad.chunk_gradient(obj, probe, y, ds.positions, options=options, valid=valid, want_positions=True,
                             position_noise=True)
    rtol = 1e-12 if wide else 1e-5
    for key in ("object_grad", "illumination"):
        got = part.boxes[key].data
        assert got.dtype == ref[key].dtype, key
        assert np.linalg.norm(got - ref[key]) <= rtol * np.linalg.norm(ref[key]), key
    for key in ("probe_grad", "probe_illumination", "position_grad", "position_noise"):
        got = part.arrays[key]
        assert got.dtype == (np.float64 if key.startswith("position") else ref[key].dtype), key
        assert np.linalg.norm(got - ref[key]) <= rtol * np.linalg.norm(ref[key]), key
    for key in ("loss", "sum_measured", "sum_model"):
        assert part.scalars[key] == pytest.approx(ref[key], rel=rtol), key
    assert part.scalars["n"] == len(y)
    total = ad.chunk_loss(obj, probe, y, ds.positions, options=options, valid=valid)
    assert total.scalars == {"loss": pytest.approx(ref["loss"], rel=rtol), "n": len(y)}
    # what is not asked for is neither computed nor returned; the rest does not change
    only = ad.chunk_gradient(obj, probe, y, ds.positions, options=options, valid=valid, want_object=False,
                             want_probe=False)
    assert set(only.boxes) == {"illumination"} and not only.arrays
    np.testing.assert_array_equal(only.boxes["illumination"].data, part.boxes["illumination"].data)
    assert only.scalars == part.scalars
    positions_only = ad.chunk_gradient(obj, probe, y, ds.positions, options=options, valid=valid,
                                       want_object=False, want_probe=False, want_positions=True)
    np.testing.assert_array_equal(positions_only.arrays["position_grad"], part.arrays["position_grad"])



# ----------------------------------------------------------------------------------------- optimisers


def _quadratic(n=10, seed=0, condition=50.0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    a = q @ np.diag(np.geomspace(1.0, condition, n)) @ q.T
    b = rng.normal(size=n)
    x_star = np.linalg.solve(a, b)

    def f(x):
        return 0.5 * x @ a @ x - b @ x

    def grad(x):
        return a @ x - b

    return f, grad, x_star


@pytest.mark.parametrize("optimizer", [ad.Adam(), ad.SGD(momentum=0.0), ad.SGD(momentum=0.9, nesterov=True),
                                       ad.SGD(momentum=0.5, nesterov=False)])
def test_first_order_optimisers_decrease_a_quadratic(optimizer):
    f, grad, x_star = _quadratic()
    lr = 0.05 if isinstance(optimizer, ad.Adam) else 0.01
    x = {"object": np.zeros_like(x_star)}
    state = ad.OptimizerState()
    values = [f(x["object"])]
    for _ in range(300):
        x, state = optimizer.step(x, {"object": grad(x["object"])}, {"object": lr}, state)
        values.append(f(x["object"]))
    assert values[-1] < values[0] - 0.9 * (values[0] - f(x_star))
    assert all(isinstance(v, np.ndarray) for v in state.arrays.values())
    assert all(isinstance(v, float) for v in state.scalars.values())


def test_adam_on_complex_parameters():
    rng = np.random.default_rng(3)
    target = _complex(rng, 5, 5)
    x = {"probe": np.zeros((5, 5), np.complex128)}
    state = ad.OptimizerState()
    for _ in range(500):
        x, state = ad.Adam().step(x, {"probe": 2 * (x["probe"] - target)}, {"probe": 0.05}, state)
    assert np.linalg.norm(x["probe"] - target) < 0.05 * np.linalg.norm(target)


def test_cg_with_line_search_solves_a_quadratic_in_n_steps():
    n = 10
    f, grad, x_star = _quadratic(n=n)
    x = {"object": np.zeros_like(x_star)}
    cg = ad.ConjugateGradient(max_evaluations=8)
    state = ad.OptimizerState()
    start = np.linalg.norm(x_star)
    for _ in range(n):
        g = {"object": grad(x["object"])}
        x, state = cg.step(x, g, g, {"object": 1.0}, f(x["object"]), lambda p: f(p["object"]), state)
    assert np.linalg.norm(x["object"] - x_star) < 1e-5 * start
    # plain steepest descent with the same line search is far from done after n steps
    y = {"object": np.zeros_like(x_star)}
    state = ad.OptimizerState()
    for _ in range(n):
        g = {"object": grad(y["object"])}
        state.drop("cg_d")
        y, state = cg.step(y, g, g, {"object": 1.0}, f(y["object"]), lambda p: f(p["object"]), state)
    assert np.linalg.norm(y["object"] - x_star) > 1e-3 * start


def test_options_are_validated_with_clear_messages():
    with pytest.raises(ValueError, match="loss"):
        ad.ADOptions(loss="l2")
    with pytest.raises(ValueError, match="optimizer"):
        ad.ADOptions(optimizer="lbfgs")
    with pytest.raises(ValueError, match="lr"):
        ad.ADOptions(lr=-1.0)
    with pytest.raises(ValueError, match="probe_stop_epoch"):
        ad.ADOptions(probe_start_epoch=5, probe_stop_epoch=3)
    with pytest.raises(ValueError, match="momentum"):
        ad.ADOptions(momentum=1.0)
    with pytest.raises(ValueError, match="decay"):
        ad.ADOptions(schedule="exponential", decay=1.5)
    opts = ad.ADOptions(schedule="step", decay=0.5, decay_every=2, probe_start_epoch=2)
    assert opts.learning_rate("object", 3) == pytest.approx(opts.object_lr * 0.5)
    assert opts.learning_rate("probe", 3) == pytest.approx(opts.probe_lr_value)
    assert not opts.active("probe", 1) and opts.active("probe", 2)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_scale_normalisation_carries_the_optimiser_memory_along(optimizer):
    """Removing the O·c, P/c ambiguity between two steps changes nothing but the scale."""
    ds = make_dataset(grid=5, seed=4)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    opts = ad.ADOptions(optimizer=optimizer, probe_start_epoch=0)

    def step(state):
        total = ad.chunk_gradient(state.object, state.probe, y, ds.positions, options=opts)
        return ad.apply(state, total, opts)

    a = step(ad.ADState(object=np.ones_like(ds.truth.object), probe=ds.truth.probe.copy()))
    b = ad.ADState(object=a.object.copy(), probe=a.probe.copy(), illumination=a.illumination,
                   optimizer=ad.OptimizerState({k: v.copy() for k, v in a.optimizer.arrays.items()},
                                               dict(a.optimizer.scalars)))
    b.object *= np.complex64(1.7)       # pretend the object drifted: normalise it back
    b.probe /= np.complex64(1.7)
    for k in list(b.optimizer.arrays):
        if k.split("/")[1] == "object":
            b.optimizer.arrays[k] = b.optimizer.arrays[k] * (1.7 if k[0] != "v" else 1.7**2)
        else:
            b.optimizer.arrays[k] = b.optimizer.arrays[k] / (1.7 if k[0] != "v" else 1.7**2)
    ad.normalize_scale(b, opts)
    ad.normalize_scale(a, opts)
    a, b = step(a), step(b)
    assert np.linalg.norm(a.object - b.object) / np.linalg.norm(a.object) < 1e-4
    assert np.linalg.norm(a.probe - b.probe) / np.linalg.norm(a.probe) < 1e-4


def test_cg_apply_without_loss_evaluations_is_an_error():
    _, obj, probe, positions, y, _ = _problem(6)
    opts = ad.ADOptions(optimizer="cg")
    total = ad.chunk_gradient(obj, probe, y, positions, options=opts)
    with pytest.raises(RuntimeError, match="line search"):
        ad.apply(ad.ADState(object=obj, probe=probe), total, opts)


# ----------------------------------------------------------------------------------------- on dask


def _initial_probe(ds, client):
    return daskpty.reconstruct(ds, epochs=0, object=np.ones_like(ds.truth.object), client=client).probe


@pytest.mark.slow
def test_n_workers_equal_one_worker():
    """1 and 2 worker processes: same chunks, rounds and reduction tree → the same object and probe."""
    ds = make_dataset(grid=8, seed=5)
    results = {}
    probe = None
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
            if probe is None:
                probe = _initial_probe(ds, client)
            data = prepare_data(client, ds.intensities, ds.positions, chunk_length=12)
            state = ad.ADState(object=np.ones_like(ds.truth.object), probe=probe.copy())
            results[workers], _ = run_epochs(client, data, ADAdapter(ad.ADOptions(probe_start_epoch=1)), state,
                                             epochs=3, rounds_per_epoch=2, split_every=3)
    for key in ("object", "probe"):
        a, b = getattr(results[2], key), getattr(results[1], key)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) <= 1e-5
    assert np.linalg.norm(results[1].object - 1) / np.linalg.norm(np.ones_like(results[1].object)) > 1e-2


@pytest.mark.slow
def test_default_adam_converges_like_lsqml(threads_client):
    """Defaults, no tuning: within 1.2× LSQML's object NRMSE after 3× as many epochs (same rounds)."""
    ds = make_dataset(grid=14, seed=11)
    epochs, rounds = 10, 4
    lsq = daskpty.reconstruct(ds, epochs=epochs, object=np.ones_like(ds.truth.object), client=threads_client,
                              rounds_per_epoch=rounds)
    mask = lsq.illumination > 0.3 * lsq.illumination.max()
    lsq_error = nrmse(lsq.object, ds.truth.object, mask=mask)

    errors = []

    def record(epoch, state, metrics):
        lit = state.illumination > 0.3 * state.illumination.max()
        errors.append(nrmse(state.object, ds.truth.object, mask=lit))

    data = prepare_data(threads_client, ds.intensities, ds.positions)
    state = ad.ADState(object=np.ones_like(ds.truth.object), probe=_initial_probe(ds, threads_client))
    state, history = run_epochs(threads_client, data, ADAdapter(), state, epochs=3 * epochs,
                                rounds_per_epoch=rounds, callbacks=[record])
    ad_error = nrmse(state.object, ds.truth.object, mask=mask)
    print(f"LSQML {epochs} epochs: NRMSE {lsq_error:.4f}; AD (Adam) {3 * epochs} epochs: {ad_error:.4f}")
    assert ad_error <= 1.2 * lsq_error
    assert errors[-1] < 0.5 * errors[0]
    assert history[-1]["loss"] < history[0]["loss"]


def test_cg_round_never_increases_the_loss_in_compact_mode(threads_client):
    """CG with its loss-only line search (extra map-reduces via ADAdapter.run_round), one round per epoch:
    every accepted step satisfies Armijo on the same patterns, so the loss is non-increasing."""
    ds = make_dataset(grid=8, seed=6)
    data = prepare_data(threads_client, ds.intensities, ds.positions)
    adapter = ADAdapter(ad.ADOptions(optimizer="cg", probe_start_epoch=2))
    assert adapter.needs_evaluations
    state = ad.ADState(object=np.ones_like(ds.truth.object), probe=_initial_probe(ds, threads_client))
    state = adapter.initialise(threads_client, data, state, split_every=8)
    losses, evaluations = [], 0
    for _ in range(6):
        state = adapter.begin_epoch(state)
        state, total = adapter.run_round(threads_client, data, state)
        state = adapter.end_epoch(state)
        losses.append(total.scalars["loss"])
        evaluations += total.scalars["loss_evaluations"]
    assert evaluations >= 6
    assert all(b <= a * (1 + 1e-6) for a, b in zip(losses, losses[1:]))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("optimizer,loss", [("sgd", "poisson"), ("adam", "intensity")])
def test_other_optimisers_and_losses_reduce_the_loss_with_two_modes(threads_client, optimizer, loss):
    ds = make_dataset(grid=6, modes=2, seed=7)
    probe = daskpty.reconstruct(ds, epochs=0, object=np.ones_like(ds.truth.object), client=threads_client,
                                probe_modes=2).probe
    data = prepare_data(threads_client, ds.intensities, ds.positions, modes=2)
    state = ad.ADState(object=np.ones_like(ds.truth.object), probe=probe)
    state, history = run_epochs(threads_client, data, ADAdapter(ad.ADOptions(optimizer=optimizer, loss=loss)),
                                state, epochs=6, rounds_per_epoch=2)
    assert np.isfinite(state.object).all() and np.isfinite(state.probe).all()
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    powers = (np.abs(state.probe) ** 2).sum(axis=(1, 2))
    assert powers[0] >= powers[1]  # orthogonalised, strongest mode first


def test_resume_from_a_checkpoint_continues_exactly(threads_client, tmp_path):
    """4 epochs in one go == 2 epochs, a round trip through the reconstruction store, 2 more."""
    from daskpty.io.results import Reconstruction

    ds = make_dataset(grid=6, seed=8)
    probe = _initial_probe(ds, threads_client)
    data = prepare_data(threads_client, ds.intensities, ds.positions)
    adapter = ADAdapter(ad.ADOptions(optimizer="adam", probe_start_epoch=1))
    straight, _ = run_epochs(threads_client, data, adapter, adapter.new_state(np.ones_like(ds.truth.object),
                                                                              probe.copy()),
                             epochs=4, rounds_per_epoch=2)
    half, _ = run_epochs(threads_client, data, adapter, adapter.new_state(np.ones_like(ds.truth.object),
                                                                          probe.copy()),
                         epochs=2, rounds_per_epoch=2)
    saved = adapter.engine_state(half)
    assert {"optimizer.m.object", "optimizer.v.probe", "optimizer_scalar.t.object"} <= set(saved)
    Reconstruction(object=half.object, probe=half.probe, positions=ds.positions, origin=np.zeros(2),
                   illumination=half.illumination, epoch=half.epoch,
                   engine_state=saved).to_zarr(tmp_path / "ckpt.zarr")
    back = Reconstruction.from_zarr(tmp_path / "ckpt.zarr")
    resumed = adapter.new_state(back.object, back.probe, back.epochs, back.engine_state)
    assert resumed.iteration == half.iteration and resumed.optimizer.scalars == half.optimizer.scalars
    resumed, _ = run_epochs(threads_client, data, adapter, resumed, epochs=2, rounds_per_epoch=2)
    np.testing.assert_array_equal(resumed.object, straight.object)
    np.testing.assert_array_equal(resumed.probe, straight.probe)


def test_start_and_stop_epochs_select_the_updated_parameters():
    ds = make_dataset(grid=5, seed=9)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    adapter = ADAdapter(ad.ADOptions(object_stop_epoch=1, probe_start_epoch=1))
    state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    for epoch in range(2):
        state = adapter.begin_epoch(state)
        before_obj, before_probe = state.object.copy(), state.probe.copy()
        total = adapter.chunk_function(y, ds.positions, adapter.payload(state))
        state = adapter.end_epoch(adapter.apply(state, total))
        assert state.illumination is not None
        moved_obj = not np.allclose(state.object, before_obj * (state.object[0, 0] / before_obj[0, 0]))
        moved_probe = not np.allclose(state.probe / np.abs(state.probe).max(),
                                      before_probe / np.abs(before_probe).max())
        assert (moved_obj, moved_probe) == ((True, False) if epoch == 0 else (False, True))


def test_sgd_momentum_follows_the_slices():
    """momentum=None: 0.9 for one slice, 1 − K · 0.1 for K slices (floored at 0), resolved when the
    adapter takes the sample (EngineSpec.make's ``slices``); a given momentum is kept."""
    from daskpty.engines.sample_options import SampleOptions
    from daskpty.execution.engine_registry import engine_spec
    from daskpty.execution.parts import sample_model

    assert ad.ADOptions().momentum is None and ad.ADOptions().make_optimizer().momentum == 0.9
    assert [ad.ADOptions().for_slices(k).momentum for k in (1, 2, 3, 12)] == [0.9, 0.8, 0.7, 0.0]
    assert ad.ADOptions(momentum=0.95).for_slices(3).momentum == 0.95
    for k, want in ((1, 0.9), (3, 0.7)):
        sample = SampleOptions(slices=k, slice_spacing_m=2e-9, wavelength_m=1.97e-12,
                               object_pixel_size_m=0.25e-10).resolve(None, 32)
        _, adapter = engine_spec("ad").make("gaussian", sample=sample_model(sample), slices=sample.n_slices)
        assert adapter.options.momentum == want and adapter.options.make_optimizer().momentum == want
    with pytest.raises(ValueError, match="momentum"):
        ad.ADOptions(momentum=1.0)
