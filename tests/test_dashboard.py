"""The live dashboard page: a real reconstruction on a LocalCluster, read back over HTTP."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
import zlib

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.monitor import dashboard
from daskpty.monitor.dashboard import DashboardPublisher, dashboard_link

from synthetic import make_dataset

EPOCHS = 6
MID = 3          # the run pauses after this epoch until the test has looked at the page
ROUNDS = 2


def _get(url, timeout=20):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def _json(url):
    status, ctype, body = _get(url)
    assert status == 200 and ctype.startswith("application/json")

    def no_constants(name):  # strict JSON: browsers reject NaN / Infinity
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(body, parse_constant=no_constants)


def _base(client):
    """http://127.0.0.1:<port> of the scheduler's HTTP server (where the dashboard listens)."""
    host, port = client.run_on_scheduler(dashboard._http_address)
    return f"http://{host}:{port}"


@pytest.fixture(scope="module")
def cluster_client():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def run(cluster_client):
    """Run a small reconstruction in a thread with the publisher; look at the page mid-run."""
    client = cluster_client
    ds = make_dataset(grid=8)
    publisher = DashboardPublisher(client, epochs=EPOCHS, rounds_per_epoch=ROUNDS)
    link = publisher.link                       # installs the plugin before the run starts
    paused, resume = threading.Event(), threading.Event()
    recorded, errors, result = [], [], {}

    def callback(epoch, state, metrics):
        assert publisher(epoch, state, metrics) is None
        recorded.append(dict(metrics))
        if epoch == MID:
            paused.set()
            resume.wait(30)

    def target():
        try:
            result["rec"] = daskpty.reconstruct(ds, epochs=EPOCHS, rounds_per_epoch=ROUNDS,
                                                object=np.ones_like(ds.truth.object),
                                                client=client, callback=callback)
        except BaseException as exc:  # pragma: no cover - reported by the test below
            errors.append(exc)
            paused.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert paused.wait(60), "reconstruction did not reach the pause"
    mid = {"json": _json(link + "/json"), "page": _get(link)}
    resume.set()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return {"client": client, "link": link, "mid": mid, "recorded": recorded,
            "rec": result["rec"], "publisher": publisher, "final": _json(link + "/json")}


def test_link_points_at_the_scheduler_http_server(run):
    assert run["link"] == _base(run["client"]) + "/daskpty"
    assert dashboard_link(run["client"]) == run["link"]


def test_json_while_running(run):
    mid = run["mid"]["json"]
    assert mid["plugin_installed"] is True
    assert mid["epoch"] == MID and mid["epochs"] == EPOCHS
    assert mid["finished"] is False
    assert mid["loss"] == run["recorded"][MID - 1]["loss"]
    assert mid["history"]["epoch"] == list(range(1, MID + 1))
    assert mid["history"]["loss"] == [m["loss"] for m in run["recorded"][:MID]]
    status, ctype, body = run["mid"]["page"]
    assert status == 200 and ctype.startswith("text/html")


def test_json_after_the_run_matches_history(run):
    final, history = run["final"], run["rec"].history
    assert final["epoch"] == EPOCHS == len(history)
    assert final["finished"] is True
    assert dashboard.fetch_state(run["client"])["history"] == final["history"]     # same via comm
    assert final["loss"] == history[-1]["loss"] == run["recorded"][-1]["loss"]
    assert final["patterns_per_second"] == history[-1]["patterns_per_second"]
    assert final["history"]["loss"] == [h["loss"] for h in history]
    assert final["history"]["alpha_object"] == [h["alpha_object"] for h in history]
    assert final["latest"]["reduced_bytes_per_round"] == history[-1]["reduced_bytes_per_round"]
    # every round of every epoch seen by the scheduler plugin (the first probe rescale, from
    # the value check's total, makes no round of its own)
    assert final["rounds_total"] == EPOCHS * ROUNDS
    assert final["rounds_per_epoch"] == ROUNDS
    # images: last epoch always sent, downsampled, PNG
    H, W = run["rec"].object.shape
    assert final["object"]["shape"] == [H, W] and final["object"]["epoch"] == EPOCHS
    assert max(final["object"]["image_shape"]) <= 128
    assert final["probe"]["modes"] == 1 and final["probe"]["power_fractions"] == [1.0]
    assert set(final["images"]) == {"phase", "amplitude", "probe-0"}
    for name in final["images"]:
        status, ctype, png = _get(f"{run['link']}/image/{name}.png")
        assert status == 200 and ctype == "image/png" and png.startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(run["link"] + "/image/nothing.png")
    assert err.value.code == 404
    # per-worker memory from the scheduler's worker state
    (worker,) = final["workers"]
    assert worker["nthreads"] == 1 and worker["memory_process"] > 0 and worker["memory_limit"] > 0
    # a few KB per image update
    assert run["publisher"].sent_bytes < 100_000


