"""Memory up front: a chunk step that cannot fit a worker is refused before the run; data are
persisted only when a worker's share plus the working set stays under the spill target."""
from __future__ import annotations

import pytest
from distributed import Client, LocalCluster

import daskpty
import daskpty.engines.initial
from daskpty.execution.memory import check_step_fits, persist_fits
from synthetic import make_dataset


@pytest.fixture(scope="module")
def small_workers():
    """Workers with a 64 MiB limit, whose memory monitor is off (they share this test process,
    whose memory use would pause them at once); the rules read the limits and dask's defaults."""
    import dask

    off = {f"distributed.worker.memory.{k}": False for k in ("target", "spill", "pause", "terminate")}
    with dask.config.set(off), LocalCluster(n_workers=2, threads_per_worker=1, processes=False, memory_limit="64MiB",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


def test_a_step_too_large_for_the_workers_is_refused_with_what_fits(small_workers):
    ds = make_dataset(n=64, grid=16, seed=2)
    with pytest.raises(ValueError) as info:
        daskpty.reconstruct(ds, epochs=2, client=small_workers, chunk_length=256, check_data=False)
    message = str(info.value)
    assert "\n" not in message and "pauses at 51 MiB" in message
    fits = int(message.split("chunk_length of at most ")[1].split()[0])
    assert 0 < fits < 256
    shape = daskpty.engines.initial.object_frame(ds.positions, 64)[0]
    check_step_fits(small_workers, fits, 64, 1, shape)          # the suggestion fits ...
    with pytest.raises(ValueError):
        check_step_fits(small_workers, fits + 1, 64, 1, shape)  # ... and is the largest that does
    rec = daskpty.reconstruct(ds, epochs=1, client=small_workers, chunk_length=fits, check_data=False)
    assert rec.options["chunk_length"] == fits


def test_persist_needs_room_for_the_share_and_the_working_set(small_workers):
    assert persist_fits(small_workers, 40 * 2**20)                            # 20 MiB each
    assert not persist_fits(small_workers, 40 * 2**20, working_bytes=30 * 2**20)  # 50 > 38.4 MiB
    assert not persist_fits(small_workers, 70 * 2**20)                        # > half of 128 MiB
