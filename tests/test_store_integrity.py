"""Damaged stores are found and named (issue 32 items 3, 5 and the store-side partial cases).

Real stores throughout: data sets written by ``to_zarr`` and ``daskpty import``, checkpoints
written by real reconstructions, damaged by deleting, truncating or overwriting their files.
"""
from __future__ import annotations

import os
import shutil
import time
import warnings

import numpy as np
import pytest
import zarr

import daskpty
from daskpty.cli import main
from daskpty.io.integrity import EVERY_CHUNK, DamagedStoreError
from daskpty.io.store import open_data
from daskpty.io.validate import DataError
from daskpty.io.results import RECON_VERSION, Reconstruction

from synthetic import make_dataset


def one_line_error(capsys, *argv) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one ``daskpty: error:`` line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("daskpty: error: ") and "\n" not in err, err
    return err


def files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


# --------------------------------------------------------------------------- data sets

N, SIZE = 40, 256  # 128 KiB uint16 frames: --shard-mib 1 gives 5 shards of 8 frames


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``daskpty import`` of frames whose second shard (frames 8..15) is all zero."""
    tmp = tmp_path_factory.mktemp("import")
    frames = np.random.default_rng(0).poisson(30, (N, SIZE, SIZE)).astype(np.uint16)
    frames[8:16] = 0
    np.save(tmp / "f.npy", frames)
    iy, ix = np.divmod(np.arange(N), 8)
    np.save(tmp / "p.npy", np.stack([iy, ix], 1) * 4.0)
    out = tmp / "z.zarr"
    code = main(["import", str(tmp / "f.npy"), "-o", str(out), "--positions", str(tmp / "p.npy"),
                 "--units", "px", "--shard-mib", "1"])
    assert code == 0
    return out, frames


def damaged_copy(src, dst, name, how):
    shutil.copytree(src, dst)
    path = os.path.join(dst, name)
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) // 3)
    elif how == "overwrite":  # bit rot inside the data, the file keeps its size
        with open(path, "r+b") as f:
            f.seek(64)
            f.write(b"\0" * 4000)
    return dst


def test_an_all_zero_shard_is_written_and_its_store_accepted(imported, capsys):
    path, frames = imported
    shards = [f for f in files_under(path) if f.startswith(os.path.join("intensities", "c"))]
    assert len(shards) == 5  # the all-zero shard is a file too (a few hundred bytes)
    assert os.path.getsize(os.path.join(path, "intensities", "c", "1", "0", "0")) < 2000
    assert zarr.open_group(str(path), mode="r").attrs["daskpty"][EVERY_CHUNK] is True
    data = open_data(path, validate="full")
    np.testing.assert_array_equal(np.asarray(data.intensities), frames)
    assert main(["info", str(path)]) == 0
    capsys.readouterr()


def test_a_deleted_nonzero_shard_is_named(imported, tmp_path, capsys):
    path = damaged_copy(imported[0], tmp_path / "d.zarr", "intensities/c/3/0/0", "delete")
    with pytest.raises(DamagedStoreError, match=r"shard file intensities/c/3/0/0 of 'intensities' "
                                                r"is missing"):
        open_data(path)
    err = one_line_error(capsys, "info", path)
    assert "intensities/c/3/0/0" in err and "re-copy or re-create" in err


def test_a_store_of_an_older_daskpty_is_judged_by_the_files_present(imported, tmp_path):
    """Without the writer's record, a missing shard is refused as before (it may be all zero)."""
    path = damaged_copy(imported[0], tmp_path / "old.zarr", "intensities/c/1/0/0", "delete")
    g = zarr.open_group(str(path), mode="r+")
    g.attrs["daskpty"] = {"format": "daskpty-dataset", "version": 1}
    with pytest.raises(DataError, match=r"1 of 5 shards of 'intensities' are missing "
                                        r"\(intensities/c/1/0/0\); the store is incomplete"):
        open_data(path)


def test_a_truncated_shard_is_named_when_opened(imported, tmp_path, capsys):
    path = damaged_copy(imported[0], tmp_path / "t.zarr", "intensities/c/2/0/0", "truncate")
    t0 = time.perf_counter()
    with pytest.raises(DamagedStoreError, match=r"shard file intensities/c/2/0/0 of 'intensities' "
                                                r"has a damaged index"):
        open_data(path)
    assert time.perf_counter() - t0 < 5  # index tails only, no data read
    assert "intensities/c/2/0/0" in one_line_error(capsys, "info", path)


def test_a_shard_damaged_inside_is_named_when_read(imported, tmp_path, capsys):
    path = damaged_copy(imported[0], tmp_path / "r.zarr", "intensities/c/2/0/0", "overwrite")
    data = open_data(path)  # its index is sound: found when the patterns are read
    with pytest.raises(DamagedStoreError, match=r"shard file intensities/c/2/0/0 of 'intensities' "
                                                r"cannot be read"):
        data.intensities[16:24].compute(scheduler="sync")
    with pytest.raises(DamagedStoreError, match=r"intensities/c/2/0/0"):
        data.check_values().raise_if_bad()
    err = one_line_error(capsys, "info", path, "--check")
    assert "intensities/c/2/0/0" in err and err.count("re-copy") == 1


