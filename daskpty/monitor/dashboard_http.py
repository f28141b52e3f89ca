"""The dashboard's HTTP side on the scheduler: the ``/daskpty`` routes (page, JSON state, PNGs),
the document they serve (:func:`state_of`, read off :class:`~daskpty.monitor.dashboard_plugin.DashboardPlugin`
and the scheduler's worker table), the dashboard menu link and the Prometheus gauges.

Routes and gauges find the plugin by name on the scheduler (``scheduler.plugins``), so this module
does not import the plugin's module (which installs them when it starts).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import weakref

import dask.config
from distributed.http.utils import RequestHandler

PLUGIN_NAME = "daskpty-dashboard"
ROUTE = "daskpty"
#: The module users name in ``distributed.scheduler.http.routes`` (it re-exports :data:`routes`).
ROUTES_MODULE = "daskpty.monitor.dashboard"
HISTORY_KEYS = ("epoch", "loss", "patterns_per_second", "seconds", "alpha_object", "alpha_probe",
                "position_rms_update")
_PAGE_PATH = os.path.join(os.path.dirname(__file__), "static", "dashboard.html")

_LATEST_PLUGIN: weakref.ref | None = None
_ROUTED: "weakref.WeakSet" = weakref.WeakSet()
_PROMETHEUS_LOCK = threading.Lock()
_PROMETHEUS_REGISTERED = False


def note_latest(plugin) -> None:
    """The plugin whose metrics the Prometheus gauges of this process report."""
    global _LATEST_PLUGIN
    _LATEST_PLUGIN = weakref.ref(plugin)


def _json_safe(v):
    """Replace non-finite floats (invalid in JSON) by None, recursively."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v



def workers_view(scheduler) -> list[dict]:
    """Per-worker memory as the scheduler sees it (from the workers' heartbeats)."""
    out = []
    for ws in list(scheduler.workers.values()):
        mem = ws.memory
        out.append({
            "address": ws.address,
            "name": ws.name if isinstance(ws.name, (str, int)) else str(ws.name),
            "nthreads": ws.nthreads,
            "memory_process": mem.process,
            "memory_managed": mem.managed,
            "memory_spilled": mem.spilled,
            "memory_unmanaged": mem.unmanaged,
            "memory_limit": ws.memory_limit or None,
        })
    return sorted(out, key=lambda w: str(w["name"]))


def _plugin_of(scheduler):
    plugins = getattr(scheduler, "plugins", None) or {}
    return plugins.get(PLUGIN_NAME)


def state_of(scheduler, full_history: bool = False) -> dict:
    """The ``/daskpty/json`` document for ``scheduler`` (also usable via ``run_on_scheduler``)."""
    plugin = _plugin_of(scheduler)
    if plugin is None:
        state = {"plugin_installed": False, "run_id": None, "epoch": None, "loss": None,
                 "history": {k: [] for k in HISTORY_KEYS}, "object": None, "probe": None, "live": None,
                 "images": []}
    else:
        state = plugin.snapshot(full_history=full_history)
    state["workers"] = workers_view(scheduler)
    state["time"] = time.time()
    return _json_safe(state)


class _Base(RequestHandler):
    def set_default_headers(self):
        self.set_header("Cache-Control", "no-cache, no-store, must-revalidate")


class PageHandler(_Base):
    _page: bytes | None = None

    def get(self):
        if PageHandler._page is None:
            with open(_PAGE_PATH, "rb") as f:
                PageHandler._page = f.read()
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(PageHandler._page)


class JSONHandler(_Base):
    def get(self):
        full = self.get_argument("full", "0") not in ("0", "", "false")
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(state_of(self.server, full_history=full), allow_nan=False))


class ImageHandler(_Base):
    def get(self, name):
        plugin = _plugin_of(self.server)
        png = None if plugin is None else plugin.images.get(name)
        if png is None:
            self.set_status(404)
            self.write(f"no image {name!r}")
            return
        self.set_header("Content-Type", "image/png")
        self.write(png)


