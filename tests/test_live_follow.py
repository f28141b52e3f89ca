"""Following a scan while it is written: ``daskpty reconstruct DATA --follow``.

Real processes on one real store: a writer (``daskpty simulate ... --rate``) and followers (the
CLI) started beside it, a writer killed with SIGKILL, a follower killed and resumed. One
writer's scan is shared by the followers of the module's fixture, which run at the same time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import daskpty
from daskpty.cli import main
from daskpty.io.checkpoint import extended_to, grown_canvas
from daskpty.io.results import Reconstruction
from daskpty.metrics import nrmse_vs_truth

GRID, PROBE, RATE, EPOCHS = "14x14", "32", 25, 8     # 196 frames: ~7.8 s of scan
N_FRAMES = 196
FOLLOW = ["--follow", "--follow-min-frames", "24", "--snapshot-every", "0.4", "--follow-timeout", "30",
          "--epochs", str(EPOCHS), "--seed", "1"]


def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "daskpty", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _kill(proc):
    """SIGKILL the process and the processes it started (its workers): a crash."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _writer(path, rate=RATE, grid=GRID):
    return _cli("simulate", path, "--grid", grid, "--probe-size", PROBE, "--rate", rate, "--quiet")


def _snapshots(stderr: str) -> list[int]:
    """Frames of each snapshot the follower reported ('daskpty: snapshot: 1,234 frames, ...')."""
    return [int(line.split()[2].replace(",", "")) for line in stderr.splitlines()
            if line.startswith("daskpty: snapshot:")]


