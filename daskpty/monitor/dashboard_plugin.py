"""The dashboard's state on the scheduler: :class:`DashboardPlugin` keeps the latest metrics of a
running reconstruction (per-epoch history, the current round's progress), the images the
publisher sent, and answers :func:`~daskpty.monitor.dashboard_http.state_of` with a snapshot.
"""
from __future__ import annotations

import functools
import time
from collections import deque

import numpy as np
from dask.utils import funcname, key_split
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils import key_split_group

from ..execution.rounds import CHUNK_PREFIX, ROUND_PREFIX, run_chunk
from .dashboard_http import HISTORY_KEYS, PLUGIN_NAME, _link_menu, _register_prometheus, install_routes, note_latest

HANDLER_OP = "daskpty_dashboard_update"
MAX_PLOT_POINTS = 2000


@functools.lru_cache(maxsize=1)
def _round_task_prefixes() -> tuple[frozenset, str]:
    """Task prefixes of the engine's chunk tasks, and of the task that ends a round."""
    return frozenset({key_split(funcname(run_chunk) + "-0"), CHUNK_PREFIX}), ROUND_PREFIX


class DashboardPlugin(SchedulerPlugin):
    """Scheduler plugin holding the live reconstruction state and serving ``/daskpty``.

    Updated through the scheduler handler ``daskpty_dashboard_update`` (see
    :class:`~daskpty.monitor.dashboard.DashboardPublisher`, and for a followed scan
    :class:`~daskpty.monitor.live_board.LiveBoard`: a ``live`` document and the ``live-phase``
    image); round progress is followed through ``update_graph``.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, history_length: int = 100_000):
        self.history_length = int(history_length)
        self.scheduler = None
        self._image_counter = 0
        self._reset(None)

    def _reset(self, run_id):
        self.run_id = run_id
        self.epochs = None
        self.rounds_per_epoch = None
        self.n_patterns = None
        self.epoch = None
        self.latest: dict = {}
        self.history = {k: deque(maxlen=self.history_length) for k in HISTORY_KEYS}
        self.updated = None
        self.object_meta = None
        self.probe_meta = None
        self.positions_meta = None
        self.opr_meta = None
        self.images: dict[str, bytes] = {}
        self.live = None  # a followed scan (daskpty.monitor.live_board): frames, lag, its state
        self.rounds_since_epoch = 0
        self.rounds_total = 0
        self.round_group = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers[HANDLER_OP] = self.handle_update
        install_routes(scheduler)
        _link_menu(scheduler)
        note_latest(self)
        _register_prometheus()

    async def close(self) -> None:
        sched = self.scheduler
        if sched is not None and getattr(sched.handlers.get(HANDLER_OP), "__self__", None) is self:
            del sched.handlers[HANDLER_OP]

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        """Count finished rounds (their end task reaches memory) and follow the running round's
        chunk tasks (for the round progress bar)."""
        if finish not in ("processing", "memory"):
            return
        chunk_prefixes, round_prefix = _round_task_prefixes()
        prefix = key_split(key)
        first_copy = not isinstance(key, tuple) or key[-1] == 0  # one count per replicated round end
        if finish == "memory" and prefix == round_prefix and first_copy:
            self.rounds_since_epoch += 1
            self.rounds_total += 1
        elif finish == "processing" and (prefix in chunk_prefixes or prefix == round_prefix):
            # chunk tasks; or an epoch graph's fused round tasks (they run the chunk steps)
            self.round_group = key_split_group(key)

    # -- updates from the client ------------------------------------------------------------
    def handle_update(self, message=None) -> str:
        msg = message or {}
        run_id = msg.get("run_id")
        epoch = msg.get("epoch")
        if run_id != self.run_id or (epoch is not None and self.epoch is not None and epoch <= self.epoch
                                     and msg.get("metrics")):
            self._reset(run_id)
        for k in ("epochs", "rounds_per_epoch", "n_patterns"):
            if msg.get(k) is not None:
                setattr(self, k, msg[k])
        metrics = msg.get("metrics")
        if metrics:
            self.epoch = epoch
            self.latest = dict(metrics)
            for k in HISTORY_KEYS:
                self.history[k].append(metrics.get(k))
            self.rounds_since_epoch = 0
            self.round_group = None
        obj = msg.get("object")
        if obj:
            self._image_counter += 1
            self.images["phase"] = obj.pop("phase_png")
            self.images["amplitude"] = obj.pop("amplitude_png")
            self.object_meta = dict(obj, epoch=epoch, version=self._image_counter)
        probe = msg.get("probe")
        if probe:
            self._image_counter += 1
            pngs = probe.pop("pngs")
            for name in [n for n in self.images if n.startswith("probe-")]:
                del self.images[name]
            for k, png in enumerate(pngs):
                self.images[f"probe-{k}"] = png
            self.probe_meta = dict(probe, epoch=epoch, version=self._image_counter)
        positions = msg.get("positions")
        if positions:
            self._image_counter += 1
            self.images["positions"] = positions.pop("png")
            self.positions_meta = dict(positions, epoch=epoch, version=self._image_counter)
        opr = msg.get("opr")
        if opr:
            self._image_counter += 1
            for name in [n for n in self.images if n.startswith(("eigen-", "weights-"))]:
                del self.images[name]
            for k, png in enumerate(opr.pop("eigen_pngs")):
                self.images[f"eigen-{k + 1}"] = png
            for k, png in enumerate(opr.pop("weight_pngs")):
                self.images[f"weights-{k}"] = png
            self.opr_meta = dict(opr, epoch=epoch, version=self._image_counter)
        live = msg.get("live")
        if live:
            if msg.get("live_png"):
                self.images["live-phase"] = msg["live_png"]
            self.live = dict(live)
        self.updated = time.time()
        return "OK"

    # -- views ------------------------------------------------------------------------------
    def _round_progress(self):
        sched = self.scheduler
        if sched is None or self.round_group is None:
            return None
        tg = sched.task_groups.get(self.round_group)
        if tg is None:
            return None
        states = tg.states
        total = sum(states.values())
        done = sum(states.get(s, 0) for s in ("memory", "released", "forgotten", "erred"))
        return {"done": int(done), "total": int(total)}

    def history_columns(self, max_points: int | None = MAX_PLOT_POINTS) -> dict:
        n = len(self.history["epoch"])
        cols = {k: list(v) for k, v in self.history.items()}
        if max_points and n > max_points:
            idx = np.unique(np.linspace(0, n - 1, max_points).round().astype(int))
            cols = {k: [v[i] for i in idx] for k, v in cols.items()}
        return cols

    def snapshot(self, full_history: bool = False) -> dict:
        latest = self.latest
        finished = bool(self.epochs and self.epoch is not None and self.epoch >= self.epochs)
        return {
            "plugin_installed": True,
            "run_id": self.run_id,
            "epoch": self.epoch,
            "epochs": self.epochs,
            "round": self.rounds_since_epoch if self.run_id is not None else None,
            "rounds_per_epoch": self.rounds_per_epoch,
            "rounds_total": self.rounds_total,
            "round_progress": self._round_progress(),
            "n_patterns": self.n_patterns,
            "loss": latest.get("loss"),
            "patterns_per_second": latest.get("patterns_per_second"),
            "seconds": latest.get("seconds"),
            "alpha_object": latest.get("alpha_object"),
            "alpha_probe": latest.get("alpha_probe"),
            "latest": latest,
            "history": self.history_columns(None if full_history else MAX_PLOT_POINTS),
            "object": self.object_meta,
            "probe": self.probe_meta,
            "positions": self.positions_meta,
            "opr": self.opr_meta,
            "live": self.live,
            "images": sorted(self.images),
            "finished": finished,
            "updated": self.updated,
            "age": None if self.updated is None else time.time() - self.updated,
        }
