"""Issue 15 item 6: ``daskpty export`` / ``daskpty.io.export_*`` — CXI and HDF5 hold the object,
probe, positions and geometry; TIFF and PNG the images; bad input is one line, nothing left."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

import daskpty  # noqa: E402
from daskpty.cli import main  # noqa: E402
from daskpty.io.export import export_cxi, export_hdf5, export_png, export_tiff  # noqa: E402
from daskpty.results import Reconstruction  # noqa: E402

WAVELENGTH, DISTANCE, PIXEL, N = 1.2e-10, 1.5, 55e-6, 16
DX = WAVELENGTH * DISTANCE / (N * PIXEL)


def make_reconstruction(seed=0):
    rng = np.random.default_rng(seed)
    shape = (40, 48)
    obj = (rng.uniform(0.5, 1, shape) * np.exp(1j * rng.uniform(-1, 1, shape))).astype(np.complex64)
    probe = (rng.standard_normal((2, N, N)) + 1j * rng.standard_normal((2, N, N))).astype(np.complex64)
    iy, ix = np.divmod(np.arange(12), 4)
    positions = np.stack([iy, ix], 1) * 5.0 + 12.0
    illum = np.zeros(shape, np.float32)
    for y, x in positions.astype(int):
        illum[y - N // 2:y + N // 2, x - N // 2:x + N // 2] += 1.0
    history = [{"epoch": i + 1, "loss": 10.0 / (i + 1), "seconds": 0.1} for i in range(3)]
    return Reconstruction(object=obj, probe=probe, positions=positions, origin=np.array([2.0, 3.0]),
                          illumination=illum, history=history, options={"engine": "lsqml"},
                          epoch=3)


@pytest.fixture
def recon_store(tmp_path):
    path = str(tmp_path / "recon.zarr")
    make_reconstruction().to_zarr(path)
    return path


@pytest.fixture
def data_store(tmp_path):
    rng = np.random.default_rng(1)
    iy, ix = np.divmod(np.arange(12), 4)
    data = daskpty.from_arrays(rng.poisson(5.0, (12, N, N)).astype(np.uint16),
                               np.stack([iy, ix], 1) * 5.0 + 10.0, wavelength_m=WAVELENGTH,
                               detector_distance_m=DISTANCE, detector_pixel_size_m=PIXEL)
    path = str(tmp_path / "data.zarr")
    data.to_zarr(path)
    return path


def referenced(rec):
    """Object times the conjugate unit phase of its mean over the illuminated region."""
    lit = rec.illumination > 0.1 * rec.illumination.max()
    mean = rec.object[lit].mean()
    return rec.object * np.conj(mean) / abs(mean), lit


def test_cxi_holds_object_probe_positions_geometry(tmp_path, recon_store, data_store):
    rec = Reconstruction.from_zarr(recon_store)
    export_cxi(recon_store, tmp_path / "r.cxi", data=data_store)
    with h5py.File(tmp_path / "r.cxi", "r") as f:
        np.testing.assert_array_equal(f["entry_1/image_1/data"][...], rec.object)
        np.testing.assert_array_equal(f["entry_1/image_2/data"][...], rec.probe)
        np.testing.assert_array_equal(f["entry_1/image_1/illumination"][...], rec.illumination)
        np.testing.assert_array_equal(f["entry_1/image_1/process_1/positions_px"][...], rec.positions)
        assert f["entry_1/image_1/x_pixel_size"][()] == pytest.approx(DX)
        assert f["entry_1/instrument_1/source_1/wavelength"][()] == pytest.approx(WAVELENGTH)
        assert f["entry_1/instrument_1/detector_1/distance"][()] == pytest.approx(DISTANCE)
        t = f["entry_1/data_1/translation"][...]           # the soft link resolves
        np.testing.assert_allclose(t[:, :2], -rec.positions[:, ::-1] * DX)
        np.testing.assert_allclose(f["entry_1/image_1/process_1/loss"][...], [10, 5, 10 / 3])
        assert f["entry_1/image_1/data_type"][()] == b"object"


def test_hdf5_export(tmp_path, recon_store, data_store):
    rec = Reconstruction.from_zarr(recon_store)
    export_hdf5(recon_store, tmp_path / "r.h5", data=data_store)
    with h5py.File(tmp_path / "r.h5", "r") as f:
        np.testing.assert_array_equal(f["object"][...], rec.object)
        np.testing.assert_array_equal(f["probe"][...], rec.probe)
        np.testing.assert_array_equal(f["positions"][...], rec.positions)
        np.testing.assert_array_equal(f["origin"][...], rec.origin)
        assert f.attrs["object_pixel_size_m"] == pytest.approx(DX)
        assert f.attrs["epochs"] == 3
        assert json.loads(f.attrs["options"]) == {"engine": "lsqml"}


def test_tiff_pages(tmp_path, recon_store):
    tifffile = pytest.importorskip("tifffile")
    rec = Reconstruction.from_zarr(recon_store)
    obj, _ = referenced(rec)
    export_tiff(recon_store, tmp_path / "o.tif")
    pages = tifffile.imread(tmp_path / "o.tif")
    assert pages.shape == (2, *rec.object.shape) and pages.dtype == np.float32
    np.testing.assert_allclose(pages[0], np.abs(obj), rtol=1e-6)
    np.testing.assert_allclose(pages[1], np.angle(obj), atol=1e-5)
    export_tiff(recon_store, tmp_path / "p.tif", what="probe")
    probe_pages = tifffile.imread(tmp_path / "p.tif")
    np.testing.assert_allclose(probe_pages[2], np.abs(rec.probe[1]), rtol=1e-6)


def test_png_is_the_illuminated_phase(tmp_path, recon_store):
    image = pytest.importorskip("matplotlib.image")
    rec = Reconstruction.from_zarr(recon_store)
    obj, lit = referenced(rec)
    export_png(recon_store, tmp_path / "o.png")
    img = image.imread(tmp_path / "o.png")
    rows, cols = np.nonzero(lit)
    assert img.shape[:2] == (np.ptp(rows) + 1, np.ptp(cols) + 1)
    grey = img[..., 0]
    phase = np.angle(obj)[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    assert np.corrcoef(grey.ravel(), phase.ravel())[0, 1] > 0.95


def test_cli_export_all_types(tmp_path, capsys, recon_store, data_store):
    for name in ("r.cxi", "r.h5", "r.tif", "r.png"):
        extra = ["--data", data_store] if name.endswith((".cxi", ".h5")) else []
        assert main(["export", recon_store, str(tmp_path / name), *extra]) == 0
        assert os.path.getsize(tmp_path / name) > 0
    capsys.readouterr()


@pytest.mark.parametrize("case", ["suffix", "exists", "no-recon", "data-store-as-recon"])
def test_cli_export_bad_input(tmp_path, capsys, recon_store, data_store, case):
    out = tmp_path / "out"
    out.mkdir()
    target = str(out / "r.cxi")
    args = {"suffix": [recon_store, str(out / "r.jpg")],
            "exists": [recon_store, target],
            "no-recon": [str(tmp_path / "missing.zarr"), target],
            "data-store-as-recon": [data_store, target]}[case]
    if case == "exists":
        open(target, "w").write("keep me")
    code = main(["export", *args])
    _, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("daskpty: error: ")
    assert "Traceback" not in err
    expected = ["r.cxi"] if case == "exists" else []
    assert sorted(os.listdir(out)) == expected
    if case == "exists":
        assert open(target).read() == "keep me"
