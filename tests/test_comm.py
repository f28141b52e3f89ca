"""Communication: the round-time model's arithmetic and the transport options' pass-through."""
from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from daskpty.execution import cluster as cluster_mod
from daskpty.execution.cluster import live_workers
from daskpty.execution.comm_model import (
    LINKS,
    Link,
    best_workers,
    crossover_workers,
    exchange_seconds,
    get_link,
    project_round_time,
)

# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("link", sorted(LINKS))
def test_exchange_grows_with_bytes_and_workers(link):
    for w in (2, 3, 5, 8):
        times = [exchange_seconds(b, w, link)[0] for b in (0.0, 1e6, 1e8, 1e9)]
        assert times == sorted(times) and times[-1] > times[0]
    for b in (1e6, 1e9):
        times = [exchange_seconds(b, w, link)[0] for w in range(1, 9)]
        assert times == sorted(times)
        assert times[0] == 0.0  # one worker exchanges nothing


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_compute_splits_across_workers(workers):
    one = project_round_time(6.0, 1e8, 1, "gpu-tcp")
    p = project_round_time(6.0, 1e8, workers, "gpu-tcp")
    assert p.compute_s == pytest.approx(one.compute_s / workers)
    fast = project_round_time(6.0, 1e8, workers, "gpu-tcp", worker_speed=3.0)
    assert fast.compute_s == pytest.approx(p.compute_s / 3.0)
    assert fast.exchange_s == p.exchange_s  # speed changes compute only
    assert p.total_s == pytest.approx(p.compute_s + p.exchange_s)


def test_received_and_moved_bytes_follow_the_all_to_all_exchange():
    b = 1.2e9
    for w in (2, 4, 7):
        _, received, moved = exchange_seconds(b, w, "mig-tcp")
        assert received == pytest.approx(b * (w - 1) / w)
        assert moved == pytest.approx(received * w)


def test_a_shared_path_costs_more_as_workers_grow_than_own_paths():
    own = Link("own", (10e9,))
    shared = Link("shared", (), 10e9)
    for w in (3, 5, 8):
        assert exchange_seconds(1e9, w, shared)[0] > exchange_seconds(1e9, w, own)[0]
    assert exchange_seconds(1e9, 2, shared)[0] == pytest.approx(2 * exchange_seconds(1e9, 2, own)[0])


def test_faster_link_is_never_slower_and_with_tcp_replaces_the_first_stage():
    slow = get_link("gpu-tcp")
    fast = slow.with_tcp(slow.worker_bandwidths[0] * 4)
    assert fast.worker_bandwidths[1:] == slow.worker_bandwidths[1:]
    for w in (2, 4, 8):
        assert exchange_seconds(5e8, w, fast)[0] < exchange_seconds(5e8, w, slow)[0]


def test_crossover_and_best_worker_count_agree_with_the_projection():
    compute, nbytes, link = 2.0, 4e8, "mig-tcp"
    w = crossover_workers(compute, nbytes, link)
    assert w is not None
    assert project_round_time(compute, nbytes, w, link).communication_bound
    assert not project_round_time(compute, nbytes, w - 1, link).communication_bound
    best = best_workers(compute, nbytes, link, max_workers=16)
    totals = {k: project_round_time(compute, nbytes, k, link).total_s for k in range(1, 17)}
    assert totals[best] == min(totals.values())
    # no bytes: communication never limits beyond the fixed latency of a big compute
    assert crossover_workers(100.0, 0.0, "gpu-ucx-nvlink", max_workers=8) is None


@pytest.mark.parametrize("bad", [dict(workers=0), dict(workers=2.5), dict(compute_s=-1.0),
                                 dict(bytes_per_round=float("nan")), dict(bytes_per_round="x")])
def test_bad_model_input_is_one_clear_error(bad):
    kw = dict(compute_s=1.0, bytes_per_round=1e6, workers=2, link="gpu-tcp") | bad
    with pytest.raises(ValueError, match="must be"):
        project_round_time(**kw)


def test_unknown_link_and_bad_link_figures():
    with pytest.raises(ValueError, match="unknown link 'pigeon'"):
        get_link("pigeon")
    with pytest.raises(ValueError, match="> 0"):
        Link("broken", (0.0,))
    with pytest.raises(ValueError, match="give worker_bandwidths"):
        Link("empty")


# ----------------------------------------------------------------------------- pass-through


class _Recorder:
    """Stands in for a cluster class: records its keyword arguments, starts nothing."""

    calls: list = []

    def __init__(self, **kwargs):
        type(self).calls.append(kwargs)


