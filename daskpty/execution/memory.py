"""Memory up front: will one chunk step and the state fit a worker, and may the data stay in memory?

A worker holds, besides the data chunks it keeps, one chunk step's working arrays
(:data:`WORKING_BYTES_PER_PIXEL` per pattern, mode and pixel) and the engine state:
the object and its companions (momentum, the epoch's start, the update's box, illumination),
about :data:`STATE_BYTES_PER_PIXEL` per object pixel; and a worker process its own
:data:`WORKER_PROCESS_BYTES`. dask pauses a worker at 80 % of its memory
limit (``distributed.worker.memory.pause``) and its nanny restarts it at 95 %; a run whose step
cannot fit under the pause threshold would only stall, so it is refused before it starts, with
the size that would fit. Data are persisted only when a worker's share of them plus that working
set stays under the spill target (60 %), so no worker is pushed over the thresholds by them.
"""
from __future__ import annotations

import math

import dask

from .cluster import live_workers

#: Bytes of working memory one chunk step needs per pattern, per mode and per pixel
#: (about ten complex64 arrays of the exit-wave shape).
WORKING_BYTES_PER_PIXEL = 80
#: Bytes per object pixel of one state copy and its apply: ~8 complex64 object-sized arrays.
STATE_BYTES_PER_PIXEL = 64
MIB = 2**20
#: The step (patterns) a refusal's "use at least N workers" assumes: short enough to leave the
#: memory to the state, long enough to keep the FFTs batched.
SHORT_STEP = 16
#: Memory of a worker process besides the data and the step's arrays: 84 MiB with Python, NumPy,
#: SciPy, dask and daskpty imported, but dask reported 117–151 MiB of unmanaged memory on workers
#: running chunk steps (FFT plans and scratch, the allocator's arenas: 180–220 MiB workers that
#: a 100 MiB allowance let start then paused at their limit). Counted for worker processes (with
#: a nanny) only; in-process workers share the client's process.
WORKER_PROCESS_BYTES = 150 * MIB


def smallest_worker_memory(client) -> int:
    """The smallest memory limit among the workers (0 when unknown or unlimited)."""
    workers = live_workers(client)
    limits = [w.get("memory_limit") or 0 for w in workers.values()]
    return int(min(limits)) if limits and all(limits) else 0


def _process_bytes() -> int:
    """(Runs on a worker.) Its resident memory once the engines a chunk step runs are imported."""
    import importlib

    import psutil

    for module in ("daskpty.execution.engine_registry", "daskpty.physics.kernels"):
        importlib.import_module(module)
    return int(psutil.Process().memory_info().rss)


def _baseline(client) -> int:
    """A worker process's own memory before it holds any data: the largest resident memory of the
    worker processes with daskpty's engines imported, less the data dask manages there, at least
    :data:`WORKER_PROCESS_BYTES`; 0 for in-process workers (they share the client's process).
    Measured because it varies: 117–151 MiB were seen on workers the constant alone let run,
    paused at their limit, for a whole run."""
    workers = {a: w for a, w in live_workers(client).items() if w.get("nanny")}
    if not workers:
        return 0
    try:
        rss = client.run(_process_bytes, workers=list(workers))
    except Exception:  # a worker that cannot answer: the constant, as before
        return WORKER_PROCESS_BYTES
    managed = {a: int((w.get("metrics") or {}).get("managed_bytes") or 0) for a, w in workers.items()}
    return max([WORKER_PROCESS_BYTES, *(int(rss[a]) - managed.get(a, 0) for a in rss)])


def _fraction(name: str, default: float) -> float:
    value = dask.config.get(f"distributed.worker.memory.{name}", default)
    return float(value) if value else default


def step_bytes(chunk_length: int, n: int, modes: int = 1, working_factor: float = 1.0) -> int:
    """Working bytes of one chunk step (``working_factor``: multislice's (2K + 4) / 3)."""
    return int(int(chunk_length) * int(modes) * n * n * WORKING_BYTES_PER_PIXEL * max(1.0, working_factor))