def test_page_elements(run):
    status, ctype, body = _get(run["link"])
    html = body.decode()
    for element in ('id="loss-plot"', 'id="epoch"', 'id="round"', 'id="rate"', 'id="loss"',
                    'id="object-phase"', 'id="object-amplitude"', 'id="probe-modes"', 'id="workers"'):
        assert element in html
    # self-contained: nothing loaded from another host
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert _get(run["link"] + "/")[0] == 200


def test_dashboard_menu_links_the_page(run):
    status, _, body = _get(_base(run["client"]) + "/status")
    assert status == 200 and 'href="daskpty"' in body.decode()


def test_prometheus_gauges(run):
    pytest.importorskip("prometheus_client")
    _, _, body = _get(_base(run["client"]) + "/metrics")
    text = body.decode()
    assert re.search(rf"^daskpty_epoch {EPOCHS}(\.0)?$", text, re.M)
    loss = float(re.search(r"^daskpty_loss (\S+)$", text, re.M).group(1))
    assert loss == pytest.approx(run["rec"].history[-1]["loss"], rel=1e-12)
    assert re.search(r"^daskpty_patterns_per_second [0-9.e+]+$", text, re.M)


def test_events_logged(run):
    client = run["client"]
    deadline = time.time() + 10
    while True:
        events = [msg for _, msg in client.get_events("daskpty")
                  if msg.get("run_id") == run["publisher"].run_id]
        if len(events) >= EPOCHS or time.time() > deadline:
            break
        time.sleep(0.05)
    assert [e["epoch"] for e in events] == list(range(1, EPOCHS + 1))
    assert [e["loss"] for e in events] == [h["loss"] for h in run["rec"].history]


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no headless chromium installed")
def test_page_renders_in_headless_chromium(run):
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-extensions",
           "--virtual-time-budget=4000", "--dump-dom", run["link"]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    path = re.search(r'<path[^>]*id="loss-line"[^>]*>', dom)
    assert path, dom[-3000:]
    d = re.search(r'd="([^"]*)"', path.group(0)).group(1)
    assert d.startswith("M") and d.count("L") == EPOCHS - 1
    assert re.search(rf'id="epoch">{EPOCHS} / {EPOCHS}<', dom)
    assert re.search(r'<img[^>]*id="object-phase"[^>]*src="[^"]*/image/phase\.png', dom) \
        or re.search(r'<img[^>]*src="[^"]*/image/phase\.png[^>]*id="object-phase"', dom)
    assert 'id="probe-mode-0"' in dom
    assert '<tr class="worker">' in dom


# ------------------------------------------------------------------------------------------
# Scheduler-start installation: preload and config routes
# ------------------------------------------------------------------------------------------

def test_preload_installs_routes_at_scheduler_start():
    with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0",
                      scheduler_kwargs={"preload": ["daskpty.monitor.dashboard"]}) as cluster, \
            Client(cluster) as client:
        assert dashboard.PLUGIN_NAME in cluster.scheduler.plugins
        state = _json(_base(client) + "/daskpty/json")
        assert state["plugin_installed"] is True and state["epoch"] is None and state["workers"] == []
        # a publisher reuses the preloaded plugin instead of replacing it
        plugin = cluster.scheduler.plugins[dashboard.PLUGIN_NAME]
        DashboardPublisher(client).install()
        assert cluster.scheduler.plugins[dashboard.PLUGIN_NAME] is plugin