#: Route list in the format of ``distributed.scheduler.http.routes`` modules.
routes: list[tuple] = [
    (r"daskpty/?", PageHandler, {}),
    (r"daskpty/json", JSONHandler, {}),
    (r"daskpty/image/([A-Za-z0-9_.-]+)\.png", ImageHandler, {}),
]


def _http_prefix(scheduler) -> str:
    """The dashboard's URL prefix ("" or "/prefix"), read off the Bokeh application."""
    app = getattr(scheduler, "http_application", None)
    for sub in getattr(app, "applications", ()):
        prefix = getattr(sub, "_prefix", None)
        if isinstance(prefix, str):
            return prefix.rstrip("/")
    return ""


def install_routes(scheduler) -> bool:
    """Add the ``/daskpty`` routes to a running scheduler's HTTP server (idempotent)."""
    app = getattr(scheduler, "http_application", None)
    if app is None or scheduler in _ROUTED:
        return False
    _ROUTED.add(scheduler)
    if {ROUTES_MODULE, __name__} & set(dask.config.get("distributed.scheduler.http.routes", None) or []):
        return False                                     # already there from the config
    prefix = _http_prefix(scheduler)
    app.add_handlers(r".*$", [(f"{prefix}/{url}", cls, {**kw, "dask_server": scheduler})
                              for url, cls, kw in routes])
    return True


def _link_menu(scheduler) -> bool:
    """Add "daskpty" to the dashboard's top menu.

    distributed has no public API for this: the Bokeh pages render their menu from the
    ``pages`` list of ``distributed.dashboard.scheduler.template_variables(scheduler)`` (a
    memoised dict shared with the running Bokeh application), so appending to that list links
    every page rendered from then on. Best effort: on any surprise nothing is changed.
    """
    mod = sys.modules.get("distributed.dashboard.scheduler")
    if mod is None or getattr(scheduler, "http_application", None) is None:
        return False
    try:
        pages = mod.template_variables(scheduler).get("pages")
        if isinstance(pages, list):
            if ROUTE not in pages:
                pages.append(ROUTE)
            return True
    except Exception:  # pragma: no cover - internals changed
        pass
    return False


class _PrometheusCollector:
    """Gauges of the most recently started plugin in this process."""

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily  # optional: only with prometheus_client

        plugin = _LATEST_PLUGIN() if _LATEST_PLUGIN is not None else None
        latest = getattr(plugin, "latest", {}) or {}

        def value(v):
            return float(v) if isinstance(v, (int, float)) else float("nan")

        epoch = getattr(plugin, "epoch", None)
        yield GaugeMetricFamily("daskpty_epoch", "Last completed daskpty reconstruction epoch",
                                value=value(epoch if epoch is not None else 0))
        yield GaugeMetricFamily("daskpty_loss", "Data loss per pattern of the last completed epoch",
                                value=value(latest.get("loss")))
        yield GaugeMetricFamily("daskpty_patterns_per_second", "Patterns processed per second in the last epoch",
                                value=value(latest.get("patterns_per_second")))
        yield GaugeMetricFamily("daskpty_seconds_per_epoch", "Wall time of the last epoch in seconds",
                                value=value(latest.get("seconds")))
        yield GaugeMetricFamily("daskpty_round", "Rounds started in the current epoch",
                                value=value(getattr(plugin, "rounds_since_epoch", 0)))


def _register_prometheus() -> bool:
    global _PROMETHEUS_REGISTERED
    try:
        import prometheus_client  # optional dependency (as for dask's own /metrics)
    except ImportError:
        return False
    with _PROMETHEUS_LOCK:
        if not _PROMETHEUS_REGISTERED:
            prometheus_client.REGISTRY.register(_PrometheusCollector())
            _PROMETHEUS_REGISTERED = True
    return True
