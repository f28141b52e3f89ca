"""Follow a scan while it is written: reconstruct the committed frames in cycles, publish each
cycle's snapshot to the result store, and finish as an offline run once the scan has ended.

Each cycle is one :func:`daskpty.api.reconstruct_snapshot` on the frames committed when it
starts (:mod:`daskpty.io.live`), resumed from the previous cycle's snapshot on one cluster kept
for the whole follow: the object canvas grows with the scan, frames seen before keep their
per-pattern state (refined positions, OPR weights, intensity factors) and new ones start from
their initial values. A cycle runs whole epochs until ``snapshot_every`` seconds have passed
(at least one), so every engine and part works as it does offline. The result store is the
checkpoint and each snapshot carries ``live`` attributes (``frames_used``, ``snapshot_unix``).
Once the scan has ended and every frame is in, ``epochs`` more run on the whole scan.

``snapshot_frames`` sets the cycles by the frames instead of the clock (:class:`_FrameSchedule`):
the same scan then gives the same snapshots whatever the timing of writer and follower, so a
follower killed and resumed ends where one never stopped does. ``dashboard=True`` shows the
follow on the dask dashboard's ``/daskpty`` page (:class:`daskpty.monitor.live_board.LiveBoard`):
the newest snapshot's phase, frames committed and used, the lag and the scan's state.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings

from ..faults import ScanStopped  # noqa: F401 (also named here)
from ..api import reconstruct_snapshot
from ..execution.cluster import client_context
from ..io.live import LiveStore
from ..io.live_format import COMMIT_FILE, LIVE_ATTR
from ..io.results import Reconstruction
from ..io.store import open_data
from ..options import DEFAULT_EPOCHS

#: default seconds between snapshots (a cycle's epochs end at the first epoch past it)
SNAPSHOT_SECONDS = 3.0
#: default seconds without a new commit after which an unfinished scan is taken as stopped
TIMEOUT_SECONDS = 60.0
#: a cycle's epoch budget; the cycle's clock ends it long before
_CYCLE_EPOCHS = 100_000
#: settings the follow loop owns
_OWNED = ("checkpoint", "resume", "callback", "object")


def follow(data, output, epochs: int = DEFAULT_EPOCHS, *, min_frames: int | None = None,
           snapshot_every: float = SNAPSHOT_SECONDS, timeout: float = TIMEOUT_SECONDS, resume=None,
           client=None, n_workers: int | None = None, on_snapshot=None, poll: float = 0.1,
           snapshot_frames: int | None = None, snapshot_epochs: int = 1, dashboard: bool = False,
           **options) -> Reconstruction:
    """Reconstruct the live data-set store ``data`` while it is written, into ``output``.

    Waits until ``min_frames`` are committed (default: two of the store's chunks, at most an
    eighth of the planned scan), then runs cycles of at least one epoch and about
    ``snapshot_every`` seconds on the frames committed so far, each written to ``output`` (the
    checkpoint: ``daskpty show`` and ``daskpty info`` read it while the run goes on) and passed
    to ``on_snapshot(rec)``. After the scan's end, ``epochs`` more epochs on the whole scan; the
    result is the same store as an offline run's. A store that is not live is reconstructed
    offline (``epochs`` epochs).

    ``timeout``: seconds without a new commit (or without the store appearing) after which an
    unfinished scan ends the follow with :class:`ScanStopped` (one line: where the scan stopped,
    the snapshot kept). ``resume``: a result store of an earlier follow of the same scan
    (usually ``output``) to go on from. ``options``: those of :func:`daskpty.reconstruct`
    (engine, parts, execution, ``progress`` for the final epochs), but not ``checkpoint``,
    ``resume``, ``callback`` or ``object``, which following sets.

    ``snapshot_frames``: cycles set by the frames, not the clock: snapshot k is made after
    ``snapshot_epochs`` epochs on the first ``min_frames + k * snapshot_frames`` frames (all of
    them once the scan has ended), waiting for them; ``snapshot_every`` is then unused. The
    snapshots depend on the scan only, not on when frames arrive, so a run is reproducible and a
    follower killed and resumed (``resume=output``) ends with the result of one never stopped;
    the lag grows when the follower is slower than the writer. ``dashboard``: show the follow on
    the dask dashboard's ``/daskpty`` page (its address is printed on stderr).
    """
    owned = sorted(set(options) & set(_OWNED))
    if owned:
        raise ValueError(f"follow sets {', '.join(owned)} itself; pass the result store as output "
                         f"(and resume= to go on from an earlier follow)")
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
    if not snapshot_every > 0 or not timeout > 0:
        raise ValueError(f"snapshot_every and timeout must be positive seconds, got {snapshot_every!r} "
                         f"and {timeout!r}")
    schedule = None if snapshot_frames is None else _FrameSchedule(snapshot_frames, snapshot_epochs)
    path, output = os.path.abspath(os.fspath(data)), os.fspath(output)
    previous = Reconstruction.from_zarr(resume) if resume is not None else None
    live = {"started_unix": ((previous.live or {}) if previous is not None else {}).get("started_unix",
                                                                                          time.time())}
    progress = options.pop("progress", None)
    with client_context(client, n_workers=n_workers) as c:
        board = _board(c, dashboard, previous)
        loop = _Loop(path, output, live, resume, previous, c, options, on_snapshot, board)
        try:
            store = _wait_for_store(path, timeout, poll)
            growing = store is not None and not loop.finishing  # (by frames: the same cycles after the end)
            if growing and (schedule is not None or not store.status().ended):
                loop.grow(store, min_frames, schedule or _TimeSchedule(snapshot_every), timeout, poll)
            return loop.finish(epochs, progress)
        except ScanStopped as exc:
            board.stopped(str(exc))
            raise
        finally:
            board.close()


def _board(client, dashboard: bool, previous):
    """The dashboard's live page (a no-op board without ``dashboard``)."""
    if not dashboard:
        return _NoBoard()
    from ..monitor.live_board import LiveBoard  # lazy: the page's code, only when asked

    board = LiveBoard(client, previous)
    if board.link:
        print(f"daskpty dashboard: {board.link}", file=sys.stderr, flush=True)
    return board


