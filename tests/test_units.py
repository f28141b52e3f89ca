"""Issue 31 item 4 / issue 32 item 6: positions in the wrong units stop with one line naming them.

A scan given in metres but declared 'um' (10⁶ too small), metres declared 'px', millimetres
declared 'm' (10³ too large) each end at ``daskpty import`` with exit 2 and one line, nothing
written; a store holding such positions (written through ``from_arrays``, which cannot know the
units) is refused by ``daskpty info`` and by ``reconstruct`` (API and CLI). Honest small scans,
a single position and a scan at one point pass the scale test.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import daskpty
from daskpty.cli import main
from daskpty.io.scan import unit_mistake
from daskpty.io.validate import DataError

N_PIX = 16
PIXEL_M = 1e-7  # object pixel: 100 nm
STEP_M = 4e-7  # a 6 x 6 raster of 400 nm steps: 4 px, a quarter of the 16 px window


def _raster_m(grid=6, step=STEP_M) -> np.ndarray:
    iy, ix = np.divmod(np.arange(grid * grid), grid)
    rng = np.random.default_rng(1)
    return (np.stack([iy, ix], 1) * step + rng.uniform(-0.1, 0.1, (grid * grid, 2)) * step)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """frames.npy (36 x 16 x 16 counts) and positions in metres and in millimetres."""
    d = tmp_path_factory.mktemp("units")
    rng = np.random.default_rng(0)
    np.save(d / "frames.npy", rng.poisson(30.0, (36, N_PIX, N_PIX)).astype(np.uint16))
    np.save(d / "pos_m.npy", _raster_m())
    np.save(d / "pos_mm.npy", _raster_m() * 1e3)
    return d


def _cli(capsys, *argv):
    """(exit code, stdout, stderr) of the CLI run in-process."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str, *patterns) -> str:
    assert "Traceback" not in err, err
    assert err.startswith("daskpty: error: ") and err.count("\n") == 1, err
    for p in patterns:
        assert re.search(p, err, re.I), f"{p!r} not in {err!r}"
    return err


def _import(files, out, positions, units):
    return ["import", files / "frames.npy", "-o", out, "--positions", files / positions,
            "--units", units, "--object-pixel-size", PIXEL_M, "--quiet"]


@pytest.mark.parametrize("positions, units, patterns", [
    ("pos_m.npy", "um", [r"spans only \d.*px \(\d.* pm\)", r"probe width of 16 px",
                         r"given in 'm' but declared 'um'", r"--units"]),
    ("pos_m.npy", "nm", [r"spans only", r"given in 'm' but declared 'nm'"]),
    ("pos_m.npy", "px", [r"spans only .* px", r"length unit .* declared 'px'", r"--units"]),
    ("pos_mm.npy", "m", [r"median scan step is \d+ px \(\d+ µm\)", r"no two probe windows overlap",
                         r"given in 'mm' but declared 'm'"]),
], ids=["m-as-um", "m-as-nm", "m-as-px", "mm-as-m"])
def test_import_refuses_a_unit_mistake(files, tmp_path, capsys, positions, units, patterns):
    out = tmp_path / "d.zarr"
    rc, _, err = _cli(capsys, *_import(files, out, positions, units))
    assert rc == 2, err
    _one_line(err, *patterns)
    assert not os.path.lexists(out) and os.listdir(tmp_path) == []


def test_import_with_the_right_units_passes(files, tmp_path, capsys):
    """The same positions with their true units import; the scan spans the expected pixels."""
    out = tmp_path / "d.zarr"
    rc, _, err = _cli(capsys, *_import(files, out, "pos_m.npy", "m"))
    assert rc == 0, err
    pos = daskpty.open_data(out).positions
    assert 18 < np.ptp(pos, axis=0).max() < 24  # 5 steps of 4 px, ±0.4 px jitter each end
    rc, _, err = _cli(capsys, *_import(files, tmp_path / "mm.zarr", "pos_mm.npy", "mm"))
    assert rc == 0, err


