"""An epoch's rounds as one graph (persisted data) equal the same rounds run one by one from the
client, and the client submits one graph per epoch."""
import dataclasses
import functools

import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin

from daskpty.engines import ad, lsqml
from daskpty.execution.cluster import live_workers
from daskpty.execution.engine_registry import engine_spec
from daskpty.execution.data import prepare_data
from daskpty.execution.driver import run_epochs
from daskpty.execution.epoch_graph import EpochCarry

from synthetic import make_dataset

ADAdapter = engine_spec("ad").adapter
LSQMLAdapter = engine_spec("lsqml").adapter


class _GraphCounter(SchedulerPlugin):
    name = "test-graph-counter"

    def __init__(self):
        self.graphs = 0

    def update_graph(self, scheduler, **kwargs):
        self.graphs += 1


@pytest.fixture(scope="module")
def process_client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        yield client


def _adapters(ds):
    obj0 = np.ones_like(ds.truth.object)
    yield "lsqml", LSQMLAdapter(lsqml.LSQMLOptions(noise="poisson")), lsqml.LSQMLState(obj0, ds.truth.probe.copy())
    yield "ad-adam", ADAdapter(ad.ADOptions(optimizer="adam")), ad.ADState(obj0, ds.truth.probe.copy())


@pytest.mark.parametrize("which,fused", [("lsqml", True), ("lsqml", False), ("ad-adam", True)])
@pytest.mark.slow
def test_epoch_graph_equals_rounds_from_the_client(process_client, which, fused, monkeypatch):
    ds = make_dataset(grid=10, seed=3)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=20, persist=True)
    assert data.persisted and data.n_chunks == 5
    name, adapter, state = next(a for a in _adapters(ds) if a[0] == which)
    import daskpty.execution.driver as driver

    monkeypatch.setattr(driver, "EpochGraph", functools.partial(driver.EpochGraph, fused=fused))
    results = {}
    for path, chunked in (("graph", data), ("rounds", dataclasses.replace(data, persisted=False))):
        start = adapter.new_state(state.object.copy(), state.probe.copy())
        results[path] = run_epochs(process_client, chunked, adapter, start, epochs=3, rounds_per_epoch=3,
                                   split_every=2)
    (graph, g_hist), (rounds, r_hist) = results["graph"], results["rounds"]
    np.testing.assert_array_equal(graph.object, rounds.object)
    np.testing.assert_array_equal(graph.probe, rounds.probe)
    assert [h["loss"] for h in g_hist] == [h["loss"] for h in r_hist]
    assert not np.array_equal(graph.object, state.object)  # it did reconstruct something


def test_one_graph_per_epoch(process_client):
    ds = make_dataset(grid=8, seed=4)
    counter = _GraphCounter()
    process_client.register_plugin(counter, name=counter.name)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=16, persist=True)
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    before = process_client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[counter.name].graphs)
    run_epochs(process_client, data, adapter, state, epochs=4, rounds_per_epoch=5, initialise=False)
    after = process_client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[counter.name].graphs)
    # one graph per epoch, plus one for the inputs every epoch reads (round by round: 4 × 5)
    assert after - before == 4 + 1


class _TaskLog(SchedulerPlugin):
    """Which worker ran which task (keys and worker addresses as the scheduler saw them)."""

    name = "test-task-log"

    def __init__(self):
        self.ran = []

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory" and start == "processing":
            self.ran.append((key, kwargs.get("worker")))


class _RestrictionLog(SchedulerPlugin):
    """The worker restriction and the dependencies of every task that became ready to run."""

    name = "test-restriction-log"

    def __init__(self):
        self.seen = []

    async def start(self, scheduler):
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            ts = self.scheduler.tasks[key]
            self.seen.append((key, sorted(ts.worker_restrictions or ()), [d.key for d in ts.dependencies]))


