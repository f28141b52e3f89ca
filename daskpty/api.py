"""Library entry point: :func:`reconstruct`."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings

import numpy as np

from .engines.initial import (object_frame, probe_diameter_from_scan, probe_from_mean_hologram,
                              probe_from_mean_pattern)
from .engines.positions import PositionOptions, PositionsDiverged
from .engines.probe_model import ProbeModelDiverged, effective_weights
from .engines.sample_options import aperture_probe
from .engines.specs import DEFAULT_ENGINE
from .execution.cluster import client_context, current_client, live_workers, wait_for_workers
from .execution.data import (auto_rounds, choose_chunk_length, gpu_steps_per_chunk, prepare_data, should_persist,
                             workers_have_gpus)
from .execution.driver import run_epochs, with_local
from .execution.latency import enable_low_latency
from .execution.local_state import PatternLayout
from .execution.memory import (check_step_fits, clamp_chunk_length, held_shape, largest_fitting_chunk, state_bytes,
                               step_bytes, tiles_fit_where_replicas_do_not)
from .execution.options import ExecutionOptions
from .execution.parts import sample_model
from .execution.scatter import scatter_in_memory
from .execution import tile_halo
from .execution.tile_graph import TilesUnsupported, check_tiles_supported
from .execution.watchdog import ReconstructionDiverged, ReconstructionStalled, check_finite_result
from .io.checkpoint import Checkpointer, extended_to, grown_canvas, sigterm_as_interrupt
from .io.epoch_handle import StateLost
from .io.export import geometry_from_metadata
from .io.identity import DataChanged, DataWatch
from .io.inputs import (RESUMED_SETTINGS, check_initial_object, check_initial_probe, check_object_size, check_rounds,
                        check_resumed_modes, checked_data, resume_settings, resumed_store)
from .io.lock import StoreLock
from .io.results import Reconstruction
from .io.safety import check_checkpoint_target, check_free_space, check_separate, reconstruction_bytes
from .io.validate import check_values
from .monitor.progress import interactive, make_progress
from .options import DEFAULT_EPOCHS, Options, resolve
from .physics import check_windows_inside, split_positions



def _probe_is_guessed(probe, data) -> bool:
    """Whether the run's start probe is guessed from the data (no ``probe`` argument, none in
    the store), rather than given."""
    return probe is None and getattr(data, "probe", None) is None


def _initial_probe(probe, data, client, intensities, modes, seed):
    n = intensities.shape[-1]
    if _probe_is_guessed(probe, data):
        mean = client.compute(intensities.mean(axis=0, dtype=np.float64)).result()
        diameter = probe_diameter_from_scan(data.positions, n)
        return probe_from_mean_pattern(np.asarray(mean), modes=modes or 1, seed=seed, diameter=diameter)
    probe = check_initial_probe(getattr(data, "probe", None) if probe is None else probe, n)
    if modes and modes > probe.shape[0]:
        far = np.abs(np.fft.fftshift(np.fft.fft2(probe[0], norm="ortho"))) ** 2
        extra = probe_from_mean_pattern(far, modes=modes, seed=seed)[probe.shape[0]:]
        extra *= np.sqrt((np.abs(probe) ** 2).sum() / (np.abs(extra[0]) ** 2).sum() * 0.05)
        probe = np.concatenate([probe, extra.astype(np.complex64)])
    return probe


def _geometry_probe(probe, data, client, intensities, modes, seed, options, resolved):
    """The initial probe when the sample model decides it (``probe="aperture"``, or no probe for a
    near-field data set: :func:`daskpty.engines.initial.probe_from_mean_hologram`); else None (the
    single-slice default applies)."""
    if isinstance(probe, str):
        if probe != "aperture":
            raise ValueError(f"probe must be an array, None or 'aperture', got {probe!r}")
        n = intensities.shape[-1]
        power = float(client.compute(intensities.sum(axis=(1, 2), dtype=np.float64).mean()).result())
        first = aperture_probe(getattr(data, "metadata", None), n, power=power, positions=data.positions,
                               aperture=options.aperture)
        return _more_modes(first, modes, seed)
    if probe is None and getattr(data, "probe", None) is None and resolved.near_field:
        mean = client.compute(intensities.mean(axis=0, dtype=np.float64)).result()
        return probe_from_mean_hologram(np.asarray(mean), resolved.detector_kernel, modes=modes or 1, seed=seed)
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
    """The settings stored with the result (and read back by resume); the execution settings
    that depend on the cluster are filled in once they are resolved."""
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


def _result_maker(layout, adapter, thick, frame_positions, origin, run_options, fixed_positions=None, live=None,
                  geometry=None):
    """``make_result(state, history)``: the :class:`Reconstruction` of a state (for checkpoints
    and the end), per-pattern state gathered from the chunks' layout. ``fixed_positions``: the
    positions a run without refinement used when they are not the nominal ``frame_positions``
    (a refined store resumed: :func:`_fixed_positions`); the nominal ones stay recorded.
    ``live``: a snapshot of a growing scan records it with the frames used and the time.
    ``geometry``: the data's geometry, stored so that exports describe it without the data."""
    fixed = frame_positions if fixed_positions is None else fixed_positions
    moved = fixed is not frame_positions

    def make_result(state, history):
        refined, pattern_state = layout.result_arrays(state)
        engine_state = {**adapter.engine_state(state), **pattern_state}
        weights = engine_state.get("pattern_opr_weights")
        return Reconstruction(object=thick.public(state.object), probe=state.probe,
                              positions=fixed if refined is None else refined,
                              origin=origin, illumination=thick.public(state.illumination), history=history,
                              options=run_options, epoch=state.epoch,
                              engine_state=engine_state,
                              nominal_positions=frame_positions if refined is not None or moved else None,
                              probe_weights=None if weights is None else
                              effective_weights(weights, engine_state.get("opr_weight_transform")),
                              live=None if live is None else
                              {**live, "frames_used": len(frame_positions), "snapshot_unix": time.time()},
                              geometry=geometry)

    return make_result


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


