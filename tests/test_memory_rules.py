"""Memory up front: a chunk step that cannot fit a worker is refused before the run; data are
persisted only when a worker's share plus the working set stays under the spill target."""
from __future__ import annotations

import pytest
from distributed import Client, LocalCluster

import daskpty
import daskpty.engines.initial
from daskpty.execution.cluster import live_workers
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


def test_a_step_is_one_rounds_slice_of_its_chunk(small_workers):
    """With R rounds a chunk step holds slice r::R of the chunk: the rule bounds the slice, and
    on GPUs (where a step's cost is mostly fixed) the chosen chunks are R times longer."""
    from daskpty.execution.data import choose_chunk_length, gpu_steps_per_chunk

    shape = (400, 400)
    with pytest.raises(ValueError) as info:
        check_step_fits(small_workers, 1024, 64, 1, shape)
    fits = int(str(info.value).split("chunk_length of at most ")[1].split()[0])
    check_step_fits(small_workers, 4 * fits, 64, 1, shape, rounds=4)       # four slices of `fits`
    with pytest.raises(ValueError) as info:
        check_step_fits(small_workers, 4 * fits + 4, 64, 1, shape, rounds=4)
    assert f"a chunk of {4 * fits + 4} in 4 rounds" in str(info.value)
    assert int(str(info.value).split("chunk_length of at most ")[1].split()[0]) == 4 * fits
    assert gpu_steps_per_chunk("cpu", 16) == 1 and gpu_steps_per_chunk("gpu", 16) == 16
    one = choose_chunk_length(small_workers, 65536, 128)
    sliced = choose_chunk_length(small_workers, 65536, 128, steps_per_chunk=16)
    assert 15 * one <= sliced <= 65536 // 8