@pytest.mark.parametrize("fused", [True, False])
def test_chunks_spread_evenly_and_one_chunk_task_per_worker_and_round(process_client, tmp_path, fused):
    """From a Zarr store, through the spatial reordering (a shuffle) and the first-epoch rescale
    (unpinned tasks that may copy chunks), the chunks still end up 2 : 2 on the two worker
    processes, and each round runs one chunk task per worker, on the worker holding its chunks
    (fused: the round task that also ends the previous round; split: a separate chunk task)."""
    import daskpty
    from distributed import futures_of

    from daskpty.execution.epoch_graph import EpochGraph
    from daskpty.execution.rounds import CHUNK_PREFIX, ROUND_PREFIX

    ds = make_dataset(grid=12, seed=5)
    stored = daskpty.from_arrays(ds.intensities, ds.positions).to_zarr(tmp_path / "d.zarr")
    data = prepare_data(process_client, stored.intensities, ds.positions, chunk_length=36, persist=True)
    assert data.n_chunks == 4
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    state = adapter.initialise(process_client, data, adapter.new_state(np.ones_like(ds.truth.object),
                                                                         ds.truth.probe.copy()), split_every=8)
    graph = EpochGraph(process_client, data, adapter, rounds=3, fused=fused)
    assert sorted(len(chunks) for chunks in graph.groups) == [2, 2]
    log = _TaskLog()
    log.name = f"{log.name}-{fused}"
    process_client.register_plugin(log, name=log.name)
    epoch = graph.submit(process_client.scatter(EpochCarry(state), hash=False))
    epoch.ends[0].result()
    graph.close()
    holders = process_client.who_has(futures_of(data.intensities))
    prefix = ROUND_PREFIX if fused else CHUNK_PREFIX
    chunk_tasks = [(k, w) for k, w in process_client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins[log.name].ran) if str(k[0]).startswith(prefix)]
    assert len(chunk_tasks) == 3 * 2  # rounds × workers
    for key, worker in chunk_tasks:
        group = graph.groups[key[1]]
        assert all(worker in holders[graph.block_keys[i]] for i in group)


def test_an_epoch_starts_from_the_previous_last_round_not_from_its_end(process_client):
    """Chained fused epochs: the first round tasks of epoch 2 depend on epoch 1's last round
    tasks (they end epoch 1 themselves) and on no end task, so an epoch boundary costs no extra
    scheduler hop; epoch 1's end tasks still give its state, equal to what epoch 2 started from."""
    from daskpty.execution.epoch_graph import EpochGraph
    from daskpty.execution.rounds import ROUND_PREFIX

    ds = make_dataset(grid=8, seed=4)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=16, persist=True)
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    graph = EpochGraph(process_client, data, adapter, rounds=2)
    submitted = []

    class Recording:  # the client, keeping the graphs the epoch graph submits
        def get(self, hlg, keys, **kwargs):
            submitted.append(dict(hlg))
            return process_client.get(hlg, keys, **kwargs)

    graph.client = Recording()
    first = graph.submit(process_client.scatter(EpochCarry(state), hash=False))
    second = graph.submit(first)
    graph.client = process_client
    round0 = [(f"{ROUND_PREFIX}-0-{second.tag}", w) for w in range(len(graph.replicas))]
    last_round = {f.key for f in first.last_round}
    ends = {f.key for f in first.ends}
    for key in round0:
        args = set(a for a in submitted[1][key][1:] if isinstance(a, tuple))
        assert last_round <= args and not ends & args
    ended = [f.result() for f in first.ends]
    assert ended[0].state.epoch == 1
    np.testing.assert_array_equal(ended[0].state.object, ended[-1].state.object)
    second.ends[0].result()
    graph.close()


def test_round_by_round_chunk_tasks_run_on_the_chunks_workers(process_client):
    """The round-by-round path (the first-epoch probe rescale, line searches) pins each chunk
    task to its chunk's worker too (checked on the scheduler's task restrictions): unpinned, work
    stealing ran them elsewhere, the chunk was copied there and the memory manager could drop
    the copy on plan (713 of 1,446 chunks off plan at 147,456 × 128², which the first epoch then
    fetched back). The chunks stay where they were placed."""
    from distributed import futures_of

    from daskpty.execution.placement import balanced_worker
    from daskpty.execution.rounds import map_reduce

    ds = make_dataset(grid=12, seed=8)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=18, persist=True)
    assert data.n_chunks == 8
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    payload = adapter.payload(adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy()))
    log = _RestrictionLog()
    process_client.register_plugin(log, name=log.name)
    from daskpty.execution.adapter import forward_sums_chunk

    for r in range(3):
        map_reduce(process_client, data, forward_sums_chunk, payload, round_index=r, rounds=3)
    workers = sorted(live_workers(process_client))
    keys = [f.key for f in futures_of(data.intensities)]
    planned = {k: workers[balanced_worker(i, len(keys), len(workers))] for i, k in enumerate(keys)}
    seen = process_client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[log.name].seen)
    tasks = [t for t in seen if str(t[0][0] if isinstance(t[0], tuple) else t[0]).startswith("run_chunk")]
    assert len(tasks) == 3 * 8
    for key, restriction, chunk_keys in tasks:
        (chunk,) = [k for k in chunk_keys if k in planned]
        assert restriction == [planned[chunk]], (key, restriction)
    held = process_client.who_has(futures_of(data.intensities))
    assert all(planned[k] in held[k] for k in keys)


