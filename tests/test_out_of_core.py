"""Out-of-core reconstruction: chunks re-read from Zarr each round give the in-memory result,
and no worker keeps data chunks between rounds."""
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskpty


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ooc") / "scan.zarr"
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0") as cl, \
            Client(cl) as c:
        daskpty.simulate(path, preset="small", grid=(12, 12), probe_size=32, shard_bytes=64 * 1024, client=c)
    return path


def test_out_of_core_equals_in_memory(store):
    data = daskpty.open_data(store)
    assert len(data.intensities.chunks[0]) > 4  # several shards → several chunks
    assert data.intensities.dtype == np.uint16
    held = []

    def data_keys(dask_worker):
        return [str(k) for k in dask_worker.data.keys() if "ifftshift" in str(k) or "zarr" in str(k)
                or "rechunk" in str(k) or "getitem" in str(k)]

    def watch(epoch, state, metrics):
        held.append(sum(len(v) for v in client.run(data_keys).values()))

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as cl, \
            Client(cl) as client:
        in_memory = daskpty.reconstruct(data, epochs=3, client=client, persist=True, chunk_length=24)
        out_of_core = daskpty.reconstruct(data, epochs=3, client=client, persist=False, chunk_length=24,
                                          callback=watch)
    np.testing.assert_array_equal(out_of_core.object, in_memory.object)
    np.testing.assert_array_equal(out_of_core.probe, in_memory.probe)
    assert max(held) == 0  # no data chunk stays on a worker between rounds


def test_persist_auto_chooses_out_of_core_when_data_exceed_half_the_memory(store):
    from daskpty.execution.data import should_persist

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, memory_limit="100MB",
                      dashboard_address="127.0.0.1:0") as cl, Client(cl) as client:
        assert should_persist(client, 50 * 10**6)
        assert not should_persist(client, 150 * 10**6)
