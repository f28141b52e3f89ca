"""Signals as a terminal delivers them: to the whole foreground process group, the embedded
cluster's worker processes included, through a real pseudo-terminal (Ctrl-C typed as the byte
0x03, the terminal closed) or ``killpg``. The command alone must handle them: exit 130, one line,
a stop checkpoint of the epoch reached that resumes bit-identically, nothing from the workers."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminals as on Linux")]

DASKPTY = [sys.executable, "-m", "daskpty"]


def _store(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    import daskpty
    from synthetic import make_dataset

    ds = make_dataset(grid=10, seed=3)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


def _reconstruct(data, out, *extra, epochs=400):
    return [*DASKPTY, "reconstruct", str(data), "-o", str(out), "--workers", "2", "--epochs", str(epochs),
            "--checkpoint-every", "100000", *extra]


def _in_terminal(command, stderr_file=None):
    """Start ``command`` as the only job of a new pseudo-terminal (its own session, the terminal
    as its controlling one); return (process, master fd). stderr goes to the terminal unless a
    file is given."""
    import fcntl
    import termios

    master, slave = os.openpty()
    err = slave if stderr_file is None else stderr_file
    run = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=err, start_new_session=True,
                           preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    return run, master


def _read_until(master, pattern: bytes, run, timeout=120.0, seen=b""):
    """Read the terminal until ``pattern`` shows (or the process ends); return all that was read."""
    deadline = time.monotonic() + timeout
    while pattern not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal's other side is gone
                break
            if not chunk:
                break
            seen += chunk
        elif run.poll() is not None:
            break
    return seen


def _wait_for_file(path, pattern: str, run, timeout=120.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline and run.poll() is None:
        text = path.read_text() if path.exists() else ""
        if pattern in text:
            break
        time.sleep(0.1)
    return text


def _saved_epoch(last_line: str) -> int:
    match = re.fullmatch(r"daskpty: interrupted; epoch (\d+) is saved in .* \(continue with --resume .*\)", last_line)
    assert match, last_line
    return int(match.group(1))


def _after_interrupt(text: str) -> list[str]:
    """The lines the command wrote after the interrupt (progress lines end in carriage returns)."""
    tail = text.split("^C", 1)[-1]
    return [line for line in re.split(r"[\r\n]+", tail) if line.strip() and not line.startswith("epoch ")]


def _assert_resumes_bit_identically(tmp_path, data, out, saved, *extra):
    """Two more epochs from the stop checkpoint equal an uninterrupted run of saved + 2 epochs."""
    import daskpty

    again = subprocess.run(_reconstruct(data, out, "--resume", str(out), "--quiet", *extra, epochs=saved + 2),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    whole = tmp_path / "whole.zarr"
    fresh = subprocess.run(_reconstruct(data, whole, "--quiet", *extra, epochs=saved + 2),
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    resumed, straight = daskpty.Reconstruction.from_zarr(out), daskpty.Reconstruction.from_zarr(whole)
    assert resumed.epochs == straight.epochs == saved + 2
    np.testing.assert_array_equal(resumed.object, straight.object)
    np.testing.assert_array_equal(resumed.probe, straight.probe)


@pytest.mark.parametrize("extra", [(), ("--tiles",)], ids=["replicas", "tiles"])
def test_ctrl_c_typed_in_a_terminal_stops_with_a_checkpoint(tmp_path, extra):
    """Ctrl-C reached the workers too: they died (twice a false 'interrupted while starting;
    nothing was written'), the scheduler logged broadcast errors, and the run ended with exit 2
    and 'the state of epoch N was lost' instead of its stop checkpoint."""
    import daskpty

    data, out = _store(tmp_path), tmp_path / "r.zarr"
    run, master = _in_terminal(_reconstruct(data, out, *extra))
    try:
        seen = _read_until(master, b"epoch 4/", run)
        assert b"epoch 4/" in seen, seen.decode(errors="replace")
        os.write(master, b"\x03")  # what the terminal sends for Ctrl-C: SIGINT to the whole group
        run.wait(timeout=120)
        seen = _read_until(master, b"\x00never", run, timeout=5, seen=seen)
    finally:
        os.close(master)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = seen.decode(errors="replace")
    assert run.returncode == 130, text
    lines = _after_interrupt(text)
    assert len(lines) == 1, lines
    saved = _saved_epoch(lines[0])
    assert saved >= 4 and daskpty.Reconstruction.from_zarr(out).epochs == saved
    _assert_resumes_bit_identically(tmp_path, data, out, saved, *extra)


def test_sigint_to_the_process_group_leaves_nothing_from_the_workers(tmp_path):
    """``kill -INT -PGID`` (what a terminal does, here with stderr kept in a file so that every
    line of every process shows): one line, exit 130, the epoch reached saved."""
    import daskpty

    data, out, log = _store(tmp_path), tmp_path / "r.zarr", tmp_path / "err.txt"
    with open(log, "w") as err:
        run, master = _in_terminal(_reconstruct(data, out), stderr_file=err)
    try:
        assert "epoch 10/" in _wait_for_file(log, "epoch 10/", run)
        os.killpg(run.pid, signal.SIGINT)
        run.wait(timeout=120)
    finally:
        os.close(master)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = log.read_text()
    lines = [line for line in text.splitlines() if not line.startswith("epoch ")]
    assert run.returncode == 130, text
    assert len(lines) == 1, text
    assert daskpty.Reconstruction.from_zarr(out).epochs == _saved_epoch(lines[0]) >= 10


@pytest.mark.parametrize("stderr_to", ["terminal", "file"])
def test_closing_the_terminal_stops_with_a_checkpoint(tmp_path, stderr_to):
    """A closed terminal sends SIGHUP to the group: the workers died of it, multiprocessing's
    resource tracker printed KeyError tracebacks, and with stderr on the closed terminal the
    command failed on its last line (EIO) with exit 1. Now: exit 130 and the stop checkpoint;
    with stderr kept, one line and nothing else."""
    import daskpty

    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        pytest.skip("SIGHUP is ignored in this process tree (nohup)")
    data, out, log = _store(tmp_path), tmp_path / "r.zarr", tmp_path / "err.txt"
    with open(log, "w") as err:
        run, master = _in_terminal(_reconstruct(data, out), stderr_file=err if stderr_to == "file" else None)
    try:
        if stderr_to == "file":
            assert "epoch 10/" in _wait_for_file(log, "epoch 10/", run)
        else:
            assert b"epoch 4/" in _read_until(master, b"epoch 4/", run)
    finally:
        os.close(master)  # the terminal goes away: SIGHUP to its session's foreground group
    try:
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, log.read_text()
    saved = daskpty.Reconstruction.from_zarr(out).epochs
    assert saved >= 4
    if stderr_to == "file":
        text = log.read_text()
        lines = [line for line in text.splitlines() if not line.startswith("epoch ")]
        assert len(lines) == 1 and _saved_epoch(lines[0]) == saved, text
