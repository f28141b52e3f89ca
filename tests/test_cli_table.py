"""Issue #18 item 9: a table of bad command lines and bad environments.

Every row runs the CLI in-process (``main([...])``) against one shared little world (a data
set, a reconstruction, a lone ``X.previous``, an ordinary directory, a lock held by a live
process, and — where this machine lets us mount — a read-only and a nearly full tmpfs). Each
must end with exit code 2, exactly one ``daskpty: error:`` line naming the problem, no
traceback, and the world exactly as it was (nothing created, nothing removed).
"""
from __future__ import annotations

import json
import os
import re
import socket

import numpy as np
import psutil
import pytest

import daskpty
from daskpty.cli import main
from daskpty.io.results import Reconstruction

from mounts import tmpfs
from synthetic import make_dataset


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    ds = make_dataset(grid=5, seed=4)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(root / "data.zarr")
    far = ds.positions.copy()
    far[7] = (1e9, 3.0)
    daskpty.from_arrays(ds.intensities, far).to_zarr(root / "far.zarr")
    rec = Reconstruction(object=np.ones((60, 60), np.complex64), probe=ds.truth.probe,
                         positions=ds.positions + 2.0, origin=np.array([2.0, 2.0]),
                         illumination=np.ones((60, 60), np.float32), epoch=3,
                         options={"chunk_length": 8, "rounds_per_epoch": 1})
    rec.to_zarr(root / "recon.zarr")
    shifted = Reconstruction(**{**vars(rec), "positions": rec.positions + 1.5})
    shifted.to_zarr(root / "shifted.zarr")
    rec.to_zarr(root / "lone.zarr")
    os.rename(root / "lone.zarr", root / "lone.zarr.previous")
    (root / "notes").mkdir()
    (root / "notes" / "keep.txt").write_text("precious")
    (root / "file.txt").write_text("a file")
    (root / "fig.png").write_bytes(b"not a figure")
    init = psutil.Process(1)  # a live process on this host holds locked.zarr
    (root / "locked.zarr.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": 1, "started": init.create_time(), "since": 0,
         "command": "daskpty reconstruct elsewhere"}))
    mounts = {}
    with tmpfs(root / "ro", "1m", read_only=True) as ro_reason, \
            tmpfs(root / "full", "512k") as full_reason:
        mounts["ro"], mounts["full"] = ro_reason, full_reason
        yield root, mounts


