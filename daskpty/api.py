"""Library entry point: :func:`reconstruct`."""
from __future__ import annotations

import sys
import time

import numpy as np

from .engines.positions import PositionsDiverged
from .engines.probe_model import EIGEN_SUPPORT_RMS, ProbeModelDiverged, effective_weights
from .engines.specs import DEFAULT_ENGINE
from .execution.cluster import client_context, current_client
from .execution.driver import run_epochs
from .execution.round_switch import OneRoundOnceVarying
from .execution.watchdog import ReconstructionDiverged, ReconstructionStalled, check_finite_result
from .io.checkpoint import Checkpointer, raise_if_stopped, sigterm_as_interrupt
from .io.epoch_handle import StateLost
from .io.identity import DataChanged, DataWatch
from .io.lock import StoreLock
from .io.results import Reconstruction
from .monitor.progress import interactive, make_progress
from .options import DEFAULT_EPOCHS, Options, resolve
from .plan import draft_plan, settle_plan


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


def _progress(progress, epochs: int, resumed, n_patterns: int, loss: str, warmup: int = 0):
    """The progress callback, or None: ``progress`` None shows it when the session is interactive
    (a terminal or a notebook); a resumed run counts on from its stored epoch; ``warmup``: epochs
    of the amplitude loss first (LSQML's ``noise_warmup``)."""
    if not _shows_progress(progress):
        return None
    return make_progress(epochs, n_patterns, start_epoch=resumed.epochs if resumed is not None else 0, loss=loss,
                         warmup=warmup)


def _shows_progress(progress) -> bool:
    """Whether a run shows its progress: ``progress`` None when the session is interactive."""
    return interactive() if progress is None else bool(progress)


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
        when the probe is guessed from the data or through K > 1 slices), ``scan_scale`` (the
        scan's isotropic scale refines: by default for one slice, held at the nominal one
        through K > 1 slices), ``remove_drift``, ``max_displacement``). Each
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
        core and with several object slices; depends only on the data and the model, not on the
        cluster; with OPR eigen-probes, one round per epoch from the epoch their weights show
        that the probe varies, :mod:`daskpty.execution.round_switch`); ``persist`` (keep the
        chunks in worker memory: True, re-read them every round: False, or "auto": when they
        take at most half the cluster memory); ``device`` ("auto" | "cpu" | "gpu": gpu when every worker sees
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
        does not look at stay on the workers); ``check_data`` (look at every intensity once
        before the first epoch and refuse NaN, infinite or negative values and damaged chunks;
        persisted data are checked where they were placed, their store read once; default True).
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


def _reconstruct(data, epochs, probe, object, probe_modes, client, opts: Options, live=None) -> Reconstruction:
    """:func:`reconstruct` with its settings resolved (and the checkpoint's lock held): the plan
    (:mod:`daskpty.plan`), drafted before a cluster starts and settled on it, then the run."""
    plan = draft_plan(data, epochs, probe, object, probe_modes, opts, live)
    make_result = _result_maker(plan.layout, plan.adapter, plan.thick, plan.frame_positions, plan.origin,
                                plan.run_options, plan.run_positions, live, plan.geometry)
    resumed, run = plan.resumed, opts.run
    checkpointer = Checkpointer(plan.checkpoint, make_result, every=run.checkpoint_every,
                                history=resumed.history if resumed is not None else [], check=check_finite_result)
    loss = getattr(plan.options, "loss", opts.engine.noise)
    warmup = getattr(plan.adapter.options, "noise_warmup", 0)   # (LSQML through slices, Poisson)
    callbacks = _callbacks(checkpointer, run.callback, plan.data_path,
                           _progress(run.progress, epochs, resumed, plan.n_patterns, loss, warmup),
                           frames=plan.n_patterns)
    embedded = client is None and (plan.execution.n_workers is not None or current_client() is None)
    with client_context(client, n_workers=plan.execution.n_workers) as c:
        plan = settle_plan(c, plan)
        publisher = _dashboard(c, plan) if run.dashboard else None
        if publisher is not None:
            callbacks.insert(1, publisher)
        result = _run(c, plan, checkpointer, callbacks, publisher)
        if result.is_lazy and plan.checkpoint is not None:
            result = result.reading_arrays_from(plan.checkpoint)  # the tiles can go
        elif result.is_lazy and embedded:  # no store and the cluster closes: gathered here
            result = result.computed()
    return result


def _dashboard(client, plan):
    """The dashboard's publisher (its link to stderr)."""
    from .monitor.dashboard import DashboardPublisher  # lazy: ~0.9 s of page code, only when asked

    publisher = DashboardPublisher(client, epochs=plan.epochs, rounds_per_epoch=plan.execution.rounds_per_epoch,
                                   n_patterns=plan.n_patterns, layout=plan.layout)
    if publisher.link:  # also installs the scheduler plugin before the first round
        print(f"daskpty dashboard: {publisher.link}", file=sys.stderr)
    return publisher


