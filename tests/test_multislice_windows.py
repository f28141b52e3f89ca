"""The windows' deformation sums through K slices and to a near-field detector
(engines/multislice_positions): against finite differences of the multislice model, against
the single-slice box forms for one far-field slice, and AD's against LSQML's (no cluster here)."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.engines import ad, lsqml
from daskpty.engines.ad import ADOptions
from daskpty.engines.multislice_positions import position_sums
from daskpty.engines.position_fits import solve_window_deformation

from daskpty.physics import multislice as ms
from synthetic import slice_model, whole_block
from test_compose import _setup

PAIRS = ((0, 0), (0, 1), (1, 0), (1, 1))


def _exit_and_loss(c, y, detector):
    def detected(patches):
        psi = ms.multislice_forward(c.shifted, patches, c.kernel, keep=False)[0]
        return np.fft.fft2(psi, norm="ortho") if detector is None else ms.detector_forward(psi, c.detector)

    def losses(patches):
        return ((np.sqrt((np.abs(detected(patches)) ** 2).sum(axis=1) + 1e-12) - np.sqrt(y)) ** 2).sum()

    return detected, losses


@pytest.mark.parametrize("k, near", [(2, False), (3, False), (1, True), (2, True)])
def test_window_sums_through_slices_are_the_gauss_newton_system(k, near):
    """With D_ab the windows' change u_b ∂_a O_k of every slice (the deformation L_ab) and d_ab
    the detected change it causes: window_num = Re⟨d_ab, χ⟩ = −½ ∂L/∂L_ab of the amplitude model
    (one mode) and window_gram = Σ_j Re⟨d_ab, d_cd⟩ on every 4th pattern, times 4 — both from
    finite differences of the multislice model along D_ab."""
    s = _setup(k, near, b=9)
    probe = s["probe"][:1]
    kernel, detector = (None if s[key] is None else s[key].astype(np.complex64) for key in ("kernel", "detector"))
    part = lsqml.chunk_step(s["slices"].astype(np.complex64), probe.astype(np.complex64), s["y"], s["pos"],
                            options=lsqml.LSQMLOptions(eps=1e-12), sample=slice_model(s["slices"], kernel, detector),
                            position_terms=True, window_sums=True, update_probe=False)
    c = whole_block(s["slices"], probe, s["y"], s["pos"], s["kernel"], s["detector"], np.complex128)
    detected, losses = _exit_and_loss(c, s["y"], s["detector"])
    box_d = c.box_gradients()
    n = c.n
    u = np.arange(n) - (n - 1) / 2.0
    offsets = (u[:, None], u[None, :])
    h = 1e-5
    changes, slopes = [], []
    for a, b in PAIRS:
        d = np.stack([offsets[b] * c.index.extract(np.ascontiguousarray(box_d[kk][a])) for kk in range(c.n_slices)])
        changes.append((detected(c.patches + h * d) - detected(c.patches - h * d)) / (2 * h))
        slopes.append((losses(c.patches + h * d) - losses(c.patches - h * d)) / (2 * h))
    slopes = np.asarray(slopes)
    np.testing.assert_allclose(part.arrays["window_num"], -0.5 * slopes, rtol=2e-4, atol=2e-4 * np.abs(slopes).max())
    every4 = [ch[::4].reshape(-1) for ch in changes]
    want = 4 * np.array([[np.real(np.vdot(x, z)) for z in every4] for x in every4])
    np.testing.assert_allclose(part.arrays["window_gram"], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert part.arrays["window_positions"][2] == len(s["pos"])
    assert solve_window_deformation(part.arrays["window_num"], part.arrays["window_gram"]) is not None


def test_one_far_field_slice_gives_the_single_slice_window_sums():
    """K = 1 in the far field: the sums carried through the (no) slices equal the single-slice
    step's box forms (lsqml.chunk_step), two probe modes. The object is cut to the windows' box:
    the single slice differentiates one-sidedly at the box's edge, K slices read beyond it."""
    s = _setup(1, False, b=12)
    c = whole_block(s["slices"], s["probe"], s["y"], s["pos"], None, None)
    obj, probe = c.obj_box[0], s["probe"].astype(np.complex64)
    s["pos"] = s["pos"] - c.box0
    opts = lsqml.LSQMLOptions(eps=1e-6)
    one = lsqml.chunk_step(obj, probe, s["y"], s["pos"], options=opts, position_terms=True, update_probe=False)
    many = lsqml.chunk_step(obj[None], probe, s["y"], s["pos"], options=opts, sample=slice_model(obj[None]),
                            position_terms=True, window_sums=True, update_probe=False)
    for key in ("window_num", "window_gram", "window_positions"):
        np.testing.assert_allclose(many.arrays[key], one.arrays[key], rtol=1e-3,
                                   atol=1e-3 * np.abs(one.arrays[key]).max(), err_msg=key)