R = ["--epochs", "1", "--workers", "1", "--quiet"]
# (id, argv with {w} = the world's directory, pattern the one error line must match, mount)
CASES = [
    # reconstruct: argument values
    ("epochs-negative", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--epochs", "-1"], r"--epochs must be >= 0"),
    ("epochs-word", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--epochs", "two"], r"invalid int value: 'two'"),
    ("epochs-fraction", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--epochs", "1.5"], r"invalid int value: '1.5'"),
    ("workers-zero", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--workers", "0"], r"--workers must be >= 1"),
    ("checkpoint-every-zero", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--checkpoint-every", "0"], r"--checkpoint-every must be >= 1"),
    ("rounds-zero", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--rounds-per-epoch", "0"], r"rounds_per_epoch must be an integer >= 1"),
    ("rounds-word", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--rounds-per-epoch", "x"], r"integer >= 1 or 'auto'"),
    ("rounds-above-patterns", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--rounds-per-epoch", "26"], r"rounds_per_epoch=26 exceeds the 25 patterns"),
    ("chunk-length-zero", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--chunk-length", "0"], r"chunk_length must be >= 1"),
    ("noise-unknown", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--noise", "laplace"], r"invalid choice: 'laplace'"),
    ("engine-unknown", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--engine", "nonesuch"], r"invalid choice: 'nonesuch'"),
    ("optimizer-unknown", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--engine", "ad", "--optimizer", "lbfgs"], r"invalid choice: 'lbfgs'"),
    ("lr-without-ad", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--lr", "0.1"], r"apply to --engine ad only"),
    ("loss-without-ad", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--loss", "poisson"], r"apply to --engine ad only"),
    ("probe-modes-negative", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--probe-modes", "-2"], r"probe_modes must be an integer >= 1"),
    ("unknown-option", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--frobnicate"], r"unrecognized arguments: --frobnicate"),
    ("missing-output", ["reconstruct", "{w}/data.zarr", *R], r"-o/--output"),
    # reconstruct: where the output goes
    ("output-is-data", ["reconstruct", "{w}/data.zarr", "-o", "{w}/data.zarr", *R], r"must not be the data store"),
    ("output-inside-data", ["reconstruct", "{w}/data.zarr", "-o", "{w}/data.zarr/sub.zarr", *R, "--overwrite"], r"inside the data store"),
    ("data-inside-output", ["reconstruct", "{w}/data.zarr", "-o", "{w}", *R, "--overwrite"], r"data store .* lies inside"),
    ("output-exists", ["reconstruct", "{w}/data.zarr", "-o", "{w}/recon.zarr", *R], r"exists; choose another output, pass --overwrite"),
    ("output-ordinary-dir", ["reconstruct", "{w}/data.zarr", "-o", "{w}/notes", *R, "--overwrite"], r"notes \(the output\) is a directory that is not a daskpty store"),
    ("output-is-file", ["reconstruct", "{w}/data.zarr", "-o", "{w}/file.txt", *R], r"file.txt exists"),
    ("output-is-file-overwrite", ["reconstruct", "{w}/data.zarr", "-o", "{w}/file.txt", *R, "--overwrite"], r"is a file; daskpty replaces only stores it wrote"),
    ("output-under-a-file", ["reconstruct", "{w}/data.zarr", "-o", "{w}/file.txt/o.zarr", *R], r"file.txt is not a directory"),
    ("output-is-a-data-set", ["reconstruct", "{w}/data.zarr", "-o", "{w}/far.zarr", *R, "--overwrite"], r"is a daskpty data set; a reconstruction never replaces one"),
    ("output-only-previous", ["reconstruct", "{w}/data.zarr", "-o", "{w}/lone.zarr", *R], r"exists only as .*lone.zarr.previous.*--resume"),
    ("output-locked", ["reconstruct", "{w}/data.zarr", "-o", "{w}/locked.zarr", *R], r"being written by another daskpty run: pid 1 on"),
    ("output-read-only", ["reconstruct", "{w}/data.zarr", "-o", "{w}/ro/o.zarr", *R], r"Read-only file system", "ro"),
    ("output-disk-full", ["reconstruct", "{w}/data.zarr", "-o", "{w}/full/o.zarr", *R], r"not enough free space for .*full/o.zarr", "full"),
    # reconstruct: inputs
    ("data-missing", ["reconstruct", "{w}/nope.zarr", "-o", "{w}/o.zarr", *R], r"no such data set"),
    ("data-ordinary-dir", ["reconstruct", "{w}/notes", "-o", "{w}/o.zarr", *R], r"not a Zarr store"),
    ("data-is-a-reconstruction", ["reconstruct", "{w}/recon.zarr", "-o", "{w}/o.zarr", *R], r"'daskpty-reconstruction' store, not a 'daskpty-dataset'"),
    ("position-far-outside", ["reconstruct", "{w}/far.zarr", "-o", "{w}/o.zarr", *R], r"lie far outside the scan: pattern 7 at \(y, x\) = \(1e\+09, 3\)"),
    ("resume-missing", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--resume", "{w}/nope.zarr"], r"no reconstruction store at"),
    ("resume-a-data-set", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--resume", "{w}/far.zarr"], r"is not a daskpty reconstruction store"),
    ("resume-other-positions", ["reconstruct", "{w}/data.zarr", "-o", "{w}/o.zarr", *R, "--resume", "{w}/shifted.zarr"], r"its positions differ"),
    # simulate
    ("simulate-exists", ["simulate", "{w}/data.zarr", "--quiet"], r"already exists"),
    ("simulate-ordinary-dir", ["simulate", "{w}/notes", "--overwrite", "--quiet"], r"not a Zarr store daskpty wrote"),
    ("simulate-only-previous", ["simulate", "{w}/lone.zarr", "--quiet"], r"exists only as"),
    ("simulate-locked", ["simulate", "{w}/locked.zarr", "--quiet"], r"being written by another daskpty run: pid 1"),
    ("simulate-grid-word", ["simulate", "{w}/s.zarr", "--grid", "ten"], r"expected ROWSxCOLS"),
    ("simulate-dose-negative", ["simulate", "{w}/s.zarr", "--dose", "-3"], r"dose must be positive"),
    ("simulate-odd-probe", ["simulate", "{w}/s.zarr", "--probe-size", "33", "--quiet"], r"even number"),
    ("simulate-read-only", ["simulate", "{w}/ro/s.zarr", "--grid", "2x2", "--probe-size", "16", "--quiet"], r"Read-only file system", "ro"),
    # show, info, the command itself
    ("show-missing", ["show", "{w}/nope.zarr", "-o", "{w}/f.png"], r"no such reconstruction store"),
    ("show-a-data-set", ["show", "{w}/data.zarr", "-o", "{w}/f.png"], r"is a daskpty data set, not a reconstruction"),
    ("show-bad-suffix", ["show", "{w}/recon.zarr", "-o", "{w}/f.txt"], r"unsupported figure type '.txt'"),
    ("show-exists", ["show", "{w}/recon.zarr", "-o", "{w}/fig.png"], r"fig.png exists"),
    ("show-dpi", ["show", "{w}/recon.zarr", "-o", "{w}/f.png", "--dpi", "0"], r"--dpi must lie in"),
    ("show-read-only", ["show", "{w}/recon.zarr", "-o", "{w}/ro/f.png"], r"writing the figure .* failed: Read-only file system", "ro"),
    ("info-missing", ["info", "{w}/nope.zarr"], r"does not exist"),
    ("info-ordinary-dir", ["info", "{w}/notes"], r"not a Zarr store"),
    ("no-command", [], r"choose a command"),
    ("unknown-command", ["frobnicate"], r"invalid choice: 'frobnicate'"),
]


def _snapshot(root):
    """Every path under ``root`` with its size (files) — to see that nothing was created."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = os.path.getsize(p) if os.path.isfile(p) else -1
    return out


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_command_line(world, case, capsys):
    name, argv, pattern, *needs = case
    root, mounts = world
    if needs and mounts[needs[0]] is not None:
        pytest.skip(f"no {needs[0]} tmpfs here: {mounts[needs[0]]}")
    before = _snapshot(root)
    rc = main([a.replace("{w}", str(root)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, f"exit code {rc}; stderr: {err!r}"
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("daskpty: error: "), err
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"
    assert _snapshot(root) == before
    assert (root / "notes" / "keep.txt").read_text() == "precious"
