"""The dashboard of a followed scan (:func:`daskpty.workflows.follow` with ``dashboard=True``).

:class:`LiveBoard` keeps one :class:`~daskpty.monitor.dashboard.DashboardPublisher` for the
whole follow (its cycles are one run on the page: the loss history goes on across snapshots)
and sends the scheduler's :class:`~daskpty.monitor.dashboard_plugin.DashboardPlugin` what a
person at the instrument looks for:

- the newest snapshot's object phase (the image ``live-phase``),
- frames committed (the store's commit record) against frames used (the newest snapshot),
- the lag: from the commit of the newest frame a snapshot used to the time the snapshot was in
  the result store (as ``benchmarks/bench_live.py`` measures it),
- the scan's state: ``waiting`` (for the first frames), ``live``, ``ended``, ``stopped``.

The page's "Live scan" panel shows them; ``/daskpty/json`` has them under ``live``.
"""
from __future__ import annotations

import threading
import time

from .dashboard import DashboardPublisher
from .dashboard_images import object_images

#: seconds between reads of the scan's commit record (a thread beside the follow)
STATUS_INTERVAL = 0.5
#: snapshots kept in the page's table of frames and lag
HISTORY = 500


class LiveBoard:
    """The follow loop's hooks for the dashboard; never raises into the follow (a failure is
    one warning)."""

    def __init__(self, client, previous=None, image_size: int = 256):
        self.publisher = DashboardPublisher(client, image_interval=1.0)
        self.image_size = int(image_size)
        self.lock = threading.RLock()  # (the reading thread and the follow both update the page)
        self.done = threading.Event()
        self.reader = None
        self.images = 0
        self.live = {"scan": "waiting", "frames_committed": None, "planned_frames": None, "frames_used": None,
                     "snapshots": 0, "snapshot_unix": None, "snapshot_epoch": None,
                     "newest_frame_commit_unix": None, "lag_seconds": None, "last_commit_unix": None,
                     "writer": "", "message": "", "final_epochs": None, "image_version": None,
                     "history": {"snapshot_unix": [], "frames_used": [], "frames_committed": [],
                                 "lag_seconds": []}}
        prior = (previous.live or {}) if previous is not None else {}
        if prior.get("frames_used"):
            self.live.update(frames_used=int(prior["frames_used"]), snapshot_unix=prior.get("snapshot_unix"),
                             snapshot_epoch=previous.epochs)

    @property
    def link(self) -> str | None:
        """The page's address (installs the scheduler plugin first)."""
        return self.publisher.link

    # -------------------------------------------------------------- the follow loop's hooks

    def watching(self, store) -> None:
        """Follow the live store's commit record: a thread reads it every
        :data:`STATUS_INTERVAL` seconds (an epoch may take longer) until :meth:`close`."""
        if self.reader is None:
            self.store = store
            self.reader = threading.Thread(target=self._read, name="daskpty-live-board", daemon=True)
            self.reader.start()

    def _read(self) -> None:
        while True:
            self._read_once()
            if self.done.wait(STATUS_INTERVAL):
                return

    def _read_once(self) -> None:
        try:
            self.status(self.store.status())
        except Exception as exc:
            self._warn(f"daskpty dashboard: reading the scan's commit record failed: {exc!r}")

    def close(self) -> None:
        """Stop reading the commit record (the follow has ended); the page keeps the last one."""
        self.done.set()
        if self.reader is not None:
            self.reader.join(timeout=5)
            self.reader = None
            self._read_once()

    def status(self, status) -> None:
        """The store's commit record (a :class:`~daskpty.io.live.LiveStatus`)."""
        with self.lock:
            live = self.live
            if status.frames_committed != live["frames_committed"] or live["last_commit_unix"] is None:
                live["last_commit_unix"] = status.updated_unix
            live.update(frames_committed=status.frames_committed, planned_frames=status.planned_frames,
                        writer=status.writer)
            if live["scan"] != "stopped":
                live["scan"] = "ended" if status.ended else ("live" if live["frames_used"] else "waiting")
            self._send()

    def starting(self, frames: int, epochs: int | None) -> None:
        """A cycle on ``frames`` frames begins; ``epochs``: the run's last epoch (final epochs)."""
        self.publisher.n_patterns = int(frames)
        self.publisher.epochs = epochs
        if epochs is not None:
            with self.lock:
                self.live["final_epochs"] = int(epochs)

    def snapshot(self, rec) -> None:
        """A snapshot is in the result store: its phase, frames and lag go to the page."""
        image = None
        try:
            image = object_images(rec.object, rec.illumination, self.image_size)
        except Exception as exc:
            self._warn(f"daskpty dashboard: the snapshot's image failed: {exc!r}")
        with self.lock:
            self._snapshot(rec, image)

    def _snapshot(self, rec, image) -> None:
        info = rec.live or {}
        live = self.live
        used, at = int(info.get("frames_used", len(rec.positions))), time.time()  # (in the store by now)
        commit = info.get("newest_frame_commit_unix")
        lag = at - commit if at is not None and commit is not None else None
        live.update(frames_used=used, snapshot_unix=at, snapshot_epoch=int(rec.epochs), lag_seconds=lag,
                    newest_frame_commit_unix=commit, snapshots=live["snapshots"] + 1)
        if live["scan"] == "waiting":
            live["scan"] = "live"
        history = live["history"]
        for key, value in (("snapshot_unix", at), ("frames_used", used),
                           ("frames_committed", live["frames_committed"]), ("lag_seconds", lag)):
            history[key] = (history[key] + [value])[-HISTORY:]
        if image is not None:
            self.images += 1
            live.update(image_version=self.images, image_shape=image["image_shape"],
                        phase_range=image["phase_range"], object_shape=image["shape"])
        self._send(None if image is None else image["phase_png"])

    def stopped(self, message: str) -> None:
        """The scan stopped without its end: the follow ends with ``message``."""
        with self.lock:
            self.live.update(scan="stopped", message=message)
            self._send()

    def callback(self, clock):
        """A cycle's epoch callback: the publisher's epoch update, then ``clock`` (which may
        end the cycle; None: the cycle's epoch count does)."""
        publisher = self.publisher

        class _Epoch:
            takes_epoch_state = True

            def __call__(self, epoch, state, metrics):
                publisher(epoch, state, metrics)
                return None if clock is None else clock(epoch, state, metrics)

        return _Epoch()

    # -------------------------------------------------------------- sending

    def _send(self, png: bytes | None = None) -> None:
        publisher = self.publisher
        try:
            if not publisher.install():
                return
            message = {"run_id": publisher.run_id, "live": dict(self.live, updated_unix=time.time())}
            if png is not None:
                message["live_png"] = png
            client = publisher.client
            client.sync(client.scheduler.daskpty_dashboard_update, message=message)
        except Exception as exc:
            self._warn(f"daskpty dashboard update failed: {exc!r}")

    def _warn(self, text: str) -> None:
        self.publisher._warn(text)


__all__ = ["LiveBoard"]
