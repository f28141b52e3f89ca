"""Set-up as one pass: data and options to a :class:`Plan` of the run, which
:func:`daskpty.api.reconstruct` then runs.

A plan holds what a run does, settled before its first epoch: the engine's adapter with its
parts, the chunking, rounds per epoch, persistence, layout (replicas or tiles) and device, the
initial or resumed state, the positions the chunks carry and the settings stored with the result.
:func:`draft_plan` settles what needs no cluster (the data, the sample, the parts, the resumed
store, the object's frame; bad input is refused before a cluster starts); :func:`settle_plan`
what the workers decide (their memory, their devices, the initial probe from the data) and
places the data on them.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engines.initial import (object_frame, probe_diameter_from_scan, probe_from_mean_hologram,
                              probe_from_mean_pattern)
from .engines.positions import PositionOptions
from .engines.sample_options import aperture_probe
from .execution import tile_halo
from .execution.cluster import live_workers, wait_for_workers
from .execution.data import (auto_rounds, choose_chunk_length, gpu_step_budget, gpu_steps_per_chunk, prepare_data,
                             several_workers_share_a_gpu, should_persist, worker_device_memory, workers_have_gpus)
from .execution.driver import with_local
from .execution.latency import enable_low_latency
from .execution.local_state import PatternLayout
from .execution.memory import (check_step_fits, clamp_chunk_length, held_shape, largest_fitting_chunk, state_bytes,
                               step_bytes, tiles_fit_where_replicas_do_not)
from .execution.options import ExecutionOptions
from .execution.parts import sample_model
from .execution.round_switch import may_switch
from .execution.scatter import scatter_in_memory
from .execution.tile_graph import TilesUnsupported, check_tiles_supported
from .io.checkpoint import extended_to, grown_canvas
from .io.dose import counts_per_lit_pixel, counts_per_pixel
from .io.export import geometry_from_metadata
from .io.inputs import (RESUMED_SETTINGS, check_initial_object, check_initial_probe, check_object_size, check_rounds,
                        check_resumed_modes, checked_data, resume_settings, resumed_store)
from .io.results import Reconstruction
from .io.safety import check_checkpoint_target, check_free_space, check_separate, reconstruction_bytes
from .io.validate import check_values, check_values_and
from .options import Options
from .physics import check_windows_inside, split_positions


@dataclass
class Plan:
    """What a run does (see the module docstring); ``state`` and ``chunked`` once settled."""

    opts: Options
    epochs: int
    adapter: Any                 # the engine with its parts (daskpty.execution.adapter)
    options: Any                 # the engine's validated options, as stored with the result
    execution: ExecutionOptions  # chunking, rounds, persistence, tiles, device (resolved when settled)
    thick: Any                   # the resolved sample: slices and detector
    checkpoint: Any              # the store the run writes (None: none)
    resumed: Reconstruction | None
    data: Any                    # the data set and its intensities, until placed on the workers
    intensities: Any
    n_patterns: int
    frame_positions: np.ndarray  # the nominal positions in the object's frame
    run_positions: np.ndarray    # the positions the chunks start from
    origin: np.ndarray
    object: Any                  # the initial object (the state holds it once settled)
    run_options: dict            # the settings stored with the result
    probe: Any = None            # the probe asked for and its modes (the initial probe is made when settled)
    probe_modes: int | None = None
    data_path: Any = None
    geometry: dict = field(default_factory=dict)
    layout: PatternLayout = field(default_factory=PatternLayout)
    state: Any = None
    chunked: Any = None
    #: rounds per epoch "auto" (drafted); settled: the run watches for one round per epoch
    #: once its probe is seen to vary (:mod:`daskpty.execution.round_switch`)
    one_round_once_varying: bool = False
    #: Σ of every intensity, from the value check's pass (None: not checked); the first epoch's
    #: probe rescale takes it instead of a pass of its own where it can
    #: (:meth:`daskpty.execution.adapter.Adapter.initialise_from_total`)
    data_total: float | None = None


def draft_plan(data, epochs, probe, object, probe_modes, opts: Options, live=None) -> Plan:
    """The plan as far as it needs no cluster; refuses bad input in one line."""
    eng, execution, run, sample, model = opts.engine, opts.execution, opts.run, opts.sample, opts.probe_model
    spec, checkpoint, resume = eng.spec(), run.checkpoint, run.resume
    data_path = data if isinstance(data, (str, os.PathLike)) else getattr(data, "path", None)
    if live is None:
        check_checkpoint_target(checkpoint, data_path)
    else:  # a live store's writer holds its lock while the run reads the committed frames
        check_checkpoint_target(checkpoint)
        if checkpoint is not None and data_path is not None:
            check_separate(checkpoint, data_path)
    if epochs == 0 and resume is None:
        checkpoint = None  # epochs=0 is a no-op: nothing is written (docs/reliability.md)
    refine = opts.positions  # (the features the engine takes were checked by resolve)
    _warn_late_start(epochs, refine, model)

    data, intensities, positions = checked_data(data)
    n = intensities.shape[-1]
    thick = sample.resolve(getattr(data, "metadata", None), n)  # slices and detector operator
    spec.check_features(multislice=thick.multislice)
    mask = getattr(data, "mask", None)
    valid = None if mask is None else np.asarray(mask, dtype=bool)
    if refine is not None:  # the window scale follows the start probe's size and the data's dose
        # (through slices both are held whatever the dose: the data are sampled once, below)
        unset = refine.window_scale is None or refine.scan_scale is None
        lit = counts_per_lit_pixel(intensities, valid) if unset and thick.n_slices == 1 else None
        refine = refine.for_start_probe(guessed=_probe_is_guessed(probe, data), slices=thick.n_slices,
                                        counts_per_lit_pixel=lit)
    dose = counts_per_pixel(intensities, valid) if thick.n_slices > 1 else None  # (defaults through slices follow it)
    if valid is not None and not thick.near_field:  # far field: DC at index 0
        valid = np.fft.ifftshift(valid)
    options, adapter = eng.make(positions=refine, probe_model=model, sample=sample_model(thick), valid=valid,
                                slices=thick.n_slices, counts_per_pixel=dose)
    if execution.tiles:  # before any work: what tiles cannot run yet is refused here
        check_tiles_supported(adapter)
    if model is not None:
        model.check_run(len(positions), options.probe_start_epoch is not None, eng.name)

    resumed = _resumed(resume, positions, n, probe_modes, epochs, live)
    rounds_auto = execution.rounds_per_epoch == "auto"
    if resumed is not None and live is None:  # the stored chunking, rounds and layout keep resume bit-identical
        execution = _resumed_execution(execution, resumed.options, opts.execution_given)
        rounds_auto = rounds_auto and bool(resumed.options.get("one_round_once_varying", False))
        if execution.tiles:  # (a tiled store resumed without tiles given)
            check_tiles_supported(adapter)
    check_rounds(execution.rounds_per_epoch, len(positions))
    execution = execution.replace(chunk_length=clamp_chunk_length(execution.chunk_length, len(positions)))
    obj, origin = _initial_object(object, resumed, thick, positions, n)
    frame_positions = positions + origin
    run_positions = _fixed_positions(resumed, refine, frame_positions)
    check_windows_inside(split_positions(run_positions, n)[0], n, obj.shape)
    if checkpoint is not None:
        check_free_space(checkpoint, reconstruction_bytes(obj.shape, (probe_modes or 1, n, n), len(positions)))
    run_options = _run_options(eng.name, epochs, eng.seed, execution, adapter.options, refine, model,
                               sample if thick.multislice else None)
    if resumed is not None and execution.rounds_per_epoch == 1 and "one_round_from_epoch" in resumed.options:
        run_options["one_round_from_epoch"] = resumed.options["one_round_from_epoch"]  # (round_switch)
    return Plan(opts, epochs, adapter, options, execution, thick, checkpoint, resumed, data, intensities,
                len(positions), frame_positions, run_positions, origin, obj, run_options, probe, probe_modes,
                getattr(data, "path", None), geometry_from_metadata(getattr(data, "metadata", None)),
                one_round_once_varying=rounds_auto)


def _resumed(resume, positions, n: int, probe_modes, epochs: int, live) -> Reconstruction | None:
    """The store a run resumes (None: a fresh start); a warning when it already holds the epochs."""
    if resume is None:
        return None
    if live is None:
        resumed = resumed_store(resume, positions, n, probe_modes)
    else:  # a scan that grows: the store holds its first frames
        resumed = _grown_resume(resume, positions, n, probe_modes)
    if resumed.epochs >= epochs:  # say so: no epoch runs
        warnings.warn(f"daskpty: {resume} already holds epoch {resumed.epochs} (epochs={epochs} counts "
                      f"the resumed epochs too): no epoch runs; pass epochs > {resumed.epochs} to "
                      f"continue", UserWarning, stacklevel=2)
    return resumed


def settle_plan(client, plan: Plan) -> Plan:
    """``plan`` settled on ``client``'s workers: persistence, rounds, tiles, device and chunk length from
    their memory and devices, the initial state, and the data placed on them in chunks."""
    opts, adapter, thick, resumed = plan.opts, plan.adapter, plan.thick, plan.resumed
    execution, run_options, obj = plan.execution, plan.run_options, plan.object
    data, intensities, n = plan.data, plan.intensities, plan.intensities.shape[-1]
    plan.data = plan.intensities = None  # (held here until placed on the workers)
    wait_for_workers(client)  # a cluster without workers: a bounded wait and one line, not a hang
    enable_low_latency(client)
    if not hasattr(intensities, "dask") or getattr(data, "path", "") is None:
        data, intensities = scatter_in_memory(client, data, intensities, execution.chunk_length)
    halo_reach = tile_halo.reach(adapter, n) + tile_halo.margin(adapter)  # (refined windows move)
    modes_hint = _probe_modes_hint(plan.probe, plan.probe_modes, resumed)
    if not execution.tiles and "tiles" not in opts.execution_given and resumed is None:
        execution = _tiles_by_default(client, execution, adapter, obj.shape, n, thick, halo_reach, modes_hint)
        if not execution.tiles:
            execution = tiles_on_a_shared_gpu(client, execution, adapter)
        run_options["tiles"] = bool(execution.tiles)
    tiles_of = len(live_workers(client)) if execution.tiles else None  # a row tile per worker
    execution = _resolve_persist_and_rounds(client, execution, intensities.nbytes, plan.n_patterns, n,
                                            held_shape(obj.shape, n, tiles_of, halo_reach), modes_hint, thick)
    # Persisted data are checked where they are placed (the source is read once), unless the start
    # state is computed from them: bad values then stop the run before that computation does.
    check_placed = opts.run.check_data and execution.persist and not _start_reads_intensities(plan, data)
    known = {}  # reductions of the intensities the start state takes, from the check's pass
    if opts.run.check_data and not check_placed:
        guessed = resumed is None and _probe_is_guessed(plan.probe, data)
        report, mean = check_values_and(intensities, [intensities.mean(axis=0, dtype=np.float64)] if guessed else [],
                                        client=client, where=getattr(data, "path", None))
        report.raise_if_bad()
        known = {"power": report.total / plan.n_patterns, **({"mean": mean[0]} if guessed else {})}
        plan.data_total = report.total
    plan.one_round_once_varying = may_switch(adapter, execution.rounds_per_epoch, plan.one_round_once_varying)
    run_options.update(rounds_per_epoch=execution.rounds_per_epoch, persist=execution.persist,
                       one_round_once_varying=plan.one_round_once_varying)
    # the brightness' smooth part of a varying probe follows the rounds per epoch
    adapter.probe_model = adapter.probe_model.for_rounds(execution.rounds_per_epoch, plan.one_round_once_varying)
    state = _initial_state(client, plan, data, intensities, known)
    object_shape, obj = obj.shape, None
    plan.object = None  # (the state holds it: one object-sized array less held)
    execution = _resolve_device_and_chunks(client, execution, plan.n_patterns, n, state.probe.shape[0], object_shape,
                                           thick, tiles_of, halo_reach,
                                           intensities.nbytes if execution.persist and tiles_of else 0,
                                           one_round_later=plan.one_round_once_varying)
    run_options.update(chunk_length=execution.chunk_length)
    # out of core: each chunk's task reads its own patterns from the store, in the run's order
    reader = data.intensities_in_chunks if hasattr(data, "intensities_in_chunks") and not execution.persist \
        else None
    chunked = prepare_data(client, intensities, plan.run_positions, chunk_length=execution.chunk_length,
                           modes=state.probe.shape[0], sort=execution.sort, persist=execution.persist,
                           device=execution.device, shift=not thick.near_field, row_bands=execution.tiles,
                           reader=reader)
    if check_placed:
        report = check_values(chunked.intensities, client=client, order=chunked.order,
                              where=getattr(data, "path", None))
        report.raise_if_bad()
        plan.data_total = report.total
    plan.layout.update(chunked)
    data = intensities = None  # the chunks live on the workers now: release scattered originals
    if resumed is not None and adapter.local_state:
        state = with_local(state, plan.layout.resumed_locals(adapter, chunked, resumed.positions,
                                                             resumed.engine_state))
    plan.execution, plan.state, plan.chunked = execution, state, chunked
    return plan


def _initial_state(client, plan: Plan, data, intensities, known=None):
    """The resumed store's state, or one from the initial object and a probe given or made from the data.

    ``known``: the intensities' ``mean`` pattern and mean ``power`` per pattern where already
    computed (by the value check's pass), else computed here."""
    adapter, resumed, eng = plan.adapter, plan.resumed, plan.opts.engine
    if resumed is not None:
        state = adapter.new_state(resumed.object, resumed.probe, resumed.epochs, resumed.engine_state)
        state.illumination = resumed.illumination
        return state
    reduce = _Reductions(client, intensities, known)
    first = _geometry_probe(plan.probe, data, reduce, plan.probe_modes, eng.seed, plan.opts.sample, plan.thick)
    return adapter.new_state(plan.object, first if first is not None else
                             _initial_probe(plan.probe, data, reduce, plan.probe_modes, eng.seed))


class _Reductions:
    """The intensities' mean pattern and mean power per pattern, each computed once on demand."""

    def __init__(self, client, intensities, known=None):
        self.client, self.intensities, self.known = client, intensities, dict(known or {})
        self.n = int(intensities.shape[-1])

    def mean(self) -> np.ndarray:
        if "mean" not in self.known:
            self.known["mean"] = self.client.compute(self.intensities.mean(axis=0, dtype=np.float64)).result()
        return np.asarray(self.known["mean"])

    def power(self) -> float:
        if "power" not in self.known:
            self.known["power"] = self.client.compute(
                self.intensities.sum(axis=(1, 2), dtype=np.float64).mean()).result()
        return float(self.known["power"])


def _start_reads_intensities(plan: Plan, data) -> bool:
    """Whether :func:`_initial_state` computes from the intensities (a probe from their mean, an
    aperture probe scaled to their power)."""
    if plan.resumed is not None:
        return False
    entrance = plan.probe is None and (getattr(data, "metadata", None) or {}).get("probe_plane") == "entrance"
    return isinstance(plan.probe, str) or _probe_is_guessed(plan.probe, data) or entrance


def _probe_is_guessed(probe, data) -> bool:
    """Whether the run's start probe is guessed from the data (no ``probe`` argument, none in
    the store), rather than given."""
    return probe is None and getattr(data, "probe", None) is None


def _initial_probe(probe, data, reduce: _Reductions, modes, seed):
    n = reduce.n
    if _probe_is_guessed(probe, data):
        diameter = probe_diameter_from_scan(data.positions, n)
        return probe_from_mean_pattern(reduce.mean(), modes=modes or 1, seed=seed, diameter=diameter)
    probe = check_initial_probe(getattr(data, "probe", None) if probe is None else probe, n)
    if modes and modes > probe.shape[0]:
        far = np.abs(np.fft.fftshift(np.fft.fft2(probe[0], norm="ortho"))) ** 2
        extra = probe_from_mean_pattern(far, modes=modes, seed=seed)[probe.shape[0]:]
        extra *= np.sqrt((np.abs(probe) ** 2).sum() / (np.abs(extra[0]) ** 2).sum() * 0.05)
        probe = np.concatenate([probe, extra.astype(np.complex64)])
    return probe


def _geometry_probe(probe, data, reduce: _Reductions, modes, seed, options, resolved):
    """The initial probe when the sample model decides it (``probe="aperture"``, or no probe for a
    near-field data set: :func:`daskpty.engines.initial.probe_from_mean_hologram`); else None (the
    single-slice default applies). A store's probe made from its optics at the entrance surface
    (``probe_plane: "entrance"``, as ``daskpty import --defocus`` writes it) is made again at a
    K-slice model's first screen, where the model's probe lives."""
    if probe is None and resolved.first_screen_m and getattr(data, "probe", None) is not None \
            and (getattr(data, "metadata", None) or {}).get("probe_plane") == "entrance":
        probe = "aperture"
    if isinstance(probe, str):
        if probe != "aperture":
            raise ValueError(f"probe must be an array, None or 'aperture', got {probe!r}")
        first = aperture_probe(getattr(data, "metadata", None), reduce.n, power=reduce.power(),
                               positions=data.positions,
                               aperture=options.aperture, first_screen_m=resolved.first_screen_m)
        return _more_modes(first, modes, seed)
    if probe is None and getattr(data, "probe", None) is None and resolved.near_field:
        return probe_from_mean_hologram(reduce.mean(), resolved.detector_kernel, modes=modes or 1, seed=seed)
    return None


def _more_modes(first, modes, seed):
    if not modes or modes <= first.shape[0]:
        return first
    rng = np.random.default_rng(seed)
    extra = []
    for _ in range(modes - first.shape[0]):
        mode = first[0] * np.exp(2j * np.pi * rng.random(first.shape[-2:]))  # same support, new phase
        extra.append(mode * np.sqrt(0.05 * (np.abs(first[0]) ** 2).sum() / max((np.abs(mode) ** 2).sum(), 1e-300)))
    return np.concatenate([first, np.asarray(extra, np.complex64)])


def _probe_modes_hint(probe, probe_modes, resumed) -> int:
    """Probe modes as far as known before the initial probe is built (for the rounds rule)."""
    if probe_modes:
        return int(probe_modes)
    if probe is not None and np.ndim(probe) == 3:
        return int(np.shape(probe)[0])
    if resumed is not None:
        return int(resumed.probe.shape[0])
    return 1


def _warn_late_start(epochs: int, positions, model) -> None:
    """One warning when position refinement or the probe model would start after the run ends."""
    for what, options, key in (("position refinement", positions, "refine_positions"),
                               ("the varying-probe fit", model, "probe_model")):
        if options is None:
            continue
        start = options.start_bounds()[0] if isinstance(options, PositionOptions) else options.start_epoch
        earliest = " at the earliest ('auto')" if options.start_epoch == "auto" else ""
        if epochs and start >= epochs:
            warnings.warn(f"daskpty: {what} starts at epoch {start}{earliest} but the run has {epochs} "
                          f"epochs, so it never runs; pass more epochs or {key}={{'start_epoch': ...}}",
                          UserWarning, stacklevel=2)  # past reconstruct and its lock wrapper


def _initial_object(given, resumed, thick, positions, n: int):
    """The object to start from and where position (0, 0) lies in it: the resumed store's, the
    caller's (positions then in its pixel frame) or ones covering every window plus a margin."""
    if resumed is not None:
        thick.check_resumed(resumed.object)
        return resumed.object, resumed.origin
    if given is not None:
        obj = np.array(given, dtype=np.complex64)
        if obj.ndim != 2 and not (obj.ndim == 3 and obj.shape[0] == thick.n_slices > 1):
            raise ValueError(f"object must be a 2-D array (or (slices, H, W)), got shape {obj.shape}")
        obj = thick.object_like(obj) if obj.ndim == 2 else obj
        check_initial_object(obj)
        check_object_size(obj.shape, positions, n, given=True)
        return obj, np.zeros(2)
    shape, origin = object_frame(positions, n)
    check_object_size(shape, positions, n, given=False)
    return thick.object_like(np.ones(shape, dtype=np.complex64)), origin


def _run_options(engine, epochs, seed, execution, options, positions, model, sample) -> dict:
    """The settings stored with the result (and read back by resume): ``options`` as the run
    resolved them for its slices and dose; the execution settings that depend on the cluster
    are filled in once they are resolved."""
    run = dict(engine=engine, epochs=epochs, rounds_per_epoch=execution.rounds_per_epoch, seed=seed,
               chunk_length=execution.chunk_length, split_every=execution.split_every, sort=execution.sort,
               tiles=bool(execution.tiles), **dataclasses.asdict(options))
    if positions is not None:
        run["refine_positions"] = dataclasses.asdict(positions)
    if model is not None:
        run["probe_model"] = dataclasses.asdict(model)
    if sample is not None:
        run["sample"] = sample.run_options()
    return run


def _resumed_execution(execution: ExecutionOptions, stored: dict, given) -> ExecutionOptions:
    """The execution settings of a resumed run: :data:`~daskpty.io.inputs.RESUMED_SETTINGS` and
    ``tiles`` left unset (not in ``given``) take the store's values, so a run resumed without
    ``--tiles`` keeps the tiled layout it was started with (and its bit-identity); one given and
    different is followed, with a warning that the result will not be bit-identical."""
    settings = {k: getattr(execution, k) for k in RESUMED_SETTINGS}
    settings["tiles"] = execution.tiles if "tiles" in given else None
    kept = resume_settings(stored, **settings)
    kept["tiles"] = bool(execution.tiles if kept["tiles"] is None else kept["tiles"])
    return execution.replace(**kept)


def _fixed_positions(resumed, refining, frame_positions):
    """The positions a run uses when it does not refine them: the nominal ``frame_positions``,
    or, when it resumes a store whose positions were refined, those refined positions, held
    fixed. A user who resumes without ``refine_positions`` asks to stop moving the positions,
    not to discard where refinement put them (up to a few pixels from the nominal ones, with
    the object reconstructed for them); passing ``refine_positions`` again refines on."""
    if resumed is None or refining is not None or resumed.nominal_positions is None:
        return frame_positions
    refined = np.asarray(resumed.positions, dtype=np.float64)
    return refined if refined.shape == frame_positions.shape else frame_positions


def _tiles_by_default(client, execution, adapter, object_shape, n, thick, reach, modes) -> ExecutionOptions:
    """Tiles, with one warning line, for a run that chose no layout when the whole object does
    not fit a worker beside a short step and one row tile per worker does (and the engine and
    its parts run on tiles); else ``execution`` as it is (the memory rule then refuses)."""
    workers = len(live_workers(client))
    if not tiles_fit_where_replicas_do_not(client, n, modes, object_shape, workers, thick.working_factor, reach):
        return execution
    try:
        check_tiles_supported(adapter)
    except TilesUnsupported:
        return execution
    warnings.warn(f"daskpty: the {object_shape[-2]} x {object_shape[-1]} object does not fit a worker whole; "
                  f"cutting it into {workers} row tiles, one per worker (tiles=False refuses instead)",
                  UserWarning, stacklevel=2)
    return execution.replace(tiles=True)


def tiles_on_a_shared_gpu(client, execution, adapter) -> ExecutionOptions:
    """Tiles for a run that chose no layout when it runs on GPUs and several of its workers share
    one (the stand-in for MIG slices, or workers started by hand on one device), and the engine
    and its parts run on tiles; else ``execution`` as it is.

    Replicas on one GPU repeat the same work: each worker holds the whole object and applies
    every round's update to it, so the GPU runs the apply and the epoch's end once per worker;
    on tiles each worker owns its rows, and the GPU runs them once in all."""
    gpu = execution.device == "gpu" or (execution.device == "auto" and workers_have_gpus(client))
    if not gpu or not several_workers_share_a_gpu(client):
        return execution
    try:
        check_tiles_supported(adapter)
    except TilesUnsupported:
        return execution
    warnings.warn("daskpty: several workers share a GPU: the object is cut into row tiles, one per worker "
                  "(tiles=False keeps whole-object replicas, tiles=True says so without this line)",
                  UserWarning, stacklevel=2)
    return execution.replace(tiles=True)


def _resolve_persist_and_rounds(client, execution, data_bytes, n_patterns, n, object_shape, modes_hint,
                                thick) -> ExecutionOptions:
    """``persist="auto"``: a worker's share of the data plus one step and the state under the
    spill target; ``rounds_per_epoch="auto"``: :func:`~daskpty.execution.data.auto_rounds`."""
    persist, rounds = execution.persist, execution.rounds_per_epoch
    if persist == "auto":
        length = execution.chunk_length or choose_chunk_length(client, n_patterns, n, modes_hint,
                                                                thick.working_factor)
        working = step_bytes(length, n, modes_hint, thick.working_factor) + state_bytes(object_shape)
        persist = should_persist(client, data_bytes, working_bytes=working)
    if rounds == "auto":
        rounds = auto_rounds(n_patterns, n, modes_hint, bool(persist), working_factor=thick.working_factor,
                             slices=thick.n_slices)
    return execution.replace(persist=bool(persist), rounds_per_epoch=rounds)


def _resolve_device_and_chunks(client, execution, n_patterns, n, modes, object_shape, thick,
                               tiles: int | None = None, reach: float = 0.0, data_bytes: int = 0,
                               one_round_later: bool = False) -> ExecutionOptions:
    """``device="auto"``: gpu when every worker sees one; the chunk length from the probe size and
    the workers' memory (shorter on small workers rather than a refusal); a step that cannot fit
    is refused here rather than stalling a worker (``tiles``: the object in that many row tiles;
    ``one_round_later``: a step may become a whole chunk, :mod:`~daskpty.execution.round_switch`)."""
    device, length = execution.device, execution.chunk_length
    device_bytes = worker_device_memory(client) if device != "cpu" else None   # (one query for both)
    if device == "auto":
        device = "gpu" if device_bytes is not None else "cpu"
    # A step is slice round::rounds of a chunk, but its object box spans the whole chunk's scan
    # area: only on GPUs (device memory to spare, a fixed cost per step) are chunks made longer.
    slices = gpu_steps_per_chunk(device, 1 if one_round_later else int(execution.rounds_per_epoch))
    if length is None:
        budget = gpu_step_budget(device_bytes) if device == "gpu" else None
        length = choose_chunk_length(client, n_patterns, n, modes, thick.working_factor, steps_per_chunk=slices,
                                     step_budget=budget)
        fitting = largest_fitting_chunk(client, n, modes, object_shape, thick.working_factor, tiles, reach,
                                        data_bytes)
        if fitting:
            length = min(length, fitting * slices)
    check_step_fits(client, length, n, modes, object_shape, thick.working_factor, tiles, rounds=slices, reach=reach,
                    data_bytes=data_bytes)
    return execution.replace(device=device, chunk_length=int(length))


def _grown_resume(path, positions, n: int, probe_modes) -> Reconstruction:
    """The store a growing scan's next snapshot continues from (:func:`reconstruct_snapshot`):
    extended to the frames ``positions`` and its canvas grown to cover them."""
    rec = Reconstruction.from_zarr(path)
    if tuple(np.shape(rec.probe)[-2:]) != (n, n):
        raise ValueError(f"the resume store {path} has a {np.shape(rec.probe)[-1]}-pixel probe but the data "
                         f"have {n}-pixel patterns; follow the data set it was made from")
    check_resumed_modes(path, np.shape(rec.probe)[0], probe_modes)
    return grown_canvas(extended_to(rec, positions, path), *object_frame(positions, n))


