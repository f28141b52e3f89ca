"""FFTW (pyFFTW) as the CPU transform: the same transforms as scipy's, bit-reproducible, chosen
by name with clear errors."""
import sys

import numpy as np
import pytest

from daskpty.physics import backend, fftw

pytest.importorskip("pyfftw")


@pytest.fixture(autouse=True)
def keep_backend(monkeypatch):
    """Every test leaves this process's backend as it found it."""
    fftw.fft_backend()
    monkeypatch.setattr(fftw, "_backend", fftw._backend)
    monkeypatch.setattr(fftw, "_every_size", fftw._every_size)


@pytest.fixture
def use_fftw():
    assert fftw.set_fft_backend("fftw") == "fftw"


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=shape) + (1j * rng.normal(size=shape) if np.dtype(dtype).kind == "c" else 0)
    return a.astype(dtype)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.float32])
@pytest.mark.parametrize("shape", [(16, 16), (3, 2, 32, 32), (5, 24, 40)])
def test_fftw_gives_scipys_orthonormal_transforms(use_fftw, dtype, shape):
    a = _random(shape, dtype)
    tol = 1e-5 if np.dtype(dtype) in (np.dtype(np.complex64), np.dtype(np.float32)) else 1e-12
    scale = np.abs(np.fft.fft2(a, norm="ortho")).max()
    for inverse, ref in ((False, np.fft.fft2), (True, np.fft.ifft2)):
        want = ref(a, norm="ortho")
        got = backend.ifft2(a) if inverse else backend.fft2(a)
        assert got.shape == a.shape and got.dtype == np.result_type(a.dtype, np.complex64)
        np.testing.assert_allclose(got, want, atol=tol * scale)
        inplace = backend.ifft2(a.copy(), overwrite=True) if inverse else backend.fft2(a.copy(), overwrite=True)
        np.testing.assert_allclose(inplace, want, atol=tol * scale)
    np.testing.assert_allclose(backend.ifft2(backend.fft2(a)), a, atol=tol * scale)


def test_fftw_takes_strided_views_and_leaves_its_input(use_fftw):
    a = _random((4, 2, 32, 64), np.complex64)
    view = a[:, 1, :, ::2]
    before = view.copy()
    np.testing.assert_allclose(backend.fft2(view), np.fft.fft2(before, norm="ortho"), atol=1e-4)
    np.testing.assert_array_equal(view, before)


def test_fftw_bits_do_not_depend_on_where_the_array_sits(use_fftw):
    """Replicas and a resumed run must compute the same bits: an array at any address (a received
    buffer need not be 16-byte aligned) transforms to the same result."""
    a = _random((6, 1, 64, 64), np.complex64, seed=3)
    ref = backend.fft2(a)
    for offset in range(0, 64, 8):
        buf = np.empty(a.nbytes + 128, np.uint8)
        start = (-buf.ctypes.data) % 64 + offset
        b = buf[start:start + a.nbytes].view(np.complex64).reshape(a.shape)
        b[...] = a
        np.testing.assert_array_equal(backend.fft2(b), ref)
        np.testing.assert_array_equal(b, a)


def test_auto_leaves_large_patterns_to_scipy(monkeypatch):
    """FFTW_ESTIMATE's plans are slow for 256² and up: ``auto`` hands them to pocketfft; ``fftw``
    by name keeps every size on FFTW."""
    small, large = _random((2, 64, 64), np.complex64), _random((2, 256, 256), np.complex64)
    fftw.set_fft_backend("auto")
    assert fftw.transform(small, False, False) is not None
    assert fftw.transform(large, False, False) is None
    np.testing.assert_allclose(backend.fft2(large), np.fft.fft2(large, norm="ortho"), atol=1e-4)
    fftw.set_fft_backend("fftw")
    np.testing.assert_allclose(fftw.transform(large, False, False), np.fft.fft2(large, norm="ortho"), atol=1e-4)


def test_an_unknown_fft_backend_is_refused():
    with pytest.raises(ValueError, match="unknown FFT backend 'fast'.*auto, fftw, scipy"):
        fftw.set_fft_backend("fast")


def test_asking_for_fftw_without_pyfftw_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyfftw", None)   # import pyfftw now fails
    with pytest.raises(ImportError, match=r'pip install "daskpty\[fftw\]"'):
        fftw.set_fft_backend("fftw")
    assert fftw.set_fft_backend("auto") == "scipy"      # auto falls back to scipy.fft


def test_the_environment_chooses_the_backend_of_a_process(monkeypatch):
    monkeypatch.setattr(fftw, "_backend", None)
    monkeypatch.setenv("DASKPTY_FFT_BACKEND", "scipy")
    assert fftw.fft_backend() == "scipy"
    assert fftw.transform(_random((2, 8, 8), np.complex64), False, False) is None  # scipy does it
    monkeypatch.setattr(fftw, "_backend", None)
    monkeypatch.setenv("DASKPTY_FFT_BACKEND", "FFTW")
    assert fftw.fft_backend() == "fftw" and fftw._every_size


def test_a_chunk_step_is_the_same_under_either_backend():
    """A multislice LSQML chunk step with position terms (every FFT path of the engines) agrees
    between the backends to float32 rounding."""
    from daskpty.engines.lsqml import LSQMLOptions, chunk_step
    from daskpty.physics.multislice import SliceGeometry

    from synthetic import make_dataset, slice_model

    ds = make_dataset(n=32, grid=6, modes=1, seed=4)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1)).astype(np.float32)
    obj = np.stack([ds.truth.object * np.complex64(0.9), np.ones_like(ds.truth.object)])
    kernel = SliceGeometry(2, 2e-8, 2e-12, 5e-11).kernel(32)

    def step():
        return chunk_step(obj, ds.truth.probe, y, ds.positions, options=LSQMLOptions(delta=0.5),
                          sample=slice_model(obj, kernel), position_terms=True, window_sums=True)

    fftw.set_fft_backend("scipy")
    ref = step()
    fftw.set_fft_backend("fftw")
    got = step()
    num, ref_num = got.boxes["object"].data, ref.boxes["object"].data
    assert np.linalg.norm(num - ref_num) <= 2e-5 * np.linalg.norm(ref_num)
    assert got.scalars["loss"] == pytest.approx(ref.scalars["loss"], rel=1e-5)
    for a, b in zip(got.local["shift_terms"], ref.local["shift_terms"]):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * np.abs(b).max())