def test_a_gpu_step_is_as_long_as_the_device_allows():
    """On GPUs (a fixed cost per step) the step budget comes from the device's memory, not the
    host rule's 512 MiB: 262,144 × 128² at 16 rounds on an 80 GB GPU takes 8 chunks (128 steps an
    epoch, not 656), on a 20 GB MIG slice steps that fit an eighth of it, unknown devices the host rule."""
    from daskpty.execution.data import default_chunk_length, gpu_step_budget
    from daskpty.execution.memory import step_bytes

    assert gpu_step_budget(None) is None
    whole, mig = gpu_step_budget(80 * 10**9), gpu_step_budget(20 * 10**9)
    assert whole == 3 * 2**30 and mig == 20 * 10**9 // 8
    for budget, chunks in ((whole, 8), (mig, 9), (512 * 2**20, 41)):
        length = default_chunk_length(262144, 128, memory_budget=budget * 16)
        assert -(-262144 // length) == chunks
        assert step_bytes(-(-length // 16), 128, 1) <= budget


def test_persist_needs_room_for_the_share_and_the_working_set(small_workers):
    assert persist_fits(small_workers, 40 * 2**20)                            # 20 MiB each
    assert not persist_fits(small_workers, 40 * 2**20, working_bytes=30 * 2**20)  # 50 > 38.4 MiB
    assert not persist_fits(small_workers, 70 * 2**20)                        # > half of 128 MiB


def _pause_every_worker(dask_worker):
    from distributed.core import Status

    dask_worker.memory_manager.memory_pause_fraction = False  # the monitor would unpause them (memory is low)
    dask_worker.status = Status.paused  # what the monitor does at the pause threshold


@pytest.mark.slow
def test_a_round_stalled_by_paused_workers_says_so(tmp_path, monkeypatch):
    """Workers paused at their memory limit for DASKPTY_PAUSED_SECONDS end the run with one line
    that says so and keeps the checkpoint (it stalled 5 minutes, then said nothing of memory)."""
    import time

    from daskpty.execution.cluster import WorkersPaused

    monkeypatch.setenv("DASKPTY_PAUSED_SECONDS", "3")
    ds = make_dataset(grid=8, seed=3)
    path = tmp_path / "s.zarr"
    daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(path)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        def pause_after_two(epoch, state, metrics):
            if epoch == 2:
                c.run(_pause_every_worker)

        start = time.monotonic()
        with pytest.raises(WorkersPaused) as info:
            daskpty.reconstruct(daskpty.open_data(path), epochs=20, client=c, persist=False, chunk_length=16,
                                checkpoint=tmp_path / "r.zarr", checkpoint_every=1, callback=pause_after_two,
                                check_data=False)
        took = time.monotonic() - start
    message = str(info.value)
    assert "\n" not in message and "workers paused at their memory limit" in message
    assert "epoch 2 is kept" in message and took < 60
    assert daskpty.Reconstruction.from_zarr(tmp_path / "r.zarr").epochs == 2


@pytest.mark.slow
def test_workers_paused_by_their_memory_monitor_are_named_at_the_start(tmp_path, monkeypatch):
    """Workers whose process is over the pause threshold (in-process workers with a limit below
    this process's memory: dask's monitor pauses them for real) end the run before it starts."""
    import time

    import psutil

    from daskpty.execution.cluster import WorkersPaused

    monkeypatch.setenv("DASKPTY_PAUSED_SECONDS", "3")
    ds = make_dataset(grid=6, seed=3)
    import dask

    limit = int(psutil.Process().memory_info().rss * 0.9)
    pause_only = {"distributed.worker.memory.pause": 0.8, "distributed.worker.memory.target": False,
                  "distributed.worker.memory.spill": False, "distributed.worker.memory.terminate": False}
    with dask.config.set(pause_only), LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                                   memory_limit=limit, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        deadline = time.monotonic() + 10
        while not all(str(w["status"]).endswith("paused") for w in live_workers(c).values()):
            assert time.monotonic() < deadline, "the memory monitor did not pause the worker"
            time.sleep(0.1)
        with pytest.raises(WorkersPaused, match="all 1 workers paused at their memory limit"):
            daskpty.reconstruct(ds, epochs=2, client=c, check_data=False, checkpoint=tmp_path / "r.zarr")
    assert not (tmp_path / "r.zarr").exists()


@pytest.mark.slow
def test_worker_processes_too_small_for_their_own_process_are_refused_up_front():
    """Worker processes of 180 MiB pause at 144 MiB, below what a worker process running chunk
    steps takes by itself (117–151 MiB measured): refused before the run, naming the memory that
    would do (it used to start, then stall with every worker paused at its limit)."""
    from daskpty.execution.memory import WORKER_PROCESS_BYTES, _baseline

    ds = make_dataset(n=32, grid=6, seed=1)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, memory_limit="180MiB",
                      dashboard_address=None) as cluster, Client(cluster) as c:
        assert _baseline(c) >= WORKER_PROCESS_BYTES          # measured on the worker, never below the floor
        with pytest.raises(ValueError) as info:
            daskpty.reconstruct(ds, epochs=2, client=c, check_data=False)
    message = str(info.value)
    assert "\n" not in message and "pauses at 144 MiB (180 MiB limit)" in message
    needed = int(message.split("give each worker at least ")[1].split()[0])
    assert needed > 180


def test_an_object_too_large_for_one_worker_names_the_tiles_that_fit(small_workers):
    """A state that does not fit one 64 MiB worker whole: the refusal names tiles and the fewest
    workers they need, and that many tiles do fit (the rule counts a tile and its halo)."""
    from daskpty.execution.memory import held_shape, state_bytes

    shape, n = (1200, 1200), 32  # 88 MiB of state: over the 51 MiB pause threshold alone
    with pytest.raises(ValueError) as info:
        check_step_fits(small_workers, 4, n, 1, shape)
    message = str(info.value)
    assert "\n" not in message and "tiles=True" in message
    fewest = int(message.split("over at least ")[1].split()[0])
    assert state_bytes(held_shape(shape, n, fewest - 1)) > state_bytes(held_shape(shape, n, fewest))
    check_step_fits(small_workers, 4, n, 1, shape, tiles=fewest)  # fits on that many tiles
    with pytest.raises(ValueError, match=f"at least {fewest} workers"):
        check_step_fits(small_workers, 4, n, 1, shape, tiles=fewest - 1)
    assert held_shape(shape, n, 4) == (300 + 2 * (n + 2), 1200) and held_shape(shape, n, None) == shape


def test_refined_positions_widen_the_tiles_halo_the_memory_rule_counts(small_workers):
    """Position refinement's windows move up to its largest displacement: the rule holds that
    many rows more on each side, and on a tile size just at the edge that tips a fit into a
    refusal naming more workers."""
    from daskpty.execution.memory import held_shape

    shape, n = (1200, 1200), 32
    assert held_shape(shape, n, 4, reach=8.5) == (300 + 2 * (n + 2 + 9), 1200)
    message = ""
    for tiles in range(2, 40):  # the fewest tiles that fit without refinement ...
        try:
            check_step_fits(small_workers, 4, n, 1, shape, tiles=tiles)
        except ValueError:
            continue
        with pytest.raises(ValueError) as info:  # ... do not with a wide reach
            check_step_fits(small_workers, 4, n, 1, shape, tiles=tiles, reach=200)
        message = str(info.value)
        break
    assert "workers of this memory" in message and "\n" not in message


def test_a_tiled_worker_counts_its_chunks_of_the_data(small_workers):
    """Tiles keep the data in worker memory beside the tile: the rule counts a worker's share,
    so the fewest tiles that fit alone are refused with 30 MiB of chunks each, naming more
    workers (each with a smaller share and a smaller tile), which do fit."""
    shape, n = (1200, 1200), 32
    tiles = next(t for t in range(2, 40) if _fits(small_workers, shape, n, t, 0))
    data = 30 * 2**20 * tiles
    with pytest.raises(ValueError) as info:
        check_step_fits(small_workers, 4, n, 1, shape, tiles=tiles, data_bytes=data)
    message = str(info.value)
    assert "\n" not in message and "workers of this memory" in message
    more = int(message.split("workers of this memory")[0].split("at least ")[-1].split()[0])
    assert more > tiles and _fits(small_workers, shape, n, more, data)
    assert not _fits(small_workers, shape, n, more - 1, data)
    assert "persist=False" in message and _fits(small_workers, shape, n, tiles, 0)  # out of core fits


def _fits(client, shape, n, tiles, data) -> bool:
    try:
        check_step_fits(client, 4, n, 1, shape, tiles=tiles, data_bytes=data)
    except ValueError:
        return False
    return True
