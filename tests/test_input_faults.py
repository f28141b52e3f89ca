"""Inputs the command line must refuse in one line that names the flag or the file: slice counts
and spacings no run can use, NumPy files holding Python objects (never unpickled) and outputs
that are symbolic links (the CLI's main in process, and one real subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import daskpty
from daskpty.cli import main
from daskpty.engines.sample_options import SampleOptions


@pytest.fixture(scope="module")
def data(tmp_path_factory, client):
    """A small simulated X-ray data set (5 x 5 scan of 32² patterns, 129 nm object pixels)."""
    path = tmp_path_factory.mktemp("inputs") / "s.zarr"
    with client.as_current():
        assert main(["simulate", str(path), "--grid", "5x5", "--probe-size", "32", "--quiet"]) == 0
    return str(path)


def _one_error_line(err: str, *words):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("daskpty: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flags, words", [
    (["--slices", "1000", "--slice-spacing", "1e-4"], ["--slices", "1 to 256 slices"]),
    (["--slices", "0"], ["--slices", "1 to 256 slices"]),
    (["--slices", "100", "--slice-spacing", "1e-8"], ["--slice-spacing", "depth resolution", "at least 1.4e-07 m"]),
    (["--slice-spacing", "1e-6"], ["--slice-spacing", "one slice", "--slices K"]),
    (["--slices", "2", "--slice-spacing", "-1e-6"], ["--slice-spacing", "slice spacing must be positive"]),
    (["--slices", "2", "--slice-spacing", "0"], ["--slice-spacing", "slice spacing must be positive"]),
])
def test_slices_and_spacings_no_run_can_use_are_one_line(use_client, data, tmp_path, capsys, flags, words):
    """1000 slices (minutes in the first step), slices closer than the data can tell apart,
    a spacing without slices (was silently unused) and a negative spacing (was argparse's
    "expected one argument"): one line naming the flag, before any work; nothing written."""
    out = tmp_path / "r.zarr"
    code = main(["reconstruct", data, "-o", str(out), "--epochs", "1", "--quiet", *flags])
    assert code == 2
    _one_error_line(capsys.readouterr().err, *words)
    assert not os.path.lexists(out)


def test_a_physical_spacing_still_runs(use_client, data, tmp_path, capsys):
    """The bounds leave real thick samples alone: 2 slices 10 µm apart at a 129 nm pixel."""
    out = tmp_path / "r.zarr"
    assert main(["reconstruct", data, "-o", str(out), "--epochs", "1", "--quiet", "--slices", "2",
                 "--slice-spacing", "1e-5"]) == 0, capsys.readouterr().err
    assert daskpty.Reconstruction.from_zarr(str(out)).object.shape[0] == 2
    with pytest.raises(ValueError, match="depth resolution"):  # the library refuses it too
        SampleOptions(slices=2, slice_spacing_m=1e-8).resolve(daskpty.open_data(data).metadata, 32)


def test_a_negative_spacing_parses_in_a_real_command(data, tmp_path):
    """``--slice-spacing -1e-6`` as a shell passes it: the value is read and refused as such."""
    r = subprocess.run([sys.executable, "-m", "daskpty", "reconstruct", data, "-o", str(tmp_path / "r.zarr"),
                        "--slices", "2", "--slice-spacing", "-1e-6"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 2
    _one_error_line(r.stderr, "--slice-spacing", "must be positive", "-1e-6")


class _Payload:
    """An object whose unpickling creates a file: proof that a load ran pickled code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _objects(marker, shape):
    a = np.empty(shape, dtype=object)
    a.flat[0] = _Payload(marker)
    for i in range(1, a.size):
        a.flat[i] = 1.0
    return a


@pytest.mark.parametrize("case", ["npz", "npz-compressed", "npy", "dark", "mask", "positions"])
def test_numpy_files_of_python_objects_are_refused_naming_file_and_option(use_client, tmp_path, capsys, case):
    """An .npz/.npy (data, --dark, --mask, --positions) holding Python objects: one line naming
    the file and the option, and the pickled payload never runs."""
    marker = str(tmp_path / "payload-ran")
    frames = np.ones((4, 32, 32), np.float32)
    positions = np.array([[20.0, 20.0], [20.0, 24.0], [24.0, 20.0], [24.0, 24.0]])
    np.save(tmp_path / "frames.npy", frames)
    np.save(tmp_path / "pos.npy", positions)
    bad = tmp_path / ("bad.npz" if case.startswith("npz") else "bad.npy")
    src, extra, option = str(tmp_path / "frames.npy"), ["--positions", str(tmp_path / "pos.npy")], "(SRC"
    if case.startswith("npz"):
        save = np.savez_compressed if case == "npz-compressed" else np.savez
        save(bad, intensities=_objects(marker, (4, 32, 32)), positions=positions)
        src, extra, option = str(bad), ["--positions", "positions"], "(SRC, the member chosen by --data)"
    elif case == "npy":
        np.save(bad, _objects(marker, (4, 32, 32)), allow_pickle=True)
        src = str(bad)
    elif case in ("dark", "mask"):
        np.save(bad, _objects(marker, (32, 32)), allow_pickle=True)
        extra += [f"--{case}", str(bad)]
        option = f"(--{case})"
    else:
        np.save(bad, _objects(marker, (4, 2)), allow_pickle=True)
        extra = ["--positions", str(bad)]
        option = "(--positions)"
    out = tmp_path / "d.zarr"
    code = main(["import", src, "-o", str(out), "--units", "px", "--quiet", *extra])
    assert code == 2
    _one_error_line(capsys.readouterr().err, str(bad), option, "Python objects", "numeric array")
    assert not os.path.exists(marker) and not os.path.lexists(out)


@pytest.mark.parametrize("command", ["reconstruct", "simulate"])
def test_overwrite_onto_a_symlink_names_the_link_and_its_target(use_client, data, tmp_path, capsys, command):
    """``--overwrite`` onto a symbolic link to a daskpty store is refused for what it is: a link,
    its target named and what to pass instead; the linked store stays as it was."""
    target = tmp_path / "target.zarr"
    assert main(["simulate", str(target), "--grid", "3x3", "--probe-size", "32", "--quiet"]) == 0
    before = sorted(os.listdir(target))
    link = tmp_path / "link.zarr"
    os.symlink(target, link)
    argv = ([command, data, "-o", str(link), "--epochs", "1"] if command == "reconstruct"
            else [command, str(link), "--grid", "3x3", "--probe-size", "32"])
    capsys.readouterr()
    assert main([*argv, "--overwrite", "--quiet"]) == 2
    _one_error_line(capsys.readouterr().err, str(link), "symbolic link", str(target), "remove the link")
    assert os.path.islink(link) and sorted(os.listdir(target)) == before