class _NoBoard:
    """The dashboard's hooks of :class:`~daskpty.monitor.live_board.LiveBoard`, doing nothing."""

    def callback(self, clock):
        return clock

    def watching(self, store) -> None:
        pass

    def starting(self, frames: int, epochs: int | None) -> None:
        pass

    def snapshot(self, rec) -> None:
        pass

    def stopped(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Loop:
    """The cycles of one follow: where the last snapshot is, how many frames and epochs it holds."""

    def __init__(self, path, output, live, resume, previous, client, options, on_snapshot, board):
        self.path, self.output, self.live, self.client = path, output, live, client
        self.options, self.on_snapshot, self.board = options, on_snapshot, board
        self.source = resume  # the store the next cycle resumes from (None: start afresh)
        self.previous = previous
        self.used = len(previous.positions) if previous is not None else 0
        self.epochs = previous.epochs if previous is not None else 0

    @property
    def finishing(self) -> bool:
        """Whether the store resumed from is in the final epochs already (the scan had ended)."""
        stored = (self.previous.live or {}) if self.previous is not None else {}
        return bool(stored.get("scan_ended")) and "final_from_epoch" in stored

    def grow(self, store: LiveStore, min_frames, schedule, timeout, poll) -> None:
        """Cycles until the scan has ended and a snapshot used every frame, or ScanStopped."""
        watch = _CommitWatch(store, timeout)
        self.board.watching(store)
        first = _min_frames(store, store.status(), min_frames)
        if not self.used:  # (a resumed follow goes on at once)
            watch.wait_for(first, poll, self)
        while True:
            frames, until = schedule.next(self, first)
            status = watch.wait_for(frames, poll, self) if frames is not None else watch.update()
            n = status.frames_committed if frames is None else min(frames, status.frames_committed)
            if status.ended and self.used == n == status.frames_committed and not self.epochs % schedule.epochs:
                return  # (every frame is in the last snapshot: the final epochs take over)
            if n <= self.used and watch.stalled():
                raise ScanStopped(watch.message(status, self))
            live = {**self.live, "scan_ended": status.ended, "newest_frame_commit_unix": watch.commit_unix(n)}
            self.cycle(_first_frames(self.path, n), until(store), live)

    def finish(self, epochs: int, progress) -> Reconstruction:
        """``epochs`` more epochs on the whole (ended) scan: the final result."""
        stored = (self.previous.live or {}) if self.previous is not None else {}
        start = stored.get("final_from_epoch") if stored.get("scan_ended") else None
        start = self.epochs if start is None else int(start)
        data = open_data(self.path)
        live = {**self.live, "scan_ended": True, "final_from_epoch": start,
                "newest_frame_commit_unix": _ended_unix(self.path)}
        return self.run(data, start + epochs, live, progress=progress)

    def cycle(self, data, until, live) -> None:
        """One snapshot: epochs on ``data`` until ``until`` (an epoch count, or a callback that
        stops the run)."""
        epochs, clock = (until, None) if isinstance(until, int) else (self.epochs + _CYCLE_EPOCHS, until)
        with warnings.catch_warnings():  # a part starting at a later epoch: it will, in a later cycle
            warnings.filterwarnings("ignore", message=r".*so it never runs", category=UserWarning)
            self.run(data, epochs, live, callback=self.board.callback(clock), progress=False)

    def run(self, data, epochs: int, live, **run) -> Reconstruction:
        self.board.starting(data.n_patterns, epochs if "final_from_epoch" in live else None)
        rec = reconstruct_snapshot(data, epochs, live=live, client=self.client, checkpoint=self.output,
                                   resume=self.source, **run, **self.options)
        self.source, self.previous = self.output, rec
        self.used, self.epochs = len(rec.positions), rec.epochs
        self.board.snapshot(rec)
        if self.on_snapshot is not None:
            self.on_snapshot(rec)
        return rec


class _TimeSchedule:
    """Cycles set by the clock: each takes every frame committed when it starts and runs until
    ``seconds`` have passed (at least one epoch)."""

    epochs = 1  # (any epoch may end a cycle)

    def __init__(self, seconds: float):
        self.seconds = seconds

    def next(self, loop: "_Loop", first: int):
        """(frames to wait for, None: those committed; the cycle's end)."""
        return None, lambda store: _Clock(self.seconds, store)


class _FrameSchedule:
    """Cycles set by the frames: cycle k runs ``epochs`` epochs (up to epoch (k + 1) · epochs)
    on the first ``first + k · frames`` frames, waiting for them; the scan's end cuts the count.
    The cycle and its frames follow from the epoch a snapshot holds, so a resumed follower picks
    up where its checkpoint stands, mid-cycle too."""

    def __init__(self, frames: int, epochs: int):
        for name, value in (("snapshot_frames", frames), ("snapshot_epochs", epochs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.frames, self.epochs = frames, epochs

    def next(self, loop: "_Loop", first: int):
        k, into = divmod(loop.epochs, self.epochs)
        frames = loop.used if into else first + k * self.frames  # (mid-cycle: the cycle's frames)
        return frames, lambda store: (k + 1) * self.epochs


class _Clock:
    """A cycle's epoch callback: stop after the first epoch that ends ``seconds`` after the
    cycle began, or at once when the scan has ended (the final epochs take over)."""

    takes_epoch_state = True  # never fetches the state

    def __init__(self, seconds: float, store: LiveStore):
        self.seconds, self.store, self.start = seconds, store, time.monotonic()

    def __call__(self, epoch, state, metrics):
        if time.monotonic() - self.start >= self.seconds or self.store.status().ended:
            return False
        return None


class _CommitWatch:
    """When the committed count last grew; a scan with none for ``timeout`` seconds has stalled."""

    def __init__(self, store: LiveStore, timeout: float):
        self.store, self.timeout = store, timeout
        self.count, self.since = -1, time.monotonic()
        self.commits = {}  # frames committed -> the commit record's time when first seen
        self.update()

    def update(self):
        status = self.store.status()
        if status.frames_committed != self.count:
            self.count, self.since = status.frames_committed, time.monotonic()
            self.commits.setdefault(status.frames_committed, status.updated_unix)
        return status

    def commit_unix(self, frames: int) -> float | None:
        """When frame ``frames`` (counting from one) was committed: the time of the first count
        seen that holds it (None: not seen)."""
        return min((t for count, t in self.commits.items() if count >= frames), default=None)

    def stalled(self) -> bool:
        return time.monotonic() - self.since > self.timeout

    def wait_for(self, frames: int, poll: float, loop: _Loop):
        """Wait for ``frames`` committed frames (or the scan's end); ScanStopped when stalled."""
        while True:
            status = self.update()
            if status.ended or status.frames_committed >= frames:
                return status
            if self.stalled():
                raise ScanStopped(self.message(status, loop, waiting_for=frames))
            time.sleep(poll)

    def message(self, status, loop: _Loop, waiting_for: int | None = None) -> str:
        stopped = (f"the scan stopped at frame {status.frames_committed:,}"
                   f"{f' of {status.planned_frames:,}' if status.planned_frames else ''}: no new frame for "
                   f"{self.timeout:g} s and the scan was not ended ({status.writer})")
        if loop.previous is None or not loop.used:
            kept = (f"no snapshot was made (following starts at {waiting_for:,} frames)"
                    if waiting_for else "no snapshot was made")
        else:
            kept = (f"the snapshot of {loop.used:,} frames at epoch {loop.epochs} is kept in {loop.output} "
                    f"(go on with --resume {loop.output} --follow once the writer resumes)")
        return f"{stopped}; {kept}"


def _wait_for_store(path: str, timeout: float, poll: float) -> LiveStore | None:
    """The live store at ``path`` once its writer has created it (None: an ordinary store);
    ScanStopped when none appears within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(path, "zarr.json")):
        if time.monotonic() > deadline:
            raise ScanStopped(f"no data store appeared at {path} within {timeout:g} s; start the writer "
                              f"or check the path")
        time.sleep(poll)
    import zarr

    if LIVE_ATTR not in zarr.open_group(path, mode="r").attrs:
        return None
    while not os.path.exists(os.path.join(path, COMMIT_FILE)):  # (created with the store: a moment)
        time.sleep(poll)
    return LiveStore(path)


def _first_frames(path: str, n: int):
    """The first ``n`` committed frames of the live store at ``path`` (a snapshot's data)."""
    data = open_data(path, frames="committed")
    if data.n_patterns == n:
        return data
    return dataclasses.replace(data, intensities=data.intensities[:n], positions=data.positions[:n])


def _ended_unix(path: str) -> float | None:
    """The time of a live store's last commit (None: an ordinary store)."""
    import zarr

    if LIVE_ATTR not in zarr.open_group(path, mode="r").attrs:
        return None
    return LiveStore(path).status().updated_unix


def _min_frames(store: LiveStore, status, given: int | None) -> int:
    """Frames to wait for before the first cycle: ``given``, else two of the store's chunks, at
    most an eighth of the planned scan."""
    if given is not None:
        if int(given) < 1:
            raise ValueError(f"min_frames must be at least 1, got {given}")
        return int(given)
    import zarr

    chunk = int(zarr.open_group(store.path, mode="r").attrs[LIVE_ATTR].get("chunk_frames") or 1)
    planned = status.planned_frames
    return max(1, min(2 * chunk, planned // 8)) if planned else 2 * chunk


__all__ = ["SNAPSHOT_SECONDS", "TIMEOUT_SECONDS", "ScanStopped", "follow"]
