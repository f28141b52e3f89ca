"""Put diffraction data on the cluster in the engine's layout (chunk, sort, shift, persist)."""
from __future__ import annotations

import math

import dask.array as da
import numpy as np

from .cluster import live_workers
from .ordering import compact_order, row_band_order
from .memory import WORKING_BYTES_PER_PIXEL, persist_fits, smallest_worker_memory  # noqa: F401 (re-exported)
from .placement import balanced_worker
from .rounds import ChunkedData

#: Least work per chunk, in pattern-mode pixels (512 Ki: 128 patterns of 64², 32 of 128²). A chunk
#: task costs about a millisecond of scheduling whatever its size; below this the chunk steps of a
#: minibatch round are too short to hide it.
MIN_CHUNK_PIXELS = 2**19


def default_chunk_length(n_patterns: int, n: int, modes: int = 1, memory_budget: int = 512 * 2**20,
                         min_len: int = 64, target_chunks: int = 8, working_factor: float = 1.0) -> int:
    """Patterns per chunk: small enough for ``memory_budget`` per chunk step; for small data sets
    about ``target_chunks`` chunks (a power of two, so that they spread evenly over 1, 2, 4 or 8
    workers) of at least ``min_len`` patterns and :data:`MIN_CHUNK_PIXELS` pattern-mode pixels.
    Independent of the worker count, so the reduction order (and so the result) does not change
    with the cluster size. ``working_factor``: the chunk step's working set relative to the
    single-slice engine's (multislice with K slices: (2K + 4) / 3, see
    :attr:`daskpty.engines.sample_options.ResolvedSample.working_factor`); it divides the memory bound only.
    """
    per_pattern = WORKING_BYTES_PER_PIXEL * modes * n * n * max(1.0, float(working_factor))
    by_memory = max(1, int(memory_budget // per_pattern))
    least = max(min_len, math.ceil(MIN_CHUNK_PIXELS / (modes * n * n)))
    count = max(1, min(target_chunks, n_patterns // least))
    count = 2 ** int(math.log2(count))
    by_count = math.ceil(n_patterns / count)
    longest = int(max(1, min(by_memory, by_count, n_patterns)))
    # Near-equal chunks: N = 4,096 with at most 409 gives 10 × 410 − … rather than 10 × 409 + 6,
    # balancing workers and keeping the number of distinct FFT batch shapes (cuFFT plans) at two.
    return int(math.ceil(n_patterns / math.ceil(n_patterns / longest)))


#: Pattern-mode pixels of work a minibatch round should hold at least (6 Mi: 384 patterns of 128²),
#: so that the round's fixed costs (exchange of partials, apply, scheduling) stay small next to it.
ROUND_PIXELS = 6 * 2**20


#: Least work per minibatch round when a small data set is given minibatches anyway (1 Mi
#: pattern-mode pixels: 64 patterns of 128², 256 of 64²).
MINIBATCH_PIXELS = 2**20


def auto_rounds(n_patterns: int, n: int, modes: int = 1, persisted: bool = True,
                working_factor: float = 1.0, slices: int = 1) -> int:
    """``rounds_per_epoch="auto"``: minibatch rounds per epoch.

    About 150 patterns per update (N // 150, like Pty-Chi's default batches), but no more rounds
    than keep :data:`ROUND_PIXELS` of work in each (never fewer than 3), clipped to 1…16. A small
    data set (N < 450) gets 3 rounds when each still holds :data:`MINIBATCH_PIXELS` of work,
    else N // 150 (1 below 300: compact LSQML). Out of core: 1 (every round re-reads the data).
    Depends on the data only (N, pattern size, probe modes), never on the cluster.
    ``working_factor`` (multislice: (2K + 4) / 3) scales the work of a pattern in the work
    bounds: a K-slice pattern costs that many single-slice ones, so fewer make a full round.

    Measured on 1,600 × 128² (2 workers, equal wall time ≈ 15 s): R = 4 reached NRMSE 0.051,
    R = 10 0.069, R = 1 0.077; on 576 × 64² R = 3 is needed to match Pty-Chi per epoch (R = 2:
    0.17 vs 0.14 at 30). Small scans, mean half-set FRC over 0.1–0.6 Nyquist after 100 epochs
    (benchmarks/bench_defaults_frc.py, halves reconstructed apart): halves of 258 × 128² R = 3
    beat R = 1 (0.401 vs 0.373 at linear overlap 0.36, 0.953 vs 0.937 at 0.55; a measured
    far-field scan of that size 0.55 vs 0.30); halves of 250 × 64² (1 Mi pattern-pixels) did
    worse with R = 3 (0.874 vs 0.909 at overlap 0.5, 0.461 vs 0.608 at 10⁴ photons per pattern),
    and 150 × 128² with R = 2 (0.389 vs 0.398).

    K > 1 object slices: 1. The slices share their low spatial frequencies almost freely (the
    data fix their product there; the propagation between slices tells them apart only at high
    frequencies), and cyclic minibatches walk along that near-symmetry: on the 2-slice electron
    set of bench_vs_ptychi.py (1024 × 32², Poisson) the per-slice phase NRMSE at 10 / 30 / 60
    epochs is 0.116 / 0.069 / 0.070 with R = 1 but 0.079 / 0.085 / 0.094 with the rule above
    (R = 6 of that size: 0.090 / 0.117 / 0.144); on 256 patterns R = 1 / 3 / 6 end at 0.082 /
    0.119 / 0.195 (docs/benchmarks.md, multislice).

    A varying probe takes the plain rule (with eigen-probes the run goes on with one round per
    epoch once their weights show that the probe varies, :mod:`.round_switch`): with minibatch
    rounds the smooth part of each pattern's brightness over the scan (intensity factors, or the norm of the OPR weights) is
    left to the object (:meth:`daskpty.engines.probe_model.ProbeModelOptions.for_rounds`), so
    the rounds do not walk along it; one round per epoch would cost those runs the plain run's
    pace (ideal small preset, 576 × 64², constant beam: R = 1 alone is 1.36 / 1.61× the NRMSE
    of R = 3 at 30 / 60 epochs; OPR K = 2 at R = 1 1.37 / 1.64×, at R = 3 1.01 / 1.03×).
    """
    if not persisted or slices > 1:
        return 1
    by_batch = n_patterns // 150
    work = n_patterns * n * n * modes
    if working_factor != 1.0:
        work = int(work * float(working_factor))
    by_work = max(3, work // ROUND_PIXELS)
    small = 3 if work >= 3 * MINIBATCH_PIXELS else 1
    return int(np.clip(min(max(by_batch, small), by_work), 1, 16))


#: Most bytes of one chunk step's working set on a GPU (:func:`gpu_step_budget`): 3 GiB holds
#: 2,048 patterns of 128² (80 bytes a pixel), so that 262,144 of them take 128 steps an epoch at
#: 16 rounds (8 chunks) rather than 656 of 400 patterns under the host rule's 512 MiB.
GPU_STEP_BYTES = 3 * 2**30
#: Share of a GPU's (or MIG slice's) memory one step may take: the data, the state, cuFFT's work
#: area and the memory pool's slack need the rest, and several workers may share the device.
GPU_STEP_SHARE = 1 / 8


def gpu_step_budget(device_bytes: int | None) -> int | None:
    """The chunk step's memory budget on GPU workers whose smallest device has ``device_bytes``
    (None: unknown, the host rule's budget applies).

    A GPU chunk step costs about 6 ms whatever its size (kernel launches, Python and the task
    around them; one H100, 262,144 × 128²: 656 steps of ~400 patterns, 4.4 s an epoch, where the
    bandwidth floor of the same work is 0.55 s), so the step is made as long as the device allows:
    :data:`GPU_STEP_SHARE` of its memory, at most :data:`GPU_STEP_BYTES`. It depends on the
    device's size, not on how many workers share it, so that the chunks (and the reduction
    order) are the same for one worker or several on one kind of GPU."""
    if not device_bytes:
        return None
    return int(min(GPU_STEP_BYTES, int(device_bytes) * GPU_STEP_SHARE))


def worker_device_memory(client) -> int | None:
    """Bytes of the smallest CUDA device (GPU or MIG slice) any worker of ``client`` sees, from
    CuPy (None where a worker sees none, or there are no workers)."""
    def probe():
        try:
            import cupy

            return int(cupy.cuda.runtime.memGetInfo()[1])
        except Exception:
            return None

    sizes = list(client.run(probe).values())
    return min(sizes) if sizes and all(sizes) else None


def choose_chunk_length(client, n_patterns: int, n: int, modes: int = 1, working_factor: float = 1.0,
                        steps_per_chunk: int = 1, step_budget: int | None = None) -> int:
    """:func:`default_chunk_length` with a per-step budget of at most a quarter of the smallest
    worker's memory limit and ``step_budget`` (512 MiB when None; on GPUs :func:`gpu_step_budget`).

    ``steps_per_chunk``: a chunk is stepped through in that many slices (one per minibatch round),
    so the memory bound is on a slice and the chunk may be that many times longer (still at most
    N / 8 patterns). Used on GPUs (:func:`gpu_steps_per_chunk`)."""
    budget = int(step_budget or 512 * 2**20)
    smallest = smallest_worker_memory(client)
    if smallest:
        budget = min(budget, smallest // 4)
    return default_chunk_length(n_patterns, n, modes, memory_budget=budget * max(1, int(steps_per_chunk)),
                                working_factor=working_factor)


def gpu_steps_per_chunk(device: str, rounds: int) -> int:
    """How many slices of a chunk the chunk length may assume (:func:`choose_chunk_length`).

    On a GPU a chunk step costs about 5.7 ms whatever its size (kernel launches, Python, the
    task): on one H200, 16,384 × 128² in 41 chunks of 400 took 0.17 s per round whether a round
    stepped through 400 or 25 patterns of each chunk, and 65,536 × 128² in 161 chunks 0.85 s
    (docs/gpu.md). Longer chunks, one slice per round, keep the step the same size and divide
    that cost by the rounds. On CPUs the step's compute dominates: 1 (the chunks do not change);
    there a longer chunk would also cost host memory, as a step's object box spans the whole
    chunk's scan area (4 workers of 800 MiB on a 27 Mpx object: chunks of 480 instead of 120 at
    R = 4 took a worker past its limit)."""
    return max(1, int(rounds)) if device == "gpu" else 1


def _ifftshift_patterns(block):
    xp = np if type(block).__module__.split(".")[0] == "numpy" else __import__("cupy")
    return xp.fft.ifftshift(block, axes=(-2, -1))


def _to_device(block):
    """Host chunk → device, staged through page-locked (pinned) host memory.

    A copy from pageable memory goes through the driver's own small staging buffer; from pinned
    memory it is one DMA transfer at full bus speed. The pinned buffer comes from CuPy's pinned
    memory pool (reused across chunks) and is released only after the copy has finished. Counts
    keep their integer dtype on the device (cast inside the chunk kernel).
    """
    import cupy
    import cupyx

    block = np.ascontiguousarray(block)
    staging = cupyx.empty_pinned(block.shape, dtype=block.dtype)
    staging[...] = block
    out = cupy.empty(block.shape, dtype=block.dtype)
    stream = cupy.cuda.get_current_stream()
    out.set(staging, stream=stream)
    stream.synchronize()  # the staging buffer returns to the pool when this function ends
    return out


def workers_have_gpus(client) -> bool:
    """True when every worker of ``client`` sees a CUDA device through CuPy."""
    return worker_device_memory(client) is not None


def worker_gpus(client) -> dict:
    """Each worker's CUDA device, as ``(host, device)``: the first entry of the worker's
    ``CUDA_VISIBLE_DEVICES`` (a UUID or an index: dask-cuda and :func:`~.gpu.shared_device_cluster`
    set it), or None where it is unset."""
    def probe():
        import os

        first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        return first or None

    return {address: (None if device is None else (address.rsplit(":", 1)[0], device))
            for address, device in client.run(probe).items()}


def several_workers_share_a_gpu(client) -> bool:
    """Whether two or more workers of ``client`` run on one GPU (the same device of one host)."""
    devices = [d for d in worker_gpus(client).values() if d is not None]
    return len(devices) > len(set(devices))


def should_persist(client, nbytes: int, fraction: float = 0.5, working_bytes: int = 0) -> bool:
    """Persist the data when it takes at most ``fraction`` of the cluster's memory and each
    worker's share plus ``working_bytes`` stays under the spill target
    (:func:`~.memory.persist_fits`)."""
    return persist_fits(client, nbytes, working_bytes, fraction)


def prepare_data(client, intensities, positions, *, chunk_length: int | None = None, modes: int = 1,
                 sort: bool = True, persist: bool | str = "auto", device: str = "cpu",
                 shift: bool = True, row_bands: bool = False, reader=None) -> ChunkedData:
    """Chunk along N, order chunks spatially, move the zero frequency to index 0, persist.

    intensities: dask or NumPy array (N, n, n), DC at the centre (as recorded), counts stay in
    their dtype. positions: (N, 2) float64 in the object frame.
    persist: True keeps the chunks in worker memory (spilled by dask when needed); False re-reads
    them from their source (e.g. Zarr) every round — the out-of-core mode (data already scattered
    to the workers from memory are kept there: they have no source to re-read); "auto" persists when
    the data take at most half of the cluster's memory.
    device: "cpu" (NumPy chunks) or "gpu" (CuPy chunks on dask-cuda workers).
    shift: move the zero frequency to index 0 (far field); False keeps the patterns as recorded
    (near-field holograms are images: no shift).
    row_bands: order for tiles (:func:`~.ordering.row_band_order`): each worker's chunks a band
    of rows.
    reader: for data read from their store, ``reader(chunk_length, order)`` gives the patterns
    in that order (None: as stored) in chunks whose tasks read only their own patterns
    (:meth:`~daskpty.io.store.PtychoData.intensities_in_chunks`); without it the order is a
    dask fancy index, whose shuffle reads every source chunk an output chunk touches whole.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    positions = np.asarray(positions, dtype=np.float64)
    if not isinstance(intensities, da.Array):
        intensities = da.from_array(intensities, chunks=(chunk_length or len(positions), -1, -1))
    n_patterns, n = intensities.shape[0], intensities.shape[-1]
    if chunk_length is None:
        chunk_length = choose_chunk_length(client, n_patterns, n, modes)
    order = None
    if sort:  # compact chunks; for tiles also row bands per worker
        order = (row_band_order if row_bands else compact_order)(positions, chunk_length, n)
    if reader is not None:
        intensities = reader(chunk_length, order)
    elif order is not None:
        intensities = intensities[order]
    if order is not None:
        positions = positions[order]
    intensities = intensities.rechunk((chunk_length, -1, -1))
    if device == "gpu":
        # The blocks are CuPy on the workers; the graph's meta stays NumPy, as a CuPy meta would
        # create a CUDA context (and its device memory) in the client process.
        intensities = intensities.map_blocks(_to_device, dtype=intensities.dtype,
                                             meta=np.empty((0, 0, 0), dtype=intensities.dtype))
    if shift:
        intensities = intensities.map_blocks(_ifftshift_patterns, dtype=intensities.dtype,
                                             meta=intensities._meta)
    pos = da.from_array(positions, chunks=(intensities.chunks[0], 2))
    from distributed import futures_of, wait

    if persist == "auto":
        persist = should_persist(client, intensities.nbytes)
    if not persist and futures_of(intensities):
        # In-memory data scattered to the workers have no store to read again each round: a
        # chunk could not be read outside the graph that holds their futures. They are in worker
        # memory already, so they are kept there (persisted), shifted and in the engine's order.
        persist = True
    if persist:

        intensities = persist_balanced(client, intensities)
        pos = client.persist(pos)
        wait(futures_of([intensities, pos]))  # the futures' own client, default or not
    return ChunkedData(intensities, pos, positions, order, persist)


def persist_balanced(client, array: da.Array) -> da.Array:
    """Persist ``array`` (chunked along axis 0 only) with its chunks spread evenly over the
    workers: chunk i on worker ⌊i·W/n⌋ (contiguous runs, workers sorted by address; see
    :mod:`.placement`).

    ``client.persist`` leaves placement to the scheduler, which measured 5 : 3 chunks on 2
    workers; each round then waits for the busier worker. The restriction is loose (a lost
    worker's chunks are recomputed elsewhere). Falls back to ``client.persist`` when no worker
    is connected yet.
    """
    workers = sorted(live_workers(client))  # all, as chunk_annotations sees them
    blocks = list(array.to_delayed().ravel())
    if not workers or len(blocks) < 2:
        return client.persist(array)
    futures = []
    for w, worker in enumerate(workers):
        group = [b for i, b in enumerate(blocks) if balanced_worker(i, len(blocks), len(workers)) == w]
        if group:
            futures += client.compute(group, workers=[worker], allow_other_workers=True)
    rebuild, args = array.__dask_postpersist__()
    return rebuild({f.key: f for f in futures}, *args)
