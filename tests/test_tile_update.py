"""A tile's update writes into arrays of the epoch's own (``lsqml.apply_in_place``): the same bits
as the engines' copy-and-rebind update, and the previous epoch's arrays stay as they were."""
import copy

import numpy as np
import pytest

from daskpty.engines import lsqml
from daskpty.execution import tile_numbers
from daskpty.engines.partials import BoxedArray, Partial


def _state(shape, rng, momentum_history=True):
    obj = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
    velocity = (0.1 * rng.standard_normal(shape)).astype(np.complex64) if momentum_history else None
    probe = (rng.standard_normal((1, 8, 8)) + 0j).astype(np.complex64)
    return lsqml.LSQMLState(object=obj, probe=probe, epoch=3, velocity=velocity)


def _round_sum(shape, rng, offset, size):
    lead = shape[:-2]
    num = (rng.standard_normal(lead + size) + 1j * rng.standard_normal(lead + size)).astype(np.complex64)
    illum = rng.random(lead + size).astype(np.float32) * 5
    return Partial(boxes={"object": BoxedArray(offset, num), "illumination": BoxedArray(offset, illum)},
                   arrays={"probe": (rng.standard_normal((1, 8, 8)) + 0j).astype(np.complex64)},
                   scalars={"n": 7.0})


@pytest.mark.parametrize("shape", [(150, 90), (2, 150, 90)], ids=["1 slice", "2 slices"])
@pytest.mark.parametrize("momentum", [0.5, 0.0])
def test_in_place_rounds_equal_the_engines_update_and_leave_the_previous_epoch_alone(shape, momentum):
    rng = np.random.default_rng(4)
    options = lsqml.LSQMLOptions(momentum=momentum)
    previous = _state(shape, rng)
    kept = copy.deepcopy(previous)
    sums = [_round_sum(shape, rng, (3, 5), (140, 60)), _round_sum(shape, rng, (10, 0), (100, 90))]
    layers = shape[0] if len(shape) == 3 else None
    peaks = [np.float32(6.0) if layers is None else np.full(layers, 6.0, np.float32),
             np.float32(7.5) if layers is None else np.array([7.5, 5.0], np.float32)]

    expected = lsqml.begin_epoch(copy.copy(previous), options)
    for total, peak in zip(sums, peaks):
        expected = lsqml.apply(copy.copy(expected), total, options, illumination_max=peak)

    state = lsqml.begin_owned_epoch(lsqml.begin_epoch(copy.copy(previous), options), options)
    for total, peak in zip(sums, peaks):
        state = lsqml.apply_in_place(state, total, options, peak)

    for name in ("object", "illumination", "probe"):
        np.testing.assert_array_equal(getattr(state, name), getattr(expected, name), err_msg=name)
    if momentum:
        np.testing.assert_array_equal(state.epoch_start_object, kept.object)
    for name in ("object", "velocity", "probe"):  # the previous epoch's end, as a client may fetch it
        np.testing.assert_array_equal(getattr(previous, name), getattr(kept, name), err_msg=name)
    assert not np.shares_memory(state.object, previous.object)


@pytest.mark.parametrize("shape", [(150, 90), (2, 150, 90)], ids=["1 slice", "2 slices"])
@pytest.mark.parametrize("agree", [True, False])
def test_the_in_place_epoch_end_equals_the_engines_and_leaves_the_previous_epoch_alone(shape, agree):
    rng = np.random.default_rng(7)
    options = lsqml.LSQMLOptions(momentum=0.5, normalize_every=1)
    previous = _state(shape, rng)
    kept = copy.deepcopy(previous)
    total = _round_sum(shape, rng, (3, 5), (140, 60))

    expected = lsqml.apply(lsqml.begin_epoch(copy.copy(previous), options), total, options)
    expected = lsqml.end_epoch(expected, options, agree=agree)
    state = lsqml.begin_owned_epoch(lsqml.begin_epoch(copy.copy(previous), options), options)
    state = lsqml.end_epoch(lsqml.apply_in_place(state, total, options), options, agree=agree, in_place=True)

    for name in ("object", "velocity", "probe"):
        np.testing.assert_array_equal(getattr(state, name), getattr(expected, name), err_msg=name)
        np.testing.assert_array_equal(getattr(previous, name), getattr(kept, name), err_msg=name)
    assert state.epoch == expected.epoch and state.epoch_start_object is None


def test_the_epoch_ends_sums_by_blocks_of_rows_equal_the_whole(monkeypatch):
    """The epoch end's shares on a tile go block by block of rows (their temporaries were a
    spike at each epoch's end): the same count and, to rounding, the same sums as in one block."""

    rng = np.random.default_rng(0)
    shape = (50, 40)

    def field():
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)

    state = lsqml.LSQMLState(field(), np.ones((1, 8, 8), np.complex64), epoch=1, velocity=field(),
                             epoch_start_object=field(), illumination=rng.random(shape).astype(np.float32),
                             extra={"illumination_max": 1.0})
    options = lsqml.LSQMLOptions(momentum=0.5, normalize_every=2)
    names = ("agree", "scales")
    monkeypatch.setattr(tile_numbers, "END_BLOCK_ROWS", 10**6)
    whole = tile_numbers.end_share(names, state, options, (3, 47))
    monkeypatch.setattr(tile_numbers, "END_BLOCK_ROWS", 7)
    blocks = tile_numbers.end_share(names, state, options, (3, 47))
    assert set(whole) == {"dot", "lit", "abs_sum", "abs_sum_moved"} and whole["lit"][0] > 0
    np.testing.assert_array_equal(blocks["lit"], whole["lit"])
    for key in ("abs_sum", "abs_sum_moved"):  # (float64 sums)
        np.testing.assert_allclose(blocks[key], whole[key], rtol=1e-12)
    np.testing.assert_allclose(blocks["dot"], whole["dot"], rtol=1e-5)  # (complex64 vdot; only its sign is used)