@pytest.mark.parametrize("name", ["zarr.json", "intensities/zarr.json", "positions/zarr.json"])
def test_a_truncated_zarr_json_is_named(imported, tmp_path, capsys, name):
    path = damaged_copy(imported[0], tmp_path / "j.zarr", name, "truncate")
    err = one_line_error(capsys, "info", path)
    assert os.path.join(str(path), name) in err and "is not valid JSON" in err


def test_a_data_set_left_only_as_previous_is_mentioned(imported, tmp_path, capsys):
    shutil.copytree(imported[0], tmp_path / "x.zarr.previous")
    err = one_line_error(capsys, "info", tmp_path / "x.zarr")
    assert "x.zarr.previous holds one" in err and "mv " in err


def test_from_arrays_converts_float64_with_a_warning(tmp_path):
    ds = make_dataset(n=16, grid=3, seed=1)
    x = ds.intensities.astype(np.float64)
    with pytest.warns(UserWarning, match="float64; converted to float32"):
        data = daskpty.from_arrays(x, ds.positions)
    assert data.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(data.intensities), ds.intensities)
    import dask.array as da

    with pytest.warns(UserWarning, match="float64; converted"):
        assert daskpty.from_arrays(da.from_array(x, chunks=(4, -1, -1)), ds.positions).dtype == np.float32
    x[2, 3, 3] = -5.0  # negative counts: still refused by the value check, as for float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = daskpty.from_arrays(x, ds.positions).check_values()
    with pytest.raises(DataError, match="negative"):
        report.raise_if_bad()


def test_overwrite_refuses_a_data_set_of_a_newer_format(imported, tmp_path):
    path = tmp_path / "new.zarr"
    shutil.copytree(imported[0], path)
    zarr.open_group(str(path), mode="r+").attrs["daskpty"] = {"format": "daskpty-dataset", "version": 99}
    before = files_under(path)
    data = open_data(imported[0])
    with pytest.raises(FileExistsError, match=r"format version 99, newer than this daskpty writes"):
        data.to_zarr(path, overwrite=True)
    assert files_under(path) == before


# --------------------------------------------------------------------------- reconstruction stores

def small_reconstruction(epoch=3, positions=None, **kw) -> Reconstruction:
    rng = np.random.default_rng(2)
    obj = (rng.standard_normal((64, 64)) + 1j).astype(np.complex64)
    positions = rng.uniform(8, 56, (9, 2)) if positions is None else positions
    return Reconstruction(object=obj, probe=np.ones((1, 16, 16), np.complex64),
                          positions=positions, origin=np.zeros(2),
                          illumination=np.abs(obj).astype(np.float32), epoch=epoch,
                          history=[{"epoch": e + 1, "loss": 1.0} for e in range(epoch)], **kw)


def test_all_zero_state_arrays_are_written_and_read_back(tmp_path):
    rec = small_reconstruction(engine_state={"velocity": np.zeros((64, 64), np.complex64)})
    path = rec.to_zarr(str(tmp_path / "r.zarr"))
    assert os.path.isfile(os.path.join(path, "engine_state", "velocity", "c", "0", "0"))
    back = Reconstruction.from_zarr(path)
    np.testing.assert_array_equal(back.object, rec.object)
    assert not back.engine_state["velocity"].any()


@pytest.mark.parametrize("how, match", [("delete", r"chunk file object/c/0/0 of 'object' is missing"),
                                        ("truncate", r"chunk file object/c/0/0 of 'object' cannot be "
                                                     r"decoded")])
def test_a_damaged_object_chunk_is_named(tmp_path, how, match):
    path = small_reconstruction().to_zarr(str(tmp_path / "r.zarr"))
    damaged_copy(path, tmp_path / "d.zarr", "object/c/0/0", how)
    with pytest.raises(DamagedStoreError, match=match + r".*reconstruct again without resuming"):
        Reconstruction.from_zarr(str(tmp_path / "d.zarr"))


def test_a_missing_zero_chunk_of_an_older_store_is_accepted_but_not_the_objects(tmp_path):
    """Older daskpty skipped all-zero chunks: only arrays that are never zero are judged."""
    rec = small_reconstruction(engine_state={"velocity": np.zeros((64, 64), np.complex64)})
    path = rec.to_zarr(str(tmp_path / "r.zarr"))
    g = zarr.open_group(path, mode="r+")
    g.attrs["daskpty"] = {"format": "daskpty-reconstruction", "version": RECON_VERSION}
    os.remove(os.path.join(path, "engine_state", "velocity", "c", "0", "0"))
    assert not Reconstruction.from_zarr(path).engine_state["velocity"].any()
    os.remove(os.path.join(path, "probe", "c", "0", "0", "0"))
    with pytest.raises(DamagedStoreError, match="probe/c/0/0/0"):
        Reconstruction.from_zarr(path)