def _callbacks(checkpointer, callback, data_path, progress, frames: int | None = None) -> list:
    """Per-epoch callbacks in their order: the data watch first (no checkpoint of an epoch that
    read changed data; ``frames``: those the run reads, of a live store), the checkpointer,
    ``progress`` (a callback or None), the caller's."""
    callbacks = [checkpointer]
    if progress is not None:
        callbacks.append(progress)
    if callback is not None:
        callbacks.append(callback)
    if data_path:  # the store must not change under the run
        callbacks.insert(0, DataWatch(data_path, frames))
    return callbacks


def _progress(progress, epochs: int, resumed, n_patterns: int, loss: str):
    """The progress callback, or None: ``progress`` None shows it when the session is interactive
    (a terminal or a notebook); a resumed run counts on from its stored epoch."""
    if progress is None:
        progress = interactive()
    if not progress:
        return None
    return make_progress(epochs, n_patterns, start_epoch=resumed.epochs if resumed is not None else 0, loss=loss)


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
                               tiles: int | None = None, reach: float = 0.0, data_bytes: int = 0) -> ExecutionOptions:
    """``device="auto"``: gpu when every worker sees one; the chunk length from the probe size and
    the workers' memory (shorter on small workers rather than a refusal); a step that cannot fit
    is refused here rather than stalling a worker (``tiles``: the object in that many row tiles)."""
    device, length = execution.device, execution.chunk_length
    if device == "auto":
        device = "gpu" if workers_have_gpus(client) else "cpu"
    # A step is slice round::rounds of a chunk, but its object box spans the whole chunk's scan
    # area: only on GPUs (device memory to spare, a fixed cost per step) are chunks made longer.
    slices = gpu_steps_per_chunk(device, int(execution.rounds_per_epoch))
    if length is None:
        length = choose_chunk_length(client, n_patterns, n, modes, thick.working_factor, steps_per_chunk=slices)
        fitting = largest_fitting_chunk(client, n, modes, object_shape, thick.working_factor, tiles, reach,
                                        data_bytes)
        if fitting:
            length = min(length, fitting * slices)
    check_step_fits(client, length, n, modes, object_shape, thick.working_factor, tiles, rounds=slices, reach=reach,
                    data_bytes=data_bytes)
    return execution.replace(device=device, chunk_length=int(length))


