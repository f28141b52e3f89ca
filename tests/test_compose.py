"""Issue 33: the forward model's parts compose — K slices or a near-field detector with position
refinement and a varying probe, in LSQML and AD — checked at the chunk level against finite
differences and against the single-slice code path (no cluster here; the runs through
``reconstruct`` are in tests/test_compose_runs.py)."""
from __future__ import annotations

import numpy as np
import pytest

from daskpty.engines import ad, eigen_probes, lsqml
from daskpty.engines.multislice_positions import SHIFT_STRIDE
from daskpty.engines import pattern_probes as pp
from daskpty.engines import probe_model as pm
from daskpty.engines.ad import ADOptions
from daskpty.engines.ad import opr as ad_opr
from daskpty.physics import multislice as ms
from daskpty.physics.multislice import SliceGeometry
from daskpty.physics.propagation import near_field_kernel
from synthetic import slice_model, whole_block

LAM, DX = 1.97e-12, 0.25e-10


def _setup(k=2, near=False, n=16, b=6, seed=3):
    rng = np.random.default_rng(seed)
    kernel = SliceGeometry(k, 2e-9, LAM, DX).kernel(n, dtype=np.complex128)
    detector = near_field_kernel(n, 55e-6, 1e-10, 1.0, 3e-3, dtype=np.complex128) if near else None
    h = 34
    slices = np.exp(1j * 0.3 * rng.standard_normal((k, h, h)) - 0.05 * rng.random((k, h, h)))
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = np.exp(-(yy**2 + xx**2) / (2 * (n / 5) ** 2)) * np.exp(0.4j * rng.standard_normal((n, n)))
    probe = np.stack([probe, 0.3 * np.roll(probe, 2, axis=0)]).astype(np.complex128)
    pos = np.round(rng.uniform(n / 2 + 1, h - n / 2 - 1, (b, 2)) * 1024) / 1024  # fractions exact in float32
    y = np.abs(rng.standard_normal((b, n, n)) + 1j * rng.standard_normal((b, n, n))) ** 2
    return dict(slices=slices, probe=probe, pos=pos, y=y, kernel=kernel, detector=detector, rng=rng)


@pytest.mark.parametrize("k, near", [(2, False), (1, True), (3, True)])
def test_position_gradient_through_slices_matches_finite_differences(k, near):
    s = _setup(k, near)
    kw = dict(sample=slice_model(s["slices"], s["kernel"], s["detector"]), options=ADOptions(loss="gaussian"))
    part = ad.chunk_gradient(s["slices"], s["probe"], s["y"], s["pos"], want_positions=True, **kw)
    grad = part.arrays["position_grad"]

    def loss(pos):
        return ad.chunk_loss(s["slices"], s["probe"], s["y"], pos, **kw).scalars["loss"]

    def central(j, a, h):
        plus, minus = s["pos"].copy(), s["pos"].copy()
        plus[j, a] += h
        minus[j, a] -= h
        return (loss(plus) - loss(minus)) / (2 * h)

    # Steps of 2⁻⁹ and 2⁻¹⁰ px keep the positions' float32 fractions exact; Richardson's
    # extrapolation removes the h² term (band-limited windows have large third derivatives).
    for j, a in [(0, 0), (2, 1), (5, 0)]:
        fd = (4 * central(j, a, 2.0**-10) - central(j, a, 2.0**-9)) / 3
        assert fd == pytest.approx(grad[j, a], rel=1e-6, abs=1e-9)


