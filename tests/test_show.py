"""Figures (daskpty.monitor.plot) and ``daskpty show``, on reconstructions built without the engine."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import daskpty  # noqa: E402
from daskpty.cli import COMMANDS, main  # noqa: E402
from daskpty.monitor import plot  # noqa: E402
from daskpty.io.results import Reconstruction  # noqa: E402

from synthetic import make_dataset  # noqa: E402

PAD = 3  # the fake reconstruction's frame = truth frame shifted by PAD pixels
PIXEL = 20e-9
FIGSIZE = (12.0, 8.5)  # summary_figure's default


def _illumination(shape, probe, positions):
    n = probe.shape[-1]
    power = (np.abs(probe) ** 2).sum(axis=0)
    out = np.zeros(shape, np.float32)
    for y, x in np.round(positions - n / 2).astype(int):
        out[y:y + n, x:x + n] += power
    return out


def _fake_reconstruction(ds, seed=0):
    """The truth, padded by PAD pixels of ones, slightly perturbed, with a made-up loss history."""
    rng = np.random.default_rng(seed)
    t = ds.truth
    obj = np.pad(t.object, PAD, constant_values=1).astype(np.complex64)
    obj *= (1 + 0.02 * rng.standard_normal(obj.shape)).astype(np.float32)
    positions = np.asarray(t.positions, np.float64) + PAD
    history = [{"epoch": i + 1, "loss": 1e3 * 0.7 ** i + 5.0, "seconds": 0.1} for i in range(12)]
    return Reconstruction(object=obj, probe=t.probe.copy(), positions=positions,
                          origin=np.array([PAD, PAD], float),
                          illumination=_illumination(obj.shape, t.probe, positions),
                          history=history, options={"engine": "fake"})


@pytest.fixture(scope="module")
def ds():
    return make_dataset(grid=6)


@pytest.fixture(scope="module")
def rec(ds):
    return _fake_reconstruction(ds)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, ds, rec):
    d = tmp_path_factory.mktemp("show")
    rec_path = str(d / "rec.zarr")
    rec.to_zarr(rec_path)
    data_path = str(d / "data.zarr")
    t = ds.truth
    daskpty.from_arrays(ds.intensities, ds.positions, object_pixel_size_m=PIXEL, provenance="test_show",
                        truth={"object": t.object, "probe": t.probe, "positions": t.positions}
                        ).to_zarr(data_path)
    return rec_path, data_path


def _panel_axes(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def _scalebar_texts(fig):
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_gid() == "scalebar"]


def _one_line_error(capsys, fragment):
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("daskpty: error: ") and "Traceback" not in err, err
    assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize("width, length", [(10e-6, 2e-6), (1e-6, 2e-7), (4e-6, 1e-6),
                                           (30e-9, 5e-9), (1.0, 0.2), (8e-6, 2e-6)])
def test_scale_bar_length_is_round(width, length):
    got = plot.scale_bar_length(width)
    assert got == pytest.approx(length)
    assert got <= 0.25 * width * (1 + 1e-9)


def test_format_length():
    assert plot.format_length(2e-6) == "2 µm"
    assert plot.format_length(5e-7) == "500 nm"
    assert plot.format_length(1e-9) == "1 nm"
    assert plot.format_length(5e-3) == "5 mm"
    assert plot.format_length(2.0) == "2 m"
    with pytest.raises(ValueError):
        plot.scale_bar_length(0.0)


def test_summary_panels_is_the_layout_rule():
    assert plot.summary_panels(1, False) == ["object phase", "object amplitude", "probe", "loss"]
    assert plot.summary_panels(3, True) == ["object phase", "object amplitude", "probe mode 1",
                                            "probe mode 2", "probe mode 3", "loss", "FRC"]
    many = plot.summary_panels(plot.MAX_PROBE_PANELS + 4, True)
    assert sum(p.startswith("probe") for p in many) == plot.MAX_PROBE_PANELS


# ------------------------------------------------------------------------------- figures


@pytest.mark.parametrize("with_truth", [False, True])
def test_summary_figure_panels(ds, rec, with_truth):
    truth = ds.truth if with_truth else None
    fig = plot.summary_figure(rec, truth=truth, pixel_size_m=PIXEL)
    expected = plot.summary_panels(rec.probe.shape[0], with_truth)
    assert len(_panel_axes(fig)) == len(expected)
    assert plot.panel_names(fig) == expected
    assert tuple(fig.get_size_inches()) == pytest.approx(FIGSIZE)
    # one scale bar per object image and per probe mode, each a round length in nm / µm
    bars = _scalebar_texts(fig)
    assert len(bars) == 2 + rec.probe.shape[0]
    for text in bars:
        assert re.fullmatch(r"(1|2|5)0{0,2} (nm|µm)", text), text


def test_summary_figure_multimode_and_no_pixel_size(ds):
    ds2 = make_dataset(grid=6, modes=3, seed=1)
    rec3 = _fake_reconstruction(ds2)
    fig = plot.summary_figure(rec3, truth=ds2.truth)
    assert plot.panel_names(fig) == plot.summary_panels(3, True)
    assert _scalebar_texts(fig) == []  # no pixel size: axes in pixels, no bar
    titles = [ax.get_title() for ax in _panel_axes(fig) if ax.get_label().endswith("probe mode 1")]
    assert re.fullmatch(r"mode 1\n\d+\.\d %", titles[0]), titles


def test_frc_uses_truth_frame(ds, rec):
    from matplotlib.figure import Figure

    est, lit, offset = plot.truth_frame(rec, ds.truth)
    assert offset == (PAD, PAD) and est.shape == ds.truth.object.shape and lit.any()
    ax = Figure().add_subplot()
    res = plot.plot_frc(ax, rec, ds.truth, PIXEL)
    # the fake reconstruction is the truth plus 2 % noise: high correlation at low frequency
    assert res.frc[1:6].mean() > 0.9
    labels = [line.get_label() for line in ax.get_lines()]
    assert "½-bit threshold" in labels


def test_history_handles_empty_and_bad_values():
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    plot.plot_history(ax, [])
    assert any("no loss history" in t.get_text() for t in ax.texts)
    ax = Figure().add_subplot()
    plot.plot_history(ax, [{"epoch": 1, "loss": 10.0}, {"epoch": 2, "loss": float("nan")},
                           {"epoch": 3, "loss": 2.0}])
    assert ax.get_yscale() == "log"
    assert list(ax.get_lines()[0].get_xdata()) == [1.0, 3.0]


# ------------------------------------------------------------------------------- CLI


def _read_png(path):
    from matplotlib.image import imread

    return imread(path)


def test_show_is_a_command():
    assert "show" in [m.NAME for m in COMMANDS]


def test_show_with_data(stores, tmp_path, capsys):
    rec_path, data_path = stores
    out = tmp_path / "fig.png"
    assert main(["show", rec_path, "--data", data_path, "-o", str(out), "--dpi", "40"]) == 0
    assert "FRC" in capsys.readouterr().out
    img = _read_png(out)
    assert img.shape[:2] == (round(FIGSIZE[1] * 40), round(FIGSIZE[0] * 40))
    assert float(img[..., :3].std()) > 0.05  # not blank
    assert sorted(os.listdir(tmp_path)) == ["fig.png"]  # no temporary left behind


def test_a_large_object_is_drawn_from_a_block_mean_view(stores, tmp_path, capsys, monkeypatch):
    """Past FULL_READ_BYTES the store's object is read lazily and drawn from block means (here:
    every object is "large" and the view at most 16 pixels a side)."""
    from daskpty.cli import show
    from daskpty.monitor.dashboard_images import downsample

    rec_path, data_path = stores
    monkeypatch.setattr(show, "FULL_READ_BYTES", 0)
    monkeypatch.setattr(show, "VIEW_SIDE", 16)
    out = tmp_path / "view.png"
    assert main(["show", rec_path, "--data", data_path, "-o", str(out), "--dpi", "30"]) == 0
    printed = capsys.readouterr().out
    assert "block means" in printed and "no FRC" in printed
    assert float(_read_png(out)[..., :3].std()) > 0.05
    whole = Reconstruction.from_zarr(rec_path)
    lazy = Reconstruction.from_zarr(rec_path, lazy=True)
    assert lazy.is_lazy and not whole.is_lazy
    view, factor = show.view_of(lazy, 16)
    assert factor > 1 and max(view.object.shape) <= 16
    np.testing.assert_array_equal(view.object, downsample(whole.object, 16))
    np.testing.assert_allclose(view.positions * factor, whole.positions)


def test_show_without_data(stores, tmp_path):
    rec_path, _ = stores
    out = tmp_path / "plain.png"
    assert main(["show", rec_path, "-o", str(out), "--dpi", "30"]) == 0
    img = _read_png(out)
    assert img.shape[:2] == (round(FIGSIZE[1] * 30), round(FIGSIZE[0] * 30))
    assert float(img[..., :3].std()) > 0.05


def test_show_overwrite(stores, tmp_path, capsys):
    rec_path, _ = stores
    out = tmp_path / "fig.png"
    out.write_bytes(b"old")
    assert main(["show", rec_path, "-o", str(out), "--dpi", "20"]) == 2
    _one_line_error(capsys, "--overwrite")
    assert out.read_bytes() == b"old"
    assert main(["show", rec_path, "-o", str(out), "--dpi", "20", "--overwrite"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case, fragment", [
    ("missing", "no such reconstruction store"),
    ("data_as_recon", "is a daskpty data set"),
    ("plain_dir", "not a"),
    ("plain_file", "not a daskpty reconstruction store"),
    ("bad_suffix", "unsupported figure type"),
    ("bad_dpi", "--dpi"),
    ("no_out_dir", "does not exist"),
    ("missing_data", "no such data-set store"),
    ("wrong_data", "patterns"),
])
def test_show_bad_input(stores, tmp_path, capsys, case, fragment):
    rec_path, data_path = stores
    out = str(tmp_path / "fig.png")
    extra = []
    if case == "missing":
        rec_path = str(tmp_path / "nope.zarr")
    elif case == "data_as_recon":
        rec_path = data_path
    elif case == "plain_dir":
        rec_path = str(tmp_path / "empty")
        os.mkdir(rec_path)
    elif case == "plain_file":
        rec_path = str(tmp_path / "file.zarr")
        open(rec_path, "w").close()
    elif case == "bad_suffix":
        out = str(tmp_path / "fig.bmpx")
    elif case == "bad_dpi":
        extra = ["--dpi", "0"]
    elif case == "no_out_dir":
        out = str(tmp_path / "missing" / "fig.png")
    elif case == "missing_data":
        extra = ["--data", str(tmp_path / "nodata.zarr")]
    elif case == "wrong_data":
        other = str(tmp_path / "other.zarr")
        small = make_dataset(grid=3)
        daskpty.from_arrays(small.intensities, small.positions).to_zarr(other)
        extra = ["--data", other]
    assert main(["show", rec_path, "-o", out, *extra]) == 2
    _one_line_error(capsys, fragment)
    assert not os.path.exists(out)
