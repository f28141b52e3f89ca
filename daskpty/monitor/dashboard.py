"""A live reconstruction page on the dask dashboard: ``http://<scheduler>:8787/daskpty``.

Two halves:

* :class:`DashboardPlugin` lives on the scheduler. It keeps the latest metrics of a running
  reconstruction (per-epoch history, current round), small object phase/amplitude images and the
  probe modes, and serves them on the scheduler's HTTP server (the dashboard port):

  ``/daskpty``                 self-contained HTML page (no CDN, no internet needed), polling
  ``/daskpty/json``            the current state, machine readable (``?full=1``: whole history)
  ``/daskpty/image/<name>.png`` ``phase``, ``amplitude``, ``probe-<k>`` (8-bit grey PNG)
  ``/metrics``                 adds ``daskpty_epoch``, ``daskpty_loss``, ``daskpty_patterns_per_second``,
                               ``daskpty_seconds_per_epoch``, ``daskpty_round`` gauges (needs
                               ``prometheus_client`` on the scheduler, as dask's own /metrics does)

  and adds a "Daskpty" entry to the dashboard's top menu (best effort, see :func:`_link_menu`).

* :class:`DashboardPublisher` is the client half: a ``callback(epoch, state, metrics)`` for
  :func:`daskpty.reconstruct` that installs the plugin once, downsamples the object and probe on the
  client and sends a few KB per epoch to the scheduler; it also logs every epoch's metrics as a dask
  event on the ``"daskpty"`` topic (``client.get_events("daskpty")``).

Usage::

    publisher = DashboardPublisher(client, epochs=200)
    print(dashboard_link(client))                  # http://127.0.0.1:8787/daskpty
    rec = daskpty.reconstruct(data, epochs=200, client=client, callback=publisher)

On a remote scheduler the page can exist before any client connects::

    dask scheduler --preload daskpty.monitor.dashboard

(the module's :func:`dask_setup` adds the plugin; daskpty must be importable on the scheduler).
Alternatively list ``daskpty.monitor.dashboard`` in the ``distributed.scheduler.http.routes``
config: the routes are then part of the HTTP server from the start and show data once a
publisher has installed the plugin.
"""
from __future__ import annotations

import functools
import math
import os
import struct
import sys
import threading
import time
import uuid
import warnings
import weakref
import zlib
from collections import deque

import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.http.utils import RequestHandler

PLUGIN_NAME = "daskpty-dashboard"
HANDLER_OP = "daskpty_dashboard_update"
TOPIC = "daskpty"
ROUTE = "daskpty"
HISTORY_KEYS = ("epoch", "loss", "patterns_per_second", "seconds", "alpha_object", "alpha_probe",
                "position_rms_update")
MAX_PLOT_POINTS = 2000
_PAGE_PATH = os.path.join(os.path.dirname(__file__), "static", "dashboard.html")


@functools.lru_cache(maxsize=1)
def _round_task_prefixes() -> tuple[frozenset, str]:
    """Task prefixes of the engine's chunk tasks, and of the task that ends a round."""
    from dask.utils import funcname, key_split

    from ..execution.rounds import CHUNK_PREFIX, ROUND_PREFIX, run_chunk

    return frozenset({key_split(funcname(run_chunk) + "-0"), CHUNK_PREFIX}), ROUND_PREFIX


# --------------------------------------------------------------------------------------------
# Images (client side): block-mean downsampling and a minimal PNG encoder
# --------------------------------------------------------------------------------------------

