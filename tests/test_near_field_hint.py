"""daskpty import / info recognise a near-field scan stored as far field; import refuses a store."""
from __future__ import annotations

import os

import numpy as np
import pytest

import daskpty
from daskpty.cli import main
from daskpty.io.near_field_hint import near_field_evidence, near_field_hint

REAL_CXI = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                        "PETRAIII_P25_Near_Field_Ptycho.cxi")
needs_real = pytest.mark.skipif(not os.path.isfile(REAL_CXI), reason="shared real data not present")


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def scan(n=48, grid=6, step=3.0, seed=0):
    rng = np.random.default_rng(seed)
    g = np.arange(grid) * step
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 2
    pos += rng.uniform(-0.5, 0.5, pos.shape)
    size = int(pos.max()) + n // 2 + 3
    obj = np.exp(1j * 0.6 * rng.standard_normal((size, size)))
    k = np.fft.fftfreq(size)
    obj = np.fft.ifft2(np.fft.fft2(obj) * np.exp(-(k[:, None] ** 2 + k ** 2) / 0.02))  # smooth
    yy, xx = np.mgrid[:n, :n] - n / 2
    beam = np.exp(-(yy ** 2 + xx ** 2) / (2 * (0.3 * n) ** 2))
    return obj, beam, np.round(pos).astype(int), pos


def test_holograms_move_with_the_scan_diffraction_does_not():
    """Frames that are shifted images of the sample are flagged; their far field is not."""
    obj, beam, ipos, pos = scan()
    n = beam.shape[0]
    windows = np.stack([obj[y - n // 2:y + n // 2, x - n // 2:x + n // 2] for y, x in ipos])
    holograms = np.abs(beam * (1 + 2 * (windows - windows.mean()))) ** 2  # image-like, moves
    near = near_field_evidence(holograms, pos)
    assert near.looks_near_field and near.r2 > 0.9 and near.shift_px >= 2, near
    # far field: a focused and a defocused probe from a disc aperture, their exit waves' FFT
    # (a much stronger defocus casts a moving shadow image: that is why the hint says "probable")
    k = np.hypot(*np.meshgrid(np.fft.fftfreq(n), np.fft.fftfreq(n), indexing="ij"))
    for defocus in (0, 50):
        probe = np.fft.ifft2((k < 0.2) * np.exp(1j * defocus * k ** 2))
        far = np.abs(np.fft.fftshift(np.fft.fft2(probe * windows), axes=(-2, -1))) ** 2
        farev = near_field_evidence(far, pos)
        assert not farev.looks_near_field and farev.r2 < 0.5, (defocus, farev)


@needs_real
def test_real_near_field_file_imported_as_far_field_is_recognised(tmp_path, capsys):
    code, out, err = run_cli(["import", REAL_CXI, "-o", tmp_path / "p25.zarr", "--crop", 64],
                             capsys)
    assert code == 0 and "wrote" in out
    note = [ln for ln in err.splitlines() if "near-field" in ln]
    assert len(note) == 1 and "--focus-to-sample" in note[0] and "--near-field" in note[0], err
    code, out, err = run_cli(["info", tmp_path / "p25.zarr"], capsys)
    assert code == 0
    hint = [ln for ln in err.splitlines() if "near-field holograms" in ln]
    assert len(hint) == 1 and "--focus-to-sample" in hint[0], err
    assert "little overlap" not in err          # not blamed on the overlap
    assert "not meaningful" in out
    code, out, _ = run_cli(["info", tmp_path / "p25.zarr", "--json"], capsys)
    assert "near-field holograms" in out

    # imported as near field: no hint
    code, out, err = run_cli(["import", REAL_CXI, "-o", tmp_path / "nf.zarr",
                              "--focus-to-sample", "3.65e-3", "--quiet"], capsys)
    assert code == 0 and "near-field holograms" not in err
    assert near_field_hint(daskpty.open_data(str(tmp_path / "nf.zarr"))) is None


def test_simulated_far_field_store_gets_no_hint(tmp_path, capsys, client):
    data = daskpty.simulate(tmp_path / "sim.zarr", preset="small", grid=(8, 8), probe_size=32,
                            client=client)
    assert near_field_hint(data) is None
    code, out, err = run_cli(["info", tmp_path / "sim.zarr"], capsys)
    assert code == 0 and "near-field" not in out + err


def test_import_of_a_daskpty_store_says_so(tmp_path, capsys, store_path):
    code, out, err = run_cli(["import", store_path, "-o", tmp_path / "again.zarr"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "already a daskpty data-set store" in err
    assert "daskpty info" in err and "daskpty reconstruct" in err and "tif" not in err
    assert not os.path.exists(tmp_path / "again.zarr")


def test_large_holograms_are_binned_and_still_recognised(tmp_path):
    """A 192² hologram store (binned 2 x 2 for the test) gets the hint; as near field it does not."""
    obj, beam, ipos, pos = scan()
    n = beam.shape[0]
    windows = np.stack([obj[y - n // 2:y + n // 2, x - n // 2:x + n // 2] for y, x in ipos])
    holograms = np.abs(beam * (1 + 2 * (windows - windows.mean()))) ** 2
    big = np.kron(holograms, np.ones((1, 4, 4))).astype(np.float32) * 100   # 192 x 192
    geometry = dict(wavelength_m=1e-10, detector_distance_m=1.0, detector_pixel_size_m=5e-5)
    daskpty.from_arrays(big, pos * 4, **geometry).to_zarr(tmp_path / "far.zarr")
    hint = near_field_hint(daskpty.open_data(str(tmp_path / "far.zarr")))
    assert hint is not None and "--focus-to-sample" in hint
    electrons = dict(geometry, wavelength_m=2e-12)                   # 300 keV: never flagged
    daskpty.from_arrays(big, pos * 4, **electrons).to_zarr(tmp_path / "e.zarr")
    assert near_field_hint(daskpty.open_data(str(tmp_path / "e.zarr"))) is None