def test_lsqml_shift_terms_through_slices_are_the_gauss_newton_step():
    """Far field: with D_a the windows' change when every slice moves by a unit under the probe
    (central differences, as one slice takes them) and d_a the exit wave's change it causes,
    Re⟨d_a, χ⟩ = −½ ∂L/∂a for the amplitude model (χ = −g_ψ/2 with one mode) and ‖d_a‖² its
    squared norm — both against finite differences of the multislice model along D_a. The norm
    is carried through the slices on every SHIFT_STRIDE-th pattern (exact there) and scaled from
    its slice-wise form on the others (within 30 % here)."""
    s = _setup(2, False)
    probe = s["probe"][:1]
    part = lsqml.chunk_step(s["slices"].astype(np.complex64), probe.astype(np.complex64), s["y"], s["pos"],
                            options=lsqml.LSQMLOptions(eps=1e-12),
                            sample=slice_model(s["slices"], s["kernel"].astype(np.complex64)),
                            position_terms=True, update_probe=False)
    num, den, _ = part.local["shift_terms"]
    c = whole_block(s["slices"], probe, s["y"], s["pos"], s["kernel"], None, np.complex128)
    box_d = c.box_gradients()

    def exit_wave(patches):
        return ms.multislice_forward(c.shifted, patches, c.kernel, keep=False)[0]

    def losses(patches):
        far = np.fft.fft2(exit_wave(patches), norm="ortho")
        return ((np.sqrt((np.abs(far) ** 2).sum(axis=1) + 1e-12) - np.sqrt(s["y"])) ** 2).sum(axis=(1, 2))

    h = 1e-5
    for a in range(2):
        d = np.stack([c.index.extract(np.ascontiguousarray(box_d[k][a])) for k in range(2)])
        change = (exit_wave(c.patches + h * d) - exit_wave(c.patches - h * d)) / (2 * h)
        want = (np.abs(change) ** 2).reshape(len(change), -1).sum(axis=1)
        np.testing.assert_allclose(den[::SHIFT_STRIDE, a], want[::SHIFT_STRIDE], rtol=1e-4)
        np.testing.assert_allclose(den[:, a], want, rtol=0.3)
        slope = (losses(c.patches + h * d) - losses(c.patches - h * d)) / (2 * h)
        np.testing.assert_allclose(num[:, a], -0.5 * slope, rtol=1e-4, atol=1e-4 * np.abs(slope).max())


def _variable(model, probe, local, like, background=None, eigen=None, cdtype=np.complex128):
    return pp.PatternProbes(model, probe, eigen, local, like, active=True, background=background, cdtype=cdtype)


@pytest.mark.parametrize("near", [False, True])
def test_probe_model_gradients_through_slices_match_finite_differences(near):
    """∂L/∂w_jk, ∂L/∂U_k, ∂L/∂b and ∂L/∂c_j of a 2-slice (or near-field) chunk, as tests/test_opr.py
    checks them for one slice."""
    s = _setup(2, near)
    rng, probe, b = s["rng"], s["probe"], len(s["y"])
    kw = dict(sample=slice_model(s["slices"], s["kernel"], s["detector"]), options=ADOptions(loss="gaussian"))
    model = pm.ProbeModelOptions(opr_modes=3, background="pixel", start_epoch=0)
    intensity_model = pm.ProbeModelOptions(fit_intensity=True, start_epoch=0)
    eigen = eigen_probes.initial_eigen_probes(probe[0], 2).astype(np.complex128)
    w0 = np.c_[1 + 0.1 * rng.standard_normal(b), 0.1 * rng.standard_normal((b, 2))]
    c0 = (1 + 0.1 * rng.standard_normal(b))[:, None]
    bg0 = 0.5 * np.abs(rng.standard_normal(s["y"].shape[1:]))

    def variable(w=w0, e=eigen, bg=bg0, c=None):
        if c is not None:
            return _variable(intensity_model, probe, {"intensity_scale": c}, s["y"])
        return _variable(model, probe, {"opr_weights": w}, s["y"], background=bg, eigen=e)

    def loss(**v):
        return ad.chunk_loss(s["slices"], probe, s["y"], s["pos"], variable=variable(**v), **kw).scalars["loss"]

    def central(name, base, index, unit=1.0, h=1e-6):
        plus, minus = base.copy(), base.copy()
        plus[index] += h * unit
        minus[index] -= h * unit
        return (loss(**{name: plus}) - loss(**{name: minus})) / (2 * h)

    v = variable()
    part = ad.chunk_gradient(s["slices"], probe, s["y"], s["pos"], variable=v, **kw)
    g_w = ad_opr.pattern_gradients(v)["opr_weights"]
    g_u = np.fft.ifft2(part.arrays["opr_eigen_num"], norm="ortho")
    g_b = part.arrays["background_grad"].reshape(bg0.shape)
    for index in [(0, 0), (3, 1), (5, 2)]:
        assert central("w", w0, index) == pytest.approx(g_w[index], rel=1e-5, abs=1e-7)
    for index in [(0, 5, 6), (1, 8, 3)]:
        for unit in (1.0, 1j):
            assert central("e", eigen, index, unit) == pytest.approx((np.conj(unit) * g_u[index]).real,
                                                                   rel=1e-4, abs=1e-6)
    for index in [(0, 0), (2, 3)]:
        assert central("bg", bg0, index) == pytest.approx(g_b[index], rel=1e-5, abs=1e-7)
    v = variable(c=c0)
    ad.chunk_gradient(s["slices"], probe, s["y"], s["pos"], variable=v, **kw)
    g_c = ad_opr.pattern_gradients(v)["intensity_scale"]
    for j in (0, 4):
        assert central("c", c0, (j, 0)) == pytest.approx(g_c[j, 0], rel=1e-5)


