"""Electron scans from the command line: ``simulate --preset electron`` → ``reconstruct --slices
--refine-positions`` → ``show``, and ``import`` flags that give ``--probe aperture`` what it needs.

The commands are read from docs/howto/electron.md and run as written (through ``daskpty.cli.main``,
in a fresh directory, on the session's LocalCluster of 2 workers); the reconstruction is judged
against the store's truth/ (K slices, true positions). Real stores, the real CLI.
"""
from __future__ import annotations

import contextlib
import itertools
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import daskpty
from daskpty import metrics
from daskpty.cli import main
from daskpty.physics.geometry import electron_wavelength_m
from daskpty.physics.multislice import SliceGeometry, multislice_intensities
from daskpty.physics.probes import electron_probe
from daskpty.physics.propagation import angular_spectrum_kernel

PAGE = Path(__file__).resolve().parents[1] / "docs" / "howto" / "electron.md"
SPACING = "2e-9"


def _commands(marker: str) -> list[list[str]]:
    """The ``.venv/bin/daskpty`` command lines of the block after ``<!-- test: marker -->``, as
    argument lists of ``main``."""
    found = re.search(rf"<!-- test: {re.escape(marker)} -->\n```bash\n(.*?)```", PAGE.read_text(), re.S)
    assert found, f"{PAGE.name} has no block marked {marker!r}"
    lines = [shlex.split(line) for line in found.group(1).splitlines() if line.strip()]
    assert all(line[0] == ".venv/bin/daskpty" for line in lines), lines
    return [line[1:] for line in lines]


def _run(args: list[str], where) -> int:
    with contextlib.chdir(where):
        return main(args)


def _position_error(positions, truth) -> float:
    """rms distance (px) after removing the common shift (the object frame's free offset)."""
    d = np.asarray(positions) - truth
    d = d - d.mean(axis=0)
    return float(np.sqrt((d ** 2).sum(axis=1).mean()))


def _phase_nrmse(estimate, truth, mask) -> float:
    """‖Δφ‖ / ‖φ − mean φ‖ on the mask after alignment (shift, ramp, complex scale)."""
    a = metrics.align(estimate, truth, mask=mask)
    pa, pt = np.angle(a), np.angle(truth)
    pa, pt = pa - pa[mask].mean(), pt - pt[mask].mean()
    return float(np.sqrt(((pa - pt)[mask] ** 2).sum() / (pt[mask] ** 2).sum()))


def _slice_errors(rec, data) -> list[float]:
    """Phase NRMSE of each reconstructed slice against the true one, in the truth's frame, on the
    region the entrance slice's illumination covers well."""
    true = np.asarray(data.truth.object)
    lit = np.asarray(rec.illuminated(0.3))[0]
    out = []
    for k in range(true.shape[0]):
        est, mask, _ = metrics.truth_frame(np.asarray(rec.object)[k], rec.positions, lit, true[k],
                                           data.truth.positions, rec.origin)
        out.append(_phase_nrmse(est, true[k], mask))
    return out


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
    """The how-to's scan: the preset with scan errors (0.5 px noise, 1 % scale, 1°)."""
    where = tmp_path_factory.mktemp("electron")
    simulate = _commands("electron recipe")[0]
    assert simulate[:4] == ["simulate", "e.zarr", "--preset", "electron"] and "--position-errors" in simulate
    assert _run(simulate, where) == 0
    return daskpty.open_data(str(where / "e.zarr"))


@pytest.fixture(scope="module")
def runs(scan, client):
    """The how-to's reconstructions from the nominal positions: without and with refinement."""
    where = Path(scan.path).parent
    refined, plain = _commands("electron recipe")[1], _commands("electron without refinement")[0]
    assert refined[0] == "reconstruct" and "--refine-positions" in refined and "--slices" in refined
    # the same run into plain.zarr, refinement left out
    assert [a for a in refined if a != "--refine-positions"] == [{"plain.zarr": "r.zarr"}.get(a, a) for a in plain]
    with client.as_current():
        assert _run(plain, where) == 0
        assert _run(refined, where) == 0
    return (daskpty.Reconstruction.from_zarr(str(where / "plain.zarr")),
            daskpty.Reconstruction.from_zarr(str(where / "r.zarr")))


