"""Resumes whose settings or checkpoint contradict each other: ``daskpty reconstruct --resume``
follows the user's explicit flag correctly or refuses in one line, never silently (the CLI's
main, in process, on the session's cluster; real Zarr stores edited as a user or an older tool
would)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr

import daskpty
from daskpty.cli import main

RUN = ("--quiet", "--persist", "yes")


@pytest.fixture(scope="module")
def data(tmp_path_factory, client):
    """A small simulated data set (5 x 5 scan of 32² patterns, truth included)."""
    path = tmp_path_factory.mktemp("resume") / "s.zarr"
    with client.as_current():
        assert main(["simulate", str(path), "--grid", "5x5", "--probe-size", "32", "--quiet"]) == 0
    return str(path)


def _cli(capsys, *argv):
    """``daskpty reconstruct ARGV``: (exit code, stderr)."""
    code = main(["reconstruct", *map(str, argv)])
    return code, capsys.readouterr().err


def _one_error_line(err: str, *words):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("daskpty: error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _checkpoint(capsys, data, path, *extra, epochs=2):
    code, err = _cli(capsys, data, "-o", path, "--epochs", epochs, *RUN, *extra)
    assert code == 0, err
    return str(path)


def _set_attribute(store, key, value):
    """Edit one root attribute of a store's zarr.json, as by hand."""
    meta_path = os.path.join(store, "zarr.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["attributes"][key] = value
    with open(meta_path, "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("stored, asked", [(1, 2), (2, 1)])
def test_probe_modes_that_differ_from_the_checkpoint_are_refused(use_client, data, tmp_path, capsys,
                                                                  stored, asked):
    """A resumed run cannot change the probe modes (the stored state is shaped by them): one line
    says how many the checkpoint holds, what the flag asks and both ways out; nothing is written."""
    ckpt = _checkpoint(capsys, data, tmp_path / "r.zarr", "--probe-modes", stored)
    out = tmp_path / "out.zarr"
    code, err = _cli(capsys, data, "-o", out, "--resume", ckpt, "--epochs", 3, "--probe-modes", asked, *RUN)
    assert code == 2
    _one_error_line(err, ckpt, f"holds {stored} probe mode", f"--probe-modes {asked}", "drop it to resume",
                    "start afresh")
    assert not os.path.lexists(out)
    code, err = _cli(capsys, data, "-o", out, "--resume", ckpt, "--epochs", 3, "--probe-modes", stored, *RUN)
    assert code == 0, err
    assert daskpty.Reconstruction.from_zarr(str(out)).probe.shape == (stored, 32, 32)


def test_a_2d_probe_in_a_checkpoint_is_one_mode(use_client, data, tmp_path, capsys):
    """A checkpoint whose probe an older tool (or a hand edit) stored as (n, n) resumes as one
    mode, bit-identical to resuming the (1, n, n) original; a 2-D probe of another pattern size
    is refused naming the store and the field."""
    ckpt = _checkpoint(capsys, data, tmp_path / "r.zarr")
    flat = tmp_path / "flat.zarr"
    daskpty.Reconstruction.from_zarr(ckpt).to_zarr(str(flat))
    group = zarr.open_group(str(flat), mode="r+")
    probe = group["probe"][...]
    del group["probe"]
    group.create_array("probe", data=probe[0])
    for source, out in ((ckpt, tmp_path / "a.zarr"), (str(flat), tmp_path / "b.zarr")):
        code, err = _cli(capsys, data, "-o", out, "--resume", source, "--epochs", 3, *RUN)
        assert code == 0, err
    a, b = (daskpty.Reconstruction.from_zarr(str(tmp_path / p)) for p in ("a.zarr", "b.zarr"))
    assert b.probe.shape == (1, 32, 32)
    np.testing.assert_array_equal(b.probe, a.probe)
    np.testing.assert_array_equal(b.object, a.object)

    del group["probe"]
    group.create_array("probe", data=probe[0, :16, :16])
    out = tmp_path / "c.zarr"
    code, err = _cli(capsys, data, "-o", out, "--resume", flat, "--epochs", 3, *RUN)
    assert code == 2
    _one_error_line(err, str(flat), "field 'probe'", "16-pixel probe", "32-pixel patterns")
    assert not os.path.lexists(out)


def test_a_tiled_checkpoint_resumes_tiled_bit_identically(use_client, data, tmp_path, capsys):
    """Resumed without ``--tiles``, a tiled checkpoint keeps its tiles (the store records them),
    so the result is bit-identical to an uninterrupted tiled run."""
    whole = _checkpoint(capsys, data, tmp_path / "whole.zarr", "--tiles", epochs=4)
    ckpt = _checkpoint(capsys, data, tmp_path / "r.zarr", "--tiles")
    out = tmp_path / "out.zarr"
    code, err = _cli(capsys, data, "-o", out, "--resume", ckpt, "--epochs", 4, *RUN)
    assert code == 0, err
    assert "warning" not in err, err
    a, b = daskpty.Reconstruction.from_zarr(whole), daskpty.Reconstruction.from_zarr(str(out))
    assert b.options["tiles"] is True
    np.testing.assert_array_equal(b.object, a.object)
    np.testing.assert_array_equal(b.probe, a.probe)


def test_tiles_asked_on_an_untiled_checkpoint_are_followed_with_a_warning(use_client, data, tmp_path, capsys):
    """``--tiles`` on a checkpoint of replicas: the user's flag is followed, and one warning line
    says the result will not be bit-identical and how to keep the store's layout."""
    ckpt = _checkpoint(capsys, data, tmp_path / "r.zarr")
    out = tmp_path / "out.zarr"
    code, err = _cli(capsys, data, "-o", out, "--resume", ckpt, "--epochs", 3, "--tiles", *RUN)
    assert code == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("daskpty: warning: ")]
    assert len(warnings) == 1 and "tiles=True differs from the tiles=False" in warnings[0], err
    assert "drop --tiles" in warnings[0], err
    assert daskpty.Reconstruction.from_zarr(str(out)).options["tiles"] is True


def test_refined_positions_stay_when_resumed_without_refinement(use_client, data, tmp_path, capsys):
    """A position-refined checkpoint resumed without ``--refine-positions`` keeps its refined
    positions, fixed (not the nominal ones, up to a pixel away here); the nominal ones stay
    recorded beside them."""
    ckpt = _checkpoint(capsys, data, tmp_path / "r.zarr", "--refine-positions", "start_epoch=1", epochs=6)
    refined = daskpty.Reconstruction.from_zarr(ckpt)
    assert np.abs(refined.positions - refined.nominal_positions).max() > 0.2
    out = tmp_path / "out.zarr"
    code, err = _cli(capsys, data, "-o", out, "--resume", ckpt, "--epochs", 8, *RUN)
    assert code == 0, err
    rec = daskpty.Reconstruction.from_zarr(str(out))
    np.testing.assert_array_equal(rec.positions, refined.positions)
    np.testing.assert_array_equal(rec.nominal_positions, refined.nominal_positions)
    assert rec.epochs == 8


@pytest.mark.parametrize("epoch", [-5, "abc", 2.5, True])
def test_an_edited_epoch_is_refused_naming_the_store_and_field(use_client, data, tmp_path, capsys, epoch):
    """An ``epoch`` attribute that is no count of epochs (-5 would count on from -4, 'abc' failed
    inside int()) is one line naming the store and the field; nothing is written."""
    ckpt = _checkpoint(capsys, data, tmp_path / "r.zarr")
    _set_attribute(ckpt, "epoch", epoch)
    out = tmp_path / "out.zarr"
    code, err = _cli(capsys, data, "-o", out, "--resume", ckpt, "--epochs", 4, *RUN)
    assert code == 2
    _one_error_line(err, ckpt, "'epoch' attribute", repr(epoch))
    assert not os.path.lexists(out)