def test_chunks_the_scheduler_put_on_the_wrong_worker_still_give_even_rounds(process_client, monkeypatch):
    """Chunks persisted 3 : 1 (as when the scheduler moves persist tasks) still give 2 : 2 round
    tasks: each chunk's task goes to the worker it was meant for, which fetches it once and holds
    it from then on. (The holder choice alone gave 3 : 1.)"""
    from distributed import futures_of

    from daskpty.execution import data as data_module
    from daskpty.execution.epoch_graph import EpochGraph

    ds = make_dataset(grid=12, seed=6)
    with monkeypatch.context() as patch:  # persist 3 : 1 instead of 2 : 2
        patch.setattr(data_module, "balanced_worker", lambda i, n, w: 0 if i < 3 else 1)
        data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=36, persist=True)
    workers = sorted(live_workers(process_client))
    keys = [f.key for f in futures_of(data.intensities)]
    held = process_client.who_has(futures_of(data.intensities))
    assert sorted(len([k for k in keys if w in held[k]]) for w in workers) == [1, 3]
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    graph = EpochGraph(process_client, data, adapter, rounds=2)
    assert sorted(len(chunks) for chunks in graph.groups) == [2, 2]
    epoch = graph.submit(process_client.scatter(EpochCarry(state), hash=False))
    epoch.ends[0].result()
    graph.close()
    held = process_client.who_has(futures_of(data.intensities))
    for w, chunks in enumerate(graph.groups):
        assert all(graph.replicas[w] in held[graph.block_keys[i]] for i in chunks)


@pytest.mark.parametrize("n,split_every", [(1, 8), (5, 2), (8, 8), (8, 4), (13, 3), (64, 8), (70, 8)])
def test_fixed_tree_sums_like_tree_reduce_however_the_chunks_are_split(n, split_every):
    """Summing each worker's complete subtrees first and finishing the tree elsewhere gives the
    same bits as the tree_reduce graph, for any split of the chunks among workers."""
    import dask

    from daskpty.engines.partials import BoxedArray, Partial
    from daskpty.execution.rounds import FixedTree, tree_reduce

    rng = np.random.default_rng(n)
    parts = []
    for _ in range(n):
        origin = tuple(int(v) for v in rng.integers(0, 20, 2))
        data = (rng.normal(size=(9, 7)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        parts.append(Partial(boxes={"object": BoxedArray(origin, data)},
                             scalars={"loss": float(rng.normal())}))
    reference = dask.compute(tree_reduce([dask.delayed(p) for p in parts], split_every),
                             scheduler="sync")[0]
    # the tree as documented, written out here: sums of split_every, level by level, then the root
    from daskpty.execution.rounds import combine

    level = list(parts)
    while len(level) > split_every:
        level = [combine(*level[i:i + split_every]) for i in range(0, len(level), split_every)]
    written_out = combine(*level)
    np.testing.assert_array_equal(reference.boxes["object"].data, written_out.boxes["object"].data)
    assert reference.scalars == written_out.scalars
    tree = FixedTree(n, split_every)
    for trial in range(4):
        owner = np.sort(rng.integers(0, 3, n)) if trial % 2 else rng.integers(0, 3, n)
        nodes = {}
        for w in range(3):
            nodes.update(tree.reduce({(0, i): parts[i] for i in range(n) if owner[i] == w}))
        total = tree.reduce(nodes)[tree.root]
        np.testing.assert_array_equal(total.boxes["object"].data, reference.boxes["object"].data)
        assert total.boxes["object"].offset == reference.boxes["object"].offset
        assert total.scalars == reference.scalars


@pytest.mark.parametrize("restart_from", ["surviving copy", "client copy"])
def test_a_round_state_gone_from_its_worker_restarts_the_epoch_with_states_in_the_graph(process_client,
                                                                                        monkeypatch,
                                                                                        restart_from):
    """If a fused round task does not find its state (as when dask moves or recomputes it on
    another worker), the epoch restarts with the split graph, from the last finished epoch's
    state on a worker or, when none is left, from the client's last copy (here the start: no
    epoch's state was fetched), recomputing the epochs since then without reporting them twice.
    The result and the history equal an undisturbed run bit for bit."""
    import daskpty.execution.driver as driver
    from daskpty.execution.epoch_graph import EpochGraph, _round_task

    ds = make_dataset(grid=10, seed=6)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=20, persist=True)
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    graphs = []

    class LosesAState(EpochGraph):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            graphs.append(self)

        def _fused_tasks(self, tasks, *args):
            built = super()._fused_tasks(tasks, *args)
            if self.count == 2:  # the second epoch: round 1 of the first replica looks for a lost state
                for layer in tasks:
                    for key, task in layer.items():
                        if task[0] is _round_task and task[7] == 1:  # round 1
                            layer[key] = task[:4] + ("gone",) + task[5:]
                            return built
            return built

    if restart_from == "client copy":
        monkeypatch.setattr(driver, "_state_of_any", lambda futures: None)
    results, histories = {}, {}
    for name, graph_class in (("undisturbed", EpochGraph), ("disturbed", LosesAState)):
        monkeypatch.setattr(driver, "EpochGraph", graph_class)
        start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
        results[name], histories[name] = run_epochs(process_client, data, adapter, start, epochs=4,
                                                    rounds_per_epoch=3)
    assert len(graphs) == 1 and not graphs[0].fused  # it fell back to the split graph
    np.testing.assert_array_equal(results["disturbed"].object, results["undisturbed"].object)
    np.testing.assert_array_equal(results["disturbed"].probe, results["undisturbed"].probe)
    assert [h["epoch"] for h in histories["disturbed"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in histories["disturbed"]] == [h["loss"] for h in histories["undisturbed"]]


def test_states_stay_on_the_workers_unless_a_callback_asks(process_client, monkeypatch):
    """With callbacks that take an EpochState and never fetch it, the client fetches one state,
    the last; a plain callback gets every epoch's state. Both runs give the same bits."""
    import daskpty.execution.driver as driver

    fetched = []
    original = driver.EpochState.get

    def counting_get(self):
        if not self.fetched:
            fetched.append(self.epoch)
        return original(self)

    monkeypatch.setattr(driver.EpochState, "get", counting_get)
    ds = make_dataset(grid=8, seed=2)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=16, persist=True)
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())

    class Lazy:
        takes_epoch_state = True
        seen = []

        def __call__(self, epoch, state, metrics):
            self.seen.append((epoch, state.epoch, type(state).__name__))

    results = {}
    for name, callback in (("lazy", Lazy()), ("plain", lambda epoch, state, metrics: None)):
        fetched.clear()
        start = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
        results[name] = run_epochs(process_client, data, adapter, start, epochs=5, rounds_per_epoch=2,
                                   callbacks=[callback])[0]
        assert fetched == ([5] if name == "lazy" else [1, 2, 3, 4, 5])
    assert Lazy.seen == [(e, e, "EpochState") for e in range(1, 6)]
    np.testing.assert_array_equal(results["lazy"].object, results["plain"].object)


