"""Position refinement: the affine fit, the LSQML shift, and refinement end to end on a real
LocalCluster (ground truth, N workers == 1 worker, resume, bad input)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import daskpty
from daskpty.engines import lsqml
from daskpty.engines.positions import (
    PositionOptions,
    PositionsDiverged,
    affine_sums,
    lsqml_shift,
    solve_affine,
)
from daskpty.metrics import nrmse_vs_truth
from synthetic import make_dataset


def perturb(positions, rms=1.0, scale=0.015, rotation_deg=0.5, seed=1):
    """Nominal positions of a scan whose stage has ``rms`` px random errors, a scale error and a
    rotation about the scan centre."""
    rng = np.random.default_rng(seed)
    centre = positions.mean(axis=0)
    t = np.radians(rotation_deg)
    m = (1 + scale) * np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
    return (positions - centre) @ m.T + centre + rng.normal(0, rms, positions.shape)


def position_error(refined, truth) -> float:
    """rms distance after removing the global offset (the object frame's arbitrary shift)."""
    d = refined - truth
    d = d - d.mean(axis=0)
    return float(np.sqrt((d ** 2).sum(axis=1).mean()))


@pytest.fixture(scope="module")
def scan():
    ds = make_dataset(n=32, grid=12, step=4.0, photons=1e6, seed=0)
    return ds, perturb(ds.truth.positions)


def test_affine_fit_is_additive_and_exact():
    rng = np.random.default_rng(3)
    nominal = rng.uniform(20, 80, (200, 2))
    a = np.array([[1.02, 0.01], [-0.015, 0.99], [0.7, -1.3]])
    refined = np.c_[nominal, np.ones(200)] @ a
    whole = affine_sums(nominal, refined)
    left, right = affine_sums(nominal[:70], refined[:70]), affine_sums(nominal[70:], refined[70:])
    for key in whole:
        np.testing.assert_allclose(left[key] + right[key], whole[key], rtol=1e-12)
    np.testing.assert_allclose(solve_affine(whole["affine_xtx"], whole["affine_xty"]), a, atol=1e-9)
    kept = solve_affine(whole["affine_xtx"], whole["affine_xty"], remove_drift=True)
    centroid = nominal.mean(axis=0)
    np.testing.assert_allclose(np.r_[centroid, 1] @ kept, centroid, atol=1e-9)
    # too few patterns: no fit rather than a wild one
    two = affine_sums(nominal[:2], refined[:2])
    assert solve_affine(two["affine_xtx"], two["affine_xty"]) is None


def test_the_windows_small_isotropic_deformation_is_left_out():
    """The windows' scale request is soft-thresholded by the dead band; rotation and shear stay."""
    from daskpty.engines.position_fits import WINDOW_SCALE_DEADBAND as band, without_small_scale

    rotation_shear = np.array([[0.0, 3e-4], [-1e-4, 0.0]])
    small = rotation_shear + 0.5 * band * np.eye(2)
    np.testing.assert_allclose(without_small_scale(small), rotation_shear, atol=1e-15)
    large = rotation_shear - 4 * band * np.eye(2)
    np.testing.assert_allclose(without_small_scale(large), rotation_shear - 3 * band * np.eye(2), atol=1e-15)
    anisotropic = np.diag([2 * band, -2 * band])     # a shear along the axes: no isotropic part
    np.testing.assert_allclose(without_small_scale(anisotropic), anisotropic)


def test_the_affine_boost_leaves_the_window_correction_alone():
    """The boost extrapolates only what the refinement moved by itself: a fitted map that is the
    last one moved by the epoch's window correction (and the last boost) asks for no boost, and
    a change on top of it is boosted by gain − 1 alone."""
    from daskpty.engines.positions import affine_boost, mapped_affine, window_correction

    rng = np.random.default_rng(4)
    nominal = rng.uniform(20, 80, (50, 2))
    previous = np.array([[0.99, 0.004], [-0.006, 1.01], [0.3, -0.2]])
    window, _, _ = window_correction(np.array([[0.004, -0.002], [0.003, -0.001]]), (50.0, 50.0), 0.5)
    design = np.c_[nominal, np.ones(len(nominal))]
    # the map of the moved positions is the mapped map
    np.testing.assert_allclose(np.c_[design @ previous, np.ones(len(nominal))] @ window,
                               design @ mapped_affine(previous, window), atol=1e-12)
    last_boost = np.full((3, 2), 1e-3)
    fitted = mapped_affine(previous, window) + last_boost
    assert np.abs(affine_boost(previous, last_boost, fitted, 3.0, window)).max() < 1e-12
    own = np.array([[2e-3, 0.0], [0.0, -1e-3], [0.05, 0.0]])
    np.testing.assert_allclose(affine_boost(previous, last_boost, fitted + own, 3.0, window), 2 * own, atol=1e-12)
    # without the window the correction itself would have been boosted
    assert np.abs(affine_boost(previous, last_boost, fitted, 3.0)).max() > 1e-3


def test_lsqml_shift_points_to_the_true_position(scan):
    """With the true object and probe, the per-pattern LSQML shift from nominal positions off by
    known amounts points back to the truth (sign and size)."""
    ds, _ = scan
    rng = np.random.default_rng(5)
    truth = ds.truth.positions
    offsets = rng.uniform(-0.4, 0.4, truth.shape)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    part = lsqml.chunk_step(ds.truth.object, ds.truth.probe, y, truth + offsets,
                            options=lsqml.LSQMLOptions(), update_probe=False, position_terms=True)
    shift = lsqml_shift(*part.local["shift_terms"])
    for axis in (0, 1):
        r = np.corrcoef(shift[:, axis], -offsets[:, axis])[0, 1]
        assert r > 0.8, f"axis {axis}: correlation {r:.2f} between the shift and the error"
    gain = np.sum(shift * -offsets) / np.sum(offsets * offsets)
    assert 0.3 < gain < 1.5, f"the shift recovers {gain:.2f} of the error"


def _run(ds, positions, client, **kw):
    data = daskpty.from_arrays(ds.intensities, positions)
    kw.setdefault("chunk_length", 48)
    return daskpty.reconstruct(data, client=client, check_data=False, **kw)


def _truth(ds):
    return SimpleNamespace(object=ds.truth.object, probe=ds.truth.probe, positions=ds.truth.positions)


@pytest.mark.parametrize("engine, epochs", [("lsqml", 40), ("ad", 60)])
@pytest.mark.slow
def test_refinement_recovers_positions(scan, client, engine, epochs):
    ds, nominal = scan
    truth = ds.truth.positions
    kw = dict(engine=engine, epochs=epochs)
    if engine == "ad":
        kw.update(optimizer="adam")
    fixed = _run(ds, nominal, client, **kw)
    refined = _run(ds, nominal, client, refine_positions={"start_epoch": 3}, **kw)
    before = position_error(nominal, truth)
    after = position_error(refined.positions - refined.origin, truth)
    np.testing.assert_allclose(refined.nominal_positions - refined.origin, nominal, rtol=0, atol=1e-9)
    assert after < 0.6 * before, f"{engine}: position error {before:.2f} -> {after:.2f} px"
    e_fixed = nrmse_vs_truth(fixed.object, fixed.positions, fixed.illumination, _truth(ds))
    e_refined = nrmse_vs_truth(refined.object, refined.positions, refined.illumination, _truth(ds))
    assert e_refined < e_fixed, f"{engine}: object NRMSE {e_fixed:.3f} fixed, {e_refined:.3f} refined"
    updates = [h["position_rms_update"] for h in refined.history if "position_rms_update" in h]
    assert len(updates) == epochs - 3 and all(np.isfinite(updates))
    assert "affine_scale_x" in refined.history[-1]


def test_window_deformation_recovers_a_known_deformation():
    """The windows' normal equations (window_deformation.WindowDeformation) on exit-wave residuals made by
    sampling a smooth object at u + L u: the solved L is the L used (to first order)."""
    from scipy.ndimage import gaussian_filter, map_coordinates

    from daskpty.engines.positions import central_gradients, solve_window_deformation
    from daskpty.engines.window_deformation import WindowDeformation
    from daskpty.physics.backend import real_dots
    from daskpty.physics.patches import scatter_add_patches

    rng = np.random.default_rng(4)
    n, size = 32, 128
    field = gaussian_filter(rng.normal(size=(2, size, size)), (0, 2.5, 2.5))
    obj = (np.exp(0.5j * field[0] / field[0].std()) * (1 + 0.1 * field[1] / field[1].std())).astype(np.complex64)
    yy, xx = np.meshgrid(np.arange(n) - (n - 1) / 2, np.arange(n) - (n - 1) / 2, indexing="ij")
    probe = np.exp(-(yy ** 2 + xx ** 2) / (2 * 7.0 ** 2)).astype(np.complex64)
    true_l = np.array([[0.004, -0.003], [0.002, 0.005]])
    corners = np.stack(np.meshgrid(np.arange(20, 80, 6), np.arange(20, 80, 6), indexing="ij"), -1).reshape(-1, 2)
    dy, dx = central_gradients(obj, np)
    deform = WindowDeformation(n, np, (dy, dx))

    def sample(a, cy, cx):
        return map_coordinates(a.real, [cy, cx], order=3) + 1j * map_coordinates(a.imag, [cy, cx], order=3)

    g, w, grads = [], [], ([], [])
    for c in corners:
        centre = c + (n - 1) / 2
        uy, ux = true_l[0, 0] * yy + true_l[0, 1] * xx, true_l[1, 0] * yy + true_l[1, 1] * xx
        moved = sample(obj, centre[0] + yy + uy, centre[1] + xx + ux)
        here = obj[c[0]:c[0] + n, c[1]:c[1] + n]
        chi = probe * (moved - here)
        g.append(np.conj(probe) * chi)
        w.append(np.abs(probe) ** 2)
        grads[0].append(dy[c[0]:c[0] + n, c[1]:c[1] + n])
        grads[1].append(dx[c[0]:c[0] + n, c[1]:c[1] + n])
    g = np.asarray(g, np.complex64)
    scattered = np.zeros(obj.shape, np.complex64)
    scatter_add_patches(scattered, corners, g)
    grads = [np.asarray(v, np.complex64) for v in grads]
    deform.add_first(scattered, corners, np.stack([real_dots(d, g) for d in grads], 1))
    deform.add_gram(slice(0, len(corners)), np.asarray(w, np.float32), grads)
    sums = deform.sums(corners + n / 2)
    got = solve_window_deformation(sums["window_num"], sums["window_gram"])
    np.testing.assert_allclose(got, true_l, rtol=0, atol=0.1 * np.abs(true_l).max())
    assert sums["window_positions"][2] == len(corners)


def test_window_sums_on_the_box_equal_the_double_sums():
    """WindowDeformation's cheap forms equal the direct double sums (float64 reference): the first
    moments b from the box identity (Σ_j g_j scattered on the box, minus the window centres times
    the shift numerators), the normal matrix G from products summed over patterns first (every
    4th pattern of the chunk, scaled; here a sub-batch that starts at the chunk's pattern 3), from the
    gradient windows alone or with their squares gathered from the box, on windows that overlap and
    reach the box's edges."""
    from daskpty.engines.positions import central_gradients
    from daskpty.engines.window_deformation import WindowDeformation
    from daskpty.engines.window_deformation import squared_gradients
    from daskpty.physics.patches import PatchIndex, extract_patches, scatter_add_patches

    rng = np.random.default_rng(3)
    n, b, start, size = 16, 11, 3, 40
    box = (rng.normal(size=(size, size)) + 1j * rng.normal(size=(size, size))).astype(np.complex64)
    corners = rng.integers(0, size - n + 1, (b, 2))
    corners[0], corners[1] = (0, 0), (size - n, size - n)
    box_d = central_gradients(box, np)
    d = [extract_patches(x, corners, n) for x in box_d]
    g = (rng.normal(size=(b, n, n)) + 1j * rng.normal(size=(b, n, n))).astype(np.complex64)
    w = rng.random((b, n, n)).astype(np.float32)
    scattered = np.zeros_like(box)
    scatter_add_patches(scattered, corners, g)
    d64, g64, w64 = [x.astype(np.complex128) for x in d], g.astype(np.complex128), w.astype(np.float64)
    s = np.array([[np.real(np.vdot(d64[a][j], g64[j])) for a in range(2)] for j in range(b)])
    # the chunk: ``start`` patterns before the sub-batch (elsewhere on the box), then the b tested
    index = PatchIndex(np.vstack([np.zeros((start, 2), int), corners]), n, box.shape)
    batch = slice(start, start + b)
    deform = WindowDeformation(n, np, box_d, gram_stride=4)
    deform.add_first(scattered, corners, s)
    deform.add_gram(batch, w, d)                           # squares formed from the windows
    sums = deform.sums(np.zeros((b, 2)))
    other = WindowDeformation(n, np, box_d, gram_stride=4)  # squares gathered from the box, as LSQML does
    other.add_gram(batch, w, d, index.extract(squared_gradients(box_d, np), batch))
    np.testing.assert_allclose(other.sums(np.zeros((b, 2)))["window_gram"], sums["window_gram"], rtol=1e-6)
    c = np.arange(n) - (n - 1) / 2
    u = np.stack(np.meshgrid(c, c, indexing="ij"))                      # u_y, u_x
    second = [j for j in range(b) if (start + j) % 4 == 0]
    want_num = np.array([[sum(np.sum(u[bb] * np.real(np.conj(d64[a][j]) * g64[j])) for j in range(b))
                          for bb in range(2)] for a in range(2)]).reshape(4)
    want_gram = np.array([[sum(np.sum(u[bb] * u[dd] * np.real(np.conj(d64[a][j]) * d64[c_][j]) * w64[j])
                               for j in second) for c_ in range(2) for dd in range(2)]
                          for a in range(2) for bb in range(2)]) * 4
    np.testing.assert_allclose(sums["window_num"], want_num, rtol=1e-5, atol=1e-5 * np.abs(want_num).max())
    np.testing.assert_allclose(sums["window_gram"], want_gram, rtol=1e-4, atol=1e-4 * np.abs(want_gram).max())


def test_ad_window_sums_are_lsqmls_from_the_loss_gradient():
    """AD forms the windows' deformation sums from −∂L/∂ψ* (the noise model's window_chi_factor): for the Gaussian
    loss they equal LSQML's, formed from its exit-wave update χ, on the same chunk (patterns
    at shifted positions, so that χ is not small)."""
    from daskpty.engines.ad import ADOptions
    from daskpty.engines.ad.gradient import chunk_gradient

    ds = make_dataset(n=32, grid=6, step=4.0, photons=1e6, seed=5)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    moved = ds.truth.positions + np.random.default_rng(0).normal(0, 0.7, ds.truth.positions.shape)
    obj, probe = ds.truth.object.astype(np.complex64), ds.truth.probe.astype(np.complex64)
    ref = lsqml.chunk_step(obj, probe, y, moved, options=lsqml.LSQMLOptions(eps=1e-6), position_terms=True)
    got = chunk_gradient(obj, probe, y, moved, options=ADOptions(loss="gaussian", eps=1e-6), window_sums=True)
    for key in ("window_num", "window_gram", "window_positions"):
        np.testing.assert_allclose(got.arrays[key], ref.arrays[key], rtol=2e-3,
                                   atol=2e-3 * np.abs(ref.arrays[key]).max(), err_msg=key)
    assert np.abs(ref.arrays["window_num"]).max() > 0
    intensity = chunk_gradient(obj, probe, y, moved, options=ADOptions(loss="intensity"), window_sums=True)
    assert "window_num" not in intensity.arrays    # no constant χ factor: no window correction


@pytest.fixture(scope="module")
def wide_scan():
    """A wider scan (24 × 24 positions, 5 px apart): there a 1.5 % scale error moves the edge
    patterns by ~0.9 px, beside 1 px of random error (on the 12 × 12 scan by 0.3 px only)."""
    ds = make_dataset(n=32, grid=24, step=5.0, photons=1e6, seed=2)
    return ds, perturb(ds.truth.positions, seed=3)


@pytest.mark.slow
def test_window_correction_removes_the_scans_rotation_and_scale(wide_scan, client):
    """LSQML on a scan with 1 px random, 1.5 % scale and 0.5° rotation errors: the per-pattern
    shifts leave most of the global part; the window correction (window_gain, default 0.5)
    removes more of it."""
    from daskpty.engines.positions import affine_parameters

    ds, nominal = wide_scan
    truth = ds.truth.positions
    early = {"start_epoch": 6}                      # 18 epochs of refinement in each run
    off = _run(ds, nominal, client, epochs=24, refine_positions={"window_gain": 0, **early})
    on = _run(ds, nominal, client, epochs=24, refine_positions=early)
    start = dict(epochs=24, probe=ds.truth.probe)   # window_scale needs a probe of the right size
    off_p = _run(ds, nominal, client, refine_positions={"window_gain": 0, **early}, **start)
    scaled = _run(ds, nominal, client, refine_positions={"window_scale": True, **early}, **start)

    def global_error(rec):
        design = np.c_[truth, np.ones(len(truth))]
        a = np.linalg.lstsq(design, rec.positions - rec.origin, rcond=None)[0]
        p = affine_parameters(a)
        return abs(p["affine_scale_y"] - 1) + abs(p["affine_scale_x"] - 1), abs(p["affine_rotation_deg"])

    (s_off, r_off), (s_on, r_on), (s_offp, _), (s_sc, _) = map(global_error, (off, on, off_p, scaled))
    e_off, e_on, e_offp, e_sc = (position_error(r.positions - r.origin, truth) for r in (off, on, off_p, scaled))
    print(f"window correction off / on: rotation {r_off:.3f} / {r_on:.3f} deg, position error {e_off:.3f} / "
          f"{e_on:.3f} px; from the true probe, off / window_scale: scale error {s_offp:.4f} / {s_sc:.4f}, "
          f"position error {e_offp:.3f} / {e_sc:.3f} px")
    assert r_on < 0.5 * r_off and e_on < e_off
    assert s_sc < 0.7 * s_offp and e_sc < e_offp
    assert "affine_window_rotation_deg" in on.history[-1]


@pytest.mark.slow
def test_ad_window_correction_removes_the_scans_rotation_and_scale(wide_scan, client):
    """AD on the same scan from the true probe: with the window correction (rotation, scale and
    shear, window_scale) the global part of the errors and the position error fall."""
    from daskpty.engines.positions import affine_parameters

    ds, nominal = wide_scan
    truth = ds.truth.positions
    kw = dict(engine="ad", epochs=40, probe=ds.truth.probe)
    off = _run(ds, nominal, client, refine_positions={"window_gain": 0, "start_epoch": 5}, **kw)
    on = _run(ds, nominal, client, refine_positions={"start_epoch": 5}, **kw)
    assert on.options["refine_positions"]["window_scale"] is True

    def global_error(rec):
        design = np.c_[truth, np.ones(len(truth))]
        p = affine_parameters(np.linalg.lstsq(design, rec.positions - rec.origin, rcond=None)[0])
        return abs(p["affine_scale_y"] - 1) + abs(p["affine_scale_x"] - 1) + np.radians(abs(p["affine_rotation_deg"]))

    g_off, g_on = global_error(off), global_error(on)
    e_off, e_on = (position_error(r.positions - r.origin, truth) for r in (off, on))
    print(f"AD window correction off / on: global error {g_off:.4f} / {g_on:.4f}, position error "
          f"{e_off:.3f} / {e_on:.3f} px")
    assert g_on < 0.5 * g_off and e_on < e_off
    # AD takes the windows' sums in the first epoch of refinement and every 2nd after it (window_every)
    measured = [e for e, h in enumerate(on.history) if "affine_window_scale" in h]
    assert measured == list(range(5, 40, 2))


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
@pytest.mark.slow
def test_two_workers_equal_one_and_rounds_from_the_client(scan, client, engine):
    """Bit for bit up to float32 rounding: 1 worker, 2 workers, and round by round from the
    client (chunks not persisted, positions travel with the tasks)."""
    from distributed import Client, LocalCluster

    ds, nominal = scan
    kw = dict(engine=engine, epochs=6, rounds_per_epoch=2, refine_positions={"start_epoch": 2})
    two = _run(ds, nominal, client, **kw)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as c1, \
            Client(c1) as one_client:
        one = _run(ds, nominal, one_client, **kw)
        streamed = _run(ds, nominal, one_client, persist=False, **kw)
    for other in (one, streamed):
        np.testing.assert_allclose(other.positions, two.positions, rtol=0, atol=1e-6)
        np.testing.assert_allclose(other.object, two.object, rtol=0, atol=1e-4)
    assert np.abs(two.positions - two.nominal_positions).max() > 0.01  # they did move


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
@pytest.mark.slow
def test_resume_with_refinement_is_bit_identical(scan, client, tmp_path, engine):
    ds, nominal = scan
    kw = dict(engine=engine, rounds_per_epoch=2, refine_positions={"start_epoch": 1, "momentum": 0.5})
    straight = _run(ds, nominal, client, epochs=6, **kw)
    # stop after an epoch that took the window sums (LSQML every epoch, AD every 2nd from the start)
    stop = 3 if engine == "lsqml" else 2
    _run(ds, nominal, client, epochs=stop, checkpoint=tmp_path / "c.zarr", **kw)
    stored = daskpty.Reconstruction.from_zarr(tmp_path / "c.zarr")
    assert "position_velocity" in stored.engine_state and stored.nominal_positions is not None
    assert "window_map" in stored.engine_state        # the window correction pending for the next epoch
    resumed = _run(ds, nominal, client, epochs=6, resume=tmp_path / "c.zarr", **kw)
    np.testing.assert_array_equal(resumed.positions, straight.positions)
    np.testing.assert_array_equal(resumed.object, straight.object)


def test_auto_start_waits_longer_for_the_loss_where_the_scale_may_stretch():
    """A loss still falling 1 % an epoch holds "auto" back while the scan's scale is free (an
    early stretch would stay), not where it is held through slices; one slice with the scale
    held (few counts per lit pixel) keeps the free scale's rule (the early start cost there)."""
    from daskpty.engines import positions
    from daskpty.engines.position_options import PositionOptions

    free = PositionOptions(start_epoch="auto", scan_scale=True)
    held = PositionOptions(start_epoch="auto", scan_scale=False)

    def decided(options, fall, slices=3):
        state = SimpleNamespace(positions_start=None, epoch=10, epoch_start_probe=np.ones((1, 4, 4)),
                                probe=np.ones((1, 4, 4)) * 1.001, epoch_loss=100 * (1 - fall), previous_loss=100.0,
                                object=np.ones((slices, 8, 8)) if slices > 1 else np.ones((8, 8)))
        positions.settle_start(state, options)
        return state.positions_start

    assert decided(free, 0.01) is None and decided(held, 0.01) == 10
    assert decided(free, 0.004) == 10 and decided(held, 0.03) is None
    assert decided(held, 0.01, slices=1) is None and decided(held, 0.004, slices=1) == 10


def test_auto_start_takes_a_probe_still_moving_a_few_percent_where_the_scale_is_held():
    """Through slices (scale held) a probe changing 3 % an epoch counts as settled (it keeps
    taking up what the slab model leaves out); with a free scale it must change by at most 1 %."""
    from daskpty.engines import positions
    from daskpty.engines.position_options import PositionOptions

    def decided(scan_scale, change):
        state = SimpleNamespace(positions_start=None, epoch=10, epoch_start_probe=np.ones((1, 4, 4)),
                                probe=np.ones((1, 4, 4)) * (1 + change), epoch_loss=100.0, previous_loss=100.0,
                                object=np.ones((3, 8, 8)))
        positions.settle_start(state, PositionOptions(start_epoch="auto", scan_scale=scan_scale))
        return state.positions_start

    assert decided(True, 0.005) == 10 and decided(True, 0.03) is None
    assert decided(False, 0.03) == 10 and decided(False, 0.08) is None


@pytest.mark.slow
def test_auto_start_waits_for_the_probe_to_settle(scan, client, monkeypatch):
    """LSQML's default start ("auto"): refinement starts in the epoch after the first one (from
    epoch 2 on) whose probe changed by at most PROBE_SETTLED, measured here from the epochs'
    probes, or in epoch AUTO_LATEST; no position moves before it. The small scan's probe settles
    at once, so the tolerance is set from a first run's changes to a value the rule meets later."""
    from daskpty.engines import position_options, positions

    ds, nominal = scan

    def run():
        probes = []

        def keep(epoch, state, metrics):
            probes.append(np.array(state.get().probe))

        keep.takes_epoch_state = True
        rec = _run(ds, nominal, client, epochs=positions.AUTO_LATEST + 1, callback=keep, refine_positions=True)
        change = [np.inf] + [np.linalg.norm(p - b) / np.linalg.norm(p) for b, p in zip(probes, probes[1:])]
        decided = rec.history[-1]["position_start_epoch"]
        moved = [e for e, h in enumerate(rec.history) if h.get("position_rms_update", 0) > 0]
        assert moved[0] == decided and rec.options["refine_positions"]["start_epoch"] == "auto"
        return decided, change

    monkeypatch.setattr(position_options, "PROBE_SETTLED", 0.0)     # never settled: the latest start
    decided, change = run()
    assert decided == positions.AUTO_LATEST
    tolerance = float(min(change[3:7])) * (1 + 1e-3)   # the rule meets it there, not by a rounding
    monkeypatch.setattr(position_options, "PROBE_SETTLED", tolerance)
    monkeypatch.setattr(position_options, "LOSS_SETTLED", np.inf)   # the probe's rule alone
    decided, change2 = run()
    expected = next(e + 1 for e in range(positions.AUTO_EARLIEST - 1, len(change)) if change[e] <= tolerance)
    np.testing.assert_array_equal(change2[:expected], change[:expected])  # the same run until it starts
    assert decided == expected and positions.AUTO_EARLIEST <= decided <= 7, (change, decided)


@pytest.mark.filterwarnings("ignore:daskpty. position refinement starts at epoch")  # the run that stops before it
@pytest.mark.slow
def test_resume_across_the_auto_start_is_bit_identical(scan, client, tmp_path, monkeypatch):
    """Checkpoints before and after "auto" decides the start: both resume bit-identically."""
    from daskpty.engines import position_options

    monkeypatch.setattr(position_options, "LOSS_SETTLED", 0.02)   # a decision within these few epochs
    ds, nominal = scan
    kw = dict(engine="lsqml", rounds_per_epoch=2, refine_positions={"momentum": 0.5})
    straight = _run(ds, nominal, client, epochs=8, **kw)
    start = straight.history[-1]["position_start_epoch"]
    assert 3 <= start <= 6, start
    for stop in (start - 1, start + 1):
        path = tmp_path / f"c{stop}.zarr"
        _run(ds, nominal, client, epochs=stop, checkpoint=path, **kw)
        resumed = _run(ds, nominal, client, epochs=8, resume=path, **kw)
        np.testing.assert_array_equal(resumed.positions, straight.positions)
        np.testing.assert_array_equal(resumed.object, straight.object)
        assert resumed.history[-1]["position_start_epoch"] == start


def test_diverging_refinement_stops_with_one_message(scan, client, tmp_path):
    ds, nominal = scan
    with pytest.raises(PositionsDiverged, match="diverged.*limit 0.01 px.*checkpoint .* of epoch 2 is kept"):
        _run(ds, nominal, client, epochs=8, checkpoint=tmp_path / "d.zarr", checkpoint_every=2,
             refine_positions={"start_epoch": 2, "max_displacement": 0.01})
    assert daskpty.Reconstruction.from_zarr(tmp_path / "d.zarr").epochs == 2


@pytest.mark.parametrize("value, message", [
    ({"max_step": 0}, "max_step"),
    ({"momentum": 1.0}, "momentum"),
    ({"start_epoch": -1}, "start_epoch"),
    ({"start_epoch": "soon"}, "start_epoch must be an integer >= 0 or 'auto'"),
    ({"affine_blend": 2}, "affine_blend"),
    ({"optimizer": "lbfgs"}, "optimizer"),
    ({"steps": 3}, "unknown option"),
    ("yes", "must be True, False"),
    ({"window_scale": "yes"}, "window_scale"),
    ({"window_every": 0}, "window_every must be a whole number of epochs in"),
    ({"window_every": 1.5}, "window_every"),
])
def test_bad_refinement_options_are_one_line_errors(value, message):
    with pytest.raises((ValueError, TypeError), match=message) as info:
        PositionOptions.from_argument(value)
    assert "\n" not in str(info.value)


def test_window_sums_are_taken_every_window_every_epochs_of_refinement():
    """The window sums come in the first epoch of refinement and every window_every-th after it
    (AD's default every 2nd), none before the start or with the correction off."""
    from daskpty.engines.window_deformation import wants_window_sums

    def epochs(**kw):
        options = PositionOptions(**kw)
        return [e for e in range(12) if wants_window_sums(options, e)]

    assert epochs(start_epoch=3) == list(range(3, 12))
    assert epochs(start_epoch=3, window_every=2) == [3, 5, 7, 9, 11]
    assert PositionOptions().for_engine("ad").window_every == 2
    assert PositionOptions().for_engine("lsqml").window_every == 1
    assert epochs(start_epoch=4, window_every=3) == [4, 7, 10]
    assert epochs(start_epoch=0, window_gain=0) == []


def test_window_scale_follows_the_start_probe(scan, client):
    """By default the scale part of the window correction is on when the run starts from a
    given probe and off when the probe is guessed from the data; a setting given stays."""
    ds, nominal = scan
    resolved = {}
    start = {"start_epoch": 0}
    for label, kw in (("guessed", {}), ("given", {"probe": ds.truth.probe}),
                      ("given, off", {"probe": ds.truth.probe, "refine_positions": {**start, "window_scale": False}})):
        rec = _run(ds, nominal, client, epochs=1, **{"refine_positions": start, **kw})
        resolved[label] = rec.options["refine_positions"]["window_scale"]
    assert resolved == {"guessed": False, "given": True, "given, off": False}
    assert PositionOptions().window_scale is None
    assert PositionOptions().for_start_probe(guessed=True).window_scale is False
    through = PositionOptions().for_start_probe(guessed=False, slices=3)   # the scale held through slices
    assert (through.window_scale, through.scan_scale) == (False, False)
    assert PositionOptions().for_start_probe(guessed=False).scan_scale is True
    assert PositionOptions(scan_scale=True).for_start_probe(guessed=False, slices=3).scan_scale is True


def test_the_scans_scale_is_held_on_few_counts_per_lit_pixel():
    """On counting data of few counts per lit pixel the windows' scale is off by default, and at
    fewer the scan's scale too (the amplitude model's bias reads as a stretch there:
    daskpty.engines.dose_rule); a setting given stays; data that are not counts keep the
    probe's rule."""
    from daskpty.engines.dose_rule import LOW_COUNTS_SCAN_SCALE, LOW_COUNTS_WINDOW_SCALE
    from daskpty.io.dose import counts_per_lit_pixel

    assert LOW_COUNTS_SCAN_SCALE < LOW_COUNTS_WINDOW_SCALE
    resolved = {counts: PositionOptions().for_start_probe(guessed=False, counts_per_lit_pixel=counts)
                for counts in (0.5 * LOW_COUNTS_SCAN_SCALE, 1.5 * LOW_COUNTS_SCAN_SCALE, 2 * LOW_COUNTS_WINDOW_SCALE, None)}
    assert [(o.window_scale, o.scan_scale) for o in resolved.values()] == \
        [(False, False), (False, True), (True, True), (True, True)]
    given = PositionOptions(window_scale=True, scan_scale=True).for_start_probe(guessed=False, counts_per_lit_pixel=1.0)
    assert (given.window_scale, given.scan_scale) == (True, True)
    assert PositionOptions().loss_settled(slices=1) == PositionOptions(scan_scale=False).loss_settled(slices=1)
    assert PositionOptions(scan_scale=False).loss_settled(slices=3) > PositionOptions().loss_settled(slices=3)

    rng = np.random.default_rng(1)
    counts = rng.poisson(30.0, (40, 16, 16)).astype(np.float32)
    counts[:, :8] = 0                                                  # a dark half of the detector
    lit = counts[counts > 0]
    assert counts_per_lit_pixel(counts) == pytest.approx(lit.mean(), rel=0.05)
    assert counts_per_lit_pixel(counts) > 1.9 * float(counts.mean())  # the dark half does not count
    assert counts_per_lit_pixel(counts * 1.5 + 0.25) is None          # scaled intensities are not counts
    assert counts_per_lit_pixel(np.zeros((40, 16, 16), np.uint16)) is None


@pytest.mark.slow
def test_refinement_at_few_counts_per_lit_pixel_costs_at_most_five_percent(tmp_path):
    """An exact scan of the small preset at 3·10⁴ photons per pattern (34 counts per lit pixel):
    refining (LSQML defaults) costs at most 5 % of the plain run's NRMSE at 30 epochs. With the
    scan's scale free the scan stretched (+1.3 % by epoch 60) and cost 1.13–1.21× at 30."""
    from distributed import Client, LocalCluster

    data = daskpty.simulate(tmp_path / "d.zarr", preset="small", seed=5, dose=3e4, n_workers=1)
    truth = SimpleNamespace(object=np.asarray(data.truth.object), positions=np.asarray(data.truth.positions))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as c:
        runs = [daskpty.reconstruct(data.path, epochs=30, client=c, progress=False, **kw)
                for kw in ({}, {"refine_positions": True})]
    plain, refined = (nrmse_vs_truth(r.object, r.positions, r.illumination, truth) for r in runs)
    assert (runs[1].options["refine_positions"]["window_scale"], runs[1].options["refine_positions"]["scan_scale"]) \
        == (False, False)
    assert refined <= 1.05 * plain, f"refined {refined:.4f} against {plain:.4f} without refining"


@pytest.mark.slow
def test_cli_refines_and_show_draws_the_corrections(scan, tmp_path):
    """``daskpty reconstruct --refine-positions k=v`` stores refined and nominal positions;
    ``daskpty show`` draws them as a panel; a bad setting is one line, exit 2."""
    from daskpty.cli import main
    from daskpty.monitor.plot import panel_names, summary_figure

    ds, nominal = scan
    daskpty.from_arrays(ds.intensities, nominal).to_zarr(tmp_path / "s.zarr")
    out = tmp_path / "r.zarr"
    code = main([ "reconstruct", str(tmp_path / "s.zarr"), "-o", str(out), "--epochs", "6", "--workers", "1",
                  "--quiet", "--refine-positions", "start_epoch=2,max_step=0.4,affine=false,window_gain=0"])
    assert code == 0
    rec = daskpty.Reconstruction.from_zarr(out)
    assert rec.options["refine_positions"]["max_step"] == 0.4
    assert rec.options["refine_positions"]["affine"] is False
    moved = np.abs(rec.positions - rec.nominal_positions).max()
    assert 0 < moved <= 4 * 0.4 + 1e-9   # 4 refining epochs of at most max_step (no window moves)
    assert "positions" in panel_names(summary_figure(rec))
    assert main(["show", str(out), "-o", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert main(["reconstruct", str(tmp_path / "s.zarr"), "-o", str(tmp_path / "x.zarr"),
                 "--refine-positions", "max_step"]) == 2
    assert not (tmp_path / "x.zarr").exists()


def _adam_walk(pull, steps=40, patterns=2000, threshold=3.0, seed=0):
    """Positions (patterns, 2) after ``steps`` AD position steps against gradients of unit
    scatter plus a constant ``pull`` (in units of the scatter), from zero."""
    from daskpty.engines.position_options import PositionOptions
    from daskpty.engines.positions import step_with_optimizer

    rng = np.random.default_rng(seed)
    options = PositionOptions(noise_threshold=threshold, max_step=8.0).for_engine("ad")
    zeros = np.zeros((patterns, 2))
    local = {"positions": zeros, "velocity": zeros, "moment2": zeros}
    noise = np.ones((patterns, 2))
    for t in range(1, steps + 1):
        local, _ = step_with_optimizer(local, pull + rng.standard_normal((patterns, 2)), options, t, noise=noise)
    return local["positions"]


def test_ads_noise_gate_stops_noise_draws_and_lets_a_steady_pull_through():
    """Adam's steps are about lr whatever the gradient: on pure noise the ungated walk wanders
    ~lr per step; the gate, testing the mean gradient against its own averaged scatter, keeps the
    patterns nearly still (under a tenth of the free walk), while a pull of three scatters that
    persists moves them down it at least 0.6 as far as without the gate (its mean gradient has
    scatter 0.23 after many steps, so the gate takes (3 − 3 · 0.23) / 3 of it)."""
    still_free, still_gated = _adam_walk(0.0, threshold=0.0), _adam_walk(0.0)
    assert np.sqrt(np.mean(still_gated ** 2)) < 0.1 * np.sqrt(np.mean(still_free ** 2))
    pulled_free, pulled_gated = _adam_walk(3.0, threshold=0.0), _adam_walk(3.0)
    assert np.all(pulled_free.mean(axis=0) < 0)                     # down the gradient
    assert np.all(pulled_gated.mean(axis=0) < 0.6 * pulled_free.mean(axis=0))


def test_a_pattern_far_off_is_gated_by_the_typical_scatter_not_its_own():
    """The scatter comes from each pattern's residual as if it were noise; a pattern far off its
    position has a large residual that is signal, so it is measured by the chunk's median."""
    from daskpty.engines.positions import noise_gate, typical_scatter

    noise = np.ones((9, 2))
    noise[0] = 10.0                      # the far-off pattern's residual is ten times the others'
    grad = np.full((9, 2), 5.0)
    assert np.all(noise_gate(grad, noise, 3.0)[0] == 0)              # its own would stop it
    assert np.allclose(noise_gate(grad, typical_scatter(noise), 3.0), 0.4)


def test_the_noise_gate_opens_for_good_once_the_patterns_move():
    """AD's gate holds exact scans still; an epoch whose patterns moved more than gate_release rms
    shows errors to fix, and from then on the steps are ungated (a gated run stalled 0.31 px off
    bench_positions' scan, 0.06 px ungated). The opening survives a checkpoint."""
    from daskpty.engines.ad.state import ADState
    from daskpty.engines.positions import finish_epoch, restore_rules, start_arrays

    options = PositionOptions().for_engine("ad")                    # from the "auto" start
    assert options.noise_threshold > 0 and options.gate_release > 0
    state = ADState(object=np.ones((8, 8), np.complex64), probe=np.ones((1, 4, 4), np.complex64), epoch=3)
    state.positions_start = 2

    def epoch_with_moves(rms):
        state.epoch_moves = np.array([rms ** 2 * 10, 10.0])
        finish_epoch(state, options, lambda *args: None)
        return options.for_state(state).noise_threshold

    assert epoch_with_moves(0.01) == options.noise_threshold          # standing still: gated
    assert epoch_with_moves(2 * options.gate_release) == 0            # moving: open
    assert epoch_with_moves(0.0) == 0                                  # and it stays open
    resumed = restore_rules(ADState(object=state.object, probe=state.probe, epoch=3), start_arrays(state))
    resumed.positions_start = 2
    assert options.for_state(resumed).noise_threshold == 0
    # from a fixed start the residual is the forming object's, not noise: no gate
    fresh = ADState(object=state.object, probe=state.probe, epoch=3)
    fresh.positions_start = 2
    assert options.for_state(fresh).noise_threshold > 0                             # auto: gated
    assert PositionOptions(start_epoch=2).for_engine("ad").for_state(fresh).noise_threshold == 0
