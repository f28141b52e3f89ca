"""docs/howto/own-data.md's commands run as written and give real reconstructions.

The near-field recipe on the real P25 file is run from a directory laid out as the repository is
(``../shared/data/`` beside it); the far-field walk-through on the CXI file the page's Python
block writes; then the exports. Only the number of epochs is lowered.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import daskpty

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "howto" / "own-data.md"
SHARED = ROOT.parent / "shared" / "data"
REAL_CXI = SHARED / "PETRAIII_P25_Near_Field_Ptycho.cxi"
EPOCHS = 8


def block(marker: str, lang: str = "bash") -> str:
    """The fenced block right after ``<!-- test: marker -->`` on the page."""
    text = PAGE.read_text()
    m = re.search(rf"<!-- test: {re.escape(marker)} -->\n```{lang}\n(.*?)```", text, re.S)
    assert m, f"own-data.md has no '{marker}' block"
    return m.group(1)


def commands(marker: str) -> list[str]:
    """The block's command lines; each calls the README's ``.venv/bin/daskpty``."""
    lines = [ln.split("  #")[0].strip() for ln in block(marker).splitlines() if ln.strip()]
    assert all(ln.startswith(".venv/bin/daskpty ") for ln in lines), lines
    return lines


def run(line: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(line)[1:]
    if argv[0] == "reconstruct":   # the page's run, shortened
        i = argv.index("--epochs")
        argv[i + 1] = str(EPOCHS)
    proc = subprocess.run([sys.executable, "-m", "daskpty", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_real_reconstruction(path: Path, min_drop: float):
    """The data loss falls over the epochs and the object has structure (it starts flat)."""
    rec = daskpty.Reconstruction.from_zarr(str(path))
    assert rec.epochs == EPOCHS
    loss = np.array([h["loss"] for h in rec.history], dtype=float)
    assert np.all(np.isfinite(loss))
    # the Poisson / Gaussian losses may be offset by a constant: compare the fall with its scale
    drop = (loss[0] - loss[-1]) / abs(loss[0])
    assert drop > min_drop, f"loss {loss[0]:.4g} -> {loss[-1]:.4g}"
    lit = rec.illumination > 0.2 * rec.illumination.max()
    phase = np.angle(rec.object[lit] / np.mean(rec.object[lit]))
    assert lit.sum() > 1000 and np.std(phase) > 0.02, np.std(phase)
    return rec, loss


def test_page_marks_its_recipes():
    near = commands("near-field recipe")
    assert [c.split()[1] for c in near] == ["import", "info", "reconstruct", "show"]
    assert "../shared/data/PETRAIII_P25_Near_Field_Ptycho.cxi" in near[0]
    assert "--focus-to-sample" in near[0] and "--crop" not in near[0]
    assert [c.split()[1] for c in commands("far-field walk-through")] == [
        "import", "info", "reconstruct", "show"]
    assert all(c.split()[1] == "export" for c in commands("exports"))


@pytest.mark.slow
@pytest.mark.skipif(not REAL_CXI.is_file(), reason="shared real data not present")
def test_near_field_recipe_as_written(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "shared").mkdir()
    os.symlink(SHARED, tmp_path / "shared" / "data")       # ../shared/data beside the "repo"
    repo = tmp_path / "repo"
    repo.mkdir()
    procs = [run(line, repo) for line in commands("near-field recipe")]
    assert "near-field holograms" not in procs[0].stderr      # imported as near field: no hint
    data = daskpty.open_data(str(repo / "p25.zarr"))
    assert data.metadata["detector"] == "near_field" and data.pattern_shape == (100, 100)
    rec, loss = assert_real_reconstruction(repo / "p25-recon.zarr", min_drop=0.1)
    assert rec.probe.shape[-1] == 100
    for name in ("p25-scan.png", "p25.png"):
        assert (repo / name).stat().st_size > 10_000, name


@pytest.mark.slow
def test_far_field_walk_through_and_exports(tmp_path):
    pytest.importorskip("h5py")
    pytest.importorskip("matplotlib")
    (tmp_path / "make_farfield.py").write_text(_writer())
    proc = subprocess.run([sys.executable, "make_farfield.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    procs = [run(line, tmp_path) for line in commands("far-field walk-through")]
    assert "near-field" not in procs[0].stderr + procs[1].stderr   # no hint for far field
    data = daskpty.open_data(str(tmp_path / "ff.zarr"))
    assert data.pattern_shape == (48, 48) and data.n_patterns == 100
    assert data.metadata.get("detector", "far_field") == "far_field"
    assert_real_reconstruction(tmp_path / "ff-recon.zarr", min_drop=0.3)
    for line in commands("exports"):
        run(line, tmp_path)
    for name in ("ff-scan.png", "ff.png", "ff.cxi", "ff.h5", "ff-phase.png", "ff.tif"):
        assert (tmp_path / name).stat().st_size > 1000, name


def _writer() -> str:
    """The page's Python block that writes farfield.cxi (the one that mentions it)."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    (code,) = [b for b in blocks if "farfield.cxi" in b]
    return code
