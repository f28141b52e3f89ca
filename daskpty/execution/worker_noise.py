"""Worker preload of the embedded local cluster: in its worker processes too, distributed's
reports of a handled loss or an interrupt (a task cancelled as the cluster closes, a lost
scheduler) go to INFO, as :class:`.watchdog.HandledLossNoise` does in the client's process."""
from __future__ import annotations

from .watchdog import install_loss_filter


def dask_setup(worker) -> None:
    install_loss_filter()