@pytest.fixture(scope="module")
def metres_store(files, tmp_path_factory):
    """A store whose positions are metres stored as if they were pixels (from_arrays)."""
    path = tmp_path_factory.mktemp("m") / "m.zarr"
    frames = np.load(files / "frames.npy")
    daskpty.from_arrays(frames, _raster_m() + N_PIX, object_pixel_size_m=PIXEL_M).to_zarr(path)
    return path


def test_info_describes_then_refuses_metres_as_pixels(metres_store, capsys):
    rc, out, err = _cli(capsys, "info", metres_store)
    assert rc == 2
    assert "extent 0.0 x 0.0 px" in out  # the description is printed first: it shows the scale
    _one_line(err, r"spans only .*px \(.*pm\)", r"too small", r"object pixels")


def test_reconstruct_refuses_metres_as_pixels(metres_store, tmp_path, capsys):
    """API and CLI, before any cluster starts: one line, no reconstruction store."""
    with pytest.raises(DataError, match=r"spans only .* about 1e\+06 times too small") as info:
        daskpty.reconstruct(metres_store, epochs=1, checkpoint=tmp_path / "r.zarr")
    assert "\n" not in str(info.value)
    rc, _, err = _cli(capsys, "reconstruct", metres_store, "-o", tmp_path / "r.zarr",
                      "--epochs", "1", "--quiet")
    assert rc == 2
    _one_line(err, r"spans only", r"metres")
    assert not (tmp_path / "r.zarr").exists()


def test_reconstruct_refuses_steps_of_many_probe_widths(files, tmp_path):
    frames = np.load(files / "frames.npy")
    pos = _raster_m() / PIXEL_M * 1e3 + N_PIX  # 4000 px steps: pixel positions x 1000
    with pytest.raises(DataError, match=r"\d+ probe widths .* about 1e\+03 times too large"):
        daskpty.reconstruct(daskpty.from_arrays(frames, pos), epochs=1)


@pytest.mark.parametrize("positions, refused", [
    (np.array([[8.0, 8.0]]), False),                              # a single position
    (np.full((5, 2), 8.0), False),                                # all at one point: no scale
    (np.array([[8.0, 8.0], [8.0, 10.0], [10.0, 8.0]]), False),    # a tiny honest scan, 2 px
    (np.array([[8.0, 8.0], [8.0, 8.6], [8.6, 8.0], [8.6, 8.6]]), True),  # inside one pixel
    (np.repeat([[8.0, 8.0], [8.0, 8.6]], 3, axis=0), True),      # repeated exposures, 0.6 px
    (np.repeat([[8.0, 8.0], [8.0, 12.0]], 3, axis=0), False),     # repeated exposures, 4 px
], ids=["single", "one-point", "tiny-scan", "sub-pixel", "repeats-sub-pixel", "repeats"])
def test_scale_test_thresholds(positions, refused):
    problem = unit_mistake(positions, N_PIX)
    assert (problem is not None) == refused, problem
    if refused:
        assert "spans only 0.6 px" in problem and "object pixels" in problem


def test_scale_test_edges():
    """Around the thresholds: a scan of a few pixels with 0.1 px steps passes (a dense but
    real scan), 0.01 px steps inside one probe width do not; 10 widths pass, 11 do not."""
    fine = np.stack(np.divmod(np.arange(100), 10), 1) * 0.1 + 8.0
    assert unit_mistake(fine * 30, N_PIX) is None  # 3 px steps
    assert unit_mistake(np.concatenate([fine, fine + 2.0]), N_PIX) is None  # 0.1 px steps, 2.9 px
    dense = np.concatenate([fine * 0.1, fine * 0.1 + 5.0])  # 0.01 px steps, span 5.9 px
    assert "median step of 0.01 px" in unit_mistake(dense, N_PIX)
    assert unit_mistake(np.array([[0.0, 0.0], [0.0, 10.0 * N_PIX]]), N_PIX) is None
    assert "11 probe widths" in unit_mistake(np.array([[0.0, 0.0], [0.0, 11.0 * N_PIX]]), N_PIX)
