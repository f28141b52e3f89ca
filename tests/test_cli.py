"""The daskpty command line: real subprocess runs and in-process ``main([...])`` calls."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import daskpty
from daskpty.cli import COMMANDS, main

from conftest import corrupt, leftovers


def _cli(*args, timeout=180):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "daskpty", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _assert_one_line_error(err: str, pattern: str | None = None):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("daskpty: error: "), err
    assert "Traceback" not in err
    if pattern is not None:
        assert pattern in lines[0], lines[0]


def test_subprocess_help_and_version():
    r = _cli("--help")
    assert r.returncode == 0 and "simulate" in r.stdout and "info" in r.stdout
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"daskpty {daskpty.__version__}"


@pytest.mark.slow
def test_subprocess_simulate_then_info(tmp_path):
    out = tmp_path / "cli.zarr"
    r = _cli("simulate", out, "--grid", "6x5", "--probe-size", "32", "--workers", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("info", out, "--json", "--check")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["n_patterns"] == 30 and d["pattern_shape"] == [32, 32] and d["dtype"] == "uint16"
    assert d["check"]["ok"] is True
    assert d["truth"]["object"]["dtype"] == "complex64"
    r = _cli("simulate", out, "--grid", "2x2", "--probe-size", "32", "--quiet")
    assert r.returncode == 2
    _assert_one_line_error(r.stderr, "already exists")
    assert daskpty.open_data(out).n_patterns == 30


def test_commands_are_pluggable():
    names = [m.NAME for m in COMMANDS]
    assert names[:2] == ["simulate", "info"] and len(set(names)) == len(names)
    for module in COMMANDS:
        assert callable(module.add_parser) and callable(module.run)


def test_simulate_and_info_in_process(tmp_path, use_client, capsys):
    out = tmp_path / "sim.zarr"
    rc = main(["simulate", str(out), "--scan", "fermat", "--n-patterns", "40", "--probe-size", "32",
               "--modes", "2", "--dose", "1e5", "--seed", "3", "--shard-mib", "0.05"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "wrote" in captured.out and "patterns/s" in captured.out
    d = daskpty.open_data(out)
    assert d.n_patterns == 40 and d.truth.probe.shape[0] == 2
    assert d.metadata["simulation"]["scan"] == "fermat" and d.metadata["simulation"]["seed"] == 3
    assert len(d.intensities.chunks[0]) > 1
    rc = main(["info", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for key in ("patterns", "chunking", "shards", "inner chunks", "on disk", "scan", "µm",
                "linear overlap", "geometry", "truth", "provenance", "simulation"):
        assert key in text, key
    # --overwrite replaces; noise-free float32
    rc = main(["simulate", str(out), "--grid", "3x3", "--probe-size", "32", "--dose", "none",
               "--overwrite", "--quiet"])
    assert rc == 0 and capsys.readouterr().out == ""
    assert daskpty.open_data(out).dtype == np.float32
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind,pattern", [
    ("missing_positions", "no 'positions' array"),
    ("n_mismatch", "but 11 positions"),
    ("nan_positions", "NaN or infinite"),
    ("newer_version", "upgrade daskpty"),
    ("no_format", "not a daskpty data set"),
])
def test_info_structural_errors(store_path, kind, pattern, capsys):
    corrupt(store_path, kind)
    assert main(["info", str(store_path)]) == 2
    _assert_one_line_error(capsys.readouterr().err, pattern)


@pytest.mark.parametrize("kind", ["nan_intensity", "inf_intensity", "negative_intensity"])
def test_info_check_value_errors(store_path, kind, capsys):
    corrupt(store_path, kind)
    assert main(["info", str(store_path)]) == 0  # values are only read with --check
    capsys.readouterr()
    assert main(["info", str(store_path), "--check"]) == 2
    captured = capsys.readouterr()
    _assert_one_line_error(captured.err, "intensities contain 1")
    assert "FAILED" in captured.out


def test_info_not_a_store(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing.zarr")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "does not exist")
    (tmp_path / "plain").mkdir()
    assert main(["info", str(tmp_path / "plain")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "not a Zarr store")


def test_simulate_bad_input(tmp_path, store_path, capsys):
    before = daskpty.open_data(store_path).intensities.compute()
    assert main(["simulate", str(store_path), "--quiet"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "already exists")
    np.testing.assert_array_equal(daskpty.open_data(store_path).intensities.compute(), before)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    assert main(["simulate", str(tmp_path / "notes"), "--overwrite", "--quiet"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "not a Zarr store")
    assert (tmp_path / "notes" / "a.txt").exists()
    usage_errors = [
        ["simulate", str(tmp_path / "x.zarr"), "--grid", "ten"],
        ["simulate", str(tmp_path / "x.zarr"), "--dose", "-3"],
        ["simulate", str(tmp_path / "x.zarr"), "--grid", "2x2", "--n-patterns", "4"],
        ["simulate", str(tmp_path / "x.zarr"), "--preset", "huge"],
        ["simulate"],
        ["frobnicate"],
        [],
    ]
    for argv in usage_errors:
        assert main(argv) == 2, argv
        _assert_one_line_error(capsys.readouterr().err)
    # value errors found by the simulator itself, before any computation
    assert main(["simulate", str(tmp_path / "x.zarr"), "--probe-size", "33", "--quiet"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "even number")
    assert main(["simulate", str(tmp_path / "x.zarr"), "--dose", "none", "--dtype", "uint16",
                 "--quiet"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "float32")
    assert not (tmp_path / "x.zarr").exists()
    assert leftovers(tmp_path) == []


def test_help_of_subcommands(capsys):
    for name in ("simulate", "info"):
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert "usage: daskpty " + name in out


def test_reconstruct_multislice_prints_per_slice_and_projected_nrmse(tmp_path, use_client, capsys):
    """A (K, H, W) result against a store whose truth/object holds the K slices: the final line
    gives each slice's NRMSE and the projected object's (the product of the slices); a 2-D
    truth (the projection) gives the projected one only."""
    from types import SimpleNamespace

    from daskpty.cli.reconstruct import _nrmse_vs_truth
    from daskpty.metrics import nrmse_vs_truth
    from daskpty.simulate.multislice import simulate_multislice

    ds = simulate_multislice(n=32, n_slices=2, grid=5, noise=True, seed=1)
    g = ds.geometry
    truth = {"object": ds.truth.slices, "probe": ds.truth.probe, "positions": ds.positions}
    store, out = tmp_path / "ms.zarr", tmp_path / "rec.zarr"
    daskpty.from_arrays(ds.intensities.astype(np.float32), ds.positions, wavelength_m=g.wavelength_m,
                        object_pixel_size_m=g.pixel_size_m, electron_voltage_v=300e3,
                        convergence_semiangle_rad=25e-3, truth=truth).to_zarr(str(store))
    data = daskpty.open_data(str(store))
    assert data.truth.object.shape == ds.truth.slices.shape
    rc = main(["reconstruct", str(store), "-o", str(out), "--slices", "2", "--slice-spacing", "2e-9",
               "--epochs", "3", "--probe", "aperture", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rec = daskpty.Reconstruction.from_zarr(str(out))
    assert rec.object.shape[0] == 2

    def expected(estimate, true_object):
        ref = SimpleNamespace(object=true_object, positions=ds.positions)
        return nrmse_vs_truth(estimate, rec.positions, rec.illumination[0], ref)

    per = [expected(rec.object[k], ds.truth.slices[k]) for k in range(2)]
    projected = expected(np.prod(rec.object, axis=0), ds.truth.object)
    assert all(np.isfinite(per)) and np.isfinite(projected)
    line = captured.out.strip().splitlines()[-1]
    assert f"object NRMSE vs truth per slice [{per[0]:.4f}, {per[1]:.4f}]" in line, line
    assert line.endswith(f"projected object NRMSE vs truth {projected:.4f}"), line
    flat = SimpleNamespace(truth=SimpleNamespace(object=ds.truth.object, positions=ds.positions))
    assert _nrmse_vs_truth(rec, flat) == f", projected object NRMSE vs truth {projected:.4f}"


def test_reconstruct_help_groups_every_option_and_shows_its_default(capsys, monkeypatch):
    """``daskpty reconstruct --help``, parsed as text: every option sits under a named group (not
    the catch-all "options:") and its help text is non-empty and states its default."""
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["reconstruct", "--help"]) == 0
    text = capsys.readouterr().out
    assert "LSQML by default" in text and "with the LSQML engine" not in text
    from daskpty.cli.reconstruct import ENGINE_NAMES
    from daskpty.execution.engine_registry import ENGINES

    assert ENGINE_NAMES == list(ENGINES) and "{lsqml,ad,rpie,epie}" in text
    groups, group, options = {}, None, {}
    current = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            group, current = line[:-1], None
            groups[group] = []
        elif group is not None and line.startswith("  -"):
            flags, _, rest = line.strip().partition("  ")
            current = flags.split(", ")[-1].split()[0]
            groups[group].append(current)
            options[current] = rest.strip()
        elif current is not None and line.startswith(" " * 10):
            options[current] += " " + line.strip()
    from daskpty.options import GROUPS  # the option groups of reconstruct, in their order

    assert [g for g in groups if g not in ("positional arguments", "options")] == [g.title for g in GROUPS]
    assert groups["options"] == ["--help"], groups["options"]
    flags = [f for g, names in groups.items() if g != "options" for f in names]
    assert len(flags) == len(set(flags)) >= 28
    for flag in ("--engine", "--epochs", "--noise", "--seed", "--quiet", "--rounds-per-epoch", "--workers"):
        assert flag in flags, flag
    for flag in flags:
        help_text = " ".join(options[flag].split())
        assert help_text, f"{flag} has no help"
        if flag != "--output":  # required: no default
            assert "default" in help_text, f"{flag}: {help_text}"
    assert "(default: 100)" in options["--epochs"] and "(default: lsqml)" in options["--engine"]
    assert "(default: 0)" in " ".join(options["--seed"].split())
    assert "(default: off)" in options["--quiet"]
    assert "negative log-likelihood" in " ".join(options["--noise"].split())
    assert "(default: None)" not in text


def _after_usage(text: str) -> str:
    """A help text from its description on, whitespace collapsed (the usage block wraps with
    the terminal and the docs shorten it)."""
    return " ".join(text.split("\n\n", 1)[1].split())


def test_the_cli_page_shows_reconstructs_help_as_it_is(capsys, monkeypatch):
    """docs/cli.md quotes ``daskpty reconstruct --help``: the quoted block is the command's help of
    today, from its description on (it had fallen behind the options twice)."""
    import pathlib
    import re

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["reconstruct", "--help"]) == 0
    page = (pathlib.Path(__file__).parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
    quoted = re.search(r"```text\n(daskpty reconstruct DATA.zarr.*?)```", page, re.S)
    assert quoted, "docs/cli.md has no quoted reconstruct --help block"
    assert _after_usage(quoted.group(1)) == _after_usage(capsys.readouterr().out)


def test_reconstruct_fft_backend_reaches_the_workers(tmp_path, monkeypatch, capsys):
    """``--fft-backend scipy`` sets the library of the embedded cluster's workers (they inherit
    DASKPTY_FFT_BACKEND); ``fftw`` without pyFFTW is one line that says how to install it."""
    from distributed import Client, LocalCluster

    from daskpty.physics import fftw

    monkeypatch.setenv("DASKPTY_FFT_BACKEND", "auto")       # restored after the test
    monkeypatch.setattr(fftw, "_backend", fftw._backend)
    monkeypatch.setattr(fftw, "_every_size", fftw._every_size)
    store, out = tmp_path / "s.zarr", tmp_path / "r.zarr"
    assert main(["simulate", str(store), "--grid", "4x4", "--probe-size", "32", "--quiet"]) == 0
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "pyfftw", None)   # import pyfftw fails
        assert main(["reconstruct", str(store), "-o", str(out), "--epochs", "1", "--fft-backend", "fftw",
                     "--quiet"]) == 2
    _assert_one_line_error(capsys.readouterr().err, 'pip install "daskpty[fftw]"')
    assert main(["reconstruct", str(store), "-o", str(out), "--epochs", "1", "--fft-backend", "scipy",
                 "--workers", "1", "--quiet"]) == 0
    assert os.environ["DASKPTY_FFT_BACKEND"] == "scipy"
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:   # a worker started now, as the embedded cluster's were
        assert list(client.run(fftw.fft_backend).values()) == ["scipy"]
