"""Watching a followed scan: the dashboard page as a person sees it, and ``daskpty show`` on the
result store while the follower writes it.

Real processes: a writer (``daskpty simulate ... --rate``) and a follower
(``daskpty reconstruct --follow --dashboard``); a headless Chromium loads the page twice during the
run and the test reads the DOM after the page's scripts ran (the browser fetched the JSON and
decoded the image). Without a Chromium binary the page test skips (``.ci/run`` installs Debian's
``chromium`` where it can).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty
from daskpty.io.results import Reconstruction
from daskpty.monitor.dashboard import fetch_state
from daskpty.workflows import ScanStopped, follow

from synthetic import make_dataset

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
GRID, RATE = "16x16", 16          # 256 frames: 16 s of scan


def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "daskpty", *map(str, args)], start_new_session=True, **kw)


def _until(what, timeout, poll=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(poll)
    return None


def _live(url):
    """The page's ``live`` document (None while the page or the document is not there)."""
    try:
        with urllib.request.urlopen(url + "/json", timeout=5) as r:
            return json.loads(r.read()).get("live")
    except OSError:
        return None


def _link(err_file):
    with open(err_file) as f:
        found = re.search(r"daskpty dashboard: (http://\S+/daskpty)", f.read())
    return found and found.group(1)


def _dom(url, profile) -> dict:
    """Load the page in headless Chromium and read what its scripts rendered."""
    out = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={profile}",
                          "--virtual-time-budget=3000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=60).stdout

    def tag(element_id):
        found = re.search(rf'<[a-z]+ [^>]*id="{element_id}"[^>]*>([^<]*)', out)
        return (found.group(0), found.group(1)) if found else (None, None)

    used, used_text = tag("live-used")
    image, _ = tag("live-image")
    state, state_text = tag("live-state")
    frames = re.search(r'data-frames="(\d+)"', used or "")
    width = re.search(r'data-width="(\d+)"', image or "")
    return {"frames_used": int(frames.group(1)) if frames else None, "used_text": used_text,
            "image_width": int(width.group(1)) if width else 0, "image_src": re.search(r'src="([^"]*)"', image or ""),
            "state": state_text, "scan": re.search(r'data-scan="(\w+)"', state or ""),
            "lag": tag("live-lag")[1], "hidden": 'id="live-section" class="wide" hidden' in out}


def _show(out, data, fig):
    return subprocess.run([sys.executable, "-m", "daskpty", "show", str(out), "--data", str(data), "-o", str(fig)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """A scan written at RATE frames/s, followed with --dashboard; during the run: the page
    loaded (when Chromium exists) once the first snapshot is on it and again once a later one
    is, and ``daskpty show`` on the result store in between."""
    root = tmp_path_factory.mktemp("watch")
    data, out, err_file = root / "scan.zarr", root / "r.zarr", root / "follower.err"
    with open(err_file, "w") as err:
        follower = _cli("reconstruct", data, "-o", out, "--follow", "--dashboard", "--workers", 1,
                        "--follow-min-frames", 24, "--snapshot-every", 0.5, "--follow-timeout", 30, "--epochs", 4,
                        "--quiet", stderr=err, stdout=subprocess.DEVNULL)
    writer = _cli("simulate", data, "--grid", GRID, "--probe-size", 32, "--rate", RATE, "--quiet",
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = {"loads": [], "shows": []}
    try:
        url = _until(lambda: _link(err_file), 60)
        assert url, open(err_file).read()[-3000:]
        first = _until(lambda: (_live(url) or {}).get("frames_used"), 60)
        assert first, f"no snapshot on the page: {_live(url)}"
        if CHROMIUM:
            seen["loads"].append(_dom(url, root / "profile-1"))
        show = _show(out, data, root / "during.png")
        seen["shows"].append((show, follower.poll() is None))
        if CHROMIUM:
            before = seen["loads"][0]["frames_used"] or first
            _until(lambda: ((_live(url) or {}).get("frames_used") or 0) > before, 20)
            seen["loads"].append(_dom(url, root / "profile-2"))
        seen["running_after_loads"] = follower.poll() is None
        assert writer.wait(60) == 0
        seen["follower_rc"] = follower.wait(120)
    finally:
        for proc in (writer, follower):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seen.update(root=root, data=data, out=out, err=open(err_file).read())
    return seen


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run installs it "
                                             "where it can)")
def test_the_page_shows_the_live_image_and_frames_used_growing(watched):
    """Two loads of the page during the run: the Live scan panel is shown, its frames-used count
    grew from the first load to the second, the newest snapshot's phase image was decoded by the
    browser, the scan is live and the lag is a number of seconds."""
    assert watched["follower_rc"] == 0, watched["err"][-3000:]
    assert watched["running_after_loads"], "the follow ended before the page's second load"
    first, second = watched["loads"]
    for page in (first, second):
        assert not page["hidden"] and page["frames_used"], page
        assert page["image_width"] > 0 and "live-phase.png" in page["image_src"].group(1), page
        assert page["scan"] and page["scan"].group(1) in ("live", "ended"), page
        assert re.match(r"[\d.]+ s \(commit of frame [\d,]+ ", page["lag"] or ""), page
    assert first["scan"].group(1) == "live"
    assert 0 < first["frames_used"] < second["frames_used"] <= 256, (first, second)


@pytest.mark.slow
def test_show_draws_a_snapshot_while_the_follower_writes_it(watched):
    """``daskpty show R.zarr --data SCAN.zarr`` while the follower goes on: exit 0 and a PNG, on
    a result store holding a snapshot of part of the scan (the data store's scan not yet ended)."""
    (show, still_running), = watched["shows"]
    assert show.returncode == 0, show.stderr[-3000:]
    assert still_running, "the follow ended before show did; the scan is too short for this machine"
    with open(watched["root"] / "during.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in show.stdout and "FRC vs truth" in show.stdout


def test_a_stopped_scan_on_the_page(tmp_path):
    """A scan whose writer stops without ending it: the page's ``live`` document says
    ``stopped`` with the follower's one line, holds the frames committed and used, and the lag
    from the commit of the newest frame used to the snapshot (both times as recorded)."""
    ds = make_dataset(grid=6)
    path = tmp_path / "scan.zarr"
    writer = daskpty.ScanWriter(path, pattern_shape=ds.intensities.shape[1:], dtype="float32", planned_frames=36)
    writer.append(ds.intensities[:20], ds.positions[:20])
    committed = daskpty.LiveStore(path).status().updated_unix
    writer.stop()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        with pytest.raises(ScanStopped, match="the scan stopped at frame 20 of 36") as stop:
            follow(path, tmp_path / "r.zarr", 2, client=client, dashboard=True, snapshot_every=0.2, timeout=1.0,
                   progress=False)
        state = fetch_state(client)
    live = state["live"]
    assert live["scan"] == "stopped" and live["message"] == str(stop.value)
    assert live["frames_committed"] == live["frames_used"] == 20 and live["planned_frames"] == 36
    rec = Reconstruction.from_zarr(tmp_path / "r.zarr")
    assert live["newest_frame_commit_unix"] == committed == rec.live["newest_frame_commit_unix"]
    assert live["lag_seconds"] == pytest.approx(live["snapshot_unix"] - committed)
    assert live["lag_seconds"] >= rec.live["snapshot_unix"] - committed > 0  # (on the page once in the store)
    assert live["snapshots"] >= 1 and live["history"]["frames_used"][-1] == 20
    assert "live-phase" in state["images"] and live["image_version"] == live["snapshots"]
    assert np.isfinite(live["phase_range"]).all()