@pytest.fixture
def fake_dask_cuda(monkeypatch):
    """A recording ``dask_cuda.LocalCUDACluster`` (tests daskpty's pass-through, not dask-cuda)."""
    recorder = type("LocalCUDACluster", (_Recorder,), {"calls": []})
    module = types.ModuleType("dask_cuda")
    module.LocalCUDACluster = recorder
    monkeypatch.setitem(sys.modules, "dask_cuda", module)
    return recorder


@pytest.fixture
def with_ucxx(monkeypatch):
    module = types.ModuleType("distributed_ucxx")
    module.__spec__ = importlib.machinery.ModuleSpec("distributed_ucxx", None)
    monkeypatch.setitem(sys.modules, "distributed_ucxx", module)


@pytest.fixture
def without_ucxx(monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed_ucxx", None)  # find_spec -> None


def test_cuda_cluster_passes_ucx_and_its_switches_through(fake_dask_cuda, with_ucxx):
    from daskpty.execution.gpu import cuda_cluster

    cuda_cluster(["GPU-a", "GPU-b"], protocol="ucx", enable_nvlink=True, enable_infiniband=False,
                 rmm_pool_size="1GB")
    (kw,) = fake_dask_cuda.calls
    assert kw["protocol"] == "ucx" and kw["enable_nvlink"] is True and kw["enable_infiniband"] is False
    assert "enable_rdmacm" not in kw and "enable_tcp_over_ucx" not in kw  # None: UCX chooses
    assert kw["CUDA_VISIBLE_DEVICES"] == ["GPU-a", "GPU-b"] and kw["rmm_pool_size"] == "1GB"
    assert kw["ip"] == "127.0.0.1"


def test_cuda_cluster_default_is_dasks_tcp(fake_dask_cuda):
    from daskpty.execution.gpu import cuda_cluster

    cuda_cluster(["GPU-a"])
    cuda_cluster(["GPU-a"], protocol="tcp")
    assert "protocol" not in fake_dask_cuda.calls[0]
    assert fake_dask_cuda.calls[1]["protocol"] == "tcp"


def test_cuda_cluster_ucx_without_distributed_ucxx_is_one_clear_error(fake_dask_cuda, without_ucxx):
    from daskpty.execution.gpu import cuda_cluster

    with pytest.raises(ImportError, match="protocol='ucx' needs distributed-ucxx"):
        cuda_cluster(["GPU-a"], protocol="ucx")
    with pytest.raises(ValueError, match="need protocol='ucx'"):
        cuda_cluster(["GPU-a"], enable_nvlink=True)
    with pytest.raises(ValueError, match="protocol must be one of tcp, ucx"):
        cuda_cluster(["GPU-a"], protocol="udp")
    assert fake_dask_cuda.calls == []


def test_a_device_listed_twice_gets_two_plain_workers_on_it(monkeypatch, with_ucxx):
    import distributed

    from daskpty.execution.gpu import cuda_cluster

    recorder = type("SpecCluster", (_Recorder,), {"calls": []})
    monkeypatch.setattr(distributed, "SpecCluster", recorder)
    cuda_cluster(["GPU-a", "GPU-a"], protocol="tcp", threads_per_worker=2)  # needs no dask-cuda
    (kw,) = recorder.calls
    workers = [w["options"] for w in kw["workers"].values()]
    assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in workers] == ["GPU-a", "GPU-a"]
    assert all(w["nthreads"] == 2 and w["protocol"] == "tcp" and w["host"] == "127.0.0.1" for w in workers)
    assert kw["scheduler"]["options"]["protocol"] == "tcp"
    with pytest.raises(ValueError, match="rmm_pool_size .*do not apply"):
        cuda_cluster(["GPU-a", "GPU-a"], rmm_pool_size="1GB")
    with pytest.raises(ValueError, match="protocol= only"):
        cuda_cluster(["GPU-a", "GPU-a"], protocol="ucx", enable_nvlink=True)


