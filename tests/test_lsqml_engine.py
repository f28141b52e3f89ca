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