def _one_round_switch(plan, publisher, callbacks: list) -> OneRoundOnceVarying:
    """The watch of a run whose "auto" rounds go to one per epoch once its probe is seen to vary:
    from then on the result, the checkpoints and the dashboard say one round per epoch, with the
    epoch it began (``one_round_from_epoch``), and the probe model's rounds-dependent settings
    follow (:meth:`daskpty.execution.parts.ProbeModel.for_rounds`). With progress shown, one line
    after that epoch's says so."""
    def switch(epoch: int, rms: float) -> None:
        plan.adapter.probe_model = plan.adapter.probe_model.for_rounds(1)
        plan.run_options.update(rounds_per_epoch=1, one_round_from_epoch=epoch + 1)
        if publisher is not None:
            publisher.rounds_per_epoch = 1
        if _shows_progress(plan.opts.run.progress):
            callbacks.append(_SayOnce(f"daskpty: the probe varies over the scan (eigen-probe weights that "
                                      f"neighbours share: {rms:.3f} rms in epoch {epoch}): one round per epoch "
                                      f"from epoch {epoch + 1} on (rounds_per_epoch=N keeps N)"))
    behind = plan.resumed.history if plan.resumed is not None else ()   # (a resumed run decides as if not stopped)
    return OneRoundOnceVarying(switch, history=behind or ())


class _SayOnce:
    """An epoch callback that prints a message to stderr once, at the first epoch whose metrics
    ``when(metrics)`` accepts (default: the first it sees), after the callbacks before it (e.g.
    the progress line); it never fetches the state. ``message``: a string, or
    ``message(epoch, metrics)``."""

    takes_epoch_state = True

    def __init__(self, message, when=None, said: bool = False):
        self.message, self.when, self.said = message, when, said

    def __call__(self, epoch, state, metrics):
        if self.said or (self.when is not None and not self.when(metrics)):
            return
        self.said = True
        text = self.message(epoch, metrics) if callable(self.message) else self.message
        print(text, file=sys.stderr, flush=True)


def _eigen_dropped_line(epoch: int, metrics: dict) -> str:
    """What stderr says when the eigen-probes are dropped (:data:`~daskpty.engines.probe_model.EIGEN_SUPPORT_RMS`)."""
    return (f"daskpty: the eigen-probe weights show no probe varying over the scan (shared by neighbours: "
            f"{metrics.get('opr_eigen_shared_rms', 0.0):.4f} rms in epoch {epoch}, below {EIGEN_SUPPORT_RMS}): "
            f"OPR's eigen-probes are dropped from epoch {epoch + 1} on, the patterns' brightness is still "
            f"fitted (probe_model drop_unsupported_eigen=False keeps them)")


def _run(client, plan, checkpointer, callbacks, publisher=None) -> Reconstruction:
    """The plan's epochs; the result (on the cluster still: a large tiled object is a dask array
    over the workers' tiles), written to the checkpoint when the last epoch was not."""
    execution, checkpoint, state = plan.execution, plan.checkpoint, plan.state
    chunked, plan.chunked, plan.state = plan.chunked, None, None
    callbacks = [*callbacks, raise_if_stopped]   # (a stop signal Python dropped ends the run at the epoch's end)
    switch = _one_round_switch(plan, publisher, callbacks) if plan.one_round_once_varying else None
    model = getattr(plan.adapter.probe_model, "model", None)
    if model is not None and model.n_eigen and _shows_progress(plan.opts.run.progress):
        behind = plan.resumed.history if plan.resumed is not None else ()
        callbacks.append(_SayOnce(_eigen_dropped_line, when=lambda metrics: metrics.get("opr_eigen_dropped"),
                                  said=bool(behind) and bool(behind[-1].get("opr_eigen_dropped"))))
    initialise = plan.opts.engine.rescale_probe and state.epoch == 0
    if initialise:   # the first epoch's probe rescale, from the value check's Σy where it can
        rescaled = plan.adapter.initialise_from_total(state, plan.data_total, plan.n_patterns)
        state, initialise = (state, True) if rescaled is None else (rescaled, False)
    try:
        with sigterm_as_interrupt():
            state, _ = run_epochs(client, chunked, plan.adapter, state, epochs=max(plan.epochs - state.epoch, 0),
                                  rounds_per_epoch=execution.rounds_per_epoch, split_every=execution.split_every,
                                  tiles=execution.tiles, callbacks=callbacks,
                                  initialise=initialise, one_round_when=switch)
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
    result = checkpointer.make_result(state, checkpointer.history)
    try:
        check_finite_result(result.object, result.probe, state.epoch)
    except ReconstructionDiverged as exc:
        raise _saying_what_is_kept(exc, checkpoint, checkpointer) from None
    if checkpoint is not None and checkpointer.written_epoch != state.epoch:
        result.to_zarr(checkpoint, overwrite=True)  # a lazy object: each worker writes its tile
    return result
