"""reconstruct's option groups (daskpty.options): one merge rule for every keyword shortcut, typos
answered with the close matches, the groups exported from daskpty. Fast: no cluster starts,
except in the one run marked as such (the session's client)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import daskpty
from daskpty import options as op
from daskpty.cli import main

#: two valid values of every shortcut (the group sets the first, not its default; the keyword the second)
TWO_VALUES = {
    "noise": ("poisson", "gaussian"), "loss": ("gaussian", "intensity"), "optimizer": ("sgd", "adam"),
    "lr": (0.1, 0.2), "seed": (1, 2), "rescale_probe": (False, True),
    "opr_modes": (2, 3), "fit_intensity": (True, False), "background": ("constant", "pixel"),
    "slices": (2, 3), "slice_spacing_m": (1e-9, 2e-9),
    "n_workers": (1, 2), "chunk_length": (8, 16), "rounds_per_epoch": (2, 3), "persist": (True, False),
    "device": ("cpu", "gpu"), "split_every": (2, 4), "sort": (False, True), "tiles": (True, False),
    "checkpoint": ("a.zarr", "b.zarr"), "checkpoint_every": (5, 7), "resume": ("a.zarr", "b.zarr"),
    "progress": (True, False), "dashboard": (True, False), "callback": (print, repr),
    "check_data": (False, True),
}


def _group_of(name):
    group = op.SHORTCUTS[name]
    extra = {"slice_spacing_m": 1e-9} if group.keyword == "sample" else {}  # slices > 1 need a spacing
    return group, extra


def test_every_shortcut_has_a_group_field_and_two_test_values():
    assert set(TWO_VALUES) == set(op.SHORTCUTS)
    for name, group in op.SHORTCUTS.items():
        assert name in group.cls.__dataclass_fields__, (name, group.cls)


@pytest.mark.parametrize("name", sorted(TWO_VALUES))
def test_a_shortcut_that_changes_its_group_is_one_line_naming_both(name):
    """The one merge rule, for every shortcut and both forms of a group (dict, instance)."""
    group, extra = _group_of(name)
    first, second = TWO_VALUES[name]
    engine = "ad" if name in ("loss", "optimizer", "lr") else "lsqml"
    base = {**extra, name: first}
    forms = [dict(base)]
    if group.keyword != "engine":
        forms.append(group.cls(**base))
    for form in forms:
        kwargs = {"engine": {"name": engine, **form}} if group.keyword == "engine" else \
            {"engine": engine, group.keyword: form}
        with pytest.raises(op.OptionError) as info:
            op.resolve(**kwargs, **{name: second})
        text = str(info.value)
        assert "\n" not in text and isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
        assert text.startswith(f"{name} is given twice: {name}={second!r} and {group.keyword}'s {name}={first!r}")
        agreed = op.resolve(**kwargs, **{name: first})  # repeating the group's value is fine
        assert getattr(getattr(agreed, "engine" if group.keyword == "engine" else group.keyword), name) == first


@pytest.mark.parametrize("name", sorted(TWO_VALUES))
def test_a_shortcut_fills_a_field_its_group_leaves_unset(name):
    group, extra = _group_of(name)
    value = TWO_VALUES[name][0]  # not the default
    extra.pop(name, None)
    engine = "ad" if name in ("loss", "optimizer", "lr") else "lsqml"
    group_value = {"n_workers": 1} if name != "n_workers" else {"chunk_length": 4}
    given = {"engine": engine}
    if group.keyword == "execution":
        given["execution"] = group_value
    elif group.keyword != "engine":
        given[group.keyword] = dict(extra)
    merged = op.resolve(**given, **{name: value})
    resolved = getattr(merged, group.keyword)
    assert getattr(resolved, name) == value


def test_opr_modes_against_a_probe_model_instance():
    """Issue 33.5: ``opr_modes=3, probe_model=ProbeModelOptions(...)`` ignored the shortcut (OPR
    silently off when the instance did not set it). Now: a conflict is an error, agreement is
    fine, and a field the instance leaves at its default takes the shortcut."""
    with pytest.raises(TypeError, match=r"^opr_modes is given twice: opr_modes=3 and probe_model's opr_modes=2"):
        op.resolve(opr_modes=3, probe_model=op.ProbeModelOptions(opr_modes=2))
    assert op.resolve(opr_modes=3, probe_model=op.ProbeModelOptions(opr_modes=3)).probe_model.opr_modes == 3
    merged = op.resolve(opr_modes=3, probe_model=op.ProbeModelOptions(fit_intensity=True, start_epoch=4))
    assert (merged.probe_model.opr_modes, merged.probe_model.fit_intensity, merged.probe_model.start_epoch) == \
        (3, True, 4)
    assert op.resolve().probe_model is None  # nothing varies: today's code path
    with pytest.raises(TypeError, match="opr_modes is given twice"):  # the same through reconstruct,
        daskpty.reconstruct("/nonexistent.zarr", opr_modes=3, probe_model={"opr_modes": 2})  # before the data


def test_a_shortcut_given_as_none_is_unset():
    merged = op.resolve(execution={"chunk_length": 9}, chunk_length=None, sample={"slices": 2, "slice_spacing_m": 1e-9},
                        slices=None, progress=None, run={"progress": False})
    assert (merged.execution.chunk_length, merged.sample.slices, merged.run.progress) == (9, 2, False)


@pytest.mark.parametrize("typo, engine, pattern", [
    ("rounds_per_epcoh", "lsqml", r"'rounds_per_epcoh' \(did you mean 'rounds_per_epoch'\?\)"),
    ("opr_mode", "lsqml", r"'opr_mode' \(did you mean 'opr_modes'\?\)"),
    ("betta", "lsqml", r"'betta' \(did you mean 'beta'\?\) for engine 'lsqml'"),
    ("chekpoint", "ad", r"'chekpoint' \(did you mean 'checkpoint'\?\)"),
    ("alpha", "lsqml", r"'alpha' is a setting of engine 'rpie' and 'epie', not 'lsqml'"),
])
def test_a_typo_is_answered_with_the_close_match(typo, engine, pattern):
    with pytest.raises(op.OptionError, match=pattern) as info:
        daskpty.reconstruct("/nonexistent.zarr", engine=engine, **{typo: 1})
    assert "\n" not in str(info.value)


def test_groups_by_dict_and_instance_and_engine_settings():
    ad = op.resolve({"name": "ad", "lr": 0.1, "settings": {"probe_lr": 0.2}}, optimizer="adam", schedule="cosine")
    assert (ad.engine.name, ad.engine.lr, ad.engine.optimizer) == ("ad", 0.1, "adam")
    assert ad.engine.settings == {"probe_lr": 0.2, "schedule": "cosine"}
    with pytest.raises(TypeError, match=r"^beta is given twice: beta=0.5 and engine's settings beta=0.7"):
        op.resolve(op.EngineOptions("lsqml", settings={"beta": 0.7}), beta=0.5)
    with pytest.raises(op.OptionError, match=r"unknown option\(s\) 'betta' \(did you mean 'beta'\?\)"):
        op.EngineOptions("lsqml", settings={"betta": 0.7})
    with pytest.raises(ValueError, match=r"engine must be one of .* got 'lsqnl' \(did you mean 'lsqml'\?\)"):
        op.resolve("lsqnl")
    with pytest.raises(op.OptionError, match=r"execution: unknown option\(s\) 'workers' \(did you mean 'n_workers'\?\)"):
        op.resolve(execution={"workers": 2})
    with pytest.raises(op.OptionError, match=r"refine_positions: unknown option\(s\) 'max_stp' \(did you mean 'max_step'\?\)"):
        op.resolve(refine_positions={"max_stp": 0.5})
    with pytest.raises(op.OptionError, match="run must be a RunOptions or a dict of its fields, got int"):
        op.resolve(run=3)
    group = op.ExecutionOptions(chunk_length=16)
    assert op.resolve(execution=group).execution is group  # an instance without shortcuts is kept
    positions = op.resolve("ad", refine_positions={"max_step": 0.5}).positions
    assert positions.max_step == 0.5 and positions.affine_gain == 2.0  # the engine's default filled in


@pytest.mark.parametrize("run, pattern", [
    ({"checkpoint_every": 0}, "checkpoint_every must be >= 1, got 0"),
    ({"checkpoint_every": 2.5}, "checkpoint_every must be an integer, got 2.5"),
    ({"checkpoint": 3}, "checkpoint must be a path or None, got 3"),
    ({"progress": "yes"}, "progress must be True, False or None, got 'yes'"),
    ({"dashboard": 1}, "dashboard must be True or False, got 1"),
    ({"callback": 5}, "callback must be callable or None, got 5"),
])
def test_run_options_are_validated(run, pattern):
    with pytest.raises(ValueError, match=pattern):
        op.RunOptions(**run)
    with pytest.raises(ValueError, match=pattern):  # the same as a shortcut
        op.resolve(**run)


def test_the_groups_are_exported_from_daskpty():
    from daskpty.engines.positions import PositionOptions
    from daskpty.engines.probe_model import ProbeModelOptions
    from daskpty.execution.options import ExecutionOptions

    assert daskpty.PositionOptions is op.PositionOptions is PositionOptions
    assert daskpty.ProbeModelOptions is ProbeModelOptions and daskpty.ExecutionOptions is ExecutionOptions
    for name in ("EngineOptions", "RunOptions", "SampleOptions", "OptionError"):
        assert getattr(daskpty, name) is getattr(op, name)
        assert name in daskpty.__all__
    assert [g.keyword for g in op.GROUPS] == ["engine", "probe_model", "refine_positions", "sample", "execution",
                                              "run"]


def test_cli_conflict_is_one_line_before_the_data_is_read(tmp_path, capsys):
    """--opr-modes and --probe-model opr_modes=... disagreeing: one line, exit 2, nothing read."""
    rc = main(["reconstruct", str(tmp_path / "missing.zarr"), "-o", str(tmp_path / "out.zarr"), "--opr-modes", "3",
               "--probe-model", "opr_modes=2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("daskpty: error: opr_modes is given twice: opr_modes=3 and probe_model's opr_modes=2"), err


def test_a_run_with_groups_equals_the_run_with_keywords(client, tmp_path):
    """Groups and shortcuts are the same settings: the same run, bit for bit, and the run group's
    checkpoint is written (and locked) like the keyword's."""
    from synthetic import make_dataset

    ds = make_dataset(grid=5, seed=1)
    data = daskpty.from_arrays(ds.intensities, ds.positions)
    grouped = daskpty.reconstruct(data, op.EngineOptions("lsqml", settings={"beta": 0.8}), 2, client=client,
                                  execution=op.ExecutionOptions(chunk_length=9, rounds_per_epoch=2),
                                  run=op.RunOptions(checkpoint=str(tmp_path / "g.zarr"), checkpoint_every=1))
    keywords = daskpty.reconstruct(data, "lsqml", 2, client=client, beta=0.8, chunk_length=9, rounds_per_epoch=2,
                                   checkpoint=str(tmp_path / "k.zarr"), checkpoint_every=1)
    np.testing.assert_array_equal(grouped.object, keywords.object)
    stored = daskpty.Reconstruction.from_zarr(str(tmp_path / "g.zarr"))
    assert stored.epochs == 2 and stored.options["beta"] == 0.8 and stored.options["chunk_length"] == 9