class _FailsInSecondEpoch(LSQMLAdapter):
    """An adapter whose chunk steps raise once the state reaches epoch 1."""

    def payload(self, state):
        payload = super().payload(state)
        return payload if state.epoch < 1 else None


def test_an_error_in_an_epoch_graph_reaches_the_caller_and_leaves_the_client_usable(process_client):
    ds = make_dataset(grid=8, seed=7)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=16, persist=True)
    adapter = _FailsInSecondEpoch(lsqml.LSQMLOptions())
    state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    before = float(data.intensities.sum().compute())
    with pytest.raises(AttributeError):  # the chunk step reads payload.object from None
        run_epochs(process_client, data, adapter, state, epochs=4, rounds_per_epoch=2, initialise=False)
    # the client kept its connection and its futures: the persisted chunks are still there
    from distributed import futures_of

    assert all(f.status == "finished" for f in futures_of(data.intensities))
    assert float(data.intensities.sum().compute()) == before
    assert process_client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3


def test_exchanged_bytes_are_the_other_workers_partial_sums(process_client):
    """Two workers: each receives the other's partial sums every round (less than everything the
    reduction produced); the history reports it per round."""
    ds = make_dataset(grid=10, seed=8)
    data = prepare_data(process_client, ds.intensities, ds.positions, chunk_length=25, persist=True)
    adapter = LSQMLAdapter(lsqml.LSQMLOptions())
    state = adapter.new_state(np.ones_like(ds.truth.object), ds.truth.probe.copy())
    _, history = run_epochs(process_client, data, adapter, state, epochs=2, rounds_per_epoch=2)
    for h in history:
        assert 0 < h["exchanged_bytes_per_round"] < h["reduced_bytes_per_round"]
    _, client_history = run_epochs(process_client, dataclasses.replace(data, persisted=False), adapter, state,
                                   epochs=1, rounds_per_epoch=2)
    assert client_history[0]["exchanged_bytes_per_round"] is None  # round by round: not measured