def downsample(a, max_size: int) -> np.ndarray:
    """Block-mean of a 2-D (NumPy or CuPy) array so that both sides are ≤ ``max_size``.

    One integer factor for both axes (square pixels stay square); trailing rows/columns that do
    not fill a block are dropped. Works in slabs, so the temporary memory stays small even for a
    multi-GiB object; only the small result is copied to the host.
    """
    from ..physics import to_numpy

    H, W = a.shape
    f = max(1, -(-max(H, W) // int(max_size)))
    if f == 1:
        return to_numpy(a).copy()
    fy, fx = min(f, H), min(f, W)
    h, w = H // fy, W // fx
    rows = max(1, (1 << 22) // max(1, fy * W))      # output rows per slab (~4 M input elements)
    out = []
    for r in range(0, h, rows):
        r1 = min(h, r + rows)
        slab = a[r * fy:r1 * fy, :w * fx].reshape(r1 - r, fy, w, fx)
        out.append(to_numpy(slab.mean(axis=(1, 3))))
    return np.concatenate(out, axis=0)


def encode_png(gray: np.ndarray) -> bytes:
    """8-bit greyscale PNG of a (h, w) uint8 array (no dependencies beyond zlib)."""
    gray = np.ascontiguousarray(gray, dtype=np.uint8)
    h, w = gray.shape
    raw = np.zeros((h, w + 1), dtype=np.uint8)       # filter byte 0 (None) per row
    raw[:, 1:] = gray

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
            + chunk(b"IEND", b""))


def _to_uint8(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    if not hi > lo:
        hi = lo + 1.0
    y = (np.nan_to_num(x, nan=lo) - lo) * (255.0 / (hi - lo))
    return np.clip(y, 0, 255).astype(np.uint8)


def _robust_range(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0, 1.0
    lo, hi = np.percentile(x, [1.0, 99.0])
    return float(lo), float(hi)


def object_images(obj, illumination=None, size: int = 128) -> dict:
    """Downsampled phase and amplitude of the object as PNGs plus their display ranges.

    The complex object is block-averaged, its global phase (the phase of the sum over the
    illuminated region) removed, and each image scaled to its 1st–99th percentile over the
    illuminated region (``illumination > 10 % of max``; everything when unknown). A multislice
    object (K, H, W) is shown projected: the product of its slices (phase = sum of the slices'
    phases), masked by the entrance slice's illumination.
    """
    if np.ndim(obj) == 3:
        obj = np.prod(np.asarray(obj), axis=0)
        if illumination is not None and np.ndim(illumination) == 3:
            illumination = np.asarray(illumination)[0]
    small = downsample(obj, size).astype(np.complex64)
    mask = None
    if illumination is not None and tuple(illumination.shape) == tuple(obj.shape):
        ill = downsample(illumination, size).astype(np.float32)
        if ill.shape == small.shape and float(ill.max()) > 0:
            mask = ill > 0.1 * float(ill.max())
    if mask is None or not mask.any():
        mask = np.ones(small.shape, dtype=bool)
    ref = complex(small[mask].sum())
    if abs(ref) > 0:
        small = small * np.complex64(np.conj(ref) / abs(ref))
    phase = np.angle(small).astype(np.float32)
    amplitude = np.abs(small).astype(np.float32)
    phase_range = _robust_range(phase[mask])
    amplitude_range = _robust_range(amplitude[mask])
    return {
        "shape": [int(s) for s in obj.shape],
        "image_shape": [int(s) for s in small.shape],
        "phase_range": list(phase_range),
        "amplitude_range": list(amplitude_range),
        "phase_png": encode_png(_to_uint8(phase, *phase_range)),
        "amplitude_png": encode_png(_to_uint8(amplitude, *amplitude_range)),
    }


def probe_images(probe, size: int = 64) -> dict:
    """Per-mode amplitude PNGs (each scaled to its own maximum) and power fractions."""
    from ..physics import get_xp, to_numpy

    xp = get_xp(probe)
    if probe.ndim == 2:
        probe = probe[None]
    power = to_numpy(xp.sum(xp.abs(probe) ** 2, axis=(-2, -1))).astype(np.float64)
    total = float(power.sum())
    fractions = [float(p / total) if total > 0 else float("nan") for p in power]
    pngs = []
    for k in range(probe.shape[0]):
        amp = downsample(xp.abs(probe[k]), size).astype(np.float32)
        pngs.append(encode_png(_to_uint8(amp, 0.0, float(amp.max()) if amp.size else 1.0)))
    return {"modes": int(probe.shape[0]), "shape": [int(s) for s in probe.shape[-2:]],
            "power_fractions": fractions, "pngs": pngs}


def scan_map(nominal, values, size: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Per-pattern values (B,) or (B, K) as images over the scan, at most ``size`` pixels a side:
    each pixel takes the value of the nearest pattern, if one lies within the scan's typical
    spacing (the median distance between nearest neighbours). Returns ``(images, covered)``:
    images (h, w) or (K, h, w), covered (h, w)."""
    from scipy.spatial import cKDTree

    nominal = np.asarray(nominal, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    lo, hi = nominal.min(axis=0), nominal.max(axis=0)
    extent = np.maximum(hi - lo, 1e-9)
    scale = (size - 1) / extent.max()
    shape = tuple(int(v) for v in np.ceil(extent * scale) + 1)
    pixels = np.indices(shape).reshape(2, -1).T / scale + lo
    tree = cKDTree(nominal)
    spacing = float(np.median(tree.query(nominal, 2)[0][:, 1])) if len(nominal) > 1 else 0.0
    distance, nearest = tree.query(pixels)
    covered = (distance <= max(spacing, 0.5 / scale) + 1e-9).reshape(shape)
    picked = np.moveaxis(values[nearest], 0, -1).reshape(values.shape[1:] + shape)
    return np.where(covered, picked, 0.0), covered


def position_images(nominal, moved, size: int = 128) -> dict:
    """The distance each pattern moved from its nominal position, as a grey map over the scan
    (:func:`scan_map`; black = not moved or no pattern near)."""
    distance = np.hypot(*np.asarray(moved, dtype=np.float64).T)
    mean, _ = scan_map(nominal, distance, size)
    top = float(distance.max()) if distance.size else 0.0
    return {"png": encode_png(_to_uint8(mean, 0.0, top if top > 0 else 1.0)), "max_moved": top,
            "rms_moved": float(np.sqrt(np.mean(distance ** 2))) if distance.size else 0.0,
            "image_shape": list(mean.shape), "patterns": int(distance.size)}


def opr_images(eigen_probes, nominal, weights, size: int = 128, probe_size: int = 64) -> dict:
    """A varying probe (OPR): the eigen-probes' amplitudes (U_1 … U_{K−1}; U_0 is the probe's
    mode 0) and each weight w_k as a grey map over the scan, black to white over its own range
    across the patterns (pixels no pattern falls in: black)."""
    weights = np.asarray(weights, dtype=np.float64)
    eigen = probe_images(eigen_probes, probe_size) if eigen_probes is not None and len(eigen_probes) else None
    images, covered = scan_map(nominal, weights, size)          # (K, h, w): one lookup for all
    maps, ranges = [], []
    for image, column in zip(images, weights.T):
        lo, hi = float(column.min()), float(column.max())
        gray = _to_uint8(image, lo, hi if hi > lo else lo + 1.0)
        gray[~covered] = 0
        maps.append(encode_png(gray))
        ranges.append([lo, hi])
    return {"modes": int(weights.shape[1]), "eigen_pngs": [] if eigen is None else eigen["pngs"],
            "weight_pngs": maps, "weight_ranges": ranges, "image_shape": list(covered.shape),
            "patterns": int(len(weights))}


def _plain(v):
    """Metric value as a msgpack/JSON-friendly Python scalar (None when not representable)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if isinstance(v, str):
        return v
    return None


def _json_safe(v):
    """Replace non-finite floats (invalid in JSON) by None, recursively."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


# --------------------------------------------------------------------------------------------
# Scheduler side
# --------------------------------------------------------------------------------------------

_LATEST_PLUGIN: weakref.ref | None = None
_ROUTED: "weakref.WeakSet" = weakref.WeakSet()
_PROMETHEUS_LOCK = threading.Lock()
_PROMETHEUS_REGISTERED = False


class DashboardPlugin(SchedulerPlugin):
    """Scheduler plugin holding the live reconstruction state and serving ``/daskpty``.

    Updated through the scheduler handler ``daskpty_dashboard_update`` (see
    :class:`DashboardPublisher`); round progress is followed through ``update_graph``.
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
        self.rounds_since_epoch = 0
        self.rounds_total = 0
        self.round_group = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, scheduler) -> None:
        global _LATEST_PLUGIN
        self.scheduler = scheduler
        scheduler.handlers[HANDLER_OP] = self.handle_update
        install_routes(scheduler)
        _link_menu(scheduler)
        _LATEST_PLUGIN = weakref.ref(self)
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
        from dask.utils import key_split

        chunk_prefixes, round_prefix = _round_task_prefixes()
        prefix = key_split(key)
        first_copy = not isinstance(key, tuple) or key[-1] == 0  # one count per replicated round end
        if finish == "memory" and prefix == round_prefix and first_copy:
            self.rounds_since_epoch += 1
            self.rounds_total += 1
        elif finish == "processing" and (prefix in chunk_prefixes or prefix == round_prefix):
            # chunk tasks; or an epoch graph's fused round tasks (they run the chunk steps)
            from distributed.utils import key_split_group

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
            "images": sorted(self.images),
            "finished": finished,
            "updated": self.updated,
            "age": None if self.updated is None else time.time() - self.updated,
        }




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
                 "history": {k: [] for k in HISTORY_KEYS}, "object": None, "probe": None, "images": []}
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
        import json

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
    import dask.config

    app = getattr(scheduler, "http_application", None)
    if app is None or scheduler in _ROUTED:
        return False
    _ROUTED.add(scheduler)
    if __name__ in (dask.config.get("distributed.scheduler.http.routes", None) or []):
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
        from prometheus_client.core import GaugeMetricFamily

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
        import prometheus_client
    except ImportError:
        return False
    with _PROMETHEUS_LOCK:
        if not _PROMETHEUS_REGISTERED:
            prometheus_client.REGISTRY.register(_PrometheusCollector())
            _PROMETHEUS_REGISTERED = True
    return True


def dask_setup(scheduler) -> None:
    """Preload hook: ``dask scheduler --preload daskpty.monitor.dashboard``."""
    from distributed import Scheduler

    if not isinstance(scheduler, Scheduler):
        warnings.warn("daskpty.monitor.dashboard is a scheduler preload; ignored on "
                      f"{type(scheduler).__name__}", stacklevel=2)
        return
    scheduler.add_plugin(DashboardPlugin(), name=PLUGIN_NAME, idempotent=True)


# --------------------------------------------------------------------------------------------
# Client side
# --------------------------------------------------------------------------------------------

def _resolve_client(client):
    if client is not None:
        return client
    from ..execution.cluster import current_client

    return current_client()


def install(client=None) -> bool:
    """Register :class:`DashboardPlugin` on the client's scheduler (no-op when already there)."""
    client = _resolve_client(client)
    if client is None:
        raise ValueError("no dask client: pass one or create one first")
    client.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)
    return True