@pytest.mark.parametrize("near", [False, True])
def test_ad_window_sums_through_slices_are_lsqmls_from_the_loss_gradient(near):
    """AD's multislice gradient forms the same sums from −∂L/∂ψ* (Gaussian loss: χ = −g/2), and
    none without the object gradient or with the intensity loss (no constant χ factor)."""
    s = _setup(2, near, b=8)
    obj, probe = s["slices"].astype(np.complex64), s["probe"][:1].astype(np.complex64)
    kw = dict(sample=slice_model(obj, *(None if s[key] is None else s[key].astype(np.complex64)
                                        for key in ("kernel", "detector"))))
    ref = lsqml.chunk_step(obj, probe, s["y"], s["pos"], options=lsqml.LSQMLOptions(eps=1e-6), position_terms=True,
                           window_sums=True, update_probe=False, **kw)
    got = ad.chunk_gradient(obj, probe, s["y"], s["pos"], options=ADOptions(loss="gaussian", eps=1e-6),
                            window_sums=True, **kw)
    for key in ("window_num", "window_gram", "window_positions"):
        np.testing.assert_allclose(got.arrays[key], ref.arrays[key], rtol=2e-3,
                                   atol=2e-3 * np.abs(ref.arrays[key]).max(), err_msg=key)
    assert np.abs(ref.arrays["window_num"]).max() > 0
    for extra in (dict(options=ADOptions(loss="intensity")), dict(options=ADOptions(), want_object=False)):
        assert "window_num" not in ad.chunk_gradient(obj, probe, s["y"], s["pos"], window_sums=True,
                                                     **extra, **kw).arrays


def test_position_sums_without_the_window_leave_it_out():
    s = _setup(2, False, b=5)
    c = whole_block(s["slices"], s["probe"], s["y"], s["pos"], s["kernel"], None, np.complex128)
    exit_waves, incident = ms.multislice_forward(c.shifted, c.patches, c.kernel)
    grads = ms.multislice_vjp(exit_waves, c.patches, incident, c.kernel)[0]
    (num, den, ratio), window = position_sums(c, grads, incident)
    assert window is None and num.shape == den.shape == ratio.shape == (5, 2) and (den > 0).all()


