"""How a reconstruction runs on the cluster: :class:`ExecutionOptions`.

One of the option groups of :func:`daskpty.reconstruct` (design.md, "Keep reconstruct
readable"): the engine's options live in ``LSQMLOptions`` / ``ADOptions``, the sample's in
``SampleOptions``, position refinement's in ``PositionOptions``, the varying probe's in
``ProbeModelOptions``. ``reconstruct`` takes these settings as keywords or as one group
(``execution=ExecutionOptions(...)`` or a dict) and validates them here, once, before any work
starts. Apart from ``rounds_per_epoch`` (compact LSQML or minibatches) and
``chunk_length`` / ``split_every`` (the order of float32 sums), none of them changes the result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

DEVICES = ("auto", "cpu", "gpu")


def _integer(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class ExecutionOptions:
    """Where and how the epochs run (see :func:`daskpty.reconstruct` for each setting).

    n_workers: worker processes of an embedded cluster (None: one per core).
    chunk_length: patterns per chunk (None: from the probe size and the workers' memory).
    rounds_per_epoch: updates per epoch, an integer ≥ 1 or ``"auto"``.
    persist: keep the chunks in worker memory (True), re-read them every round (False), or
        ``"auto"``.
    device: ``"auto"``, ``"cpu"`` (NumPy chunks) or ``"gpu"`` (CuPy chunks).
    split_every: fan-in of the tree reduction (None: 4 for up to 16 chunks, else 8).
    sort: order the patterns along a Morton curve when that makes chunks more compact.
    tiles: cut the object into row tiles, one per worker, instead of a whole copy on every
        worker; only tile borders and small sums travel (:mod:`daskpty.execution.tile_graph`).
    """

    n_workers: int | None = None
    chunk_length: int | None = None
    rounds_per_epoch: int | str = "auto"
    persist: bool | str = "auto"
    device: str = "auto"
    split_every: int | None = None
    sort: bool = True
    tiles: bool = False

    def __post_init__(self):
        def check(ok, message):
            if not ok:
                raise ValueError(message)

        r = self.rounds_per_epoch
        check(r == "auto" or _integer(r) and r >= 1,
              f"rounds_per_epoch must be an integer >= 1 or 'auto', got {r!r}")
        check(self.n_workers is None or _integer(self.n_workers) and self.n_workers >= 1,
              f"n_workers must be an integer >= 1, got {self.n_workers!r}")
        check(self.persist is True or self.persist is False or self.persist == "auto",
              f"persist must be True, False or 'auto', got {self.persist!r}")
        for name, least in (("chunk_length", 1), ("split_every", 2)):
            v = getattr(self, name)
            check(v is None or _integer(v), f"{name} must be an integer, got {v!r}")
            check(v is None or v >= least, f"{name} must be >= {least}, got {v!r}")
        check(isinstance(self.device, str) and self.device in DEVICES,
              f"device must be one of {DEVICES}, got {self.device!r}")
        for name in ("sort", "tiles"):
            v = getattr(self, name)
            check(isinstance(v, (bool, np.bool_)), f"{name} must be True or False, got {v!r}")

    def replace(self, **changes) -> "ExecutionOptions":
        """These options with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
