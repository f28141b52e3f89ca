"""The embedded default cluster: worker processes unless the script cannot be re-imported."""
from __future__ import annotations

import sys
import time

import dask
import pytest
from distributed import Client, LocalCluster

from daskpty.execution.cluster import live_workers, main_module_importable, start_local_cluster


def test_a_script_from_stdin_gets_thread_workers_with_a_warning(monkeypatch):
    """``python - <<EOF`` scripts have ``__file__ == "<stdin>"``: spawned worker processes would
    fail to re-import it ("Nanny failed to start"), so the cluster runs thread workers."""
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "<stdin>", raising=False)
    assert not main_module_importable()
    with pytest.warns(RuntimeWarning, match="no file that worker processes could import"):
        cluster = start_local_cluster(n_workers=1, gpu=False, dashboard=False)
    with cluster:
        kinds = {type(w).__name__ for w in cluster.workers.values()}
    assert kinds == {"Worker"}          # in-process workers, not Nannies


def test_scripts_with_a_file_or_none_keep_worker_processes(monkeypatch, tmp_path):
    script = tmp_path / "run.py"
    script.write_text("")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    assert main_module_importable()
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    assert main_module_importable()     # python -c, notebooks: spawn does not re-import


def _worker_filters_handled_losses() -> bool:
    import logging

    from daskpty.execution.watchdog import HandledLossNoise

    record = logging.LogRecord("distributed.worker.state_machine", logging.WARNING, __file__, 1,
                               "Async instruction for %s ended with %s", ("<Task cancelled>", "CancelledError"), None)
    handlers = [h for name in ("distributed", "") for h in logging.getLogger(name).handlers]
    filtered = any(isinstance(f, HandledLossNoise) for h in handlers for f in h.filters)
    return filtered and not all(f.filter(record) for h in handlers for f in h.filters)


@pytest.mark.slow
def test_embedded_worker_processes_route_handled_loss_reports_to_info():
    """The embedded cluster's worker processes install the handled-loss filter at start (a
    preload): a task cancelled as an interrupted run closes the cluster is no WARNING on stderr."""
    from distributed import Client

    with start_local_cluster(n_workers=1, gpu=False, dashboard=False) as cluster, Client(cluster) as client:
        assert all(client.run(_worker_filters_handled_losses).values())


def test_the_workers_are_asked_of_the_scheduler_not_read_from_the_clients_cache():
    """distributed's client refreshes its cached identity every ``scheduler-info-interval`` with one
    that lists no workers; ``client.scheduler_info()`` read just after such a refresh said that no
    worker was connected (tiles then ran unpinned). Here the refresh runs every 5 ms."""
    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        seen, deadline = [], time.monotonic() + 1.5
        while time.monotonic() < deadline:
            seen.append(len(live_workers(client)))
    assert len(seen) > 100 and set(seen) == {2}, f"{seen.count(0)} of {len(seen)} reads saw no worker"