def _wait(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def followed(tmp_path_factory):
    """One scan written at RATE frames/s, followed from its start by a plain LSQML follower, one
    refining positions, one on tiles (2 workers) and one SIGKILLed after its first snapshot and
    resumed with --resume OUT --follow."""
    root = tmp_path_factory.mktemp("follow")
    data = root / "scan.zarr"
    writer = _writer(data)
    runs = {"plain": [], "refine": ["--refine-positions", "start_epoch=2"], "tiles": ["--tiles"]}
    procs = {name: _cli("reconstruct", data, "-o", root / f"{name}.zarr", *FOLLOW, *extra, "--workers",
                        2 if name == "tiles" else 1) for name, extra in runs.items()}
    killed = _cli("reconstruct", data, "-o", root / "killed.zarr", *FOLLOW, "--workers", 1)
    out = root / "killed.zarr"
    deadline = time.monotonic() + 60
    while not os.path.isdir(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill(killed)
    killed_frames = _frames_used(out) if os.path.isdir(out) else None
    resumed = _cli("reconstruct", data, "-o", out, "--resume", out, *FOLLOW, "--workers", 1)
    results = {name: _wait(p) for name, p in procs.items()}
    results["resumed"] = _wait(resumed)
    assert _wait(writer)[0] == 0
    return {"root": root, "data": data, "results": results, "killed_frames": killed_frames}


def _frames_used(path) -> int:
    return Reconstruction.from_zarr(path).live["frames_used"]


def test_snapshots_grow_and_the_result_matches_an_offline_run(followed, capsys):
    """The follower's snapshots use more and more frames; the final result uses all of them, is
    the ordinary result-store format, and its NRMSE against the truth is at most 1.1 x that of
    an offline run with the same epochs after the scan's end. (The follower ran more epochs
    before the end, on part of the scan, so it should not be worse; 1.1 leaves room for a
    different chunking and rounds of the partial scans leading somewhere a little different.)"""
    rc, out, err = followed["results"]["plain"]
    assert rc == 0, err[-3000:]
    frames = _snapshots(err)
    assert len(frames) >= 2 and frames == sorted(frames) and frames[0] < frames[-1], frames
    assert frames[0] < N_FRAMES, "the first snapshot came after the scan had ended"
    rec = Reconstruction.from_zarr(followed["root"] / "plain.zarr")
    assert rec.live["frames_used"] == N_FRAMES and rec.live["scan_ended"]
    assert len(rec.positions) == N_FRAMES and rec.epochs == rec.live["final_from_epoch"] + EPOCHS
    capsys.readouterr()
    assert main(["info", "--json", str(followed["root"] / "plain.zarr")]) == 0
    assert json.loads(capsys.readouterr().out)["frames_used"] == N_FRAMES
    data = daskpty.open_data(followed["data"])
    offline = daskpty.reconstruct(data, epochs=EPOCHS, n_workers=1, seed=1, progress=False)
    live_err = nrmse_vs_truth(rec.object, rec.positions, rec.illumination, data.truth)
    offline_err = nrmse_vs_truth(offline.object, offline.positions, offline.illumination, data.truth)
    assert live_err <= 1.1 * offline_err, (live_err, offline_err)


@pytest.mark.parametrize("name", ["refine", "tiles"])
def test_followers_with_refinement_and_tiles_run_to_the_end(followed, name):
    rc, out, err = followed["results"][name]
    assert rc == 0, err[-3000:]
    assert _snapshots(err), "no snapshot before the end"
    rec = Reconstruction.from_zarr(followed["root"] / f"{name}.zarr")
    assert rec.live["frames_used"] == N_FRAMES and rec.live["scan_ended"]
    assert np.isfinite(rec.object).all()
    if name == "refine":
        assert rec.nominal_positions is not None and len(rec.nominal_positions) == N_FRAMES
    else:
        assert rec.options["tiles"]
    assert "wrote" in out


def test_a_killed_follower_resumes_and_catches_up(followed):
    """SIGKILLed once its output holds a snapshot, the follower goes on from it with
    --resume OUT --follow and ends with every frame used, counting on from the kept epochs."""
    assert followed["killed_frames"] is not None, "the follower was killed before its first snapshot"
    assert followed["killed_frames"] < N_FRAMES
    rc, out, err = followed["results"]["resumed"]
    assert rc == 0, err[-3000:]
    rec = Reconstruction.from_zarr(followed["root"] / "killed.zarr")
    assert rec.live["frames_used"] == N_FRAMES and rec.live["scan_ended"]


def test_a_writer_killed_without_ending_ends_the_follower_in_one_line(tmp_path):
    """The writer is SIGKILLed mid-scan: after --follow-timeout seconds without a new frame the
    follower ends (exit 3) with one line naming the frame the scan stopped at; the snapshot of
    those frames is kept in the output store."""
    data, out = tmp_path / "scan.zarr", tmp_path / "r.zarr"
    writer = _writer(data, rate=40, grid="20x20")   # 400 frames: 10 s, killed after ~60 of them
    follower = _cli("reconstruct", data, "-o", out, "--follow", "--follow-min-frames", "24",
                    "--snapshot-every", "0.4", "--follow-timeout", "3", "--epochs", "4", "--workers", "1")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(data / "live.json") and daskpty.LiveStore(data).status().frames_committed >= 60:
            break
        time.sleep(0.05)
    _kill(writer)
    rc, stdout, err = _wait(follower)
    committed = daskpty.LiveStore(data).status().frames_committed
    assert 0 < committed < 400
    assert rc == 3, err[-3000:]
    lines = [line for line in err.splitlines() if not line.startswith("daskpty: snapshot:")]
    assert lines == [lines[0]] and f"the scan stopped at frame {committed:,} of 400" in lines[0], err[-3000:]
    assert "is kept in" in lines[0]
    rec = Reconstruction.from_zarr(out)
    assert rec.live["frames_used"] == committed and not rec.live["scan_ended"]


def test_a_grown_canvas_keeps_every_pixel_where_it_was():
    """Growing the canvas for frames further out moves the origin by whole pixels; each old
    pixel keeps its data coordinate, new object pixels are one and new pixels of object-sized
    engine state (momenta, optimiser moments) zero, and the new frames' per-pattern state rows
    are NaN (initial values)."""
    rng = np.random.default_rng(0)
    obj = (rng.random((40, 50)) + 1j * rng.random((40, 50))).astype(np.complex64)
    pos = np.array([[10.0, 12.0], [11.0, 20.0]])
    rec = Reconstruction(object=obj, probe=np.ones((1, 8, 8), np.complex64), positions=pos + [5, 6],
                         origin=np.array([5.0, 6.0]), illumination=np.abs(obj).astype(np.float32),
                         engine_state={"pattern_intensity_scale": np.ones((2, 1)), "velocity": obj * 0,
                                       "optimizer.m.object": np.full(obj.shape, 0.5, np.float32)})
    more = np.vstack([pos, [[-20.0, 12.0], [30.0, 70.0]]])
    grown = grown_canvas(extended_to(rec, more, "R"), (80, 110), np.array([30.0, 8.0]))
    dy, dx = (grown.origin - rec.origin).astype(int)
    assert (dy, dx) == (25, 2)
    assert np.array_equal(grown.object[dy:dy + 40, dx:dx + 50], obj)
    assert grown.object.shape[0] >= 80 and np.all(grown.object[:dy] == 1)
    assert np.allclose(grown.positions, more + grown.origin)
    assert np.isnan(grown.engine_state["pattern_intensity_scale"][2:]).all()
    assert grown.engine_state["velocity"].shape == grown.object.shape
    moment = grown.engine_state["optimizer.m.object"]       # AD's Adam moment: zero where new
    assert np.all(moment[dy:dy + 40, dx:dx + 50] == 0.5) and np.all(moment[:dy] == 0)
    with pytest.raises(ValueError, match="not the first frames"):
        extended_to(rec, more[::-1], "R")


#: a follower on the frame schedule (``snapshot_frames``), as its own process: DATA OUT [--resume]
FRAME_FOLLOWER = """
import sys
from daskpty.workflows import follow

if __name__ == "__main__":
    data, out = sys.argv[1], sys.argv[2]
    follow(data, out, {epochs}, min_frames=24, snapshot_frames=24, snapshot_epochs={per_cycle}, timeout=30,
           resume=out if "--resume" in sys.argv else None, n_workers=1, seed=1, checkpoint_every=1,
           progress=False, on_snapshot=lambda rec: print("snapshot", rec.live["frames_used"], rec.epochs, flush=True))
"""


@pytest.mark.slow
def test_a_killed_follower_resumed_ends_bit_identical_to_one_never_killed(tmp_path):
    """Snapshots set by frames (``snapshot_frames``): the writer writes the whole scan at
    12 frames/s; follower A is SIGKILLed inside its second snapshot cycle (the checkpoint of an
    epoch part-way through it, every epoch being checkpointed), restarted on its output, killed
    again in its final epochs after the scan's end and restarted again; follower B is never
    killed. A's final object, probe, positions and loss history equal B's bit for bit: each
    cycle's frames and epochs follow from the scan and the epoch count alone, B too starts each
    cycle from its stored snapshot, the checkpoint holds the whole state at the precision it was
    computed in (complex64 / float32 / float64), and one worker reduces in a fixed order."""
    per_cycle, epochs, cycles = 4, 8, 6                       # cycles on 24, 48, ..., 144 frames
    script = tmp_path / "follower.py"
    script.write_text(FRAME_FOLLOWER.format(epochs=epochs, per_cycle=per_cycle))
    data, a, b = tmp_path / "scan.zarr", tmp_path / "a.zarr", tmp_path / "b.zarr"

    def follower(out, *extra):
        return subprocess.Popen([sys.executable, str(script), str(data), str(out), *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def kill_after(proc, epoch):
        """SIGKILL ``proc`` once A's store holds an epoch past ``epoch``; the store as kept."""
        from daskpty.io.safety import stored_epoch

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            held = stored_epoch(a) if os.path.isdir(a) else None
            if held is not None and held > epoch:
                break
            time.sleep(0.002)
        assert proc.poll() is None, f"A ended before it could be killed: {proc.communicate()}"
        _kill(proc)
        return Reconstruction.from_zarr(a)

    writer = _writer(data, rate=12, grid="12x12")            # 144 frames: 12 s
    never = follower(b)
    kept = kill_after(follower(a), per_cycle)                # inside the second cycle (48 frames)
    assert kept.epochs > per_cycle and kept.live["frames_used"] < 144, (kept.epochs, kept.live)
    kept = kill_after(follower(a, "--resume"), cycles * per_cycle)   # in the final epochs
    assert kept.live["final_from_epoch"] == cycles * per_cycle < kept.epochs, kept.live
    for proc in (follower(a, "--resume"), never, writer):
        rc, out, err = _wait(proc)
        assert rc == 0, err[-3000:]
    ra, rb = Reconstruction.from_zarr(a), Reconstruction.from_zarr(b)
    assert ra.live["frames_used"] == rb.live["frames_used"] == 144
    assert ra.epochs == rb.epochs == cycles * per_cycle + epochs
    assert np.array_equal(ra.object, rb.object) and np.array_equal(ra.probe, rb.probe)
    assert np.array_equal(ra.positions, rb.positions)
    assert [h["loss"] for h in ra.history] == [h["loss"] for h in rb.history]


@pytest.mark.parametrize("bad", [{"snapshot_frames": 0}, {"snapshot_frames": 2.5}, {"snapshot_frames": 8, "snapshot_epochs": 0}])
def test_frame_schedule_settings_are_refused_in_one_line(tmp_path, bad):
    from daskpty.workflows import follow

    with pytest.raises(ValueError, match=r"must be a positive integer, got"):
        follow(tmp_path / "scan.zarr", tmp_path / "r.zarr", **bad)


def test_the_frame_schedule_from_the_command_line_equals_the_api(followed, tmp_path):
    """``--snapshot-frames Q --snapshot-epochs E`` runs the cycles of ``follow(snapshot_frames=Q,
    snapshot_epochs=E)``: on the finished scan both end bit-identical, after (cycles x E) + epochs."""
    from daskpty.workflows import follow

    data = followed["data"]
    cli_out, api_out = tmp_path / "cli.zarr", tmp_path / "api.zarr"
    rc, _, err = _wait(_cli("reconstruct", data, "-o", cli_out, "--follow", "--follow-min-frames", 48,
                            "--snapshot-frames", 74, "--snapshot-epochs", 2, "--epochs", 3, "--seed", 1,
                            "--workers", 1, "--quiet"))
    assert rc == 0, err[-3000:]
    follow(data, api_out, 3, min_frames=48, snapshot_frames=74, snapshot_epochs=2, n_workers=1, seed=1,
           progress=False)
    a, b = Reconstruction.from_zarr(cli_out), Reconstruction.from_zarr(api_out)
    assert a.epochs == b.epochs == 3 * 2 + 3          # cycles on 48, 122 and 196 frames
    assert np.array_equal(a.object, b.object) and np.array_equal(a.probe, b.probe)


@pytest.mark.parametrize("flags, says", [
    (["--snapshot-frames", "8", "--snapshot-every", "1"], "give one of them"),
    (["--snapshot-epochs", "2"], "applies with --snapshot-frames only"),
    (["--snapshot-frames", "0"], "must be a positive number"),
])
def test_frame_schedule_flags_are_refused_in_one_line(tmp_path, capsys, flags, says):
    rc = main(["reconstruct", str(tmp_path / "scan.zarr"), "-o", str(tmp_path / "r.zarr"), "--follow", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and says in err and len(err.splitlines()) == 1, err