@pytest.mark.parametrize("brightness_first", [False, True])
def test_one_far_field_slice_with_a_varying_probe_equals_the_single_slice_step(brightness_first):
    """K = 1 in the far field through the composed multislice step gives what the single-slice
    LSQML step gives with the same varying probe: probe and eigen-probe sums, step lengths and
    every pattern's least-squares terms."""
    s = _setup(1, False, b=8)
    obj = s["slices"][0].astype(np.complex64)
    probe = s["probe"].astype(np.complex64)
    rng, b = s["rng"], len(s["y"])
    model = pm.ProbeModelOptions(opr_modes=2, fit_intensity=True, background="constant", start_epoch=0,
                                 brightness_first=brightness_first).for_engine("lsqml")
    eigen = eigen_probes.initial_eigen_probes(probe[0], 1)
    local = {"opr_weights": np.c_[1 + 0.1 * rng.standard_normal(b), 0.1 * rng.standard_normal(b)],
             "intensity_scale": (1 + 0.1 * rng.random(b))[:, None]}
    options = lsqml.LSQMLOptions()
    out = []
    for o in (obj, obj[None]):
        v = _variable(model, probe, local, s["y"], background=np.full((1, 1), 0.1, np.float32), eigen=eigen,
                      cdtype=np.complex64)
        part = lsqml.chunk_step(o, probe, s["y"], s["pos"], options=options, variable=v)
        out.append((part, v))
    (one, v1), (many, v2) = out
    rel = lambda a, b: np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b)  # noqa: E731
    assert rel(many.arrays["probe"], one.arrays["probe"]) < 1e-4
    assert rel(many.boxes["object"].data[0], one.boxes["object"].data) < 1e-4
    for key in ("opr_eigen_num", "opr_eigen_mean_num", "background_residual"):
        assert rel(many.arrays[key], one.arrays[key]) < 1e-4, key
    for name in ("rhs", "obj_power", "int_num", "int_den"):
        assert rel(getattr(v2, name), getattr(v1, name)) < 1e-4, name
    if brightness_first:
        assert rel(v2.brightness, v1.brightness) < 1e-4
    assert many.scalars["loss"] == pytest.approx(one.scalars["loss"], rel=1e-5)


def test_ad_multislice_with_one_slice_and_positions_matches_the_single_slice_gradient():
    """The position gradient through the composed step, K = 1 in the far field, equals the AD
    engine's own (both are the derivative of the same model)."""
    s = _setup(1, False)
    obj = s["slices"][0]
    want = ad.chunk_gradient(obj, s["probe"], s["y"], s["pos"], want_positions=True)
    got = ad.chunk_gradient(obj[None], s["probe"], s["y"], s["pos"], want_positions=True)
    np.testing.assert_allclose(got.arrays["position_grad"], want.arrays["position_grad"], rtol=1e-6,
                               atol=1e-9 * np.abs(want.arrays["position_grad"]).max())