@pytest.mark.parametrize("near", [False, True])
def test_reused_sums_carry_nothing_and_keep_the_ratios(near, monkeypatch):
    """A step that reuses an earlier epoch's carried sums (``ReusedSums``) carries no change
    through the slices: with the ratios a forming step just gave, the patterns the sample did
    not carry get the same denominators, the carried ones their slice-wise form times the ratio,
    the numerators and the windows' right-hand sides are unchanged, and no normal matrix comes
    (the fit keeps the last one)."""
    from daskpty.engines import multislice_positions as mp

    s = _setup(3, near, b=12)
    c = whole_block(s["slices"], s["probe"], s["y"], s["pos"], s["kernel"], s["detector"], np.complex128)
    exit_waves, incident = ms.multislice_forward(c.shifted, c.patches, c.kernel)
    grads = ms.multislice_vjp(exit_waves, c.patches, incident, c.kernel)[0]
    scattered = c.boxes(grads, np.complex128)
    (num, den, ratio), window = position_sums(c, grads, incident, scattered=scattered, positions=s["pos"])
    assert np.isfinite(ratio).all() and (ratio > 0).all() and np.ptp(ratio, axis=0).max() == 0  # one per chunk
    carried = []
    monkeypatch.setattr(mp, "_carried", lambda *a, **k: carried.append(1))
    (num2, den2, ratio2), window2 = position_sums(c, grads, incident, scattered=scattered, positions=s["pos"],
                                                  reuse=mp.ReusedSums(ratio))
    assert not carried and "window_gram" not in window2 and "window_gram" in window
    np.testing.assert_array_equal(num2, num)
    np.testing.assert_array_equal(ratio2, ratio)
    np.testing.assert_allclose(den2[1::mp.SHIFT_STRIDE], den[1::mp.SHIFT_STRIDE], rtol=1e-12)
    np.testing.assert_allclose(den2[::mp.SHIFT_STRIDE].sum(axis=0), den[::mp.SHIFT_STRIDE].sum(axis=0), rtol=1e-9)
    for key in ("window_num", "window_positions"):
        np.testing.assert_array_equal(window2[key], window[key])


def test_the_window_fit_through_slices_removes_a_scans_rotation_and_scale(client):
    """Through ``reconstruct``: a 2-slice electron scan whose nominal positions are the true ones
    turned by 1°, stretched by 1.5 % and 0.3 px noisy; LSQML refinement with the window fit
    (from the true probe, the scale let free: ``window_scale`` and ``scan_scale`` on, off by
    default through slices) leaves less of the rotation and the scale, and a smaller position
    error, than without it (``window_gain=0``)."""
    import daskpty
    from daskpty.simulate.multislice import simulate_multislice

    ds = simulate_multislice(n=32, n_slices=2, grid=12, step=3.0, noise=True, photons=1e6, seed=4)
    true = ds.positions
    centre, turn = true.mean(axis=0), np.radians(1.0)
    rotation = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
    nominal = centre + (true - centre) @ rotation.T * 1.015 + 0.3 * np.random.default_rng(5).standard_normal(true.shape)
    g = ds.geometry
    data = daskpty.from_arrays(ds.intensities, nominal, wavelength_m=g.wavelength_m, object_pixel_size_m=g.pixel_size_m,
                               electron_voltage_v=300e3, convergence_semiangle_rad=25e-3)

    def left(refine):
        rec = daskpty.reconstruct(data, "lsqml", 30, client=client, slices=2, slice_spacing_m=g.spacing_m,
                                  probe=ds.truth.probe, refine_positions=refine, check_data=False, progress=False)
        p = np.asarray(rec.positions) - rec.origin
        design = np.c_[true, np.ones(len(true))]
        m = np.linalg.lstsq(design, p, rcond=None)[0][:2].T          # true -> refined, linear part
        d = p - true
        error = float(np.sqrt(((d - d.mean(axis=0)) ** 2).sum(axis=1).mean()))
        return (abs(np.degrees(np.arctan2(m[1, 0] - m[0, 1], m[0, 0] + m[1, 1]))),
                abs(np.sqrt(abs(np.linalg.det(m))) - 1), error, rec.history[-1])

    free = {"window_scale": True, "scan_scale": True, "start_epoch": 5}   # 25 epochs of refinement each
    rot_off, scale_off, err_off, _ = left({**free, "window_gain": 0})
    rot_on, scale_on, err_on, last = left(free)
    assert "affine_window_rotation_deg" in last
    assert rot_on < 0.5 * rot_off and scale_on < 0.8 * scale_off and err_on < 0.8 * err_off, \
        (rot_off, rot_on, scale_off, scale_on, err_off, err_on)
