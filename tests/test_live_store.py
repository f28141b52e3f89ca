"""Live data-set stores: a writer process appends blocks while other processes read them.

Real Zarr stores, real writer and reader processes (``python -c``), a real SIGKILL. The frames
are a known function of their index, so every reader can check what it sees against what was
written; block sizes vary and straddle chunk boundaries (chunks of 6 frames).
"""
from __future__ import annotations

import inspect
import json
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import daskpty
from daskpty.cli import main
from daskpty.io.live import LiveStore, ScanWriter

N_PIX = 16
CHUNK_BYTES = 6 * N_PIX * N_PIX * 2       # 6 uint16 frames per chunk
SIZES = [1 + (7 * b) % 9 for b in range(40)]   # frames per block: 1 .. 9
BOUNDS = np.cumsum(SIZES).tolist()        # the only counts a reader may see

def frames(start, stop):
    i = np.arange(start, stop)[:, None, None]
    y, x = np.mgrid[:N_PIX, :N_PIX]
    return ((7 * i + 3 * y + x) % 50000 + 1).astype(np.uint16)


def positions(start, stop):
    i = np.arange(start, stop, dtype=np.float64)
    return np.stack([10 + (i // 8) * 3.0, 10 + (i % 8) * 3.0], axis=1)


#: the frames and positions of the test scan, for the writer and reader processes
COMMON = (f"import numpy as np\nN_PIX, CHUNK_BYTES, SIZES = {N_PIX}, {CHUNK_BYTES}, {SIZES}\n"
          + inspect.getsource(frames) + inspect.getsource(positions))

WRITER = COMMON + textwrap.dedent("""
    import sys, time
    import daskpty
    import daskpty.io.live as live
    path, planned, per_s, hang_after = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    planned = None if planned == "none" else int(planned)
    w = daskpty.ScanWriter(path, pattern_shape=(N_PIX, N_PIX), planned_frames=planned,
                           chunk_bytes=CHUNK_BYTES, wavelength_m=1e-10)
    print("created", flush=True)
    n = 0
    for b, k in enumerate(SIZES):
        if b == hang_after:             # the next block's bytes reach the disk, its commit never
            def hang(root, record):
                print("block written", flush=True)
                time.sleep(120)
            live.write_record = hang
            w.append(np.full((k, N_PIX, N_PIX), 65535, np.uint16), positions(n, n + k))
        w.append(frames(n, n + k), positions(n, n + k))
        n += k
        if per_s:
            time.sleep(1 / per_s)
    w.close()
    print("ended", flush=True)
""")

READER = COMMON + textwrap.dedent("""
    import json, sys, time
    import daskpty
    path = sys.argv[1]
    seen, bad = [], []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = daskpty.open_data(path, frames="committed")
        except (daskpty.DataError, FileNotFoundError) as exc:   # not created, or no block yet
            if seen:
                bad.append(str(exc))
            time.sleep(0.01)
            continue
        n = data.n_patterns
        x = data.intensities.compute(scheduler="sync")
        if not (np.array_equal(x, frames(0, n)) and np.array_equal(data.positions, positions(0, n))):
            bad.append(f"data differ at {n} frames")
        seen.append(n)
        if daskpty.LiveStore(path).status().ended and n == sum(SIZES):
            break
    print(json.dumps({"seen": seen, "bad": bad}))
""")


def _start(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_line(proc, line, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = proc.stdout.readline()
        if out.strip() == line:
            return
        if not out and proc.poll() is not None:
            break
    raise AssertionError(f"no {line!r} from the process: {proc.stderr.read()[-2000:]}")


def _info(capsys, path, *flags) -> str:
    """``daskpty info`` (in this process) on ``path``: its stdout."""
    capsys.readouterr()
    rc = main(["info", str(path), *flags])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_reader_process_sees_only_whole_committed_blocks(tmp_path):
    """A writer appends 40 blocks (undeclared length: the arrays grow) at ~40 blocks/s while a
    reader process polls: every count it sees is a block boundary, counts never decrease,
    and the data equal what was written."""
    path = tmp_path / "live.zarr"
    reader = _start(READER, path)
    writer = _start(WRITER, path, "none", 40, -1)
    w_out, w_err = writer.communicate(timeout=90)
    r_out, r_err = reader.communicate(timeout=90)
    assert writer.returncode == 0, w_err
    assert reader.returncode == 0, r_err
    report = json.loads(r_out.strip().splitlines()[-1])
    seen = report["seen"]
    assert report["bad"] == []
    assert all(n in BOUNDS for n in seen), sorted(set(seen) - set(BOUNDS))
    assert seen == sorted(seen), "the committed count went down"
    assert len(set(seen)) >= 5, f"the reader saw too few blocks arrive: {sorted(set(seen))}"
    assert seen[-1] == BOUNDS[-1]
    data = daskpty.open_data(path)                       # ended: an ordinary store
    assert data.n_patterns == BOUNDS[-1]
    assert np.array_equal(data.intensities.compute(), frames(0, BOUNDS[-1]))
    assert np.array_equal(data.positions, positions(0, BOUNDS[-1]))


def test_writer_killed_mid_block_leaves_the_last_commit_and_can_resume(tmp_path, capsys):
    """SIGKILL after a block's bytes are on disk but before its commit: readers get the last
    commit (not the block's 65535 frames), the store says how to finish, and a resumed writer
    completes it into an ordinary store."""
    path = tmp_path / "live.zarr"
    planned = BOUNDS[-1]
    writer = _start(WRITER, path, planned, 0, 12)
    try:
        _wait_line(writer, "block written")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    n = BOUNDS[11]
    data = daskpty.open_data(path, frames="committed")
    assert data.n_patterns == n
    assert np.array_equal(data.intensities.compute(), frames(0, n))
    with pytest.raises(daskpty.DataError, match="no writer holds it.*ScanWriter.resume"):
        daskpty.open_data(path)
    assert f"live         {n:,} of {planned:,} frames, no writer holds it" in _info(capsys, path)
    info = json.loads(_info(capsys, path, "--json"))
    assert info["frames_committed"] == n and info["live"]["ended"] is False

    with ScanWriter.resume(path) as writer:
        assert writer.frames_committed == n
        for k in SIZES[12:]:
            m = writer.frames_committed
            writer.append(frames(m, m + k), positions(m, m + k))
    data = daskpty.open_data(path, validate="full")
    assert data.n_patterns == planned
    assert np.array_equal(data.intensities.compute(), frames(0, planned))
    assert LiveStore(path).status().describe() == f"ended at {planned:,} frames ({planned:,} planned)"
    assert not list(path.rglob("*.partial")), "the killed write's temporary files were left"


def test_writer_killed_at_any_time_leaves_a_readable_store(tmp_path):
    """SIGKILL at an arbitrary moment of a fast stream of blocks: the store reads at a block
    boundary with the right data."""
    path = tmp_path / "live.zarr"
    writer = _start(WRITER, path, "none", 100, -1)
    _wait_line(writer, "created")
    status = LiveStore(path).wait(frames=BOUNDS[5], timeout=60)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    data = daskpty.open_data(path, frames="committed")
    assert data.n_patterns >= status.frames_committed and data.n_patterns in BOUNDS
    assert np.array_equal(data.intensities.compute(), frames(0, data.n_patterns))
    assert np.array_equal(data.positions, positions(0, data.n_patterns))


def test_finished_live_store_reconstructs_like_an_ordinary_store(tmp_path, client):
    """A scan written by the acquisition stand-in, once ended, reconstructs with the ordinary
    reconstruct on a LocalCluster to the same result as the same frames in an ordinary store."""
    live = daskpty.simulate(tmp_path / "live.zarr", grid=(6, 6), probe_size=32, rate=100)
    assert live.metadata["live"]["planned_frames"] == 36
    plain = daskpty.from_arrays(live.intensities.compute(), live.positions, probe=live.probe,
                                wavelength_m=live.metadata["wavelength_m"],
                                detector_distance_m=live.metadata["detector_distance_m"],
                                detector_pixel_size_m=live.metadata["detector_pixel_size_m"],
                                ).to_zarr(tmp_path / "plain.zarr")
    start = np.ones_like(live.truth.object)
    a = daskpty.reconstruct(str(live.path), epochs=4, object=start, client=client, chunk_length=12)
    b = daskpty.reconstruct(str(plain.path), epochs=4, object=start, client=client, chunk_length=12)
    assert np.isfinite(a.object).all()
    assert np.array_equal(a.object, b.object) and np.array_equal(a.probe, b.probe)


def test_simulate_rate_takes_frames_over_rate_and_grows_while_it_runs(tmp_path, capsys):
    """``daskpty simulate --rate 40`` of 64 frames: blocks of 10 frames arrive over ~1.6 s, a
    reader sees the store part-written, and ``info`` reports it ended."""
    path = tmp_path / "scan.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "daskpty", "simulate", str(path), "--grid", "8x8",
                             "--probe-size", "32", "--rate", "40", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    seen = set()
    while proc.poll() is None:
        try:
            s = LiveStore(path).status()
        except (daskpty.DataError, FileNotFoundError, ValueError):  # not created yet
            time.sleep(0.02)
            continue
        seen.add((s.frames_committed, s.ended))
        time.sleep(0.02)
    assert proc.wait() == 0, proc.stderr.read()
    partial = {n for n, ended in seen if not ended and 0 < n < 64}
    assert partial and all(n % 10 == 0 for n in partial), seen
    record = json.loads((path / "live.json").read_text())
    took = record["updated_unix"] - record["created_unix"]
    assert 0.95 * 64 / 40 <= took <= 64 / 40 + 1.0, took
    assert record["ended"] and record["frames_committed"] == 64 and record["blocks"] == 7
    text = _info(capsys, path)
    assert "live         ended at 64 frames (64 planned)" in text
    info = json.loads(_info(capsys, path, "--json"))
    assert info["frames_committed"] == 64 and info["live"]["ended"] is True


def test_writer_refuses_bad_blocks_with_one_line(tmp_path):
    with ScanWriter(tmp_path / "s.zarr", pattern_shape=(N_PIX, N_PIX), planned_frames=4) as w:
        with pytest.raises(ValueError, match=r"expected \(k, 16, 16\)"):
            w.append(np.zeros((2, 8, 8), np.uint16), positions(0, 2))
        with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
            w.append(frames(0, 2), positions(0, 3))
        with pytest.raises(ValueError, match="cannot store exactly"):
            w.append(frames(0, 2).astype(np.float32) + 0.5, positions(0, 2))
        w.append(frames(0, 3), positions(0, 3))
        with pytest.raises(ValueError, match="exceeds the planned 4"):
            w.append(frames(3, 5), positions(3, 5))
        w.append(frames(3, 4), positions(3, 4))
    assert daskpty.open_data(tmp_path / "s.zarr").n_patterns == 4
    with pytest.raises(daskpty.DataError, match="already ended at 4 frames"):
        ScanWriter.resume(tmp_path / "s.zarr")
    with pytest.raises(FileExistsError, match="already exists"):
        ScanWriter(tmp_path / "s.zarr", pattern_shape=(N_PIX, N_PIX))
