"""The driver's epoch-state handle as io sees it: a protocol and the one error its ``get`` raises.

Kept apart from :mod:`.checkpoint` (which loads zarr) so the CLI can name :class:`StateLost`
among its one-line errors without loading zarr at start.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..faults import StateLost  # noqa: F401 (also named here)


@runtime_checkable
class EpochHandle(Protocol):
    """What a callback with ``takes_epoch_state = True`` receives after an epoch
    (``daskpty.execution.driver.EpochState``): the epoch counter at once, the state on ``get()``,
    which raises :class:`StateLost` when the state died with its worker."""

    epoch: int

    def get(self): ...


__all__ = ["EpochHandle", "StateLost"]