def test_the_preset_stores_an_electron_scan_with_its_truth(tmp_path, capsys):
    """Geometry in the store's units, K true slices, nominal positions off the true ones by the
    asked errors, and — noise-free — patterns that are the multislice model of the truth."""
    out = str(tmp_path / "e.zarr")
    assert main(["simulate", out, "--preset", "electron", "--dose", "none", "--grid", "5x6",
                 "--position-errors", "rms=0.3,scale=0.02,rotation=2"]) == 0
    printed = capsys.readouterr().out
    assert "--slices 3 --slice-spacing 2e-09" in printed
    data = daskpty.open_data(out)
    meta, sim = data.metadata, data.metadata["simulation"]
    assert meta["electron_voltage_v"] == 300e3 and meta["convergence_semiangle_rad"] == pytest.approx(25e-3)
    assert meta["object_pixel_size_m"] == pytest.approx(0.25e-10)
    assert sim["slices"] == 3 and sim["slice_spacing_m"] == 2e-9 and data.n_patterns == 30
    truth = data.truth
    assert truth.object.shape[0] == 3 and truth.probe.shape == (1, 64, 64)
    true_c, nominal_c = truth.positions - truth.positions.mean(0), data.positions - data.positions.mean(0)
    m = np.linalg.lstsq(true_c, nominal_c, rcond=None)[0]  # nominal ≈ true @ m: the scan's linear error
    assert np.sqrt(np.linalg.det(m)) == pytest.approx(1.02, abs=0.01)
    assert np.degrees(np.arctan2(m[0, 1], m[0, 0])) == pytest.approx(2.0, abs=0.5)
    assert _position_error(data.positions, truth.positions) == pytest.approx(sim["position_error_rms_px"])
    lam = electron_wavelength_m(300e3)
    kernel = SliceGeometry(3, 2e-9, lam, 0.25e-10).kernel(64)
    model = multislice_intensities(truth.object, truth.probe, truth.positions, kernel)
    np.testing.assert_allclose(np.asarray(data.intensities), np.fft.fftshift(model, axes=(-2, -1)),
                               rtol=1e-4, atol=1e-3 * float(model.max()))


@pytest.mark.slow
def test_reconstructing_the_preset_beats_its_nominal_start(scan, runs):
    """Through the CLI with 3 slices: the refined positions are far closer to the true ones than
    the nominal positions the run started from, and every slice is closer to its true slice than
    the same run's slices without refinement."""
    data, (plain, refined) = scan, runs
    nominal = _position_error(data.positions, data.truth.positions)
    moved = _position_error(refined.positions, data.truth.positions)
    assert moved < 0.5 * nominal, (nominal, moved)
    without, with_refinement = _slice_errors(plain, data), _slice_errors(refined, data)
    assert all(b < a for a, b in zip(without, with_refinement)), (without, with_refinement)
    assert max(with_refinement) < 0.5, with_refinement


def _electron_npz(data, path):
    np.savez(path, data=np.asarray(data.intensities), pos=np.asarray(data.positions))
    return ["import", str(path), "--data", "data", "--positions", "pos", "--units", "px",
            "--energy", "300e3", "--object-pixel-size", "2.5e-11", "--quiet"]


def test_import_flags_fill_what_the_aperture_probe_needs(scan, use_client, tmp_path, capsys):
    """``--convergence-semiangle`` (mrad) is stored in rad, ``--defocus`` in m, the store's start
    probe is that aperture's defocused probe at the entrance surface (the true one carried half a
    slice in, up to scale, is the preset's first-slice truth), and ``reconstruct --probe
    aperture`` runs on it."""
    data = scan
    args = _electron_npz(data, tmp_path / "e.npz")
    out = str(tmp_path / "i.zarr")
    assert main([*(a for a in args if a != "--quiet"), "-o", out, "--convergence-semiangle", "25", "--defocus", "6e-9"]) == 0
    assert "300 kV electrons, convergence semi-angle 25 mrad, defocus 6 nm" in capsys.readouterr().out
    imported = daskpty.open_data(out)
    assert imported.metadata["convergence_semiangle_rad"] == pytest.approx(0.025)
    assert imported.metadata["electron_voltage_v"] == 300e3 and imported.metadata["defocus_m"] == 6e-9
    true = np.asarray(data.truth.probe)[0]
    start = np.asarray(imported.probe)[0]
    half = angular_spectrum_kernel(64, 2.5e-11, electron_wavelength_m(300e3), float(SPACING) / 2, band_limit=False)
    carried = np.fft.ifft2(np.fft.fft2(start) * half)
    for probe, same in ((carried, True), (start, False)):
        overlap = abs(np.vdot(probe, true)) / (np.linalg.norm(probe) * np.linalg.norm(true))
        assert (overlap > 0.999) == same, overlap
    ref = electron_probe(64, 2.5e-11, electron_wavelength_m(300e3), 0.025, defocus_m=6e-9)[0]
    np.testing.assert_allclose(start / np.linalg.norm(start), ref / np.linalg.norm(ref), atol=1e-5)
    rec = str(tmp_path / "r.zarr")
    assert main(["reconstruct", out, "-o", rec, "--probe", "aperture", "--slices", "3", "--slice-spacing",
                 SPACING, "--epochs", "2", "--quiet"]) == 0, capsys.readouterr().err
    assert daskpty.Reconstruction.from_zarr(rec).object.shape[0] == 3
    assert imported.metadata["probe_plane"] == "entrance"
    # without --probe, a K-slice run starts from the store's probe made again at its first screen
    first = daskpty.reconstruct(imported, epochs=0, slices=3, slice_spacing_m=float(SPACING), check_data=False,
                                progress=False).probe
    for probe, same in ((carried, True), (start, False)):
        overlap = abs(np.vdot(first, probe)) / (np.linalg.norm(first) * np.linalg.norm(probe))
        assert (overlap > 0.9999) == same, overlap


