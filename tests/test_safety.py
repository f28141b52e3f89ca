"""Issue #18 items 3, 4, 6, 7, 8: never delete what daskpty did not write, one writer per store,
resume with the stored chunking, sane inputs, and one-line failures of full or read-only disks.

Real processes where the case is about processes (locks, signals, pipes), real small tmpfs
mounts for full and read-only disks (skipped with the reason where this machine cannot mount).
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import daskpty
from daskpty.cli import main
from daskpty.io import safety
from daskpty.io.lock import StoreLock, StoreLocked, lock_path
from daskpty.io.results import RECON_FORMAT, Reconstruction

from mounts import tmpfs
from synthetic import make_dataset

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def ds():
    return make_dataset(grid=6, seed=5)


@pytest.fixture
def data_path(tmp_path, ds):
    path = tmp_path / "data.zarr"
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(path)
    return path


def _leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".partial-" in n or ".old-" in n)


def _cli(*args, **kwargs):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "daskpty", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


# --------------------------------------------------------------------------- item 3: markers

def test_store_formats_are_the_writers_own():
    from daskpty.io.validate import FORMAT_NAME

    assert set(safety.STORE_FORMATS) == {FORMAT_NAME, RECON_FORMAT}


def test_remove_own_deletes_only_what_daskpty_wrote(tmp_path, data_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("precious")
    foreign = tmp_path / "x.zarr.partial-notours"  # not one of daskpty's names
    foreign.mkdir()
    (foreign / "zarr.json").write_text("{}")
    unmarked = tmp_path / "x.zarr.partial-0123abcd"  # daskpty's name, someone else's content
    unmarked.mkdir()
    (unmarked / "thesis.tex").write_text("precious")
    for path in (notes, foreign, unmarked, tmp_path / "file.txt"):
        if not path.exists():
            path.write_text("precious")
        with pytest.raises(FileExistsError, match="refusing to delete it"):
            safety.remove_own(path)
        assert path.exists()
    own = tmp_path / "x.zarr.partial-89abcdef"
    own.mkdir()
    (own / safety.WRITING_MARKER).touch()
    (own / "half").write_text("a shard")
    safety.remove_own(own)
    safety.remove_own(data_path)
    assert not own.exists() and not data_path.exists()


def test_reconstruction_never_replaces_an_ordinary_directory(tmp_path, ds):
    rec = Reconstruction(object=np.ones((8, 8), np.complex64), probe=np.ones((1, 4, 4), np.complex64),
                         positions=np.zeros((1, 2)), origin=np.zeros(2))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="daskpty replaces only stores it wrote"):
        rec.to_zarr(notes, overwrite=True)
    assert (notes / "keep.txt").read_text() == "precious" and _leftovers(tmp_path) == []


def test_api_refuses_a_checkpoint_at_in_or_around_the_data(tmp_path, data_path):
    before = daskpty.open_data(data_path).intensities.compute()
    for checkpoint, pattern in ((data_path, "is the data store"),
                                (data_path / "r.zarr", "lies inside the data store"),
                                (tmp_path, "lies inside the checkpoint")):
        with pytest.raises(ValueError, match=pattern):
            daskpty.reconstruct(str(data_path), epochs=1, checkpoint=checkpoint, n_workers=1)
    np.testing.assert_array_equal(daskpty.open_data(data_path).intensities.compute(), before)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a daskpty store"):
        daskpty.reconstruct(str(data_path), epochs=1, checkpoint=notes, n_workers=1)
    assert (notes / "keep.txt").read_text() == "precious"


def test_a_lone_previous_is_resumed_not_deleted(tmp_path, ds, data_path, client, capsys):
    out = tmp_path / "r.zarr"
    daskpty.reconstruct(ds, epochs=2, client=client, checkpoint=out)
    os.rename(out, str(out) + ".previous")  # as if killed between the two renames of a swap
    assert main(["reconstruct", str(data_path), "-o", str(out), "--epochs", "3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "exists only as" in err and "--resume" in err and err.count("\n") == 1
    assert Reconstruction.from_zarr(str(out) + ".previous").epochs == 2
    rec = daskpty.reconstruct(ds, epochs=3, client=client, checkpoint=out, resume=out)
    assert rec.epochs == 3 and Reconstruction.from_zarr(out).epochs == 3
    assert not os.path.exists(str(out) + ".previous")  # superseded by the newer store


def test_a_swap_killed_while_removing_the_old_copy_never_blocks_the_next_write(tmp_path, ds, client):
    """A checkpoint swap ends by deleting ``PATH.previous``. Killed part-way through that
    deletion (a follower SIGKILLed mid-checkpoint) it must leave something the next write
    recognises as daskpty's: at every step of :func:`safety.deletion_order` the half-deleted
    copy is still a daskpty store, its own leftover or an empty directory, and a resumed run
    writes over it. Deleted in directory order, the root ``zarr.json`` went early and the next
    resume refused "a directory that is not a daskpty store"."""
    out = tmp_path / "r.zarr"
    daskpty.reconstruct(ds, epochs=1, client=client, checkpoint=out)
    template = tmp_path / "template.zarr"
    shutil.copytree(out, template)
    steps = safety.deletion_order(str(template))
    assert steps[-1].endswith("zarr.json") and len(steps) > 3
    previous = str(out) + ".previous"
    for k in range(len(steps) + 1):
        shutil.rmtree(previous, ignore_errors=True)
        shutil.copytree(template, previous)
        for entry in safety.deletion_order(previous)[:k]:                 # killed after k steps
            shutil.rmtree(entry) if os.path.isdir(entry) else os.remove(entry)
        safety.check_replaceable(previous)                              # never refused
        assert safety.is_daskpty_store(previous) or safety.is_own_leftover(previous) \
            or not os.listdir(previous), (k, sorted(os.listdir(previous)))
    rec = daskpty.reconstruct(ds, epochs=2, client=client, checkpoint=out, resume=out)
    assert rec.epochs == 2 and not os.path.exists(previous)


def test_two_quick_interrupts_during_a_checkpoint_write_leave_no_partial_store(tmp_path):
    """Two Ctrl-Cs in quick succession: the first stops a checkpoint write (the run then writes
    its stop checkpoint), the second lands while the partial store is being removed. The removal
    must still finish; cut short, it left ``PATH.partial-*`` beside the checkpoint (CI:
    ``test_interrupts_say_which_epoch_was_kept``, interrupts 20 ms apart)."""
    rng = np.random.default_rng(0)
    shape = (2000, 2000)
    obj = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
    rec = Reconstruction(object=obj, probe=np.ones((1, 16, 16), np.complex64), positions=np.zeros((4, 2)),
                         origin=np.zeros(2))
    for k, gap in enumerate((0.0, 0.005, 0.01, 0.02, 0.03, 0.05) * 2):
        out = tmp_path / f"r{k}.zarr"

        def interrupt_twice(out=out, gap=gap):
            deadline = time.monotonic() + 10
            while not glob.glob(f"{out}.partial-*/object/c/*") and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(gap)
            os.kill(os.getpid(), signal.SIGINT)

        sender = threading.Thread(target=interrupt_twice)
        caught = 0
        try:
            sender.start()
            try:
                rec.to_zarr(out)
            except KeyboardInterrupt:
                caught += 1
            sender.join()
            time.sleep(0.1)  # a second interrupt not taken by the write lands here
        except KeyboardInterrupt:
            caught += 1
            sender.join()
        assert caught >= 1, "the write ended before the first interrupt"
        time.sleep(0.3)
        assert _leftovers(tmp_path) == [], (gap, _leftovers(tmp_path))
        assert not out.exists() or Reconstruction.from_zarr(out).object.shape == shape


def test_settling_zarr_waits_for_a_write_its_caller_stopped_waiting_for(tmp_path):
    """A write still running on zarr's IO loop (its caller interrupted) ends before
    ``settle_zarr_writes`` returns, so a removal after it is not undone by that write."""
    import asyncio

    from zarr.core.sync import _get_loop

    from daskpty.io.pending_writes import settle_zarr_writes

    late = tmp_path / "late" / "c" / "0"

    async def slow_write():
        await asyncio.sleep(0.3)
        late.parent.mkdir(parents=True)
        late.write_bytes(b"x")

    asyncio.run_coroutine_threadsafe(slow_write(), _get_loop())
    assert settle_zarr_writes(timeout=5.0) and late.exists()


def test_stale_partials_of_daskpty_are_cleaned_and_others_kept(tmp_path, ds, client):
    out = tmp_path / "r.zarr"
    own = tmp_path / "r.zarr.partial-0123abcd"  # a killed checkpoint write
    own.mkdir()
    (own / safety.WRITING_MARKER).touch()
    (own / "object").mkdir()
    other = tmp_path / "r.zarr.partial-cafebabe"  # the same name pattern, not daskpty's content
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    daskpty.reconstruct(ds, epochs=1, client=client, checkpoint=out)
    assert not own.exists() and (other / "notes.txt").read_text() == "precious"
    assert Reconstruction.from_zarr(out).epochs == 1 and not os.path.exists(lock_path(out))


# --------------------------------------------------------------------------- item 4: locks

HOLDER = ("import sys, time\nfrom daskpty.io.lock import StoreLock\n"
          "StoreLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(120)\n")


def test_a_second_writer_gets_one_line_naming_the_first(tmp_path, ds, data_path, capsys):
    out = tmp_path / "r.zarr"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        owner = json.loads(open(lock_path(out)).read())
        assert owner["pid"] == holder.pid and {"host", "started", "since"} <= set(owner)
        for argv in (["reconstruct", data_path, "-o", out, "--epochs", "1", "--quiet"],
                     ["simulate", out, "--grid", "2x2", "--probe-size", "16", "--quiet"]):
            assert main([str(a) for a in argv]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err
            assert f"being written by another daskpty run: pid {holder.pid} on" in err
        with pytest.raises(StoreLocked, match=f"pid {holder.pid}"):
            daskpty.reconstruct(ds, epochs=1, checkpoint=out, n_workers=1)
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    with StoreLock(out):  # the holder died without releasing: a stale lock, taken over
        assert json.loads(open(lock_path(out)).read())["pid"] == os.getpid()
    assert not os.path.exists(lock_path(out))


STUCK_TAKING = ("import json, sys, time\nfrom daskpty.io.lock import StoreLock\n"
                "def stuck(*a, **k):\n    print('taking', flush=True)\n    time.sleep(120)\n"
                "json.dump = stuck\nStoreLock(sys.argv[1]).acquire()\n")


def test_a_writer_killed_while_taking_the_lock_leaves_none_behind(tmp_path):
    """A writer SIGKILLed while it wrote its name into the lock left an empty lock file, which the
    next run took for one being created and refused for 10 s ("a process that is creating its
    lock": a follower resumed at once failed so). The lock now appears filled in."""
    out = tmp_path / "r.zarr"
    taker = subprocess.Popen([sys.executable, "-c", STUCK_TAKING, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout.readline().strip() == "taking"
    finally:
        taker.kill()
        taker.wait()
    start = time.monotonic()
    with StoreLock(out):
        assert json.loads(open(lock_path(out)).read())["pid"] == os.getpid()
    assert time.monotonic() - start < 5
    assert sorted(os.listdir(tmp_path)) == []   # neither the lock nor the dead writer's staged file


@pytest.mark.slow
def test_two_simulations_of_one_store_at_once(tmp_path):
    out = tmp_path / "s.zarr"
    args = ["simulate", out, "--grid", "24x24", "--probe-size", "64", "--workers", "1", "--quiet"]
    runs = [_cli(*args) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in runs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    err = next(e for rc, e in results if rc == 2)
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert re.search(r"being written by another daskpty run: pid \d+|already exists", err), err
    assert daskpty.open_data(out).n_patterns == 576 and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- item 6: resume

def test_resume_reuses_the_stored_chunking_and_rounds(tmp_path, ds, client):
    start = np.ones_like(ds.truth.object)
    settings = dict(chunk_length=9, rounds_per_epoch=2, client=client)
    full = daskpty.reconstruct(ds, epochs=5, object=start, **settings)
    ck = tmp_path / "ck.zarr"
    daskpty.reconstruct(ds, epochs=3, object=start, checkpoint=ck, **settings)
    # the defaults would choose one chunk of 36 and one round: resume must keep 9 and 2
    resumed = daskpty.reconstruct(ds, epochs=5, client=client, resume=ck)
    np.testing.assert_array_equal(resumed.object, full.object)
    np.testing.assert_array_equal(resumed.probe, full.probe)
    with pytest.warns(UserWarning, match=r"chunk_length=12 differs from the chunk_length=9"):
        daskpty.reconstruct(ds, epochs=4, client=client, resume=ck, chunk_length=12)


# --------------------------------------------------------------------------- item 7: inputs

@pytest.mark.parametrize("far", [1e9, 1e5])
def test_positions_far_outside_the_scan_are_refused_by_name(ds, far):
    from types import SimpleNamespace

    positions = ds.positions.copy()
    positions[[3, 20]] = (far, 10.0), (10.0, -far)
    bad = SimpleNamespace(**{**vars(ds), "positions": positions})
    with pytest.raises(ValueError, match=r"2 scan position\(s\) lie far outside the scan: pattern 3 "
                                         r"at .*, 20 at .*fix or drop those patterns"):
        daskpty.reconstruct(bad, epochs=1, n_workers=1)  # refused before any cluster starts


def test_real_scans_are_not_outliers(ds):
    from daskpty.io.inputs import position_outliers
    from daskpty.simulate import make_positions

    rng = np.random.default_rng(0)
    scans = {"raster": make_positions("raster", 400, (20, 20), 6.0, 0.1, 64, rng),
             "fermat": make_positions("fermat", 500, None, 6.0, 0.0, 64, rng),
             "line": np.stack([np.full(50, 40.0) + rng.uniform(-0.3, 0.3, 50),
                               np.arange(50) * 5.0], axis=1),
             "two by two": np.array([[0.0, 0.0], [0.0, 20.0], [20.0, 0.0], [20.0, 20.0]]),
             "test data": ds.positions}
    for name, positions in scans.items():
        assert position_outliers(positions, 64).size == 0, name


def test_an_object_too_large_for_memory_is_refused(ds):
    from types import SimpleNamespace

    from daskpty.io.inputs import memory_bytes

    if not memory_bytes():
        pytest.skip("this platform does not report its memory")
    # two dense 3 x 6 rasters (overlapping windows: no unit mistake) far apart: the frame too big
    far = np.sqrt(memory_bytes() / 48) * 2.5 + 500
    grid = np.stack(np.meshgrid(np.arange(3), np.arange(6), indexing="ij"), -1).reshape(-1, 2) * 4.0
    big = SimpleNamespace(**{**vars(ds), "positions": np.concatenate([grid, grid + far])})
    with pytest.raises(ValueError, match=r"the object covering the scan would be .* more than "
                                         r"this machine's"):
        daskpty.reconstruct(big, epochs=1, n_workers=1)


def test_non_finite_initial_object_and_too_many_rounds_are_refused(ds):
    start = np.ones_like(ds.truth.object)
    start[4, 7] = np.nan
    with pytest.raises(ValueError, match=r"initial object contains 1 NaN or infinite values "
                                         r"\(the first at pixel \(4, 7\)\)"):
        daskpty.reconstruct(ds, epochs=1, object=start, n_workers=1)
    with pytest.raises(ValueError, match=r"rounds_per_epoch=37 exceeds the 36 patterns"):
        daskpty.reconstruct(ds, epochs=1, rounds_per_epoch=37, n_workers=1)


def test_epochs_zero_is_a_no_op(tmp_path, ds, data_path, client, capsys):
    out = tmp_path / "r.zarr"
    assert main(["reconstruct", str(data_path), "-o", str(out), "--epochs", "0"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    rec = daskpty.reconstruct(ds, epochs=0, client=client, checkpoint=out)
    assert rec.epochs == 0 and rec.history == []
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["data.zarr"]


# --------------------------------------------------------------------------- item 8: disks

def _fill(directory):
    """Take every free byte of the filesystem of ``directory`` (already full is full too: the
    run's own checkpoints may have taken the last block, so even creating the file can fail)."""
    try:
        with open(os.path.join(directory, "filler"), "wb") as f:
            f.write(b"\0" * shutil.disk_usage(directory).free)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_disk_full_or_read_only_during_a_checkpoint(tmp_path, ds, client, how):
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "3m") as reason:
        if reason is not None:
            pytest.skip(reason)
        out = mnt / "r.zarr"

        def after_epoch_2(epoch, state, metrics):
            if epoch == 2:
                if how == "full":
                    _fill(mnt)
                else:
                    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

        with pytest.raises(safety.StoreWriteError) as info:
            daskpty.reconstruct(ds, epochs=6, client=client, checkpoint=out, checkpoint_every=1,
                                callback=after_epoch_2)
        msg = str(info.value)
        assert "\n" not in msg and str(out) in msg, msg
        assert ("No space left on device" if how == "full" else "Read-only file system") in msg
        assert "writing the reconstruction (epoch 3)" in msg and "still holds epoch 2, intact" in msg
        assert Reconstruction.from_zarr(out).epochs == 2
        assert _leftovers(mnt) == []
        if how == "full":  # (a read-only disk keeps the lock file: stale once this process ends)
            assert not os.path.exists(lock_path(out))


@pytest.mark.slow
def test_cli_disk_full_mid_run_is_one_line_exit_2(tmp_path, data_path):
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "3m") as reason:
        if reason is not None:
            pytest.skip(reason)
        out = mnt / "r.zarr"
        run = _cli("reconstruct", data_path, "-o", out, "--epochs", "100000", "--workers", "1",
                   "--checkpoint-every", "1", "--quiet")
        try:
            _wait_for(lambda: os.path.exists(out) or run.poll() is not None, timeout=90)
            _fill(mnt)
            rc = run.wait(timeout=90)
        finally:
            run.kill()
        err = run.stderr.read()
        assert rc == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert re.match(r"daskpty: error: writing the reconstruction \(epoch \d+\) to .*r.zarr "
                        r"failed: No space left on device.*still holds epoch \d+, intact", lines[0])
        assert _leftovers(mnt) == []
        epoch = int(re.search(r"still holds epoch (\d+)", lines[0]).group(1))
        assert Reconstruction.from_zarr(out).epochs == epoch


def test_cli_simulate_on_a_full_disk_is_one_line_exit_2(tmp_path, use_client, capsys):
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "1m") as reason:
        if reason is not None:
            pytest.skip(reason)
        out = mnt / "s.zarr"
        assert main(["simulate", str(out), "--grid", "24x24", "--probe-size", "64",
                     "--dose", "none", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert re.match(r"daskpty: error: writing .*s.zarr failed: No space left on device", err)
        assert "nothing was written there and no partial store was left" in err
        assert os.listdir(mnt) == []


# --------------------------------------------------------------------------- item 8: processes

def test_a_closed_pipe_is_not_an_error(data_path):
    run = _cli("info", data_path)
    run.stdout.close()  # like `| head -1` having read all it wanted
    rc = run.wait(timeout=60)
    err = run.stderr.read()
    assert rc == 0 and err == "", err


@pytest.mark.slow
def test_interrupts_say_which_epoch_was_kept(tmp_path, data_path):
    out = tmp_path / "r.zarr"
    start = _cli("reconstruct", data_path, "-o", tmp_path / "early.zarr", "--epochs", "100000",
                 "--workers", "1", "--quiet")
    run = _cli("reconstruct", data_path, "-o", out, "--epochs", "100000", "--workers", "1",
               "--checkpoint-every", "5", "--quiet")
    try:
        import psutil

        # Ctrl-C as soon as the first run has started a worker process: during cluster start-up
        _wait_for(lambda: psutil.Process(start.pid).children() or start.poll() is not None, 60)
        start.send_signal(signal.SIGINT)
        _wait_for(lambda: (safety.stored_epoch(out) or 0) >= 5 or run.poll() is not None, 90)
        run.send_signal(signal.SIGINT)
        time.sleep(0.02)  # the second Ctrl-C lands while (or after) the stop checkpoint is written
        run.send_signal(signal.SIGINT)
        # The eighth session's "hang" here (the run never ended, its main thread in a periodic
        # checkpoint write) was a test suite started in the background of a shell, which starts
        # every command with SIGINT ignored: the run never saw the Ctrl-Cs and kept writing
        # checkpoints (conftest.py now restores the handler). Should the interrupt guard
        # (daskpty/cli/interrupts.py) ever have to end a stuck run, that is reported as a
        # warning with the stacks it printed; no exit within 90 s fails with every thread's
        # stack (SIGUSR1).
        try:
            rc = run.wait(timeout=90)
        except subprocess.TimeoutExpired:
            run.send_signal(signal.SIGUSR1)
            time.sleep(3)
            run.kill()
            start.kill()
            pytest.fail("the interrupted run did not end within 90 s; stacks:\n" + run.stderr.read())
        err = run.stderr.read()
        rc0, err0 = start.wait(timeout=60), start.stderr.read()
    finally:
        run.kill()
        start.kill()
    forced = "did not stop within 5 s of the second interrupt" in err
    if forced:
        warnings.warn("the interrupt guard had to end a stuck run:\n" + err, stacklevel=1)
    assert rc == 130, err
    last = err.strip().splitlines()[-1]
    m = re.match(r"daskpty: interrupted; epoch (\d+) is saved in (\S+) \(continue with --resume", last)
    # (a worker may still log distributed's heartbeat error while the cluster goes down; no
    # traceback comes from daskpty's own code, except the stacks of a forced exit)
    assert m and (forced or "daskpty/" not in "".join(ln for ln in err.splitlines() if 'File "' in ln)), err
    kept = Reconstruction.from_zarr(out)
    assert int(m.group(1)) == kept.epochs
    # a forced exit may cut a write short: its partial copy is daskpty's own, and the next write
    # of that store removes it
    assert all(safety.is_own_leftover(tmp_path / n) for n in _leftovers(tmp_path)) if forced \
        else _leftovers(tmp_path) == []
    assert rc0 == 130 and "Traceback" not in err0 and "AssertionError" not in err0, err0
    assert err0.startswith("daskpty: interrupted; no output was left behind\n"), err0
