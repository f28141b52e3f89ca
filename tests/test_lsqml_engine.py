"""LSQML engine on single chunks (no dask): partial algebra, fixed points, monotone loss."""
import numpy as np
import pytest

from daskpty.engines import lsqml
from daskpty.engines.partials import BoxedArray, Partial, sum_partials

from synthetic import make_dataset


def _dc0(intensities):
    return np.fft.ifftshift(intensities, axes=(-2, -1))


def _random_partial(rng, offset, shape):
    data = (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(np.complex64)
    return Partial(boxes={"object": BoxedArray(offset, data)},
                   arrays={"probe": rng.normal(size=(2, 3)).astype(np.float32)},
                   scalars={"loss": float(rng.random()), "n": 1.0})


def _frame(p, shape=(40, 40)):
    f = np.zeros(shape, np.complex64)
    p.boxes["object"].add_into(f)
    return f


def test_partials_merge_boxes_and_add_associatively():
    rng = np.random.default_rng(1)
    a = _random_partial(rng, (0, 0), (10, 12))
    b = _random_partial(rng, (5, 20), (8, 8))
    c = _random_partial(rng, (30, 3), (6, 9))
    left, right = (a + b) + c, a + (b + c)
    np.testing.assert_allclose(_frame(left), _frame(right), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_frame(left), _frame(a) + _frame(b) + _frame(c), rtol=1e-6, atol=1e-6)
    assert left.boxes["object"].offset == (0, 0) and left.boxes["object"].stop == (36, 28)
    assert left.scalars["loss"] == pytest.approx(a.scalars["loss"] + b.scalars["loss"] + c.scalars["loss"])
    np.testing.assert_allclose(sum_partials(a, b, c).arrays["probe"], a.arrays["probe"] + b.arrays["probe"]
                               + c.arrays["probe"], rtol=1e-6)


@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
def test_truth_is_a_fixed_point_on_noise_free_data(noise):
    ds = make_dataset(noise=False, grid=6)
    part = lsqml.chunk_step(ds.truth.object, ds.truth.probe, _dc0(ds.intensities), ds.positions,
                            options=lsqml.LSQMLOptions(noise=noise))
    assert part.scalars["loss"] / part.scalars["n"] < 1e-3 * ds.intensities.sum(axis=(1, 2)).mean()
    illum = part.boxes["illumination"].data
    update = part.boxes["object"].data / np.sqrt(illum**2 + (0.1 * illum.max()) ** 2)
    assert np.abs(update).max() < 1e-3


def test_single_chunk_iterations_reduce_the_loss():
    ds = make_dataset(grid=8, seed=3)
    options = lsqml.LSQMLOptions()
    state = lsqml.LSQMLState(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    losses = []
    for _ in range(15):
        state = lsqml.begin_epoch(state, options)
        part = lsqml.chunk_step(state.object, state.probe, _dc0(ds.intensities), ds.positions, options=options)
        losses.append(part.scalars["loss"])
        state = lsqml.end_epoch(lsqml.apply(state, part, options), options)
    assert losses[-1] < 0.5 * losses[0]
    assert all(b <= a * 1.01 for a, b in zip(losses, losses[1:]))


def test_options_are_validated():
    with pytest.raises(ValueError, match="noise"):
        lsqml.LSQMLOptions(noise="laplace")
    with pytest.raises(ValueError, match="beta"):
        lsqml.LSQMLOptions(beta=0)


def _reference_chunk_step(obj, probe, y, positions, options, update_probe, valid):
    """The LSQML step written out directly from the physics operators (no blocking, no identities)."""
    from daskpty.physics import (
        extract_patches,
        fft2,
        ifft2,
        poisson_loss,
        scatter_add_patches,
        shift_probe,
        shift_probe_adjoint,
        shift_ramps,
        split_positions,
    )
    from daskpty.physics.noise import far_field_update

    n, B = probe.shape[-1], len(y)
    corners, fractions = split_positions(positions, n)
    box0 = corners.min(axis=0)
    box = obj[box0[0]:corners[:, 0].max() + n, box0[1]:corners[:, 1].max() + n]
    local = corners - box0
    ramps = shift_ramps(fractions, n)
    patches = extract_patches(box, local, n)
    shifted = shift_probe(probe, ramps)
    delta, yhat, _ = far_field_update(options.noise, fft2(shifted * patches[:, None]), y, valid, options.eps)
    chi = ifft2(delta)
    num = np.zeros(box.shape, np.complex64)
    illum = np.zeros(box.shape, np.float32)
    scatter_add_patches(num, local, (np.conj(shifted) * chi).sum(axis=1))
    scatter_add_patches(illum, local, (np.abs(shifted) ** 2).sum(axis=1))
    direction = num / np.sqrt(illum**2 + (options.object_delta * illum.max()) ** 2)

    def dot(u, v):
        return (np.conj(u.astype(np.complex128)) * v).real.sum(axis=(1, 2, 3))

    a = extract_patches(direction, local, n)[:, None] * shifted
    a_chi, a_a = dot(a, chi), dot(a, a)
    if update_probe:
        probe_sum = shift_probe_adjoint(np.conj(patches)[:, None] * chi, ramps)
        b = shift_probe(probe_sum / np.float32(B), ramps) * patches[:, None]
        b_chi, b_b, a_b = dot(b, chi), dot(b, b), dot(a, b)
        a_a = a_a + options.step_tikhonov * a_a.mean() + 1e-30
        b_b = b_b + options.step_tikhonov * b_b.mean() + 1e-30
        det = a_a * b_b - a_b**2
        alpha_o = np.clip((b_b * a_chi - a_b * b_chi) / det, 0, None)
        alpha_p = lsqml._trimmed_mean(np.clip((a_a * b_chi - a_b * a_chi) / det, 0, None), np)
    else:
        alpha_o = np.clip(a_chi / (a_a * (1 + options.step_tikhonov) + 1e-30), 0, None)
        alpha_p, probe_sum = 0.0, None
    alpha_o = lsqml._trimmed_mean(alpha_o, np)
    mask = 1.0 if valid is None else valid
    loss = poisson_loss(yhat, y, valid) if options.noise == "poisson" else \
        (((np.sqrt(yhat + options.eps) - np.sqrt(y.astype(np.float64))) ** 2) * mask).sum(axis=(1, 2))
    return {"object": alpha_o * num, "illumination": illum,
            "probe": None if probe_sum is None else alpha_p * probe_sum,
            "loss": loss.sum(), "alpha_object": alpha_o * B, "alpha_probe": alpha_p * B,
            "sum_measured": (y * mask).sum(dtype=np.float64), "sum_model": (yhat * mask).sum(dtype=np.float64)}


@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
@pytest.mark.parametrize("update_probe", [True, False])
@pytest.mark.parametrize("modes,masked,n", [(1, False, 32), (2, True, 32), (1, True, 16)])
def test_chunk_step_matches_direct_reference(monkeypatch, noise, update_probe, modes, masked, n):
    """Sub-batched chunk step (with its Fourier-domain identities) = the step written out directly."""
    ds = make_dataset(n=n, grid=5, modes=modes, seed=11)
    rng = np.random.default_rng(0)
    obj = (ds.truth.object * (1 + 0.1 * rng.standard_normal(ds.truth.object.shape))).astype(np.complex64)
    probe = (ds.truth.probe * 0.8).astype(np.complex64)
    y = _dc0(ds.intensities).astype(np.uint16 if noise == "poisson" else np.float32)
    valid = (rng.random((n, n)) > 0.1) if masked else None
    options = lsqml.LSQMLOptions(noise=noise)
    ref = _reference_chunk_step(obj, probe, y, ds.positions, options, update_probe, valid)
    monkeypatch.setattr(lsqml, "CPU_BLOCK_BYTES", 7 * 8 * modes * n * n)  # 25 patterns: blocks 7, 7, 7, 4
    part = lsqml.chunk_step(obj, probe, y, ds.positions, options=options, update_probe=update_probe, valid=valid)
    assert part.boxes["object"].data.dtype == np.complex64 and part.boxes["illumination"].data.dtype == np.float32
    for key in ("object", "illumination"):
        got, want = part.boxes[key].data, ref[key]
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), key
    if update_probe:
        assert part.arrays["probe"].dtype == np.complex64
        assert np.linalg.norm(part.arrays["probe"] - ref["probe"]) <= 1e-4 * np.linalg.norm(ref["probe"])
    else:
        assert "probe" not in part.arrays
    for key in ("loss", "alpha_object", "alpha_probe", "sum_measured", "sum_model"):
        assert part.scalars[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-12), key
    assert part.scalars["n"] == len(y)


def test_apply_adds_the_preconditioned_step_and_keeps_the_epochs_largest_illumination():
    """O += β ΔO / √(W² + (δ max W)²) on the update's box (the state's arrays are not written),
    P += β ΔP / N, and the illumination is the pixelwise maximum of the epoch's rounds'."""
    rng = np.random.default_rng(3)
    options = lsqml.LSQMLOptions(beta=0.7, delta=0.2)
    obj = (rng.normal(size=(30, 40)) + 1j * rng.normal(size=(30, 40))).astype(np.complex64)
    probe = (rng.normal(size=(1, 4, 4)) + 1j * rng.normal(size=(1, 4, 4))).astype(np.complex64)
    state = lsqml.LSQMLState(object=obj.copy(), probe=probe.copy())
    frames = []
    for offset, shape in (((2, 3), (10, 12)), ((8, 1), (15, 30))):
        num = (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(np.complex64)
        illum = rng.random(shape).astype(np.float32) * 5
        dprobe = (rng.normal(size=(1, 4, 4)) + 1j * rng.normal(size=(1, 4, 4))).astype(np.complex64)
        total = Partial(boxes={"object": BoxedArray(offset, num), "illumination": BoxedArray(offset, illum)},
                        arrays={"probe": dprobe}, scalars={"n": 8.0})
        before_object, before_probe = state.object, state.probe
        expected = before_object.astype(np.complex128)
        box = (slice(offset[0], offset[0] + shape[0]), slice(offset[1], offset[1] + shape[1]))
        precond = np.sqrt(illum.astype(np.float64) ** 2 + (0.2 * illum.max()) ** 2)
        expected[box] += 0.7 * num / precond
        frame = np.zeros(obj.shape, np.float32)
        frame[box] = illum
        frames.append(frame)
        kept = before_object.copy()
        state = lsqml.apply(state, total, options)
        np.testing.assert_array_equal(before_object, kept)  # not written in place
        np.testing.assert_allclose(state.object, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state.probe, before_probe + 0.7 * dprobe / 8.0, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state.illumination, np.maximum(*frames))


def test_the_preconditioner_floor_follows_the_slices():
    """delta=None: 0.1 for one slice, 0.5 for K > 1, resolved when the adapter takes the sample
    (EngineSpec.make's ``slices``); a given delta is kept; unresolved options read as 0.1."""
    from daskpty.engines.sample_options import SampleOptions
    from daskpty.execution.engine_registry import engine_spec
    from daskpty.execution.parts import sample_model

    LSQMLOptions = lsqml.LSQMLOptions
    assert LSQMLOptions().delta is None and LSQMLOptions().object_delta == 0.1
    assert [LSQMLOptions().for_slices(k).delta for k in (1, 2, 5)] == [0.1, 0.5, 0.5]
    assert LSQMLOptions(delta=0.2).for_slices(3).object_delta == 0.2
    for k, want in ((1, 0.1), (3, 0.5)):
        sample = SampleOptions(slices=k, slice_spacing_m=2e-9, wavelength_m=1.97e-12,
                               object_pixel_size_m=0.25e-10).resolve(None, 32)
        options, adapter = engine_spec("lsqml").make("gaussian", sample=sample_model(sample), slices=sample.n_slices)
        assert options.delta is None and adapter.options.object_delta == want
    with pytest.raises(ValueError, match="delta"):
        LSQMLOptions(delta=0.0)


def test_the_step_system_regularisation_follows_the_slices():
    """tikhonov=None: 0.01 for one slice (also unresolved), 0.5 through K > 1 slices, resolved
    when the adapter takes the sample; a given tikhonov is kept."""
    from daskpty.engines.sample_options import SampleOptions
    from daskpty.execution.engine_registry import engine_spec
    from daskpty.execution.parts import sample_model

    LSQMLOptions = lsqml.LSQMLOptions
    assert LSQMLOptions().tikhonov is None and LSQMLOptions().step_tikhonov == 0.01
    assert [LSQMLOptions().for_slices(k).step_tikhonov for k in (1, 2, 5)] == [0.01, 0.5, 0.5]
    assert LSQMLOptions(tikhonov=0.3).for_slices(3).step_tikhonov == 0.3
    sample = SampleOptions(slices=3, slice_spacing_m=2e-9, wavelength_m=1.97e-12,
                           object_pixel_size_m=0.25e-10).resolve(None, 32)
    options, adapter = engine_spec("lsqml").make("gaussian", sample=sample_model(sample), slices=sample.n_slices)
    assert adapter.options.step_tikhonov == 0.5
    with pytest.raises(ValueError, match="tikhonov"):
        LSQMLOptions(tikhonov=-1.0)


def test_poisson_through_slices_warms_up_with_the_gaussian_model():
    """noise_warmup None: NOISE_WARMUP Gaussian epochs before a Poisson model through K > 1
    slices, none for one slice or the Gaussian model; a given warm-up is kept. The chunk steps
    of each epoch take the model at_epoch names (the adapter's payload)."""
    from daskpty.engines.sample_options import SampleOptions
    from daskpty.execution.engine_registry import engine_spec
    from daskpty.execution.parts import sample_model

    LSQMLOptions, warmup = lsqml.LSQMLOptions, lsqml.NOISE_WARMUP
    resolved = {(noise, k): LSQMLOptions(noise=noise).for_slices(k, 10.0).noise_warmup
                for noise in ("gaussian", "poisson") for k in (1, 3)}
    assert resolved == {("gaussian", 1): 0, ("gaussian", 3): 0, ("poisson", 1): 0, ("poisson", 3): warmup}
    assert LSQMLOptions(noise="poisson", noise_warmup=2).for_slices(3).noise_warmup == 2
    poisson = LSQMLOptions(noise="poisson").for_slices(3)
    assert [poisson.at_epoch(e).noise for e in range(warmup + 2)] == ["gaussian"] * warmup + ["poisson"] * 2
    assert LSQMLOptions(noise="poisson").at_epoch(0).noise == "poisson"      # unresolved: no warm-up
    with pytest.raises(ValueError, match="noise_warmup"):
        LSQMLOptions(noise_warmup=-1)

    sample = SampleOptions(slices=3, slice_spacing_m=2e-9, wavelength_m=1.97e-12,
                           object_pixel_size_m=0.25e-10).resolve(None, 16)
    _, adapter = engine_spec("lsqml").make("poisson", sample=sample_model(sample), slices=3)
    state = lsqml.LSQMLState(object=np.ones((3, 40, 40), np.complex64), probe=np.ones((1, 16, 16), np.complex64))
    seen = []
    for epoch in (0, warmup - 1, warmup):
        state.epoch = epoch
        seen.append(adapter.payload(state).options.noise)
    assert seen == ["gaussian", "gaussian", "poisson"]


def test_low_dose_counting_data_through_slices_take_no_momentum():
    """momentum and delta None: through K > 1 slices on counting data below LOW_DOSE_COUNTS
    counts per pixel, momentum 0 and δ 0.1 (AD: momentum 0); otherwise 0.5 and the slices' δ (AD:
    its slices' rule); given values kept.
    reconstruct reads the dose from the data (integer-valued floats count; fractional ones do not)."""
    from daskpty.engines.sample_options import SampleOptions
    from daskpty.execution.engine_registry import engine_spec
    from daskpty.execution.parts import sample_model
    from daskpty.engines.dose_rule import LOW_DOSE_COUNTS
    from daskpty.io.dose import counts_per_pixel

    LSQMLOptions = lsqml.LSQMLOptions
    low, high = 0.5 * LOW_DOSE_COUNTS, 2 * LOW_DOSE_COUNTS
    resolved = {(k, c): LSQMLOptions().for_slices(k, c) for k in (1, 3) for c in (None, low, high)}
    assert {key: (o.momentum, o.delta) for key, o in resolved.items()} == {
        (1, None): (0.5, 0.1), (1, low): (0.5, 0.1), (1, high): (0.5, 0.1),
        (3, None): (0.5, 0.5), (3, low): (0.0, 0.1), (3, high): (0.5, 0.5)}
    given = LSQMLOptions(momentum=0.3, delta=0.4).for_slices(3, low)
    assert (given.momentum, given.delta) == (0.3, 0.4)
    assert LSQMLOptions().object_momentum == 0.5
    from daskpty.engines.ad import ADOptions
    assert [ADOptions().for_slices(k, c).momentum for k, c in ((1, low), (3, None), (3, high), (3, low))] == \
        [0.9, 0.7, 0.7, 0.0]
    assert ADOptions(momentum=0.5).for_slices(3, low).momentum == 0.5
    with pytest.raises(ValueError, match="momentum"):
        LSQMLOptions(momentum=1.0)

    rng = np.random.default_rng(0)
    counts = rng.poisson(12.0, (40, 16, 16)).astype(np.float32)
    assert abs(counts_per_pixel(counts) - 12.0) < 1.0
    assert counts_per_pixel(counts.astype(np.uint16)) == counts_per_pixel(counts)
    assert counts_per_pixel(counts * 1.5 + 0.25) is None        # scaled intensities are not counts
    hot, valid = counts.copy(), np.ones((16, 16), bool)
    hot[:, 0, 0], valid[0, 0] = 65535, False                    # a masked hot pixel does not count
    assert counts_per_pixel(hot, valid) == counts_per_pixel(counts, valid) < counts_per_pixel(hot) / 10
    sample = SampleOptions(slices=3, slice_spacing_m=2e-9, wavelength_m=1.97e-12,
                           object_pixel_size_m=0.25e-10).resolve(None, 16)
    _, adapter = engine_spec("lsqml").make("gaussian", sample=sample_model(sample), slices=3,
                                           counts_per_pixel=counts_per_pixel(counts))
    assert (adapter.options.object_momentum, adapter.options.object_delta) == (0.0, 0.1)