def test_the_previous_copy_is_suggested(tmp_path):
    path = small_reconstruction().to_zarr(str(tmp_path / "r.zarr"))
    shutil.copytree(path, path + ".previous")
    os.remove(os.path.join(path, "positions", "c", "0", "0"))
    with pytest.raises(DamagedStoreError, match=r"r.zarr.previous holds an earlier copy \(epoch 3\)"):
        Reconstruction.from_zarr(path)


def test_a_truncated_reconstruction_zarr_json_is_named(tmp_path, capsys):
    path = small_reconstruction().to_zarr(str(tmp_path / "r.zarr"))
    os.truncate(os.path.join(path, "probe", "zarr.json"), 50)
    err = one_line_error(capsys, "show", path, "-o", tmp_path / "s.png")
    assert os.path.join(path, "probe", "zarr.json") in err and "not valid JSON" in err


def test_overwrite_refuses_a_reconstruction_of_a_newer_format(tmp_path, store_path, capsys):
    path = small_reconstruction().to_zarr(str(tmp_path / "r.zarr"))
    g = zarr.open_group(path, mode="r+")
    g.attrs["daskpty"] = {"format": "daskpty-reconstruction", "version": RECON_VERSION + 1}
    before = files_under(path)
    with pytest.raises(FileExistsError, match=rf"format version {RECON_VERSION + 1}, newer"):
        small_reconstruction().to_zarr(path, overwrite=True)
    err = one_line_error(capsys, "reconstruct", store_path, "-o", path, "--overwrite", "--epochs", "1")
    assert f"format version {RECON_VERSION + 1}, newer than this daskpty writes" in err
    assert files_under(path) == before


def test_resume_of_a_store_at_or_past_epochs_says_so(tmp_path, store_path, capsys):
    fits = open_data(store_path).positions  # the store must fit the data even when nothing runs
    path = small_reconstruction(epoch=5, positions=fits).to_zarr(str(tmp_path / "r.zarr"))
    mtime = os.stat(os.path.join(path, "zarr.json")).st_mtime_ns
    for epochs in ("5", "3"):
        code = main(["reconstruct", str(store_path), "-o", path, "--resume", path, "--epochs", epochs])
        err = capsys.readouterr().err.strip()
        assert code == 0 and "\n" not in err
        assert f"already holds epoch 5 (--epochs {epochs}" in err and "nothing to run" in err
    assert os.stat(os.path.join(path, "zarr.json")).st_mtime_ns == mtime


@pytest.mark.slow
def test_resume_api_past_epochs_warns(checkpoint, client):
    data, ck = checkpoint
    with pytest.warns(UserWarning, match=r"already holds epoch 2 \(epochs=2 counts"):
        rec = daskpty.reconstruct(str(data), epochs=2, client=client, resume=str(ck), progress=False)
    assert rec.epochs == 2


# --------------------------------------------------------------------------- real checkpoints

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, client):
    """A data set and the checkpoint of a real 2-epoch run on the session cluster."""
    tmp = tmp_path_factory.mktemp("ck")
    ds = make_dataset(n=16, grid=5, seed=3)
    data = daskpty.from_arrays(ds.intensities, ds.positions, truth={"object": ds.truth.object})
    data.to_zarr(tmp / "d.zarr")
    daskpty.reconstruct(str(tmp / "d.zarr"), epochs=2, client=client, checkpoint=str(tmp / "ck.zarr"),
                        progress=False)
    return tmp / "d.zarr", tmp / "ck.zarr"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_resume_and_export_refuse_a_damaged_checkpoint(checkpoint, client, tmp_path, capsys, how):
    data, ck = checkpoint
    bad = damaged_copy(ck, tmp_path / "bad.zarr", "object/c/0/0", how)
    before = files_under(bad)
    word = "is missing" if how == "delete" else "cannot be decoded"
    t0 = time.perf_counter()
    with pytest.raises(DamagedStoreError, match=rf"chunk file object/c/0/0 of 'object' {word}"):
        daskpty.reconstruct(str(data), epochs=4, client=client, resume=str(bad), checkpoint=str(bad),
                            progress=False)
    api_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    err = one_line_error(capsys, "reconstruct", data, "-o", bad, "--resume", bad, "--epochs", "4",
                         "--quiet")
    cli_s = time.perf_counter() - t0
    assert f"object/c/0/0 of 'object' {word}" in err
    err = one_line_error(capsys, "export", bad, tmp_path / "o.tif")
    assert f"object/c/0/0 of 'object' {word}" in err and not os.path.exists(tmp_path / "o.tif")
    assert files_under(bad) == before  # nothing of the user's changed
    assert api_s < 10 and cli_s < 10, (api_s, cli_s)
