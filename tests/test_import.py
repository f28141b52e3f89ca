"""Issue 15: ``daskpty import`` / ``daskpty.io.import_*`` — each format from a small file written
here, round-tripped against the arrays written (after the known preprocessing); the real CXI file
in ../shared/data with its own geometry; bad input as one clear line with nothing left behind;
in-memory data sent to the cluster once (no "large graph" warning)."""
from __future__ import annotations

import glob
import os
import warnings

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

import daskpty  # noqa: E402
from daskpty.cli import main  # noqa: E402
from daskpty.io.importers import Geometry, Preprocess  # noqa: E402
from daskpty.io.importers import import_cxi, import_empad, import_hdf5, import_numpy, import_tiff  # noqa: E402

REAL_CXI = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                        "PETRAIII_P25_Near_Field_Ptycho.cxi")
HC = 6.62607015e-34 * 299792458.0
WAVELENGTH, DISTANCE, PIXEL = 1.5e-10, 2.0, 75e-6


def frames(n=24, h=32, w=32, seed=0, dtype=np.uint16):
    rng = np.random.default_rng(seed)
    return rng.poisson(30.0, size=(n, h, w)).astype(dtype)


def raster(n=24, cols=6, step=1.0):
    iy, ix = np.divmod(np.arange(n), cols)
    return np.stack([iy, ix], axis=1) * step


def expected_positions(yx_pixels, size):
    """The importer's convention: (y, x) object pixels, smallest at n/2."""
    p = np.asarray(yx_pixels, dtype=np.float64)
    return p - p.min(axis=0) + size / 2


def leftovers(directory):
    return sorted(os.listdir(directory))


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- CXI

def write_cxi(path, data, translation, bad, energy_j=None, wavelength=None):
    with h5py.File(path, "w") as f:
        f["cxi_version"] = 160
        det = f.create_group("entry_1/instrument_1/detector_1")
        det.create_dataset("data", data=data, chunks=(4, *data.shape[1:]), compression="gzip")
        det["distance"] = DISTANCE
        det["x_pixel_size"] = det["y_pixel_size"] = PIXEL
        det["mask"] = bad.astype(np.uint32)
        src = f.create_group("entry_1/instrument_1/source_1")
        src["energy"] = HC / WAVELENGTH if energy_j is None else energy_j
        if wavelength is not None:
            src["wavelength"] = wavelength
        f["entry_1/sample_1/geometry_1/translation"] = translation
        f["entry_1/data_1/data"] = h5py.SoftLink("/entry_1/instrument_1/detector_1/data")


def test_cxi_round_trip_with_crop(tmp_path):
    raw = frames(h=40, w=36)
    bad = np.zeros((40, 36), bool)
    bad[21, 17] = bad[5, 30] = True                      # (5, 30) falls outside the crop
    size = 24
    dx = WAVELENGTH * DISTANCE / (size * PIXEL)
    probe_yx = raster(step=3.3) * dx                     # metres
    translation = np.zeros((24, 3))
    translation[:, 0], translation[:, 1] = -probe_yx[:, 1], -probe_yx[:, 0]  # the sample moves
    write_cxi(tmp_path / "scan.cxi", raw, translation, bad)

    data = import_cxi(tmp_path / "scan.cxi", tmp_path / "out.zarr",
                      preprocess=Preprocess(crop=size, center=(20, 18)))
    window = (slice(8, 32), slice(6, 30))
    want = raw[:, window[0], window[1]].copy()
    want[:, 21 - 8, 17 - 6] = 0
    np.testing.assert_array_equal(np.asarray(data.intensities), want)
    assert data.dtype == np.uint16
    assert data.mask.sum() == size * size - 1 and not data.mask[13, 11]
    np.testing.assert_allclose(data.positions, expected_positions(probe_yx / dx, size), atol=1e-9)
    assert data.metadata["object_pixel_size_m"] == pytest.approx(dx, rel=1e-12)
    assert data.metadata["wavelength_m"] == pytest.approx(WAVELENGTH, rel=1e-9)
    assert data.metadata["import"]["preprocess"]["window_rows"] == [8, 32]
    assert "crop rows 8:32 cols 6:30" in data.metadata["provenance"]


