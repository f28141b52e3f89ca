"""Workers sharing one GPU take tiles by default (several slices of a GPU: one object, rows each).

The devices are real worker processes' ``CUDA_VISIBLE_DEVICES`` (as dask-cuda and
:func:`~daskpty.execution.gpu.shared_device_cluster` set it), so the decision is tested on the
CPU; the run itself on a GPU is marked ``gpu``.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from distributed import Client

from daskpty.execution.data import several_workers_share_a_gpu, worker_gpus
from daskpty.execution.gpu import shared_device_cluster
from daskpty.execution.options import ExecutionOptions
from daskpty.execution.engine_registry import engine_spec
from daskpty.plan import tiles_on_a_shared_gpu

from gpu_device import cupy_or_skip


def _cluster(devices):
    return shared_device_cluster(devices, memory_limit="1GiB", dashboard_address=None)


@pytest.mark.slow
def test_workers_on_one_device_are_found_and_take_tiles_on_gpus():
    adapter = engine_spec("lsqml").adapter()
    with _cluster(["GPU-a", "GPU-a"]) as shared, Client(shared) as client:
        devices = set(worker_gpus(client).values())
        assert devices == {("tcp://127.0.0.1", "GPU-a")} and several_workers_share_a_gpu(client)
        with pytest.warns(UserWarning, match="several workers share a GPU"):
            assert tiles_on_a_shared_gpu(client, ExecutionOptions(device="gpu"), adapter).tiles
        with warnings.catch_warnings():                      # on the CPU: replicas, no line
            warnings.simplefilter("error")
            assert not tiles_on_a_shared_gpu(client, ExecutionOptions(device="cpu"), adapter).tiles
    with _cluster(["GPU-a", "GPU-b"]) as apart, Client(apart) as client:
        assert not several_workers_share_a_gpu(client)
        assert not tiles_on_a_shared_gpu(client, ExecutionOptions(device="gpu"), adapter).tiles


@pytest.mark.gpu
def test_two_workers_on_one_gpu_run_on_tiles_and_match_one_worker():
    """On a real GPU: two workers on device 0 take tiles without being asked, and end where the
    same run with tiles on one worker of that GPU ends (to float32 rounding)."""
    cupy_or_skip()
    import daskpty
    from synthetic import make_dataset

    ds = make_dataset(grid=12, seed=3)
    data = daskpty.from_arrays(ds.intensities, ds.positions)
    kw = dict(epochs=5, object=np.ones_like(ds.truth.object), chunk_length=24, check_data=False, persist=True)
    with _cluster(["0", "0"]) as shared, Client(shared) as client:
        with pytest.warns(UserWarning, match="several workers share a GPU"):
            two = daskpty.reconstruct(data, client=client, **kw)
    with _cluster(["0"]) as single, Client(single) as client:
        one = daskpty.reconstruct(data, client=client, tiles=True, **kw)
    assert two.options["tiles"] is True
    assert np.linalg.norm(two.object - one.object) / np.linalg.norm(one.object) < 1e-3