def test_shared_device_workers_each_see_only_their_device():
    """Real worker processes (no GPU needed): the device reaches each one's environment."""
    from distributed import Client

    from daskpty.execution.gpu import shared_device_cluster

    with shared_device_cluster(["GPU-x", "GPU-x", "GPU-y"], memory_limit="1GiB") as cluster, \
            Client(cluster) as client:
        seen = client.run(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES"))
        limits = {w["memory_limit"] for w in live_workers(client).values()}
    assert sorted(seen.values()) == ["GPU-x", "GPU-x", "GPU-y"]
    assert limits == {2**30}
    assert all(a.startswith("tcp://127.0.0.1:") for a in seen)


def test_embedded_gpu_cluster_passes_the_protocol_through(fake_dask_cuda, with_ucxx):
    cluster_mod.start_local_cluster(n_workers=2, gpu=True, protocol="ucx", enable_tcp_over_ucx=True)
    (kw,) = fake_dask_cuda.calls
    assert kw["protocol"] == "ucx" and kw["enable_tcp_over_ucx"] is True and kw["n_workers"] == 2


@pytest.fixture
def fake_local_cluster(monkeypatch):
    recorder = type("LocalCluster", (_Recorder,), {"calls": []})
    monkeypatch.setattr(cluster_mod, "LocalCluster", recorder)
    return recorder


def test_cpu_cluster_passes_ucx_through_when_distributed_ucxx_is_there(fake_local_cluster, with_ucxx):
    cluster_mod.start_local_cluster(n_workers=2, gpu=False, protocol="ucx")
    (kw,) = fake_local_cluster.calls
    assert kw["protocol"] == "ucx" and kw["host"] == "127.0.0.1" and kw["n_workers"] == 2


def test_cpu_cluster_refuses_ucx_without_it_and_gpu_only_switches(fake_local_cluster, without_ucxx):
    with pytest.raises(ImportError, match="needs distributed-ucxx"):
        cluster_mod.start_local_cluster(n_workers=2, gpu=False, protocol="ucx")
    with pytest.raises(ValueError, match="GPU clusters only"):
        cluster_mod.start_local_cluster(n_workers=2, gpu=False, protocol="ucx", enable_nvlink=True)
    assert fake_local_cluster.calls == []


def test_client_context_starts_a_tcp_cluster_when_asked():
    with cluster_mod.client_context(None, n_workers=1, processes=False, dashboard=False,
                                    protocol="tcp") as client:
        assert client.scheduler.address.startswith("tcp://")


def test_cli_protocol_errors_are_one_line(store_path, tmp_path, capsys, without_ucxx):
    from daskpty.cli import main

    out = str(tmp_path / "recon.zarr")
    assert main(["reconstruct", str(store_path), "-o", out, "--protocol", "ucx", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs distributed-ucxx" in err[0]
    assert main(["reconstruct", str(store_path), "-o", out, "--protocol", "tcp",
                 "--scheduler", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--scheduler" in err[0]


def test_an_interface_replaces_the_loopback_address(fake_dask_cuda, with_ucxx):
    from daskpty.execution.gpu import cuda_cluster

    cuda_cluster(["GPU-a"], protocol="ucx", interface="ib0")
    cluster_mod.start_local_cluster(gpu=True, protocol="ucx", interface="ib0")
    for kw in fake_dask_cuda.calls:
        assert kw["interface"] == "ib0" and "ip" not in kw


def test_cli_protocol_tcp_runs_on_its_own_embedded_cluster(store_path, tmp_path, capsys, monkeypatch):
    from daskpty.cli import main

    asked = []
    real = cluster_mod.start_local_cluster
    monkeypatch.setattr(cluster_mod, "start_local_cluster", lambda **kw: asked.append(kw) or real(**kw))
    out = str(tmp_path / "recon.zarr")
    assert main(["reconstruct", str(store_path), "-o", out, "--protocol", "tcp", "--workers", "1",
                 "--epochs", "1", "--quiet"]) == 0
    assert asked and asked[0]["protocol"] == "tcp" and asked[0]["n_workers"] == 1
    assert "wrote" in capsys.readouterr().out


def test_tiles_receive_at_most_two_borders_whatever_the_workers():
    """With tiles a worker receives the borders of its (at most two) neighbours: the exchange
    stops growing with the number of workers, where replicas receive B (W - 1) / W."""
    from daskpty.execution.comm_model import exchange_seconds, project_round_time, tile_border_bytes

    border = tile_border_bytes(8000, 160)
    assert border == 8000 * 160 * 12
    b = 13.0 * 8000 ** 2
    for w, neighbours in ((2, 1), (3, 2), (8, 2), (32, 2)):
        _, received, moved = exchange_seconds(b, w, "gpu-tcp", border_bytes=border)
        assert received == neighbours * border and moved == 2 * (w - 1) * border
        assert received < exchange_seconds(b, w, "gpu-tcp")[1]
    tiles = [project_round_time(1.2, b, w, "gpu-tcp", border_bytes=border).exchange_s for w in (3, 8, 32)]
    assert tiles[0] == tiles[1] == tiles[2] > 0