def dashboard_link(client=None) -> str | None:
    """URL of the daskpty page on the client's scheduler dashboard (None without a dashboard)."""
    client = _resolve_client(client)
    if client is None:
        return None
    try:
        link = client.dashboard_link
    except Exception:
        return None
    if not link:
        return None
    link = link.rstrip("/")
    link = link[: -len("/status")] if link.endswith("/status") else link
    link = _loopback_host(client, link)
    return link + "/" + ROUTE


def _loopback_host(client, link: str) -> str:
    """Use the dashboard's bound host when it listens on loopback only.

    ``client.dashboard_link`` takes its host from the scheduler's comm address, which for an
    in-process cluster (``inproc://<machine ip>/...``) is not where a dashboard bound to
    127.0.0.1 listens.
    """
    from urllib.parse import urlsplit, urlunsplit

    try:
        host, port = client.run_on_scheduler(_http_address)
    except Exception:
        return link
    parts = urlsplit(link)
    loopback = ("127.0.0.1", "localhost", "::1")
    if host in loopback and parts.hostname not in loopback and parts.port == port:
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return urlunsplit(parts._replace(netloc=netloc))
    return link


def _http_address(dask_scheduler=None):
    server = getattr(dask_scheduler, "http_server", None)
    return getattr(server, "address", None), getattr(server, "port", None)


