"""The ablation's FFT switches change how the transforms run, never what they compute."""
import numpy as np
import pytest

from daskpty.engines import lsqml
from daskpty.physics import backend

from synthetic import make_dataset


@pytest.mark.parametrize("switch", ["batched", "inplace"])
def test_fft_switch_off_gives_the_same_transform(monkeypatch, switch):
    rng = np.random.default_rng(0)
    a = (rng.normal(size=(3, 2, 16, 16)) + 1j * rng.normal(size=(3, 2, 16, 16))).astype(np.complex64)
    on_f, on_i = backend.fft2(a.copy(), overwrite=True), backend.ifft2(a.copy(), overwrite=True)
    monkeypatch.setitem(backend.FFT_SETTINGS, switch, False)
    off_f, off_i = backend.fft2(a.copy(), overwrite=True), backend.ifft2(a.copy(), overwrite=True)
    np.testing.assert_allclose(off_f, on_f, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(off_i, on_i, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(off_f, np.fft.fft2(a, norm="ortho"), rtol=1e-4, atol=1e-4)


def test_unbatched_in_place_chunk_step_matches_default(monkeypatch):
    ds = make_dataset(n=32, grid=6, modes=2, seed=2)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1)).astype(np.float32)
    obj = ds.truth.object * np.complex64(0.9)
    opts = lsqml.LSQMLOptions()
    ref = lsqml.chunk_step(obj, ds.truth.probe, y, ds.positions, options=opts)
    monkeypatch.setitem(backend.FFT_SETTINGS, "batched", False)
    monkeypatch.setitem(backend.FFT_SETTINGS, "inplace", False)
    got = lsqml.chunk_step(obj, ds.truth.probe, y, ds.positions, options=opts)
    num, ref_num = got.boxes["object"].data, ref.boxes["object"].data
    assert np.linalg.norm(num - ref_num) <= 1e-4 * np.linalg.norm(ref_num)
    assert got.scalars["loss"] == pytest.approx(ref.scalars["loss"], rel=1e-5)