def test_cxi_geometry_flags_override_the_file(tmp_path):
    raw = frames(n=12)
    write_cxi(tmp_path / "s.cxi", raw, np.c_[raster(12) * 1e-7, np.zeros(12)],
              np.zeros((32, 32), bool))
    data = import_cxi(tmp_path / "s.cxi", tmp_path / "o.zarr",
                      geometry=Geometry(energy_ev=8000.0, distance_m=3.0))
    lam = HC / (8000.0 * 1.602176634e-19)
    assert data.metadata["wavelength_m"] == pytest.approx(lam)
    assert data.metadata["object_pixel_size_m"] == pytest.approx(lam * 3.0 / (32 * PIXEL))
    np.testing.assert_array_equal(np.asarray(data.intensities), raw)


# --------------------------------------------------------------------------- HDF5 + hdf5plugin

def test_hdf5_bitshuffle_lz4_with_nexus_geometry(tmp_path):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    raw = frames(n=30, dtype=np.uint32)
    pos_um = raster(30, cols=5, step=0.12) + 3.0
    path = tmp_path / "eiger.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("entry/data/data", data=raw, chunks=(1, 32, 32),
                         **hdf5plugin.Bitshuffle(cname="lz4"))
        f["entry/sample/positions"] = pos_um
        f["entry/sample/positions"].attrs["units"] = "um"
        f["entry/instrument/detector/distance"] = 2500.0
        f["entry/instrument/detector/distance"].attrs["units"] = "mm"
        f["entry/instrument/detector/x_pixel_size"] = 75.0
        f["entry/instrument/detector/x_pixel_size"].attrs["units"] = "um"
        f["entry/instrument/beam/incident_energy"] = 9.0
        f["entry/instrument/beam/incident_energy"].attrs["units"] = "keV"
    with h5py.File(path, "r") as f:  # the data really are bitshuffle/LZ4 compressed
        assert "32008" in f["entry/data/data"]._filters

    data = import_hdf5(path, tmp_path / "o.zarr", data="/entry/data/data",
                       positions="/entry/sample/positions")
    np.testing.assert_array_equal(np.asarray(data.intensities), raw)
    assert data.dtype == np.uint32
    lam = HC / (9000.0 * 1.602176634e-19)
    dx = lam * 2.5 / (32 * 75e-6)
    assert data.metadata["object_pixel_size_m"] == pytest.approx(dx)
    np.testing.assert_allclose(data.positions, expected_positions(pos_um * 1e-6 / dx, 32))


def test_hdf5_two_position_datasets_separate_units(tmp_path):
    raw = frames(n=20)
    y, x = raster(20, cols=4, step=2.0).T
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["scan/frames"] = raw
        f["scan/y"], f["scan/x"] = y, x
    data = import_hdf5(tmp_path / "a.h5", tmp_path / "o.zarr", data="/scan/frames",
                       positions="/scan/y,/scan/x", units="px")
    np.testing.assert_allclose(data.positions, expected_positions(np.c_[y, x], 32))
    assert data.metadata["object_pixel_size_m"] is None


def test_hdf5_raster_4d_and_positions_from_separate_file(tmp_path):
    raw = frames(n=12).reshape(3, 4, 32, 32)
    with h5py.File(tmp_path / "r.h5", "w") as f:
        f["d"] = raw
    np.savetxt(tmp_path / "pos.csv", raster(12, cols=4, step=5.0), delimiter=",",
               header="y,x", comments="")
    data = import_hdf5(tmp_path / "r.h5", tmp_path / "o.zarr", data="/d",
                       positions=str(tmp_path / "pos.csv"), units="px")
    np.testing.assert_array_equal(np.asarray(data.intensities), raw.reshape(12, 32, 32))
    np.testing.assert_allclose(data.positions, expected_positions(raster(12, 4, 5.0), 32))


# --------------------------------------------------------------------------- EMPAD

def write_empad(path, n, seed=1):
    rng = np.random.default_rng(seed)
    full = rng.normal(5.0, 3.0, size=(n, 130, 128)).astype("<f4")   # some negatives
    full[:, 128:] = rng.uniform(1e3, 1e9, size=(n, 2, 128))          # metadata rows
    full.tofile(path)
    return full


