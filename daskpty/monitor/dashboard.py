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

The parts: :mod:`~daskpty.monitor.dashboard_images` (the pictures, made on the client),
:mod:`~daskpty.monitor.dashboard_plugin` (the state the scheduler keeps),
:mod:`~daskpty.monitor.dashboard_http` (routes, the JSON document, menu link, Prometheus gauges);
this module is the client half and the scheduler's preload / routes entry point.
"""
from __future__ import annotations

import math
import time
import uuid
import warnings
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from distributed import Scheduler

from ..execution.cluster import current_client
from ..execution.driver import EpochState
from .dashboard_http import (  # noqa: F401  (re-exported: the routes module of dask's config)
    HISTORY_KEYS,
    PLUGIN_NAME,
    ROUTE,
    ImageHandler,
    JSONHandler,
    PageHandler,
    install_routes,
    routes,
    state_of,
    workers_view,
)
from .dashboard_images import (  # noqa: F401  (re-exported)
    downsample,
    encode_png,
    object_images,
    opr_images,
    position_images,
    probe_images,
    scan_map,
)
from .dashboard_plugin import HANDLER_OP, MAX_PLOT_POINTS, DashboardPlugin  # noqa: F401  (re-exported)

TOPIC = "daskpty"

__all__ = ["DashboardPlugin", "DashboardPublisher", "dashboard_link", "dask_setup", "downsample", "encode_png",
           "fetch_state", "install", "install_routes", "object_images", "opr_images", "position_images",
           "probe_images", "routes", "scan_map", "state_of", "workers_view"]


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



def dask_setup(scheduler) -> None:
    """Preload hook: ``dask scheduler --preload daskpty.monitor.dashboard``."""
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