def _saying_what_is_kept(exc, checkpoint, checkpointer):
    """``exc`` again, its message ending with which checkpoint survives the stop."""
    kept = (f"the checkpoint {checkpoint} of epoch {checkpointer.written_epoch} is kept"
            if checkpointer.written_epoch is not None else "no checkpoint was written")
    return type(exc)(f"{exc}; {kept}")


def reconstruct(data, engine=DEFAULT_ENGINE, epochs: int = DEFAULT_EPOCHS, *, probe=None, object=None,
                probe_modes: int | None = None, refine_positions=False, probe_model=None, sample=None,
                execution=None, run=None, client=None, **shortcuts) -> Reconstruction:
    """Reconstruct object and probe from a ptychography data set on a dask cluster.

    The settings come in groups by concern (`daskpty.options`): ``engine``, ``probe_model``,
    ``refine_positions``, ``sample``, ``execution`` and ``run``, each an instance of its frozen
    class or a dict of its fields, validated before any work starts. The common settings are also
    keyword shortcuts (below, under their group). One merge rule for all of them: a shortcut may
    repeat a value its group sets but not change it (an `daskpty.options.OptionError` naming
    both); a keyword that names no setting is an OptionError with the close matches.

    Parameters
    ----------
    data : str or PtychoData
        A daskpty data-set store path (see `daskpty.open_data`) or an opened data set.
    engine : str, dict or EngineOptions
        The engine group (`daskpty.options.EngineOptions`), or just its name: "lsqml" (least-squares
        maximum likelihood, Odstrčil et al. 2018), "ad" (gradient descent with exact hand-written
        adjoints), or the PIE family in minibatch rounds: "rpie" (Maiden et al. 2017) and "epie",
        its alpha = 1 case (probe modes, position refinement, multislice and near field; no
        varying probe yet). The table of engines is `daskpty.execution.engine_registry.ENGINES`.
        Shortcuts: ``noise`` ("gaussian" | "poisson": the LSQML far-field correction, the AD
        default loss and the reported loss); ``loss``, ``optimizer``, ``lr`` (AD only:
        "gaussian" | "poisson" | "intensity", default ``noise``; "sgd" (Nesterov; default) |
        "adam" (default for the intensity loss) | "cg"; the object step size); ``seed`` (every
        random choice, e.g. extra probe modes; the engines are deterministic); ``rescale_probe``
        (scale the probe so that the model's total intensity matches the data before epoch 1);
        and any field of the engine's options class: `daskpty.engines.lsqml.LSQMLOptions` (beta,
        delta, momentum, ...), `daskpty.engines.ad.ADOptions` (probe_lr, schedule, ...),
        `daskpty.engines.pie.PIEOptions` (alpha, probe_alpha, object_step, ...).
    epochs : int
        Total number of passes over all patterns (when resuming, including those already done).
    probe : array or "aperture", optional
        Initial probe (n, n) or (M, n, n). Default: the store's ``probe`` if present, else derived
        from the mean diffraction pattern (`daskpty.engines.initial.probe_from_mean_pattern`; near
        field: `probe_from_mean_hologram`). "aperture": from the data's geometry
        (`daskpty.physics.probes.probe_from_geometry`, settings in ``sample.aperture``).
    object : array, optional
        Initial object (H, W); positions are then in its pixel frame. Default: ones, sized to
        cover every probe window plus a margin; ``result.origin`` says where position (0, 0) lies.
    probe_modes : int, optional
        Number of incoherent probe modes (default: those of ``probe``, else 1).
    probe_model : dict or ProbeModelOptions, optional
        A probe that varies over the scan (`daskpty.engines.probe_model.ProbeModelOptions`).
        Shortcuts: ``opr_modes`` K modes of orthogonal probe relaxation (the mean probe and
        K − 1 eigen-probes with per-pattern weights, ``result.probe_weights`` (N, K)),
        ``fit_intensity`` a per-pattern intensity factor (``result.intensity_scale``),
        ``background`` (None, "constant", "pixel") a fitted background added to the model
        intensity; the group holds the rest (``start_epoch``, ``weight_step``, ...).
    refine_positions : bool, dict or PositionOptions
        Refine the scan positions: True for the defaults, or a dict / instance of
        `daskpty.engines.positions.PositionOptions` (``start_epoch``: LSQML ``"auto"``, the
        epoch after the probe has settled, between 3 and 10; AD 5; ``max_step`` 0.3 px per
        epoch, ``gain``, ``regularization``, ``momentum``, ``optimizer``/``lr`` for AD; the
        affine fit (``affine``, ``affine_gain``: LSQML 6, AD 2, ``affine_blend``), the window
        correction (``window_gain``; ``window_every``: LSQML every epoch, AD every 2nd;
        ``window_scale``, by default on when the run starts from a given or stored probe and off
        when the probe is guessed from the data), ``remove_drift``, ``max_displacement``). Each
        chunk's positions are updated on the worker holding its data; ``result.positions`` are
        the refined ones, ``result.nominal_positions`` the measured ones.
    sample : dict or SampleOptions, optional
        Thick samples and detector geometry (`daskpty.options.SampleOptions`). Shortcuts:
        ``slices`` K object slices ``slice_spacing_m`` apart (multislice; wavelength and object
        pixel size from the data's metadata); ``result.object`` is then (K, H, W). The group
        holds further fields (``detector``, ``aperture``, ...). A near-field data set (metadata
        ``detector="near_field"``) uses the near-field detector operator, also with one slice.
        Every combination of slices or near field with position refinement and a varying probe
        is taken.
    execution : dict or ExecutionOptions, optional
        Where and how the epochs run (`daskpty.execution.options.ExecutionOptions`), e.g. kept by
        analysis code and reused across runs. Shortcuts: ``n_workers`` (worker processes of the
        embedded cluster; default one per core); ``chunk_length`` (patterns per chunk; default
        from the probe size and a memory budget, independent of the number of workers, so
        results are too); ``rounds_per_epoch`` (1 = compact LSQML, one update per epoch from
        all patterns; R > 1 = minibatches, round r using every R-th pattern of each chunk along a Hilbert curve through its positions; "auto",
        :func:`daskpty.execution.data.auto_rounds`: when the data are persisted about 150
        patterns per update (N // 150, like Pty-Chi's default batches) but at most one round per
        6 Mi pattern-pixels (at least 3), clipped to 1…16; a small data set (under 450 patterns)
        gets 3 rounds when each still holds 1 Mi pattern-pixels, else compact LSQML; 1 out of
        core, with several object slices and with OPR weights or intensity factors; depends only
        on the data and the model, not on the cluster); ``persist`` (keep the chunks in worker
        memory: True, re-read them every round: False, or "auto": when they take at most half
        the cluster memory); ``device`` ("auto" | "cpu" | "gpu": gpu when every worker sees
        one); ``split_every`` (fan-in of the tree reduction; default 4 for up to 16 chunks,
        else 8); ``sort`` (order the patterns along a Morton curve when that makes chunks more
        compact); ``tiles`` (cut the object into row tiles, one per worker, instead of a copy
        on every worker: only tile borders travel; LSQML with fixed positions so far, with every
        sample model and probe model).
    run : dict or RunOptions, optional
        How the run is kept and watched (`daskpty.options.RunOptions`). Shortcuts:
        ``checkpoint`` (a reconstruction store updated atomically every ``checkpoint_every``
        epochs (default 10), at the end and on Ctrl-C / SIGTERM); ``resume`` (a store to continue
        from; the same settings give a result bit-identical to an uninterrupted run: chunking,
        rounds, fan-in and ``tiles`` left unset are the store's, ``probe_modes`` other than the
        store's are refused, and refined positions stay, fixed, without ``refine_positions``);
        ``progress`` (epoch, loss, patterns/s and ETA on stderr, a tqdm bar when tqdm is
        installed and the session is interactive, else one line per epoch; default None: on
        when attached to a terminal or a notebook; with ``noise="poisson"`` the loss is the
        Poisson NLL up to a constant, labelled "loss (Poisson NLL + const)"); ``dashboard``
        (publish progress, loss, object and probe to the dask dashboard's ``/daskpty`` page, and
        dask events, Prometheus gauges; the link goes to stderr); ``callback``
        (``callback(epoch, state, metrics)`` after every epoch, False stops; a callback with
        ``takes_epoch_state = True`` gets a handle, ``.get()`` fetches the state, so epochs it
        does not look at stay on the workers); ``check_data`` (read every intensity once first
        and refuse NaN, infinite or negative values and damaged chunks; default True).
    client : distributed.Client, optional
        Default: the current client, else an embedded LocalCluster of ``n_workers`` processes
        (127.0.0.1 only) that is closed at the end.

    Returns
    -------
    Reconstruction
        Object, probe, positions in the object frame, origin, illumination and history.
    """
    opts = resolve(engine, refine_positions=refine_positions, probe_model=probe_model, sample=sample,
                   execution=execution, run=run, **shortcuts)
    return _start(data, epochs, probe, object, probe_modes, client, opts)


