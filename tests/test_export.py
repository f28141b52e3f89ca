"""Issue 15 item 6: ``daskpty export`` / ``daskpty.io.export_*`` — CXI and HDF5 hold the object,
probe, positions and geometry; TIFF and PNG the images; bad input is one line, nothing left.

Issue 31 item 5: a near-field run's CXI / HDF5 carry the near-field geometry and a filled
``entry_1/data_1``; every TIFF page has a description. Issue 32 item 4: a full disk (a real
1 MiB tmpfs) or a read-only directory ends in one line, exit 2, no partial file (was a
segfault, exit 139, for HDF5)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

import daskpty  # noqa: E402
from daskpty.cli import main  # noqa: E402
from daskpty.io.export import export_cxi, export_hdf5, export_png, export_tiff  # noqa: E402
from daskpty.io.export import write_file  # noqa: E402
from daskpty.io.safety import StoreWriteError  # noqa: E402
from daskpty.io.results import Reconstruction  # noqa: E402

from mounts import tmpfs  # noqa: E402

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
        np.testing.assert_array_equal(f["entry_1/data_1/data"][...], rec.object)  # data_1 filled
        assert f["entry_1/data_1"].get("data", getlink=True).path == "/entry_1/image_1/data"
        assert f["entry_1/instrument_1/detector_1/propagation"][()] == b"far_field"
        assert "focus_to_sample_distance" not in f["entry_1/instrument_1/detector_1"]
        assert f["entry_1/image_1/image_size"][()] == pytest.approx([48 * DX, 40 * DX, 0])


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


def test_tiff_pages(tmp_path, recon_store, data_store):
    tifffile = pytest.importorskip("tifffile")
    rec = Reconstruction.from_zarr(recon_store)
    obj, _ = referenced(rec)
    export_tiff(recon_store, tmp_path / "o.tif", data=data_store)
    pages = tifffile.imread(tmp_path / "o.tif")
    assert pages.shape == (2, *rec.object.shape) and pages.dtype == np.float32
    np.testing.assert_allclose(pages[0], np.abs(obj), rtol=1e-6)
    np.testing.assert_allclose(pages[1], np.angle(obj), atol=1e-5)
    with tifffile.TiffFile(tmp_path / "o.tif") as tif:
        descs = [json.loads(page.description) for page in tif.pages]
        assert [d["quantity"] for d in descs] == ["amplitude", "phase"]
        assert [d["units"] for d in descs] == ["1 (transmission)", "rad"]
        assert all(d["array"] == "object" and d["pixel_size_m"] == pytest.approx(DX)
                   and d["pages"] == 2 for d in descs)
        x_res = tif.pages[1].tags["XResolution"].value  # pixels per cm on every page
        assert x_res[0] / x_res[1] == pytest.approx(1e-2 / DX, rel=1e-6)
    export_tiff(recon_store, tmp_path / "p.tif", what="probe")
    probe_pages = tifffile.imread(tmp_path / "p.tif")
    np.testing.assert_allclose(probe_pages[2], np.abs(rec.probe[1]), rtol=1e-6)
    with tifffile.TiffFile(tmp_path / "p.tif") as tif:
        descs = [json.loads(page.description) for page in tif.pages]
    assert [(d["mode"], d["quantity"]) for d in descs] == [
        (0, "amplitude"), (0, "phase"), (1, "amplitude"), (1, "phase")]
    assert all(d["array"] == "probe" and d["pixel_size_m"] is None for d in descs)


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


# --------------------------------------------------------------------------- near field (31.5)

Z1, Z2, NF_PIXEL, NF_WAVELENGTH, NF_N = 3.65e-3, 1.12, 55e-6, 0.9795e-10, 32


@pytest.fixture(scope="module")
def near_field_run(tmp_path_factory, client):
    """A small simulated near-field scan (holograms of a smooth object, P25-like geometry) and
    its 2-epoch reconstruction, as stores."""
    from daskpty.physics.geometry import NearFieldGeometry
    from daskpty.physics.multislice import multislice_intensities
    from daskpty.physics.propagation import near_field_kernel
    from synthetic import smooth_object

    d = tmp_path_factory.mktemp("nf")
    rng = np.random.default_rng(0)
    n = NF_N
    geometry = NearFieldGeometry(n, Z2, NF_PIXEL, Z1, wavelength_m=NF_WAVELENGTH)
    kernel = near_field_kernel(n, NF_PIXEL, NF_WAVELENGTH, Z2, Z1)
    obj = smooth_object(64, rng, sigma=1.5)
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = (np.exp(-(yy**2 + xx**2) / (2 * (n / 3.5) ** 2)) * 300.0)[None].astype(np.complex64)
    g = np.arange(4) * 5.0
    pos = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 4 \
        + rng.uniform(-1, 1, (16, 2))
    y = multislice_intensities(obj[None], probe, pos, detector=kernel).astype(np.float32)
    data = str(d / "nf.zarr")
    daskpty.from_arrays(y, pos, probe=probe, geometry=geometry).to_zarr(data)
    recon = str(d / "nf-recon.zarr")
    daskpty.reconstruct(data, client=client, epochs=2, checkpoint=recon, check_data=False)
    return data, recon, geometry


@pytest.mark.slow  # a cluster and a 2-epoch reconstruction: ~5 s
def test_near_field_cxi_and_hdf5_are_self_describing(tmp_path, near_field_run, capsys):
    data, recon, geometry = near_field_run
    rec = Reconstruction.from_zarr(recon)
    m = (Z1 + Z2) / Z1
    dx = geometry.object_pixel_size_m
    assert dx == pytest.approx(NF_PIXEL / m)
    assert main(["export", recon, str(tmp_path / "nf.cxi"), "--data", data]) == 0
    assert main(["export", recon, str(tmp_path / "nf.h5"), "--data", data]) == 0
    assert capsys.readouterr().err == ""
    with h5py.File(tmp_path / "nf.cxi", "r") as f:
        det, src = f["entry_1/instrument_1/detector_1"], f["entry_1/instrument_1/source_1"]
        assert det["propagation"][()] == b"near_field"
        assert det["focus_to_sample_distance"][()] == pytest.approx(Z1)
        assert det["focus_to_sample_distance"].attrs["units"] == "m"
        assert det["distance"][()] == pytest.approx(Z2)
        assert det["magnification"][()] == pytest.approx(m)
        assert det["effective_distance"][()] == pytest.approx(Z2 / m)
        assert det["x_pixel_size"][()] == det["y_pixel_size"][()] == pytest.approx(NF_PIXEL)
        assert src["wavelength"][()] == pytest.approx(NF_WAVELENGTH)
        assert src["energy"][()] == pytest.approx(6.62607015e-34 * 299792458.0 / NF_WAVELENGTH)
        assert src["energy"].attrs["units"] == "J"
        assert f["entry_1/image_1/x_pixel_size"][()] == pytest.approx(dx)
        assert f["entry_1/image_1/detector_1/propagation"][()] == b"near_field"  # linked
        data_1 = f["entry_1/data_1"]
        assert set(data_1) == {"data", "translation"}
        np.testing.assert_array_equal(data_1["data"][...], rec.object)
        np.testing.assert_allclose(data_1["translation"][:, :2], -rec.positions[:, ::-1] * dx)
        note = json.loads(f["entry_1/image_1/process_1/note"][()])
        assert note["geometry"]["focus_to_sample_m"] == pytest.approx(Z1)
        assert note["geometry"]["detector"] == "near_field"
    with h5py.File(tmp_path / "nf.h5", "r") as f:
        assert f.attrs["detector"] == "near_field"
        assert f.attrs["focus_to_sample_m"] == pytest.approx(Z1)
        assert f.attrs["detector_distance_m"] == pytest.approx(Z2)
        assert f.attrs["magnification"] == pytest.approx(m)
        assert f.attrs["object_pixel_size_m"] == pytest.approx(dx)
        assert "object pixel" in f["object"].attrs["description"]
        np.testing.assert_array_equal(f["object"][...], rec.object)


def test_export_without_data_says_the_geometry_is_missing(tmp_path, recon_store, capsys):
    assert main(["export", recon_store, str(tmp_path / "r.cxi")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no experiment geometry" in err and "--data" in err
    with h5py.File(tmp_path / "r.cxi", "r") as f:
        assert "data" in f["entry_1/data_1"]  # data_1 is filled all the same


# --------------------------------------------------------------------------- full / read-only disk (32.4)

@pytest.fixture
def big_recon(tmp_path):
    """A reconstruction whose exports exceed 1 MiB (random phases do not compress)."""
    rec = make_reconstruction()
    rng = np.random.default_rng(3)
    rec.object = np.exp(1j * rng.uniform(-3, 3, (420, 420))).astype(np.complex64)
    rec.illumination = np.ones((420, 420), np.float32)
    path = str(tmp_path / "big.zarr")
    rec.to_zarr(path)
    return path


def _one_line_exit_2(capsys, argv, *patterns):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.startswith("daskpty: error: ") and err.count("\n") == 1 and "Traceback" not in err
    for p in patterns:
        assert p in err, err
    return err


@pytest.mark.parametrize("name", ["r.h5", "r.cxi", "r.tif"])
def test_export_onto_a_full_disk_is_one_line(tmp_path, big_recon, capsys, name):
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "1m") as reason:
        if reason is not None:
            pytest.skip(reason)
        _one_line_exit_2(capsys, ["export", big_recon, mnt / name], "not enough free space",
                         str(mnt / name), "MiB free", "nothing was written")
        assert os.listdir(mnt) == []


def test_a_disk_that_fills_while_writing_leaves_nothing(tmp_path):
    """Past the free-space check (as when another process fills the disk meanwhile): the real
    ENOSPC is one StoreWriteError line and the partial file is removed."""
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "1m") as reason:
        if reason is not None:
            pytest.skip(reason)
        payload = np.random.default_rng(0).bytes(3 * 2**20)
        with pytest.raises(StoreWriteError) as info:
            write_file(mnt / "x.h5", payload, check_space=False)
        msg = str(info.value)
        assert "\n" not in msg and "No space left on device" in msg and "no partial file" in msg
        assert os.listdir(mnt) == []
        write_file(mnt / "x.h5", payload[:2**19])  # what fits is written whole
        assert os.path.getsize(mnt / "x.h5") == 2**19 and os.listdir(mnt) == ["x.h5"]


@pytest.mark.parametrize("name", ["r.h5", "r.cxi", "r.tif", "r.png"])
def test_export_into_a_read_only_directory_is_one_line(tmp_path, recon_store, capsys, name):
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "1m", read_only=True) as reason:
        if reason is not None:
            pytest.skip(reason)
        _one_line_exit_2(capsys, ["export", recon_store, mnt / name], "Read-only file system",
                         str(mnt / name))
        assert os.listdir(mnt) == []


@pytest.mark.slow
def test_full_disk_export_in_a_real_process_exits_2(tmp_path, big_recon):
    """The reported crash (segmentation fault, exit 139, a partial file left), as a user runs it."""
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "1m") as reason:
        if reason is not None:
            pytest.skip(reason)
        r = subprocess.run([sys.executable, "-m", "daskpty", "export", big_recon,
                            str(mnt / "out.h5")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
        assert r.stderr.startswith("daskpty: error: not enough free space")
        assert r.stderr.count("\n") == 1 and os.listdir(mnt) == []
