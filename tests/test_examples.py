"""Every script in examples/ runs: as a subprocess, with small arguments, exit status 0.

Scripts that need hardware or services this machine lacks (GPUs, MIG, SLURM) must say so and exit
0; the CPU ones must produce their result line. A new example must be added to EXAMPLES.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ALL = {"cpu_quickstart.py", "from_hdf5.py", "local_cuda_cluster.py", "mig_slices.py",
       "slurm_jobqueue.py"}

NVIDIA_SMI_MIG = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5f3c0a1e-1111-2222-3333-444455556666)
  MIG 2g.20gb     Device  0: (UUID: MIG-aaaaaaaa-0000-1111-2222-333333333333)
  MIG 2g.20gb     Device  1: (UUID: MIG-bbbbbbbb-0000-1111-2222-333333333333)
  MIG 2g.20gb     Device  2: (UUID: MIG-cccccccc-0000-1111-2222-333333333333)
"""


def run(script, *args, cwd=None, env=None, timeout=180, python_args=()):
    """Run an example with this interpreter; return the CompletedProcess (stdout+stderr text)."""
    cmd = [sys.executable, *python_args, str(EXAMPLES / script), *map(str, args)]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    return subprocess.run(cmd, cwd=cwd or ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def gpu_present() -> bool:
    from daskpty.execution.gpu import list_cuda_devices

    return bool(list_cuda_devices())


def test_every_example_is_tested():
    assert {p.name for p in EXAMPLES.glob("*.py")} == ALL


@pytest.mark.parametrize("script", sorted(ALL))
def test_help(script):
    out = ok(run(script, "--help", timeout=60))
    assert out.startswith("usage:") and script in out


@pytest.mark.slow
def test_cpu_quickstart(tmp_path):
    out = ok(run("cpu_quickstart.py", "--grid", 10, "--probe-size", 32, "--epochs", 30,
                 "--workers", 2, "--out", tmp_path, cwd=tmp_path))
    m = re.search(r"^object NRMSE vs truth: ([0-9.eE+-]+)$", out, re.M)
    assert m, out
    assert 0 <= float(m.group(1)) < 0.15, out
    assert (tmp_path / "recon.zarr").is_dir() and (tmp_path / "scan.zarr").is_dir()
    import daskpty

    rec = daskpty.Reconstruction.from_zarr(str(tmp_path / "recon.zarr"))
    assert rec.epochs == 30


@pytest.mark.skipif(not have("h5py"), reason="h5py is not installed (optional dependency)")
@pytest.mark.slow
def test_from_hdf5_round_trip(tmp_path):
    out = ok(run("from_hdf5.py", "--grid", 6, "--probe-size", 32, cwd=tmp_path))
    assert "wrote synthetic CXI file" in out
    assert re.search(r"^patterns\s+36 x 32 x 32\s+uint16$", out, re.M), out
    assert re.search(r"^mask\s+99\.8 % valid pixels$", out, re.M), out
    assert "counts on valid pixels identical: True" in out, out
    err = float(re.search(r"positions agree to ([0-9.eE+-]+) px", out).group(1))
    assert err < 1e-6


@pytest.mark.skipif(not have("h5py"), reason="h5py is not installed (optional dependency)")
@pytest.mark.slow
def test_from_hdf5_converts_a_given_file(tmp_path):
    """The file-to-store path with a crop: write a synthetic file, keep it, convert it again."""
    out = ok(run("from_hdf5.py", "--grid", 5, "--probe-size", 32, "--keep", cwd=tmp_path))
    workdir = Path(re.search(r"^kept (.+)$", out, re.M).group(1))
    try:
        target = tmp_path / "cropped.zarr"
        out = ok(run("from_hdf5.py", workdir / "scan.cxi", "-o", target, "--crop", 16,
                     cwd=tmp_path))
        assert re.search(r"^patterns\s+25 x 16 x 16\s+uint16$", out, re.M), out
        import daskpty

        data = daskpty.open_data(str(target))
        # half the pattern size doubles the object pixel: the scan spans half as many pixels
        assert data.metadata["object_pixel_size_m"] == pytest.approx(
            2 * 0.155e-9 * 2 / (32 * 75e-6), rel=1e-2)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def test_from_hdf5_without_h5py(tmp_path):
    """With h5py unavailable the script says so and exits 0."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['h5py'] = None\n")
    out = ok(run("from_hdf5.py", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}))
    assert "h5py is not installed" in out


@pytest.mark.parametrize("script", ["local_cuda_cluster.py", "mig_slices.py"])
def test_gpu_examples_without_gpu(script, tmp_path):
    if gpu_present():
        pytest.skip("a GPU is present: see test_gpu_examples_on_gpu")
    out = ok(run(script, "--epochs", 2, cwd=tmp_path, timeout=60))
    assert "no GPU available" in out


@pytest.mark.gpu
def test_gpu_examples_on_gpu(tmp_path):
    if not gpu_present() or not (have("cupy") and have("dask_cuda")):
        pytest.skip("needs an NVIDIA GPU with CuPy and dask-cuda")
    out = ok(run("local_cuda_cluster.py", "--preset", "small", "--epochs", 5, cwd=tmp_path, timeout=600))
    assert re.search(r"^object NRMSE vs truth: [0-9.]+$", out, re.M), out


def _fake_nvidia_smi(tmp_path) -> dict:
    """An nvidia-smi on PATH that lists three MIG slices of one A100."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + NVIDIA_SMI_MIG + "EOF\n")
    exe.chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_mig_slices_lists_slices(tmp_path):
    env = _fake_nvidia_smi(tmp_path)
    out = ok(run("mig_slices.py", "--list", env=env, cwd=tmp_path, timeout=60))
    lines = [line for line in out.splitlines() if line.startswith("MIG-")]
    assert len(lines) == 3 and all("2g.20gb" in line and "(20 GB)" in line for line in lines), out


@pytest.mark.skipif(have("cupy") and have("dask_cuda"), reason="CuPy and dask-cuda are installed")
def test_gpu_examples_without_cupy(tmp_path):
    """nvidia-smi finds (fake) slices, but the GPU packages are missing: a clear message, exit 0."""
    env = _fake_nvidia_smi(tmp_path)
    out = ok(run("mig_slices.py", env=env, cwd=tmp_path, timeout=60))
    assert "no GPU available" in out and "pip install" in out
    out = ok(run("local_cuda_cluster.py", env=env, cwd=tmp_path, timeout=60))
    assert "no GPU available" in out and "CuPy" in out


def test_slurm_example_without_slurm(tmp_path):
    out = ok(run("slurm_jobqueue.py", cwd=tmp_path, timeout=60))
    if not have("dask_jobqueue"):
        assert "dask-jobqueue is not installed" in out
    elif not any((Path(d) / "sbatch").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        assert "no SLURM here" in out
    else:
        pytest.skip("SLURM is available here; the example would submit jobs")


@pytest.mark.skipif(not have("dask_jobqueue"), reason="dask-jobqueue is not installed")
def test_slurm_job_script(tmp_path):
    out = ok(run("slurm_jobqueue.py", "--print-job-script", "--partition", "gpu", "--account", "abc",
                 "--prologue", "source /shared/venv/bin/activate", cwd=tmp_path, timeout=60))
    for line in ("#SBATCH -p gpu", "#SBATCH -A abc", "#SBATCH --gres=gpu:1",
                 "source /shared/venv/bin/activate"):
        assert line in out, out