def test_the_aperture_probe_takes_the_stored_defocus():
    """``--probe aperture`` on an electron store with ``defocus_m`` is that defocused aperture's
    probe (it was the in-focus one, whatever the import stored)."""
    from daskpty.engines.sample_options import aperture_probe

    meta = {"electron_voltage_v": 300e3, "wavelength_m": electron_wavelength_m(300e3), "object_pixel_size_m": 2.5e-11,
            "convergence_semiangle_rad": 0.025, "defocus_m": 6e-9}
    probe = aperture_probe(meta, 64, power=1.0)[0]
    for defocus, same in ((6e-9, True), (0.0, False)):
        ref = electron_probe(64, 2.5e-11, meta["wavelength_m"], 0.025, defocus_m=defocus)[0]
        overlap = abs(np.vdot(probe, ref)) / (np.linalg.norm(probe) * np.linalg.norm(ref))
        assert (overlap > 0.9999) == same, (defocus, overlap)
    focused = aperture_probe(meta, 64, power=1.0, aperture={"defocus_m": 0.0})[0]  # the caller's own wins
    ref = electron_probe(64, 2.5e-11, meta["wavelength_m"], 0.025, defocus_m=0.0)[0]
    assert abs(np.vdot(focused, ref)) / (np.linalg.norm(focused) * np.linalg.norm(ref)) > 0.9999


def test_the_aperture_error_names_the_flag(scan, use_client, tmp_path, capsys):
    """Without the convergence semi-angle, ``--probe aperture`` stops with one line that names the
    import flag; the flag on an X-ray import is refused, naming the flag that fits."""
    args = _electron_npz(scan, tmp_path / "e.npz")
    out = str(tmp_path / "i.zarr")
    assert main([*args, "-o", out, "--radiation", "electron"]) == 0
    capsys.readouterr()
    assert main(["reconstruct", out, "-o", str(tmp_path / "r.zarr"), "--probe", "aperture",
                 "--epochs", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--convergence-semiangle MRAD" in err and err.count("\n") == 1, err
    assert main([*args, "-o", str(tmp_path / "x.zarr"), "--radiation", "xray",
                 "--convergence-semiangle", "25"]) == 2
    assert "--radiation electron" in capsys.readouterr().err
    by_wavelength = [{"--energy": "--wavelength", "300e3": "1.97e-12"}.get(a, a) for a in args]
    assert main([*by_wavelength, "-o", str(tmp_path / "x.zarr"), "--convergence-semiangle", "25"]) == 2
    assert "give --energy EV" in capsys.readouterr().err


def _texts(fig):
    """(axes index, text, window extent) of every drawn title, axis label, text and tick label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    found = [(-1, fig._suptitle)] if fig._suptitle is not None else []
    for i, ax in enumerate(fig.axes):
        found += [(i, t) for t in (ax.title, ax._left_title, ax._right_title, ax.xaxis.label,
                                   ax.yaxis.label, *ax.texts)]
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks()):
                if lo <= tick.get_loc() <= hi:  # ticks outside the view are not drawn
                    found += [(i, tick.label1), (i, tick.label2)]
    drawn = [(i, t.get_text(), t.get_window_extent(renderer)) for i, t in found
             if t.get_visible() and t.get_text().strip() and (i < 0 or fig.axes[i].get_visible())]
    return drawn, renderer


@pytest.mark.slow
def test_show_lays_out_the_slices_without_overlapping_labels(scan, runs, capsys):
    """``daskpty show`` of the refined 3-slice run writes its figure; the figure it draws has a
    panel per slice, and no two labels — nor a label and another panel — overlap, all inside the
    figure."""
    from daskpty.monitor.plot import panel_names, summary_figure

    data, (_, refined) = scan, runs
    show = _commands("electron recipe")[2]
    assert show[:2] == ["show", "r.zarr"] and "--data" in show
    assert _run(show, Path(data.path).parent) == 0
    png = Path(data.path).parent / show[show.index("-o") + 1]
    assert png.stat().st_size > 10_000 and "with FRC vs truth" in capsys.readouterr().out
    fig = summary_figure(refined, truth=data.truth, pixel_size_m=data.metadata["object_pixel_size_m"])
    names = panel_names(fig)
    assert [n for n in names if n.startswith("slice")] == ["slice 1 phase", "slice 2 phase", "slice 3 phase"]
    assert "positions" in names and "FRC" in names
    texts, renderer = _texts(fig)
    clashes = [(a[1], b[1]) for a, b in itertools.combinations(texts, 2) if a[2].overlaps(b[2])]
    clashes += [(t, f"panel {j}") for i, t, box in texts for j, ax in enumerate(fig.axes)
                if j != i and ax.get_visible() and box.overlaps(ax.get_window_extent(renderer))]
    width, height = fig.bbox.width, fig.bbox.height
    outside = [t for _, t, b in texts if b.x0 < 0 or b.y0 < 0 or b.x1 > width or b.y1 > height]
    assert not clashes and not outside, (clashes, outside)
