"""Every error daskpty raises on purpose, in one place, grouped by what went wrong.

Each class says what happened; its message (one line) says what is kept and what to do. The
rules they carry out are those of docs/reliability.md: bad input is refused before anything is
written, a lost worker costs a restart and never a wrong result, a stop keeps the last complete
checkpoint. The command line maps them to exit codes in one table (``daskpty.cli.EXIT_CODES``):
2 for what the user can fix (input, options, stores, a cluster that cannot run the work, a run
that diverged or stalled), 3 for a live scan whose writer stopped, 130 for an interrupt.

This module imports nothing of daskpty, so every layer may raise these; the modules that raise
one also name it (``daskpty.io.validate.DataError`` is this module's ``DataError``).
"""
from __future__ import annotations


# --- input: data sets, stores and options -------------------------------------------------------

class DataError(ValueError):
    """A data set (store or arrays) is not usable; the message says what is wrong and how to fix it."""


class DamagedStoreError(DataError):
    """A store's file is missing or cannot be decoded; the message names it and what to do."""


class DataChanged(ValueError):
    """The data-set store was modified or replaced while a reconstruction was reading it."""


class OptionError(TypeError, ValueError):
    """A keyword given twice with different values, or one that names no setting. A TypeError,
    as Python's own for a bad keyword; also a ValueError, so the CLI reports it in one line."""


class TilesUnsupported(ValueError):
    """What was asked cannot run on tiles (yet); the message says what to change."""


# --- writing stores -----------------------------------------------------------------------------

class StoreLocked(FileExistsError):
    """Another process writes the store; the message names it."""


class StoreWriteError(OSError):
    """A store could not be written (disk full, read-only, no permission); one line saying what
    failed, where, and what is intact."""

    def __str__(self) -> str:
        return str(self.strerror)


class WriteCancelled(RuntimeError):
    """A shard write found its store being discarded (another shard failed)."""


# --- the cluster and the epoch loop -------------------------------------------------------------

class ReconstructionStalled(RuntimeError):
    """No epoch finished within the watchdog's bound, even after restarting it."""


class ClusterUnavailable(ReconstructionStalled):
    """The cluster cannot run the reconstruction: no worker within the wait, no dask scheduler at
    the address, or the scheduler gone. The message is one line saying what is missing."""


class SchedulerLost(ClusterUnavailable):
    """The connection to the dask scheduler is gone (the scheduler died or the network dropped)."""


class WorkersPaused(ClusterUnavailable):
    """Every worker stayed paused at its memory limit: the round cannot progress."""


class StateLost(RuntimeError):
    """An epoch's state is gone: the worker that held it died with it (the run itself goes on
    from an earlier copy, so a periodic checkpoint of that epoch is skipped)."""


class StaleRoundState(RuntimeError):
    """A fused round task did not find the state it continues on its worker (its worker was
    lost and one came back under the same address, or the task ran elsewhere); the driver
    restarts the epoch with the split graph."""


class TileWorkerLost(ConnectionError):
    """A worker that holds a tile of the running epoch left the cluster (its tasks, pinned to
    it, would wait for it forever): the epoch is started again on the workers there are."""


# --- the reconstruction's own numbers -----------------------------------------------------------

class ReconstructionDiverged(FloatingPointError):
    """The data loss of an epoch became NaN or infinite: the object or probe steps diverged."""


class PositionsDiverged(ValueError):
    """Position refinement moved a pattern too far from its nominal position (or to NaN)."""


class PositionsLeftTile(ValueError):
    """A refined position's window left the rows its tile holds (the halo)."""


class ProbeModelDiverged(ValueError):
    """A per-pattern probe weight or intensity factor became non-finite (or absurdly large)."""


# --- live scans ---------------------------------------------------------------------------------

class ScanStopped(RuntimeError):
    """The writer stopped without ending the scan; the last snapshot is kept in the result store."""


#: raised and handled inside a run (a restart, a discarded write); they never reach the user
HANDLED_INSIDE = (WriteCancelled, StaleRoundState, TileWorkerLost)


__all__ = ["HANDLED_INSIDE", "ClusterUnavailable", "DamagedStoreError", "DataChanged", "DataError", "OptionError",
           "PositionsDiverged", "PositionsLeftTile", "ProbeModelDiverged", "ReconstructionDiverged",
           "ReconstructionStalled", "ScanStopped", "SchedulerLost", "StaleRoundState", "StateLost",
           "StoreLocked", "StoreWriteError", "TileWorkerLost", "TilesUnsupported", "WorkersPaused",
           "WriteCancelled"]