def reconstruct_snapshot(data, epochs: int, *, live: dict, engine=DEFAULT_ENGINE, probe=None, object=None,
                         probe_modes: int | None = None, client=None, **options) -> Reconstruction:
    """One snapshot of a scan still being written (:func:`daskpty.workflows.follow`):
    :func:`reconstruct` of the frames committed so far, where ``resume`` may hold fewer of them.

    The resumed store must hold the first frames of ``data``: its object canvas grows to cover
    the new frames (the origin moves by whole pixels, new pixels start at one), the new frames'
    per-pattern state (refined positions, OPR weights, intensity factors) starts from its
    initial value, and the execution settings are the given ones, not the store's (the data
    changed, so bit-identity with the store's run is moot). The result, and every checkpoint,
    records ``live`` (e.g. when following began) with ``frames_used`` and ``snapshot_unix``.
    """
    opts = resolve(engine, **options)
    return _start(data, epochs, probe, object, probe_modes, client, opts, live=dict(live))


def _start(data, epochs, probe, object, probe_modes, client, opts: Options, live=None) -> Reconstruction:
    """Check the counts, take the checkpoint's lock and run."""
    if not isinstance(epochs, (int, np.integer)) or epochs < 0:
        raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
    if probe_modes is not None and (not isinstance(probe_modes, (int, np.integer)) or probe_modes < 1):
        raise ValueError(f"probe_modes must be an integer >= 1, got {probe_modes!r}")
    if opts.run.checkpoint is None:
        return _reconstruct(data, epochs, probe, object, probe_modes, client, opts, live)
    with StoreLock(opts.run.checkpoint):  # one writer per store (daskpty.io.lock)
        return _reconstruct(data, epochs, probe, object, probe_modes, client, opts, live)