def fetch_state(client=None) -> dict:
    """The ``/daskpty/json`` document, fetched through the scheduler comm instead of HTTP."""
    client = _resolve_client(client)
    return client.run_on_scheduler(_state_on_scheduler)


def _state_on_scheduler(dask_scheduler=None):
    return state_of(dask_scheduler)


def _fetched(state):
    """The state itself, from the driver's EpochState handle (fetched from the workers) or as given."""
    from ..execution.driver import EpochState

    return state.get() if isinstance(state, EpochState) else state


class DashboardPublisher:
    """``callback(epoch, state, metrics)`` that shows a running reconstruction on the dashboard.

    Parameters
    ----------
    client : distributed.Client (default: the current client at the first call).
    epochs, rounds_per_epoch, n_patterns : optional run facts shown on the page ("epoch 12 / 200").
    image_size : the object images' longest side in pixels (block-mean downsampled on the client).
    probe_size : the probe images' longest side.
    image_interval : send new images at most every this many seconds (metrics go every epoch;
        the last epoch, ``epochs`` if given, always sends images; :meth:`flush` sends pending ones).
    events : also log each epoch's metrics as a dask event on ``topic``.

    Never raises into the reconstruction: failures are reported once as a warning.
    """

    def __init__(self, client=None, *, epochs: int | None = None, rounds_per_epoch: int | None = None,
                 n_patterns: int | None = None, image_size: int = 128, probe_size: int = 64,
                 image_interval: float = 1.0, events: bool = True, topic: str = TOPIC, layout=None):
        self.client = client
        self.layout = layout  # a PatternLayout: draws refined positions when the state has them
        self.epochs = epochs
        self.rounds_per_epoch = rounds_per_epoch
        self.n_patterns = n_patterns
        self.image_size = int(image_size)
        self.probe_size = int(probe_size)
        self.image_interval = float(image_interval)
        self.events = events
        self.topic = topic
        self.run_id = uuid.uuid4().hex[:12]
        self._installed: bool | None = None
        self._last_image = -math.inf
        self._pending = None
        self._warned = False
        self.sent_bytes = 0

    @property
    def link(self) -> str | None:
        """URL of the page; installs the plugin first, so the page exists (and counts rounds
        from the first one on) before the first epoch ends."""
        self.install()
        return dashboard_link(self.client)

    def install(self) -> bool:
        """Install the scheduler plugin once (idempotent); False when that is not possible."""
        if self._installed is None:
            self.client = _resolve_client(self.client)
            if self.client is None:
                raise ValueError("DashboardPublisher needs a dask client")
            try:
                install(self.client)
                self._installed = True
                # announce the run: the page resets now and counts rounds from the first one
                self.client.sync(self.client.scheduler.daskpty_dashboard_update, message=self._hello())
            except Exception as exc:
                self._installed = False
                self._warn(f"could not install the daskpty dashboard plugin on the scheduler "
                           f"(is daskpty importable there?): {exc!r}; publishing events only")
        return self._installed

    def _hello(self) -> dict:
        return {"run_id": self.run_id, "epochs": self.epochs, "rounds_per_epoch": self.rounds_per_epoch,
                "n_patterns": self.n_patterns, "time": time.time()}

    def _warn(self, text):
        if not self._warned:
            self._warned = True
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    def message(self, epoch, state, metrics, images: bool) -> dict:
        """The update sent to the scheduler (plain Python types and bytes only)."""
        clean = {str(k): _plain(v) for k, v in (metrics or {}).items()}
        clean = {k: v for k, v in clean.items() if v is not None}
        clean.setdefault("epoch", int(epoch))
        msg = dict(self._hello(), epoch=int(epoch), metrics=clean)
        if images and state is not None:
            msg["object"] = object_images(state.object, getattr(state, "illumination", None), self.image_size)
            msg["probe"] = probe_images(state.probe, self.probe_size)
            moved = None if self.layout is None else self.layout.displacements(state)
            if moved is not None:
                msg["positions"] = position_images(*moved, size=self.image_size)
            weights = None if self.layout is None else self.layout.probe_weights(state)
            if weights is not None:
                msg["opr"] = opr_images(getattr(state, "eigen_probes", None), *weights, size=self.image_size,
                                        probe_size=self.probe_size)
        return msg

    def _send(self, msg):
        if self.install():
            client = self.client
            client.sync(client.scheduler.daskpty_dashboard_update, message=msg)
            obj, probe = msg.get("object") or {}, msg.get("probe") or {}
            opr = msg.get("opr") or {}
            self.sent_bytes += (len(obj.get("phase_png", b"")) + len(obj.get("amplitude_png", b""))
                                + sum(len(p) for p in probe.get("pngs", ()))
                                + len((msg.get("positions") or {}).get("png", b""))
                                + sum(len(p) for p in [*opr.get("eigen_pngs", ()), *opr.get("weight_pngs", ())]))

    takes_epoch_state = True  # fetches the state only for the epochs it draws

    def __call__(self, epoch, state, metrics):
        try:
            now = time.monotonic()
            last = self.epochs is not None and int(epoch) >= int(self.epochs)
            images = last or now - self._last_image >= self.image_interval
            msg = self.message(epoch, _fetched(state) if images else None, metrics, images)
            if images:
                self._last_image = now
                self._pending = None
            else:
                self._pending = (epoch, state)
            self._send(msg)
            if self.events:
                self.client.log_event(self.topic, {"run_id": self.run_id, **msg["metrics"]})
        except Exception as exc:
            self._warn(f"daskpty dashboard update failed: {exc!r}")
        return None

    def flush(self):
        """Send the images of the last epoch if the rate limit held them back."""
        if self._pending is None:
            return
        epoch, state = self._pending
        self._pending = None
        try:
            msg = self.message(epoch, _fetched(state), None, True)
            del msg["metrics"]
            self._send(msg)
            self._last_image = time.monotonic()
        except Exception as exc:
            self._warn(f"daskpty dashboard update failed: {exc!r}")
