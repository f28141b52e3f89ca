"""The forward-model operator (daskpty.engines.forward_model): for one slice in the far field, K
slices, the near field and both, the detector's adjoint, the backward chain against the forward
changes it is the adjoint of (⟨J δ, G⟩ = ⟨δ, Jᴴ G⟩ for slices, probe and positions) and those
changes against finite differences of the forward model."""
import numpy as np
import pytest

from daskpty.engines.forward_model import ForwardModel
from daskpty.physics.propagation import angular_spectrum_kernel, near_field_kernel

N, B, M = 16, 5, 2


def _model(k: int, near: bool):
    kernel = angular_spectrum_kernel(N, 0.25e-10, 1.9687e-12, 2e-9, dtype=np.complex128) if k > 1 else None
    detector = near_field_kernel(N, 55e-6, 1e-10, 1.0, 3e-3).astype(np.complex128) if near else None
    return ForwardModel(k, kernel, detector)


def _setup(k: int, near: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (40, 40) if k == 1 and not near else (k, 40, 40)
    obj = np.exp(0.4j * rng.standard_normal(shape)) * (1 + 0.1 * rng.standard_normal(shape))
    probe = rng.standard_normal((M, N, N)) + 1j * rng.standard_normal((M, N, N))
    positions = rng.uniform(12, 28, (B, 2))
    return _model(k, near), obj, probe, positions, np.ones((B, N, N))


def _block(model, obj, probe, positions, y):
    c = model.chunk(obj, probe, y, positions, cdtype=np.complex128)
    assert len(c.blocks) == 1
    return c, c.forward(c.blocks[0])


def _random(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)


def _dot(a, b):
    return float(np.real(np.vdot(a, b)))


MODELS = [(1, False), (3, False), (1, True), (2, True)]


@pytest.mark.parametrize("k, near", MODELS)
def test_detector_and_its_adjoint(k, near):
    model, obj, probe, positions, y = _setup(k, near)
    c, blk = _block(model, obj, probe, positions, y)
    x, g = _random((B, M, N, N), 1), _random((B, M, N, N), 2)
    assert _dot(c.detect(blk, x.copy()), g) == pytest.approx(_dot(x, c.to_exit(blk, g.copy())), rel=1e-10)


@pytest.mark.parametrize("k, near", MODELS)
def test_backward_chain_is_the_adjoint_of_the_carried_changes(k, near):
    """Re⟨D T_k(δO_k φ_k), G⟩ = Re⟨δO_k, Σ_m conj(φ_k) g_k⟩ per slice, Re⟨D T_0(O_1 δQ), G⟩ =
    Re⟨δQ, g_Q⟩ at the entrance, and Re⟨D T_0(O_1 S_f δP), G⟩ = Re⟨δP, F⁻¹ Σ_j G_j⟩ for the probe."""
    model, obj, probe, positions, y = _setup(k, near)
    g_det = _random((B, M, N, N), 3)
    c, blk = _block(model, obj, probe, positions, y)
    grads, lit, g_q = c.vjp(blk, c.to_exit(blk, g_det.copy()))
    spectra = c.entrance_spectra(blk, g_q.copy())
    c, blk = _block(model, obj, probe, positions, y)     # (the backward chain spends its buffers)
    for s in range(k):
        d = _random((B, N, N), 10 + s)
        forward = c.detect(blk, c.carry(blk, d[:, None] * blk.incident[s], s))
        assert _dot(forward, g_det) == pytest.approx(_dot(d, grads[s]), rel=1e-10)
        np.testing.assert_allclose(lit[s], (np.abs(blk.incident[s]) ** 2).sum(axis=1), rtol=1e-12)
    dq = _random((B, M, N, N), 20)
    forward = c.detect(blk, c.carry(blk, dq * blk.patches[0][:, None], 0))
    assert _dot(forward, g_det) == pytest.approx(_dot(dq, g_q), rel=1e-10)
    dp = _random((M, N, N), 21)
    shifted = c.shifted(blk.batch, blk.ramps.copy(), np.fft.fft2(dp, norm="ortho")[None], out=dq)
    forward = c.detect(blk, c.carry(blk, shifted * blk.patches[0][:, None], 0))
    assert _dot(forward, g_det) == pytest.approx(_dot(dp, np.fft.ifft2(spectra.sum(axis=0), norm="ortho")), rel=1e-10)


@pytest.mark.parametrize("k, near", MODELS)
def test_carried_changes_and_position_derivatives_match_finite_differences(k, near):
    model, obj, probe, positions, y = _setup(k, near)
    c, blk = _block(model, obj, probe, positions, y)
    base = blk.detected.copy()
    eps = 1e-6
    for s in range(k):
        d = _random((B, N, N), 30 + s)
        want = c.detect(blk, c.carry(blk, d[:, None] * blk.incident[s], s))
        moved = obj.copy()
        total = np.zeros(c.obj_box.shape[1:], complex)
        c.index.scatter_add(total, eps * d)             # (windows may overlap: each moves by the sum)
        (y0, x0), (y1, x1) = c.box0, c.box1
        (moved if moved.ndim == 2 else moved[s])[y0:y1, x0:x1] += total
        _, blk2 = _block(model, moved, probe, positions, y)
        got = (blk2.detected - base) / eps
        overlap = _overlap_changes(c, blk, d, s)
        np.testing.assert_allclose(got, overlap, rtol=0, atol=1e-5 * np.abs(want).max())
    for a in range(2):   # ∂Ψ/∂p_a = D T_0(O_1 ∂_a S_f P) + the near-field detector's translation
        step = np.zeros(2)
        step[a] = eps
        _, blk2 = _block(model, obj, probe, positions + step, y)
        got = (blk2.detected - base) / eps
        _, blk = _block(model, obj, probe, positions, y)
        dq = c.shift_derivatives(blk)[a]
        want = c.detect(blk, c.carry(blk, dq * blk.patches[0][:, None], 0))
        if near:
            want = want + c.detector_derivatives(blk.detected)[a]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _overlap_changes(c, blk, d, s):
    """The detected change when every window of slice s moves by the sum of the d of the windows
    that overlap it (what adding εd into the object does)."""
    total = np.zeros(c.obj_box.shape[1:], complex)
    c.index.scatter_add(total, d)
    windows = c.index.extract(total)
    return c.detect(blk, c.carry(blk, windows[:, None] * blk.incident[s], s))


def test_one_slice_far_field_walks_cache_sized_blocks_and_k_slices_the_whole_chunk():
    model, obj, probe, positions, y = _setup(1, False)
    assert len(model.chunk(obj, probe, y, positions, block_bytes=2 * 8 * M * N * N).blocks) == 3
    model, obj, probe, positions, y = _setup(3, False)
    assert len(model.chunk(obj, probe, y, positions, block_bytes=2 * 8 * M * N * N).blocks) == 1
    with pytest.raises(ValueError, match="3 slices need the slice-to-slice kernel"):
        ForwardModel(3).chunk(obj, probe, y, positions)