def test_dask_scheduler_cli_preload(tmp_path):
    """``dask scheduler --preload daskpty.monitor.dashboard`` serves the page from the start."""
    scheduler_file = tmp_path / "scheduler.json"
    cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
           "--dashboard-address", "127.0.0.1:0", "--preload", "daskpty.monitor.dashboard",
           "--scheduler-file", str(scheduler_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while not scheduler_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert scheduler_file.exists(), proc.stderr.read().decode() if proc.poll() is not None else "timeout"
        with Client(scheduler_file=str(scheduler_file), timeout=20) as client:
            link = dashboard_link(client)
            assert link == _base(client) + "/daskpty"
            state = _json(link + "/json")
            assert state["plugin_installed"] is True and state["epoch"] is None
            assert _get(link)[0] == 200
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()


def test_config_routes_serve_before_any_publisher():
    routes = dask.config.get("distributed.scheduler.http.routes") + ["daskpty.monitor.dashboard"]
    with dask.config.set({"distributed.scheduler.http.routes": routes}), \
            LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        state = _json(_base(client) + "/daskpty/json")
        assert state["plugin_installed"] is False and state["epoch"] is None
        publisher = DashboardPublisher(client, events=False)
        ones = np.ones((40, 40), np.complex64)
        probe = np.ones((2, 8, 8), np.complex64)
        state_obj = type("S", (), {"object": ones, "probe": probe, "illumination": None})()
        publisher(1, state_obj, {"epoch": 1, "loss": float("nan"), "patterns_per_second": 3.0})
        state = _json(_base(client) + "/daskpty/json")
        assert state["plugin_installed"] is True and state["epoch"] == 1
        assert state["loss"] is None and state["history"]["loss"] == [None]      # NaN -> null
        assert state["probe"]["power_fractions"] == [0.5, 0.5]


# ------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------

def _decode_png(png: bytes) -> np.ndarray:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        tag, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(tag + data) & 0xFFFFFFFF
        chunks[tag] = chunks.get(tag, b"") + data
        pos += 12 + length
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 0)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, w + 1)
    assert not raw[:, 0].any()
    return raw[:, 1:]


def test_png_round_trip():
    img = np.random.default_rng(0).integers(0, 256, (17, 33), dtype=np.uint8)
    np.testing.assert_array_equal(_decode_png(dashboard.encode_png(img)), img)


def test_downsample_block_mean():
    a = np.random.default_rng(1).standard_normal((1000, 600)).astype(np.float32)
    small = dashboard.downsample(a, 128)                    # factor 8
    assert small.shape == (125, 75)
    np.testing.assert_allclose(small, a.reshape(125, 8, 75, 8).mean(axis=(1, 3)), rtol=1e-5, atol=1e-6)
    z = (a + 1j * a).astype(np.complex64)[:130, :9]          # one factor, square pixels
    assert dashboard.downsample(z, 64).shape == (43, 3)                 # factor ceil(130/64) = 3
    assert dashboard.downsample(a[:50, :60], 128).shape == (50, 60)


def test_a_lazy_object_is_downsampled_where_its_tiles_are():
    """A dask array over row tiles (a large tiled object) gives the same pictures as the NumPy
    object, computed as block means of its tiles (only the small image is gathered)."""
    import dask.array as da

    rng = np.random.default_rng(3)
    obj = (rng.standard_normal((1000, 900)) + 1j * rng.standard_normal((1000, 900))).astype(np.complex64)
    tiles = da.from_array(obj, chunks=((300, 350, 350), 900))
    np.testing.assert_array_equal(dashboard.downsample(tiles, 128), dashboard.downsample(obj, 128))
    assert dashboard.object_images(tiles, da.absolute(tiles) ** 2, 128) == dashboard.object_images(
        obj, np.abs(obj) ** 2, 128)
    slices = np.stack([obj, obj[::-1]])
    assert dashboard.object_images(da.from_array(slices, chunks=(1, 500, 900)), None, 64) == \
        dashboard.object_images(slices, None, 64)


def test_object_images_remove_global_phase():
    obj = (np.exp(1j * 2.0) * np.ones((300, 200))).astype(np.complex64)
    obj[100:120, 50:90] *= np.exp(1j * 0.5)
    info = dashboard.object_images(obj, None, size=64)
    assert info["shape"] == [300, 200] and max(info["image_shape"]) <= 64
    lo, hi = info["phase_range"]
    assert -0.2 < lo < 0.05 and 0.2 < hi < 0.6                 # global 2 rad removed
    assert _decode_png(info["phase_png"]).shape == tuple(info["image_shape"])


def test_publisher_never_raises_into_the_run():
    logged = []

    class BrokenClient:
        def register_plugin(self, *a, **k):
            raise OSError("scheduler gone")

        def log_event(self, topic, msg):
            logged.append((topic, msg))

    publisher = DashboardPublisher(BrokenClient(), image_interval=0)
    state = type("S", (), {"object": np.ones((8, 8), np.complex64),
                           "probe": np.ones((1, 4, 4), np.complex64), "illumination": None})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert publisher(1, state, {"loss": 1.5}) is None
        assert publisher(2, state, {"loss": np.float32(1.25)}) is None
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert [m["loss"] for _, m in logged] == [1.5, 1.25]
    assert all(t == "daskpty" for t, _ in logged)


