"""The interrupt guard of the command line (daskpty/cli/interrupts.py), in real processes with real
signals: a command whose main thread is stuck where Ctrl-C cannot reach it still ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signals only")

# The main thread blocks SIGINT, so the kernel hands every Ctrl-C to another thread, then sits
# in a read that never returns: Python never runs its SIGINT handler, as in a hung write.
STUCK = textwrap.dedent("""
    import os, signal, subprocess, sys
    from daskpty.io.checkpoint import sigterm_as_interrupt
    from daskpty.cli.interrupts import InterruptGuard, set_exit_note

    set_exit_note(lambda: "epoch 7 is saved in r.zarr (continue with --resume r.zarr)")
    with InterruptGuard(insist_s=float(sys.argv[1]), still_stopping_s=float(sys.argv[2])), sigterm_as_interrupt():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print(child.pid, flush=True)
        os.read(os.pipe()[0], 1)
""")


def _stuck(insist_s, still_stopping_s):
    run = subprocess.Popen([sys.executable, "-c", STUCK, str(insist_s), str(still_stopping_s)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(run.stdout.readline())
    # signal only once the main thread sits in its read (else it may still run Python code and
    # handle the signal itself): Linux shows where a thread sleeps in /proc
    wchan = f"/proc/{run.pid}/task/{run.pid}/wchan"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(wchan) as f:
                if "pipe" in f.read():
                    break
        except OSError:  # no /proc here: a pause instead
            time.sleep(1.0)
            break
        time.sleep(0.01)
    return run, child


def _alive(pid) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_stuck_command_ends_after_the_second_interrupt():
    run, child = _stuck(insist_s=1.0, still_stopping_s=0.5)
    try:
        run.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            run.wait(timeout=1.5)  # the first Ctrl-C leaves the run time to stop by itself
        run.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        rc = run.wait(timeout=30)
        waited = time.monotonic() - t0
        err = run.stderr.read()
    finally:
        run.kill()
    lines = err.strip().splitlines()
    assert rc == 130, err
    assert 0.8 < waited < 10, waited
    assert lines[0].startswith("daskpty: still stopping after 0.5 s"), err
    assert "did not stop within 1 s of the second interrupt: exiting now; the stacks" in err
    assert "os.read" in err or "<string>" in err, err  # the main thread's stack, where it is stuck
    assert lines[-1] == "daskpty: interrupted; epoch 7 is saved in r.zarr (continue with --resume r.zarr)"
    time.sleep(0.5)
    assert not _alive(child), "the command's child process was left running"


def test_a_third_interrupt_ends_it_at_once():
    run, child = _stuck(insist_s=60.0, still_stopping_s=60.0)
    try:
        for _ in range(3):
            run.send_signal(signal.SIGTERM)  # a batch system's wall time counts like Ctrl-C
            time.sleep(0.05)
        rc = run.wait(timeout=10)
        err = run.stderr.read()
    finally:
        run.kill()
    assert rc == 130, err
    assert err.splitlines() == ["daskpty: interrupted three times: exiting now",
                                "daskpty: interrupted; epoch 7 is saved in r.zarr (continue with --resume r.zarr)"]
    time.sleep(0.5)
    assert not _alive(child)


def test_a_command_run_from_python_code_installs_nothing():
    from daskpty.cli import main

    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    assert main(["--version"]) == 0
    assert main(["info", os.devnull]) == 2
    now = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(now)
    assert now == before


def test_a_first_ctrl_c_waits_for_the_cluster_start_and_a_second_does_not():
    """``interrupts_after_start`` holds a first SIGINT until its block ends (then raises
    KeyboardInterrupt as Python would) and lets a second one through at once."""
    import os
    import signal

    from daskpty.execution.cluster import interrupts_after_start

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_after_start():
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("after the first")
    assert reached == ["after the first"]
    with pytest.raises(KeyboardInterrupt):
        with interrupts_after_start():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("after the second")
    assert reached == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _store(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    import daskpty
    from synthetic import make_dataset

    ds = make_dataset(grid=8, seed=1)
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


def _command(data, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "daskpty", "reconstruct", str(data), "-o", str(out),
                             "--workers", "1", "--epochs", "500", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _skip_under_nohup():
    """Under ``nohup`` SIGHUP reaches the command ignored, and the command keeps it so (as nohup
    asks): nothing to test then."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        pytest.skip("SIGHUP is ignored in this process tree (nohup); the command rightly keeps it ignored")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_while_the_command_imports_is_one_line(tmp_path, name):
    """In the first second (Python importing daskpty) SIGTERM ended the command with -15 and no
    word, Ctrl-C with a KeyboardInterrupt traceback, SIGHUP likewise silently."""
    if name == "SIGHUP":
        _skip_under_nohup()
    out = tmp_path / "r.zarr"
    run = _command(os.devnull, out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # daskpty/__init__ has set its handlers before NumPy loads
        try:
            with open(f"/proc/{run.pid}/maps") as f:
                if "numpy" in f.read():
                    break
        except OSError:
            time.sleep(0.3)
            break
        time.sleep(0.005)
    run.send_signal(getattr(signal, name))
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, (run.returncode, err)
    assert err.splitlines() == ["daskpty: interrupted while starting; nothing was written"], err
    assert not out.exists()


@pytest.mark.slow
def test_sighup_stops_a_run_with_its_stop_checkpoint(tmp_path):
    """A closed terminal (SIGHUP) ends the run like Ctrl-C: the stop checkpoint is written (no
    periodic one here) and the message names its epoch (SIGHUP used to kill the run, no checkpoint)."""
    import daskpty

    _skip_under_nohup()
    out = tmp_path / "r.zarr"
    run = _command(_store(tmp_path), out, "--checkpoint-every", "100000")
    lines = []
    for line in run.stderr:  # progress lines: epoch 1 is the first
        lines.append(line)
        if line.startswith("epoch 1/"):
            break
    run.send_signal(signal.SIGHUP)
    _, err = run.communicate(timeout=120)
    err = "".join(lines) + err
    assert run.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("daskpty: interrupted; epoch ") and "Traceback" not in err, err
    saved = int(last.split("epoch ")[1].split()[0])
    assert saved >= 1 and daskpty.Reconstruction.from_zarr(out).epochs == saved


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.0, 1.5])
def test_sigterm_while_the_cluster_starts_is_one_line(tmp_path, after):
    """Once worker processes are being spawned: one line, nothing else (there were 'Nanny failed
    to start' tracebacks and asyncio's 'Task exception was never retrieved … AllExit')."""
    import psutil

    out = tmp_path / "r.zarr"
    run = _command(_store(tmp_path), out, "--quiet")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and run.poll() is None:
        if any("spawn_main" in " ".join(c.cmdline()) for c in psutil.Process(run.pid).children()):
            break
        time.sleep(0.02)
    time.sleep(after)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert len(err.splitlines()) == 1 and err.startswith("daskpty: interrupted"), err


def test_a_stop_signal_python_dropped_ends_the_run_at_the_epochs_end(client, tmp_path, capsys):
    """A SIGTERM whose KeyboardInterrupt lands where Python cannot raise it (an import lock's
    callback prints "Exception ignored in" and goes on; here a weakref's callback) still
    stops the run at the end of that epoch, with its checkpoint (a run once finished all its
    epochs and exited 0)."""
    import daskpty
    from synthetic import make_dataset

    ds = make_dataset(grid=6, seed=1)

    class Held:
        pass

    def signal_in_a_weakref_callback(ref):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)                  # the handler raises here, where Python drops it

    def swallowing(epoch, state, metrics):
        if epoch == 2:
            held = Held()
            keep = weakref.ref(held, signal_in_a_weakref_callback)  # noqa: F841
            del held

    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), client=client, epochs=8,
                            check_data=False, callback=swallowing, checkpoint=tmp_path / "r.zarr",
                            checkpoint_every=100)
    assert daskpty.Reconstruction.from_zarr(tmp_path / "r.zarr").epochs == 2
    assert "Exception ignored" not in capsys.readouterr().err
    from daskpty.io.checkpoint import raise_if_stopped
    raise_if_stopped()   # nothing pending once the interrupt has ended the run