def state_bytes(object_shape) -> int:
    return int(math.prod(object_shape)) * STATE_BYTES_PER_PIXEL


def held_shape(object_shape, n: int, tiles: int | None = None, reach: float = 0.0) -> tuple:
    """The part of the object a worker holds: all of it (``tiles`` None), or with the object in
    ``tiles`` row tiles (:mod:`.tile_graph`) its strip and a halo of a window (n + 2 rows) on
    each side, for spatially ordered chunks spread evenly over the workers; ``reach``: rows more
    on each side (position refinement's largest displacement, :func:`.tile_halo.reach`)."""
    shape = tuple(int(s) for s in object_shape)
    if not tiles or tiles <= 1:
        return shape
    rows = min(shape[-2], math.ceil(shape[-2] / tiles) + 2 * (n + 2 + math.ceil(reach)))
    return shape[:-2] + (rows, shape[-1])


def fewest_tiles(limit: int, baseline: int, step: int, object_shape, n: int, most: int = 4096,
                 reach: float = 0.0, data_bytes: int = 0) -> int | None:
    """The fewest row tiles whose held part, one step, the worker process and a worker's share of
    ``data_bytes`` (the data kept in worker memory, one tile per worker) fit under the pause
    threshold of a worker of ``limit`` bytes (None: no number of tiles does)."""
    pause = _fraction("pause", 0.8) * limit
    for tiles in range(1, most + 1):
        share = data_bytes / tiles
        if state_bytes(held_shape(object_shape, n, tiles, reach)) + baseline + step + share <= pause:
            return tiles
        if held_shape(object_shape, n, tiles, reach)[-2] <= 2 * (n + 3 + math.ceil(reach)):  # only the halo is left
            return None
    return None


