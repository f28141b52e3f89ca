"""Half-set FRC (daskpty.workflows.half_set_frc and its parts in daskpty.metrics) and the rounds rule for small scans."""
import numpy as np
import pytest

from daskpty.execution.data import auto_rounds
from daskpty.metrics import (
    HalfSetFRC,
    common_region,
    frc,
    illumination_map,
    registered_frc,
    split_halves,
)
from daskpty.metrics.registration import _fourier_shift
from daskpty.workflows import half_set_frc


def _object(shape=(160, 160), seed=0):
    """Complex test object with structure at all frequencies (smoothed noise plus a sharp grid)."""
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(seed)
    amp = 1 + 0.3 * gaussian_filter(rng.standard_normal(shape), 1.5) * 3
    phase = gaussian_filter(rng.standard_normal(shape), 1.0) * 2
    fine = 0.1 * rng.standard_normal(shape)
    return (amp + fine) * np.exp(1j * phase)


def _disc(shape, radius):
    yy, xx = np.indices(shape)
    return np.hypot(yy - (shape[0] - 1) / 2, xx - (shape[1] - 1) / 2) < radius


def test_identical_objects_give_one():
    a = _object()
    r = registered_frc(a, a.copy(), _disc(a.shape, 60))
    assert isinstance(r, HalfSetFRC)
    assert np.allclose(r.frc[1:], 1.0, atol=1e-6)
    assert r.mean_frc == pytest.approx(1.0, abs=1e-6)
    assert r.resolution is None and r.half_period_px is None
    assert r.band == (0.1, 0.6)


def test_independent_noise_gives_about_zero():
    rng = np.random.default_rng(1)
    shape = (160, 160)
    a = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    b = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    r = registered_frc(a, b, _disc(shape, 70))
    assert abs(r.mean_frc) < 0.06
    inside = (r.frequency >= 0.05) & (r.frequency <= 0.3)
    assert np.mean(r.frc[inside] > r.half_bit[inside]) < 0.1  # almost every ring below ½ bit
    assert r.resolution is not None and r.resolution < 0.07  # crosses at the band's lower edge (0.05)


def test_shifted_copy_registers_back():
    a = _object(seed=2)
    shift = (2.3, -1.7)
    rng = np.random.default_rng(3)
    b = 1.3 * np.exp(0.8j) * _fourier_shift(a, shift)
    b = b + 0.02 * (rng.standard_normal(a.shape) + 1j * rng.standard_normal(a.shape))
    mask = _disc(a.shape, 60)
    r = registered_frc(a, b, mask)
    assert r.mean_frc > 0.95
    assert r.alignment.shift == pytest.approx((-shift[0], -shift[1]), abs=0.05)
    # without registration (same region, same window) the two disagree: the registration did the work
    plain = registered_frc(a, b, mask, subpixel=False, ramp=False)  # integer shift only
    assert plain.mean_frc < r.mean_frc - 0.05
    unregistered = frc(a * mask, b * mask)
    band = (unregistered.frequency >= 0.05) & (unregistered.frequency <= 0.3)
    assert unregistered.frc[band].mean() < 0.5


def test_split_halves_checkerboard_on_a_raster():
    yy, xx = np.mgrid[0:10, 0:12]
    pos = np.stack([yy.ravel(), xx.ravel()], axis=1) * 7.0 + np.random.default_rng(0).uniform(-0.7, 0.7, (120, 2))
    a, b = split_halves(pos)
    assert len(a) == len(b) == 60
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(120))
    # every position's nearest neighbours (up, down, left, right) lie in the other half
    colour = np.zeros(120, bool)
    colour[b] = True
    grid = colour.reshape(10, 12)
    assert not (grid[1:] == grid[:-1]).any() and not (grid[:, 1:] == grid[:, :-1]).any()
    # "alternate": even and odd indices
    a2, b2 = split_halves(pos, "alternate")
    assert (a2 == np.arange(0, 120, 2)).all() and (b2 == np.arange(1, 120, 2)).all()
    with pytest.raises(ValueError):
        split_halves(pos, "random")


def test_common_region_and_illumination():
    probe = np.zeros((16, 16), np.complex64)
    probe[4:12, 4:12] = 1
    pos_a = np.array([[20.0, 20.0], [20.0, 30.0]])
    pos_b = np.array([[20.0, 25.0]])
    ia = illumination_map(probe, pos_a, (50, 60))
    ib = illumination_map(probe, pos_b, (50, 60))
    assert ia.sum() == pytest.approx(2 * 64) and ib.sum() == pytest.approx(64)
    region = common_region(ia, ib, 0.5)
    assert region.sum() == 2 * 8 * 3  # two 8 x 3 strips where the windows of a and b overlap
    assert (region <= (ia > 0) & (ib > 0)).all()


def test_half_set_frc_on_a_tiny_simulated_scan(tmp_path):
    import daskpty
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        data = daskpty.simulate(tmp_path / "s.zarr", "small", n_patterns=144, probe_size=32, dose=1e6,
                                client=client)
        r = half_set_frc(data, epochs=12, client=client, rounds_per_epoch=2, check_data=False)
        with pytest.raises(TypeError, match="object"):
            half_set_frc(data, epochs=1, client=client, object=np.ones((8, 8)))
        with pytest.raises(ValueError, match="one boolean per pattern"):
            half_set_frc(data, epochs=1, client=client, split=np.zeros(3, bool))
    ia, ib = r.indices
    assert len(ia) + len(ib) == 144 and not set(ia) & set(ib)
    assert abs(len(ia) - len(ib)) <= 2
    assert r.halves[0].object.shape == r.halves[1].object.shape  # one frame for both
    assert r.mask.any() and r.seconds_per_epoch > 0
    assert max(abs(s) for s in r.alignment.shift) < 2  # the halves sit in the same frame
    # two different random objects over the same region: the reference for "no agreement"
    shape = r.mask.shape
    rng = np.random.default_rng(5)
    random_pair = registered_frc(np.exp(1j * rng.uniform(-1, 1, shape)), np.exp(1j * rng.uniform(-1, 1, shape)),
                                 r.mask)
    assert r.mean_frc > random_pair.mean_frc + 0.3
    assert r.mean_frc > 0.5


def test_rounds_rule_small_scans_get_minibatches():
    from daskpty.execution.data import MINIBATCH_PIXELS

    # a few hundred patterns of 128² or more no longer fall back to compact LSQML
    for n_patterns, n in [(258, 128), (258, 256), (200, 128), (300, 128), (100, 256), (449, 128)]:
        assert auto_rounds(n_patterns, n) == 3
        assert n_patterns * n * n // 3 >= MINIBATCH_PIXELS  # each round keeps enough work
    assert auto_rounds(258, 128) > 258 // 150  # more rounds than the 150-per-batch rule alone gives
    # below 3 rounds of 1 Mi pattern-pixels (measured: R = 1 as good or better) the old rule stays
    for n_patterns, n in [(100, 32), (100, 64), (250, 64), (100, 100), (150, 128), (180, 128)]:
        assert auto_rounds(n_patterns, n) == 1
    assert auto_rounds(400, 64) == 2  # 400 // 150
    assert auto_rounds(250, 64, modes=2) == 1 and auto_rounds(250, 64, modes=4) == 3  # modes add work
    assert auto_rounds(258, 128, persisted=False) == 1  # out of core: every round re-reads the data
    # unchanged for larger sets
    assert auto_rounds(576, 64) == 3 and auto_rounds(1600, 128) == 4 and auto_rounds(16384, 128) == 16