def test_reconstruct_dashboard_flag_publishes_the_run(cluster_client):
    ds = make_dataset(grid=5, seed=9)
    rec = daskpty.reconstruct(ds, epochs=3, client=cluster_client, dashboard=True)
    state = _json(_base(cluster_client) + "/daskpty/json")
    assert state["epoch"] == 3
    assert state["loss"] == pytest.approx(rec.history[-1]["loss"])


def test_position_map_shows_where_patterns_moved():
    """The positions image is the distance moved, pattern by pattern, over the scan."""
    g = np.arange(10) * 3.0
    nominal = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    moved = np.zeros_like(nominal)
    moved[nominal[:, 1] > 14] = (0.0, 0.8)          # the right half moved by 0.8 px
    info = dashboard.position_images(nominal, moved, size=10)
    img = _decode_png(info["png"]).astype(float)
    assert info["max_moved"] == pytest.approx(0.8) and info["patterns"] == 100
    assert img[:, -3:].min() > 200 and img[:, :3].max() == 0


def test_reconstruct_with_refinement_publishes_positions(cluster_client):
    ds = make_dataset(grid=6, seed=9)
    daskpty.reconstruct(ds, epochs=4, client=cluster_client, dashboard=True,
                        refine_positions={"start_epoch": 1})
    state = _json(_base(cluster_client) + "/daskpty/json")
    assert state["positions"]["patterns"] == 36 and state["positions"]["rms_moved"] > 0
    assert "positions" in state["images"]
    assert len(state["history"]["position_rms_update"]) == 4


def test_weight_maps_show_each_weight_over_the_scan():
    """OPR's view: one map per weight, black to white over that weight's range, and the
    eigen-probes' amplitudes."""
    g = np.arange(10) * 3.0
    nominal = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    weights = np.c_[np.ones(100), np.where(nominal[:, 0] > 14, 0.3, -0.1)]   # the lower half: U1 up
    eigen = np.ones((1, 16, 16), np.complex64)
    info = dashboard.opr_images(eigen, nominal, weights, size=10, probe_size=8)
    assert info["modes"] == 2 and len(info["eigen_pngs"]) == 1 and len(info["weight_pngs"]) == 2
    assert info["weight_ranges"][1] == pytest.approx([-0.1, 0.3])
    img = _decode_png(info["weight_pngs"][1]).astype(float)
    assert img[-3:].min() == 255 and img[:3].max() == 0
    assert _decode_png(info["eigen_pngs"][0]).shape == (8, 8)


def test_reconstruct_with_opr_publishes_eigen_probes_and_weight_maps(cluster_client):
    from daskpty.simulate.variable_probe import simulate_variable_probe

    ds = simulate_variable_probe(grid=8)
    rec = daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), epochs=4, client=cluster_client,
                              dashboard=True, opr_modes=2, probe_model={"start_epoch": 1}, check_data=False)
    base = _base(cluster_client)
    state = _json(base + "/daskpty/json")
    opr = state["opr"]
    assert opr["modes"] == 2 and opr["patterns"] == 64 and opr["epoch"] == 4
    assert {"eigen-1", "weights-0", "weights-1"} <= set(state["images"])
    w1 = rec.probe_weights[:, 1]                           # the stored weights, in the final basis
    assert opr["weight_ranges"][1] == pytest.approx([w1.min(), w1.max()], rel=1e-6)
    status, ctype, png = _get(base + "/daskpty/image/weights-1.png")
    assert status == 200 and ctype == "image/png"
    img = _decode_png(png)
    assert img.shape == tuple(opr["image_shape"]) and img.max() == 255
    assert 'id="opr-section"' in _get(base + "/daskpty")[2].decode()


@pytest.mark.skipif(_chromium() is None, reason="no headless chromium installed")
def test_opr_section_renders_in_headless_chromium(cluster_client):
    from daskpty.simulate.variable_probe import simulate_variable_probe

    ds = simulate_variable_probe(grid=8)
    daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), epochs=3, client=cluster_client,
                        dashboard=True, opr_modes=2, probe_model={"start_epoch": 1}, check_data=False)
    link = dashboard_link(cluster_client)
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-extensions",
           "--virtual-time-budget=4000", "--dump-dom", link]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    section = re.search(r'<section id="opr-section"[^>]*>', dom).group(0)
    assert "hidden" not in section
    for image in ("opr-eigen-1", "opr-weights-0", "opr-weights-1"):
        assert re.search(rf'<img[^>]*id="{image}"', dom), image
    assert 'id="probe-mode-0"' in dom