def check_step_fits(client, chunk_length: int, n: int, modes: int, object_shape,
                    working_factor: float = 1.0, tiles: int | None = None, rounds: int = 1,
                    reach: float = 0.0, data_bytes: int = 0) -> None:
    """Raise ValueError (one line, with what would fit) when one chunk step plus the state (of
    the whole object, or with ``tiles`` of one row tile and its halo) exceed the pause threshold
    of the smallest worker. A step holds one of the ``rounds`` subsets of a chunk. ``data_bytes``: data
    kept in worker memory beside a tile (its worker's share counted: ``data_bytes / tiles``).
    No-op when workers have no memory limit."""
    limit = smallest_worker_memory(client)
    if not limit:
        return
    rounds = max(1, int(rounds))
    pause = _fraction("pause", 0.8) * limit
    baseline = _baseline(client)
    held = held_shape(object_shape, n, tiles, reach)
    share = data_bytes / max(int(tiles or 1), 1)  # (a worker's chunks, kept beside its tile)
    state = state_bytes(held) + baseline + share
    step_length = -(-int(chunk_length) // rounds)
    step = step_bytes(step_length, n, modes, working_factor)
    need = step + state
    if need <= pause:
        return
    fits = int((pause - state) // step_bytes(1, n, modes, working_factor)) * rounds
    what = (f"a {held[-2]}-row tile of a {object_shape[-2]} x {object_shape[-1]} object" if tiles and tiles > 1
            else f"a {object_shape[-2]} x {object_shape[-1]} object")
    how = (f"or a chunk_length of at most {fits} patterns" if fits >= 1 else
           f"(the state of {what}{', its chunks of the data' if share else ''} and the worker process, "
           f"{state / MIB:.0f} MiB, do not fit alone)")
    # (with steps of at most SHORT_STEP patterns: chosen chunks shrink to fit, see largest_fitting_chunk)
    short = step_bytes(min(step_length, SHORT_STEP), n, modes, working_factor)
    fewest = fewest_tiles(limit, baseline, short, object_shape, n, reach=reach, data_bytes=data_bytes)
    if fewest is not None and fewest > max(1, tiles or 1):
        how += (f"; or cut the object into tiles (tiles=True) over at least {fewest} workers of this memory"
                if not tiles else f"; or use at least {fewest} workers of this memory")
    if share and state - share + short <= pause:  # (the tile and a short step fit without the data)
        how += "; or persist=False (each chunk read from the store in its round, none kept beside the tile)"
    raise ValueError(
        f"one chunk step of {step_length} patterns of {n}x{n} ({modes} mode(s))"
        f"{f' (a chunk of {chunk_length} in {rounds} rounds)' if rounds > 1 else ''} plus the state needs "
        f"about {need / MIB:.0f} MiB per worker, but the smallest worker pauses at {pause / MIB:.0f} MiB "
        f"({limit / MIB:.0f} MiB limit); give each worker at least {need / _fraction('pause', 0.8) / MIB:.0f} MiB "
        f"(memory_limit=, fewer workers per machine) {how}")


def tiles_fit_where_replicas_do_not(client, n: int, modes: int, object_shape, workers: int,
                                    working_factor: float = 1.0, reach: float = 0.0) -> bool:
    """Whether the whole object and a one-pattern step exceed the smallest worker's pause
    threshold (no chunk length fits) while one of ``workers`` row tiles (and its halo) beside a
    short step (:data:`SHORT_STEP` patterns) fits: a run that chose no layout then takes tiles
    rather than being refused."""
    limit = smallest_worker_memory(client)
    if not limit or workers < 2:
        return False
    baseline = _baseline(client)
    if state_bytes(object_shape) + baseline + step_bytes(1, n, modes, working_factor) <= _fraction("pause", 0.8) * limit:
        return False
    short = step_bytes(SHORT_STEP, n, modes, working_factor)
    fewest = fewest_tiles(limit, baseline, short, object_shape, n, reach=reach)
    return fewest is not None and fewest <= workers


def largest_fitting_chunk(client, n: int, modes: int, object_shape, working_factor: float = 1.0,
                          tiles: int | None = None, reach: float = 0.0, data_bytes: int = 0) -> int | None:
    """The most patterns per chunk whose step plus the state (``tiles``: of one row tile) fit under
    the smallest worker's pause threshold (None: no memory limit; 0: not even one pattern fits)."""
    limit = smallest_worker_memory(client)
    if not limit:
        return None
    room = (_fraction("pause", 0.8) * limit - state_bytes(held_shape(object_shape, n, tiles, reach)) - _baseline(client)
            - data_bytes / max(int(tiles or 1), 1))
    return max(0, int(room // step_bytes(1, n, modes, working_factor)))


def persist_fits(client, nbytes: int, working_bytes: int = 0, fraction: float = 0.5) -> bool:
    """``persist="auto"``: keep the data in worker memory when they take at most ``fraction`` of
    the cluster's memory and each worker's share of them plus ``working_bytes`` (one chunk step
    and the state) stays under the spill target. True when workers have no memory limit."""
    workers = live_workers(client)
    limits = [w.get("memory_limit") or 0 for w in workers.values()]
    if not limits or not all(limits):
        return True
    share = nbytes / len(limits)
    working_bytes += _baseline(client)
    return nbytes <= fraction * sum(limits) and share + working_bytes <= _fraction("target", 0.6) * min(limits)


def clamp_chunk_length(chunk_length: int | None, n_patterns: int) -> int | None:
    """A ``chunk_length`` longer than the data set is its length, with a warning saying so (not
    refused for the memory a chunk of that length would take, which it never needs)."""
    if chunk_length is None or chunk_length <= n_patterns:
        return chunk_length
    import warnings

    warnings.warn(f"chunk_length {chunk_length} is longer than the data set ({n_patterns} patterns); "
                  f"using one chunk of {n_patterns}", UserWarning, stacklevel=3)
    return int(n_patterns)