def _grown_resume(path, positions, n: int, probe_modes) -> Reconstruction:
    """The store a growing scan's next snapshot continues from (:func:`reconstruct_snapshot`):
    extended to the frames ``positions`` and its canvas grown to cover them."""
    rec = Reconstruction.from_zarr(path)
    if tuple(np.shape(rec.probe)[-2:]) != (n, n):
        raise ValueError(f"the resume store {path} has a {np.shape(rec.probe)[-1]}-pixel probe but the data "
                         f"have {n}-pixel patterns; follow the data set it was made from")
    check_resumed_modes(path, np.shape(rec.probe)[0], probe_modes)
    return grown_canvas(extended_to(rec, positions, path), *object_frame(positions, n))


def _reconstruct(data, epochs, probe, object, probe_modes, client, opts: Options, live=None) -> Reconstruction:
    """:func:`reconstruct` with its settings resolved (and the checkpoint's lock held)."""
    eng, execution, run, sample, model = opts.engine, opts.execution, opts.run, opts.sample, opts.probe_model
    spec, engine, checkpoint, resume = eng.spec(), eng.name, run.checkpoint, run.resume
    data_path = data if isinstance(data, (str, os.PathLike)) else getattr(data, "path", None)
    if live is None:
        check_checkpoint_target(checkpoint, data_path)
    else:  # a live store's writer holds its lock while the run reads the committed frames
        check_checkpoint_target(checkpoint)
        if checkpoint is not None and data_path is not None:
            check_separate(checkpoint, data_path)
    if epochs == 0 and resume is None:
        checkpoint = None  # epochs=0 is a no-op: nothing is written (docs/reliability.md)
    positions_options = opts.positions  # (the features the engine takes were checked by resolve)
    _warn_late_start(epochs, positions_options, model)

    data, intensities, positions = checked_data(data)
    n = intensities.shape[-1]
    thick = sample.resolve(getattr(data, "metadata", None), n)  # slices and detector operator
    spec.check_features(multislice=thick.multislice)
    if positions_options is not None:  # the window scale follows the start probe's size
        positions_options = positions_options.for_start_probe(guessed=_probe_is_guessed(probe, data))
    mask = getattr(data, "mask", None)
    valid = None if mask is None else np.asarray(mask, dtype=bool)
    if valid is not None and not thick.near_field:  # far field: DC at index 0
        valid = np.fft.ifftshift(valid)
    options, adapter = eng.make(positions=positions_options, probe_model=model, sample=sample_model(thick),
                                valid=valid, slices=thick.n_slices)
    if execution.tiles:  # before any work: what tiles cannot run yet is refused here
        check_tiles_supported(adapter)
    if model is not None:
        model.check_run(len(positions), options.probe_start_epoch is not None, engine)

    if resume is None:
        resumed = None
    elif live is None:
        resumed = resumed_store(resume, positions, n, probe_modes)
    else:  # a scan that grows: the store holds its first frames
        resumed = _grown_resume(resume, positions, n, probe_modes)
    if resumed is not None and resumed.epochs >= epochs:  # say so: no epoch runs
        warnings.warn(f"daskpty: {resume} already holds epoch {resumed.epochs} (epochs={epochs} counts "
                      f"the resumed epochs too): no epoch runs; pass epochs > {resumed.epochs} to "
                      f"continue", UserWarning, stacklevel=2)
    if resumed is not None and live is None:  # the stored chunking, rounds and layout keep resume bit-identical
        execution = _resumed_execution(execution, resumed.options, opts.execution_given)
        if execution.tiles:  # (a tiled store resumed without tiles given)
            check_tiles_supported(adapter)
    check_rounds(execution.rounds_per_epoch, len(positions))
    execution = execution.replace(chunk_length=clamp_chunk_length(execution.chunk_length, len(positions)))
    obj, origin = _initial_object(object, resumed, thick, positions, n)
    frame_positions = positions + origin
    run_positions = _fixed_positions(resumed, positions_options, frame_positions)
    check_windows_inside(split_positions(run_positions, n)[0], n, obj.shape)
    if checkpoint is not None:
        check_free_space(checkpoint, reconstruction_bytes(obj.shape, (probe_modes or 1, n, n), len(positions)))

    run_options = _run_options(engine, epochs, eng.seed, execution, options, positions_options, model,
                               sample if thick.multislice else None)
    layout = PatternLayout()
    make_result = _result_maker(layout, adapter, thick, frame_positions, origin, run_options, run_positions, live,
                                geometry_from_metadata(getattr(data, "metadata", None)))
    previous_history = resumed.history if resumed is not None else []
    checkpointer = Checkpointer(checkpoint, make_result, every=run.checkpoint_every, history=previous_history,
                                check=check_finite_result)
    callbacks = _callbacks(checkpointer, run.callback, getattr(data, "path", None),
                           _progress(run.progress, epochs, resumed, len(positions), getattr(options, "loss", eng.noise)),
                           frames=len(positions))

    embedded = client is None and (execution.n_workers is not None or current_client() is None)
    with client_context(client, n_workers=execution.n_workers) as c:
        wait_for_workers(c)  # a cluster without workers: a bounded wait and one line, not a hang
        enable_low_latency(c)
        if not hasattr(intensities, "dask") or getattr(data, "path", "") is None:
            data, intensities = scatter_in_memory(c, data, intensities, execution.chunk_length)
        if run.check_data:
            check_values(data if hasattr(data, "path") else intensities, client=c).raise_if_bad()
        halo_reach = tile_halo.reach(adapter, n) + tile_halo.margin(adapter)  # (refined windows move)
        if not execution.tiles and "tiles" not in opts.execution_given and resumed is None:
            execution = _tiles_by_default(c, execution, adapter, obj.shape, n, thick, halo_reach,
                                          _probe_modes_hint(probe, probe_modes, resumed))
            run_options["tiles"] = bool(execution.tiles)
        tiles_of = len(live_workers(c)) if execution.tiles else None  # a row tile per worker
        execution = _resolve_persist_and_rounds(c, execution, intensities.nbytes, len(positions), n,
                                                held_shape(obj.shape, n, tiles_of, halo_reach),
                                                _probe_modes_hint(probe, probe_modes, resumed), thick)
        run_options.update(rounds_per_epoch=execution.rounds_per_epoch, persist=execution.persist)
        # the brightness' smooth part of a varying probe follows the rounds per epoch
        adapter.probe_model = adapter.probe_model.for_rounds(execution.rounds_per_epoch)
        publisher = None
        if run.dashboard:
            from .monitor.dashboard import DashboardPublisher  # lazy: ~0.9 s of page code, only when asked

            publisher = DashboardPublisher(c, epochs=epochs, rounds_per_epoch=execution.rounds_per_epoch,
                                           n_patterns=len(positions), layout=layout)
            if publisher.link:  # also installs the scheduler plugin before the first round
                print(f"daskpty dashboard: {publisher.link}", file=sys.stderr)
            callbacks.insert(1, publisher)
        if resumed is not None:
            state = adapter.new_state(resumed.object, resumed.probe, resumed.epochs, resumed.engine_state)
            state.illumination = resumed.illumination
        else:
            first = _geometry_probe(probe, data, c, intensities, probe_modes, eng.seed, sample, thick)
            state = adapter.new_state(obj, first if first is not None else
                                      _initial_probe(probe, data, c, intensities, probe_modes, eng.seed))
        object_shape, obj = obj.shape, None  # (the state holds it: one object-sized array less held)
        execution = _resolve_device_and_chunks(c, execution, len(positions), n, state.probe.shape[0], object_shape,
                                               thick, tiles_of, halo_reach,
                                               intensities.nbytes if execution.persist and tiles_of else 0)
        run_options.update(chunk_length=execution.chunk_length)
        # out of core: each chunk's task reads its own patterns from the store, in the run's order
        reader = data.intensities_in_chunks if hasattr(data, "intensities_in_chunks") and not execution.persist \
            else None
        chunked = prepare_data(c, intensities, run_positions, chunk_length=execution.chunk_length,
                               modes=state.probe.shape[0], sort=execution.sort, persist=execution.persist,
                               device=execution.device, shift=not thick.near_field, row_bands=execution.tiles,
                               reader=reader)
        layout.update(chunked)
        data = intensities = None  # the chunks live on the workers now: release scattered originals
        if resumed is not None and getattr(adapter, "local_state", False):
            state = with_local(state, layout.resumed_locals(adapter, chunked, resumed.positions,
                                                            resumed.engine_state))
        remaining = max(epochs - state.epoch, 0)
        try:
            with sigterm_as_interrupt():
                state, _ = run_epochs(c, chunked, adapter, state, epochs=remaining,
                                      rounds_per_epoch=execution.rounds_per_epoch,
                                      split_every=execution.split_every, tiles=execution.tiles,
                                      callbacks=callbacks, initialise=eng.rescale_probe)
        except KeyboardInterrupt:
            checkpointer.write()
            raise
        except (PositionsDiverged, ProbeModelDiverged, ReconstructionDiverged, ReconstructionStalled,
                DataChanged, StateLost) as exc:
            raise _saying_what_is_kept(exc, checkpoint, checkpointer) from None
        finally:
            del chunked
            if publisher is not None:
                publisher.flush()
        # (on the cluster still: a large tiled object is a dask array over the workers' tiles)
        result = make_result(state, checkpointer.history)
        try:
            check_finite_result(result.object, result.probe, state.epoch)
        except ReconstructionDiverged as exc:
            raise _saying_what_is_kept(exc, checkpoint, checkpointer) from None
        if checkpoint is not None and checkpointer.written_epoch != state.epoch:
            result.to_zarr(checkpoint, overwrite=True)  # a lazy object: each worker writes its tile
        if result.is_lazy and checkpoint is not None:
            result = result.reading_arrays_from(checkpoint)  # the tiles can go
        elif result.is_lazy and embedded:  # no store and the cluster closes: gathered here
            result = result.computed()
    return result