def test_empad_raw(tmp_path):
    full = write_empad(tmp_path / "scan.raw", 20)
    data = import_empad(tmp_path / "scan.raw", tmp_path / "o.zarr", scan_shape=(4, 5), step=0.4,
                        units="nm", geometry=Geometry(energy_ev=300e3, radiation="electron",
                                                      distance_m=0.3, pixel_size_m=150e-6))
    want = np.clip(full[:, :128], 0, None)
    np.testing.assert_array_equal(np.asarray(data.intensities), want)
    assert data.dtype == np.float32 and data.pattern_shape == (128, 128)
    lam = data.metadata["wavelength_m"]
    assert lam == pytest.approx(1.9687e-12, rel=1e-4)          # 300 keV electrons
    dx = lam * 0.3 / (128 * 150e-6)
    np.testing.assert_allclose(data.positions, expected_positions(raster(20, 5, 0.4e-9 / dx), 128))
    assert data.metadata["import"]["preprocess"]["negative_values_clipped"] == int((full[:, :128] < 0).sum())


# --------------------------------------------------------------------------- NumPy

def _bin2(a):
    n, h, w = a.shape
    return a.reshape(n, h // 2, 2, w // 2, 2).sum(axis=(2, 4))


def test_npy_memmap_with_dark_orientation_and_binning(tmp_path):
    raw = frames(n=16, dtype=np.uint16)
    dark = np.full((32, 32), 2.0)
    dark[:, :4] = 50.0                                     # makes negatives to clip
    np.save(tmp_path / "frames.npy", raw)
    np.save(tmp_path / "pos.npy", raster(16, 4, 1.5))
    pre = Preprocess(bin=2, transpose=True, flip_x=True, dark=dark)
    data = import_numpy(tmp_path / "frames.npy", tmp_path / "o.zarr",
                        positions=str(tmp_path / "pos.npy"), units="px", preprocess=pre)
    want = np.clip(raw.astype(np.float64) - dark, 0, None)
    want = _bin2(np.swapaxes(want, 1, 2)[:, :, ::-1])
    np.testing.assert_allclose(np.asarray(data.intensities), want, rtol=1e-6)
    assert data.dtype == np.float32 and data.pattern_shape == (16, 16)
    assert data.metadata["import"]["preprocess"]["negative_values_clipped"] == \
        int((raw.astype(float) - dark < 0).sum())


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_members(tmp_path, compressed):
    raw = frames(n=18)
    pos = raster(18, 6, 2.0)
    (np.savez_compressed if compressed else np.savez)(tmp_path / "s.npz", intensities=raw,
                                                      positions=pos)
    data = import_numpy(tmp_path / "s.npz", tmp_path / "o.zarr", positions="positions",
                        units="px", shard_bytes=4 * 32 * 32 * 2)    # several shards
    assert len(data.intensities.chunks[0]) > 1
    np.testing.assert_array_equal(np.asarray(data.intensities), raw)
    np.testing.assert_allclose(data.positions, expected_positions(pos, 32))


# --------------------------------------------------------------------------- TIFF

def test_tiff_stack_and_directory(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    raw = frames(n=10)
    tifffile.imwrite(tmp_path / "stack.tif", raw)
    (tmp_path / "frames").mkdir()
    for i, frame in enumerate(raw):
        tifffile.imwrite(tmp_path / "frames" / f"f{i:03d}.tif", frame)
    pos_nm = raster(10, 5, 40.0)
    np.savetxt(tmp_path / "pos.txt", pos_nm)
    geo = Geometry(wavelength_m=WAVELENGTH, distance_m=DISTANCE, pixel_size_m=PIXEL)
    dx = WAVELENGTH * DISTANCE / (32 * PIXEL)
    for src, out in ((tmp_path / "stack.tif", "a.zarr"), (tmp_path / "frames", "b.zarr")):
        data = import_tiff(src, tmp_path / out, positions=str(tmp_path / "pos.txt"),
                           units="nm", geometry=geo)
        np.testing.assert_array_equal(np.asarray(data.intensities), raw)
        np.testing.assert_allclose(data.positions, expected_positions(pos_nm * 1e-9 / dx, 32))


# --------------------------------------------------------------------------- preprocessing

def test_auto_centre_hot_and_saturated_pixels(tmp_path):
    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[:48, :48]
    beam = 400.0 * np.exp(-((yy - 27.0) ** 2 + (xx - 19.0) ** 2) / 8.0)
    raw = rng.poisson(beam + 2.0, size=(40, 48, 48)).astype(np.uint16)
    raw[:, 30, 22] = rng.poisson(3000.0, 40)                 # hot pixel, inside the crop
    raw[7, 24, 16] = 60000                                   # saturated once
    np.save(tmp_path / "f.npy", raw)
    np.save(tmp_path / "p.npy", raster(40, 8, 3.0))
    data = import_numpy(tmp_path / "f.npy", tmp_path / "o.zarr", positions=str(tmp_path / "p.npy"),
                        units="px", preprocess=Preprocess(crop=16, saturation=50000, hot_sigma=8))
    cy, cx = data.metadata["import"]["preprocess"]["beam_center"]
    m = raw.mean(axis=0)                                     # the centroid, computed here
    assert (cy, cx) == pytest.approx(((m.sum(1) * np.arange(48)).sum() / m.sum(),
                                      (m.sum(0) * np.arange(48)).sum() / m.sum()))
    y0, x0 = round(cy) - 8, round(cx) - 8
    np.testing.assert_array_equal(np.asarray(data.intensities), raw[:, y0:y0 + 16, x0:x0 + 16])
    invalid = {tuple(int(v) for v in p) for p in np.argwhere(~data.mask)}
    assert {(30 - y0, 22 - x0), (24 - y0, 16 - x0)} <= invalid and len(invalid) <= 4


# --------------------------------------------------------------------------- the real CXI file

@pytest.mark.skipif(not os.path.isfile(REAL_CXI), reason="shared real data not present")
@pytest.mark.parametrize("crop", [None, 64])
def test_real_cxi_geometry(tmp_path, capsys, crop):
    with h5py.File(REAL_CXI, "r") as f:
        det = f["entry_1/instrument_1/detector_1"]
        lam = float(f["entry_1/instrument_1/source_1/wavelength"][()])
        z, p = float(det["distance"][()]), float(det["x_pixel_size"][()])
        n_bad = int((det["mask"][...] != 0).sum())
        shape = det["data"].shape
    argv = ["import", REAL_CXI, "-o", tmp_path / "real.zarr", "--quiet"]
    if crop:
        argv += ["--crop", crop]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    data = daskpty.open_data(tmp_path / "real.zarr")
    n = crop or shape[-1]
    assert data.n_patterns == shape[0] and data.pattern_shape == (n, n)
    assert data.metadata["object_pixel_size_m"] == pytest.approx(lam * z / (n * p), rel=1e-6)
    if crop is None:
        assert int((~data.mask).sum()) == n_bad
    # the README: steps of about 1 µm over about 20 µm x 19 µm
    from daskpty.io.scan import nearest_neighbour_steps

    dx = data.metadata["object_pixel_size_m"]
    step_m = np.median(nearest_neighbour_steps(data.positions)) * dx
    assert 0.7e-6 < step_m < 1.4e-6
    extent = np.ptp(data.positions, axis=0) * dx
    assert np.all((15e-6 < extent) & (extent < 25e-6))


# --------------------------------------------------------------------------- bad input

def _npy_set(tmp_path, n=12, n_pos=12):
    np.save(tmp_path / "f.npy", frames(n=n))
    np.save(tmp_path / "p.npy", raster(n_pos, 4, 2.0))


def _not_hdf5(tmp_path):
    (tmp_path / "x.h5").write_text("not an HDF5 file\n")
    return [tmp_path / "x.h5", "--data", "/d", "--positions", "/p", "--units", "px"], "not an HDF5"


def _missing_dataset(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["entry/data/frames"] = frames(n=4)
    return ([tmp_path / "x.h5", "--data", "/entry/data/data", "--positions", "/p", "--units", "px"],
            "/entry/data/frames [4, 32, 32]")


def _count_mismatch(tmp_path):
    _npy_set(tmp_path, 12, 10)
    return [tmp_path / "f.npy", "--positions", tmp_path / "p.npy", "--units", "px"], "12 patterns"


def _units_missing(tmp_path):
    _npy_set(tmp_path)
    return [tmp_path / "f.npy", "--positions", tmp_path / "p.npy"], "--units"


def _crop_too_large(tmp_path):
    _npy_set(tmp_path)
    return ([tmp_path / "f.npy", "--positions", tmp_path / "p.npy", "--units", "px",
             "--crop", 48], "larger than the 32 x 32 detector")


def _centre_outside(tmp_path):
    _npy_set(tmp_path)
    return ([tmp_path / "f.npy", "--positions", tmp_path / "p.npy", "--units", "px",
             "--crop", 16, "--center", 40, 10], "outside the 32 x 32 detector")


def _truncated_empad(tmp_path):
    write_empad(tmp_path / "s.raw", 11)
    with open(tmp_path / "s.raw", "r+b") as fh:
        fh.truncate(os.path.getsize(tmp_path / "s.raw") - 1000)
    return [tmp_path / "s.raw", "--scan-shape", "3x4", "--step", 1, "--units", "nm"], "truncated"


def _bad_frame_mid_stream(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    (tmp_path / "frames").mkdir()
    for i in range(12):
        tifffile.imwrite(tmp_path / "frames" / f"f{i:02d}.tif", frames(n=1, h=16 if i == 9 else 32)[0])
    np.save(tmp_path / "p.npy", raster(12, 4, 2.0))
    return ([tmp_path / "frames", "--positions", tmp_path / "p.npy", "--units", "px",
             "--shard-mib", 0.004], "frame 9")


BAD = {"not-hdf5": _not_hdf5, "missing-dataset": _missing_dataset,
       "count-mismatch": _count_mismatch, "units-missing": _units_missing,
       "crop-too-large": _crop_too_large, "centre-outside": _centre_outside,
       "truncated-empad": _truncated_empad, "bad-frame-mid-stream": _bad_frame_mid_stream}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, case):
    src = tmp_path / "in"
    src.mkdir()
    args, needle = BAD[case](src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = run_cli(["import", *args, "-o", out_dir / "data.zarr", "--quiet"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("daskpty: error: "), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err + out
    assert leftovers(out_dir) == []


def test_existing_output_is_refused_and_kept(tmp_path, capsys):
    _npy_set(tmp_path)
    argv = ["import", tmp_path / "f.npy", "--positions", tmp_path / "p.npy", "--units", "px",
            "-o", tmp_path / "d.zarr", "--quiet"]
    assert run_cli(argv, capsys)[0] == 0
    before = np.asarray(daskpty.open_data(tmp_path / "d.zarr").intensities)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "--overwrite" in err
    np.testing.assert_array_equal(np.asarray(daskpty.open_data(tmp_path / "d.zarr").intensities),
                                  before)
    assert not glob.glob(str(tmp_path / "*.partial-*"))


# --------------------------------------------------------------------------- from_arrays

def test_from_arrays_numpy_sends_no_large_graph(client):
    from daskpty.execution.scatter import embedded_bytes

    rng = np.random.default_rng(0)
    n, size = 300, 128
    inten = rng.poisson(4.0, (n, size, size)).astype(np.float32)        # 18.8 MiB
    pos = raster(n, 20, 10.0) + 64 + rng.uniform(-1, 1, (n, 2))
    data = daskpty.from_arrays(inten, pos)
    assert embedded_bytes(data.intensities) > 10 * 2**20  # would trip distributed's warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = daskpty.reconstruct(data, epochs=1, client=client)
    large = [str(w.message) for w in caught if "large graph" in str(w.message)]
    assert large == []
    assert np.isfinite(rec.history[-1]["loss"])


def test_every_scatter_of_the_same_array_gets_its_own_keys(client):
    """Two runs on the same in-memory array, one right after the other: content-hashed keys
    would be shared, and the first run's release could take the second run's data away (a
    "lost dependencies" error, dask/distributed#8576)."""
    from daskpty.execution.scatter import scatter_in_memory

    inten = np.ones((40, 8, 8), np.float32)
    _, first = scatter_in_memory(client, None, inten, chunk_length=16)
    _, second = scatter_in_memory(client, None, inten, chunk_length=16)
    keys = [set(a.__dask_graph__().keys()) for a in (first, second)]
    assert not keys[0] & keys[1]
    del first
    np.testing.assert_array_equal(client.compute(second).result(), inten)


# docs/howto/own-data.md's commands run in tests/test_own_data.py


@pytest.mark.parametrize("step, warns", [(2.0, False), (30.0, True)])
def test_info_plot_and_overlap_warning(tmp_path, capsys, step, warns):
    image = pytest.importorskip("matplotlib.image")
    np.save(tmp_path / "f.npy", frames(n=16))
    np.save(tmp_path / "p.npy", raster(16, 4, step))
    assert run_cli(["import", tmp_path / "f.npy", "--positions", tmp_path / "p.npy", "--units",
                    "px", "-o", tmp_path / "d.zarr", "--quiet"], capsys)[0] == 0
    code, out, err = run_cli(["info", tmp_path / "d.zarr", "--plot", tmp_path / "scan.png"], capsys)
    assert code == 0
    assert image.imread(tmp_path / "scan.png").shape[:2] == (460, 1000)
    assert ("little overlap" in err) == warns
    assert run_cli(["info", tmp_path / "d.zarr", "--plot", tmp_path / "scan.png"], capsys)[0] == 2
    assert not glob.glob(str(tmp_path / ".scan.png.partial-*"))