def test_cli_engine_settings_typo_is_one_line(tmp_path, capsys):
    rc = main(["reconstruct", str(tmp_path / "missing.zarr"), "-o", str(tmp_path / "out.zarr"),
               "--engine-settings", "betta=0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "unknown option(s) 'betta' (did you mean 'beta'?) for engine 'lsqml'" in err, err


def test_cli_help_shows_the_classes_defaults(capsys, monkeypatch):
    """The settings' defaults in --help come from the option classes (per engine where they differ)."""
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["reconstruct", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for cls, skip in ((op.ProbeModelOptions, op.SHORTCUTS), (op.PositionOptions, ())):
        assert op.defaults_text(cls, skip=skip) in text
    assert "curvature_damping=0.02 (ad: 0.002)" in text and "affine_gain=6.0 (ad: 2.0)" in text
    assert f"(default: {op.RunOptions().checkpoint_every})" in text and "beta=0.9" in text


def test_cli_flags_reach_their_groups(store_path, tmp_path, use_client, capsys):
    """A real in-process CLI run: --engine-settings, --opr-modes with --probe-model, the execution
    and run groups' flags arrive in the stored settings."""
    out = tmp_path / "out.zarr"
    assert main(["reconstruct", str(store_path), "-o", str(out), "--epochs", "2", "--quiet", "--checkpoint-every", "1",
                 "--engine-settings", "beta=0.8,momentum=0.4", "--opr-modes", "1",
                 "--probe-model", "opr_modes=1,start_epoch=1", "--device", "cpu", "--persist", "no",
                 "--split-every", "2", "--no-check-data"]) == 0, capsys.readouterr().err
    stored = daskpty.Reconstruction.from_zarr(str(out))
    assert (stored.options["beta"], stored.options["momentum"]) == (0.8, 0.4)
    assert (stored.options["probe_model"]["opr_modes"], stored.options["probe_model"]["start_epoch"]) == (1, 1)
    assert stored.epochs == 2 and stored.probe_weights.shape == (12, 1)
    assert (stored.options["persist"], stored.options["split_every"]) == (False, 2)


@pytest.mark.parametrize("flags, pattern", [
    (["--probe-model", "start_epch=3"], r"probe_model: unknown option\(s\) 'start_epch' \(did you mean 'start_epoch'\?\)"),
    (["--refine-positions", "max_stp=0.5"], r"refine_positions: unknown option\(s\) 'max_stp' \(did you mean 'max_step'\?\)"),
    (["--refine-positions", "max_step=-1"], r"max_step must lie in \(0, 8\] pixels, got -1"),
])
def test_cli_group_settings_are_checked_in_one_line(tmp_path, capsys, flags, pattern):
    rc = main(["reconstruct", str(tmp_path / "missing.zarr"), "-o", str(tmp_path / "out.zarr"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("daskpty: error: "), err
    assert re.search(pattern, err), err
