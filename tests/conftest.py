"""Shared fixtures: one small in-process dask cluster per session, store builders, corrupters."""
from __future__ import annotations

import glob
import os
import signal

import numpy as np
import pytest
import zarr
from distributed import Client, LocalCluster

# A test run started in the background of a non-interactive shell (``cmd &``, as scripts and
# CI wrappers do) inherits SIGINT ignored, and so do the commands the tests start: those that
# send Ctrl-C to a daskpty command (test_interrupts.py, test_safety.py) would then test nothing
# but the ignored signal and wait for an exit that never comes. A process started with SIGINT
# ignored keeps it ignored across exec, one with a handler gets the default back, so restoring
# Python's handler here gives every command the tests start a real Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def client():
    """A real distributed client on an in-process LocalCluster (2 workers x 1 thread).

    Not the default client: tests that want it "current" use the ``use_client`` fixture.
    """
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                           dashboard_address=":0")
    c = Client(cluster, set_as_default=False)
    yield c
    c.close()
    cluster.close()


@pytest.fixture
def use_client(client):
    """Make the session client the current one for the duration of a test."""
    with client.as_current():
        yield client

@pytest.fixture(scope="module")
def three_workers():
    """Three worker processes (not the default client), per test module: the tile tests' W = 3."""
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield client


@pytest.fixture(scope="module")
def one_worker():
    """One in-process worker (not the default client), per test module: the tile tests' W = 1."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield client



def make_arrays(n=12, size=16, dtype="uint16", seed=0):
    """Small random data set arrays: intensities, positions (in a 4-wide raster), mask, probe."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        inten = rng.gamma(2.0, 10.0, size=(n, size, size)).astype(dtype)
    else:
        inten = rng.poisson(20.0, size=(n, size, size)).astype(dtype)
    iy, ix = np.divmod(np.arange(n), 4)
    positions = np.stack([iy, ix], axis=1) * 3.25 + size / 2 + 1.0 + rng.uniform(-0.3, 0.3, (n, 2))
    mask = np.ones((size, size), dtype=bool)
    mask[0, :3] = False
    probe = (rng.standard_normal((2, size, size))
             + 1j * rng.standard_normal((2, size, size))).astype(np.complex64)
    return inten, positions, mask, probe


@pytest.fixture
def store_path(tmp_path):
    """A valid small float32 data-set store (written through the public API)."""
    import daskpty

    inten, pos, mask, probe = make_arrays(dtype="float32")
    data = daskpty.from_arrays(inten, pos, mask=mask, probe=probe, wavelength_m=1e-10,
                               detector_distance_m=1.0, detector_pixel_size_m=5e-5,
                               provenance="test fixture")
    path = tmp_path / "data.zarr"
    data.to_zarr(path)
    return path


def corrupt(path, kind: str) -> None:
    """Damage a valid store in one specific way (for the error-path tests)."""
    g = zarr.open_group(str(path), mode="r+")
    if kind == "missing_positions":
        del g["positions"]
    elif kind == "missing_intensities":
        del g["intensities"]
    elif kind == "n_mismatch":
        pos = g["positions"][...]
        del g["positions"]
        g.create_array("positions", data=pos[:-1])
    elif kind == "nan_positions":
        g["positions"][3, 0] = np.nan
    elif kind == "newer_version":
        g.attrs["daskpty"] = {"format": "daskpty-dataset", "version": 99}
    elif kind == "other_format":
        g.attrs["daskpty"] = {"format": "daskpty-reconstruction", "version": 1}
    elif kind == "no_format":
        del g.attrs["daskpty"]
    elif kind == "nan_intensity":
        g["intensities"][5, 3, 3] = np.nan
    elif kind == "inf_intensity":
        g["intensities"][2, 1, 1] = np.inf
    elif kind == "negative_intensity":
        g["intensities"][7, 0, 4] = -1.0
    elif kind == "mask_shape":
        del g["mask"]
        g.create_array("mask", data=np.ones((3, 3), dtype=bool))
    elif kind == "probe_shape":
        del g["probe"]
        g.create_array("probe", data=np.ones((1, 5, 5), dtype=np.complex64))
    elif kind == "wrong_dtype":
        x = g["intensities"][...]
        del g["intensities"]
        g.create_array("intensities", data=x.astype(np.float64))
    else:
        raise ValueError(kind)


def leftovers(directory) -> list[str]:
    """Temporary or half-written stores next to the targets."""
    return sorted(glob.glob(os.path.join(str(directory), "*.partial-*"))
                  + glob.glob(os.path.join(str(directory), "*.old-*")))
