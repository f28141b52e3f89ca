"""``daskpty reconstruct DATA.zarr -o RECON.zarr``: reconstruct a data-set store with one of the engines."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys

from ..engines.sample_options import MAX_SLICES
from ..engines.specs import ENGINE_SPECS
from ..execution.options import DEVICES
from ..options import (DEFAULT_EPOCHS, GROUPS, EngineOptions, ExecutionOptions, PositionOptions, ProbeModelOptions,
                       RunOptions, SampleOptions, default_of, defaults_text)
from ..physics.noise_models import noise_model_names

NAME = "reconstruct"
#: the registered engines, in the spec table's order
ENGINE_NAMES = list(ENGINE_SPECS)


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="reconstruct object and probe from a data-set store", formatter_class=_DefaultsFormatter,
        description="Reconstruct a data-set store on a dask cluster (the embedded local cluster "
                    "unless --scheduler is given) with one of the engines (LSQML by default) and write a "
                    "reconstruction store, updated every --checkpoint-every epochs. Prints one "
                    "progress line per epoch on a terminal (every 10th otherwise) and a summary; "
                    "with truth/ in the store, the object NRMSE against it.")
    p.add_argument("data", metavar="DATA", help="data-set store (.zarr)")

    title = {group.keyword: group.title for group in GROUPS}  # the groups of daskpty.options, in order
    engine = EngineOptions()
    g = p.add_argument_group(title["engine"])
    g.add_argument("--engine", default=engine.name, choices=ENGINE_NAMES,
                   help="; ".join(f"{name}: {spec.summary}" for name, spec in ENGINE_SPECS.items()))
    g.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                   help="total passes over all patterns (with --resume: including those already done)")
    g.add_argument("--noise", default=engine.noise, choices=noise_model_names(lsqml=True),
                   help="noise model of the far-field correction and of the reported loss (poisson: "
                        "the negative log-likelihood up to a constant of the data, 0 for a model equal "
                        "to the counts)")
    g.add_argument("--loss", default=None, choices=noise_model_names(),
                   help="AD loss (default: --noise)")
    g.add_argument("--optimizer", default=None, choices=["adam", "sgd", "cg"],
                   help="AD optimiser (default: sgd; adam for --loss intensity)")
    g.add_argument("--lr", type=float, default=None,
                   help="AD object step size, relative (default: the optimiser's)")
    g.add_argument("--probe-lr", type=float, default=None,
                   help="AD probe step size, relative (default: the optimiser's)")
    g.add_argument("--engine-settings", default=None, metavar="KEY=VALUE,...",
                   help="the engine's own settings, e.g. beta=0.8,momentum=0.6 (defaults: "
                        f"{_percent(_engine_defaults())})")
    g.add_argument("--seed", type=int, default=engine.seed,
                   help="seed of the random choices (extra probe modes); the engines are deterministic")

    g = p.add_argument_group(title["probe_model"])
    g.add_argument("--probe", default=None, choices=["aperture"],
                   help="initial probe from the data's geometry (default: the store's probe, else "
                        "one from the mean pattern)")
    g.add_argument("--probe-modes", type=int, default=None, metavar="M",
                   help="incoherent probe modes (default: those of the initial probe, else 1)")
    g.add_argument("--opr-modes", type=int, default=None, metavar="K",
                   help="a probe varying over the scan: K modes of orthogonal probe relaxation "
                        "(the mean probe and K - 1 eigen-probes with per-pattern weights; default: "
                        "a constant probe)")
    g.add_argument("--fit-intensity", action="store_true", help="fit a per-pattern intensity factor")
    g.add_argument("--background", default=None, choices=["constant", "pixel"],
                   help="fit a background added to the model intensity (default: none)")
    g.add_argument("--probe-model", default=None, metavar="KEY=VALUE,...",
                   help="settings of the varying probe (ProbeModelOptions), e.g. "
                        "start_epoch=10,weight_smoothing=8 (defaults: "
                        f"{_percent(defaults_text(ProbeModelOptions, skip=GROUP['probe_model'].shortcuts))})")

    g = p.add_argument_group(title["refine_positions"])
    g.add_argument("--refine-positions", nargs="?", const="", default=None, metavar="KEY=VALUE,...",
                   help="refine the scan positions; optional settings (PositionOptions), e.g. "
                        "start_epoch=5,max_step=0.5,affine=true (default: fixed positions; the "
                        f"settings' defaults: {_percent(defaults_text(PositionOptions))})")

    g = p.add_argument_group(title["sample"])
    g.add_argument("--slices", type=_slices, default=None, metavar="K",
                   help=f"K object slices, at most {MAX_SLICES} (needs the data's wavelength and object "
                        f"pixel size; default: {default_of(SampleOptions, 'slices')}, a thin sample)")
    g.add_argument("--slice-spacing", type=_spacing, default=None, metavar="METRES",
                   help="distance between neighbouring slices, m (default: none; required with --slices > 1, "
                        "refused without it)")

    g = p.add_argument_group(title["execution"])
    g.add_argument("--workers", type=int, default=None, metavar="W",
                   help="worker processes of the embedded cluster (default: one per core)")
    g.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="address of a running dask scheduler (default: an embedded local cluster)")
    g.add_argument("--protocol", default=None, choices=["tcp", "ucx"],
                   help="transport of the embedded cluster (default: tcp; ucx needs distributed-ucxx)")
    g.add_argument("--fft-backend", default=None, choices=["auto", "fftw", "scipy"],
                   help="CPU transforms: fftw (pyFFTW, the fftw extra) or scipy.fft; auto: FFTW for "
                        "patterns up to 200² when pyFFTW is installed (default: auto, or "
                        "DASKPTY_FFT_BACKEND)")
    g.add_argument("--chunk-length", type=int, default=None, metavar="L",
                   help="patterns per chunk (default: from the probe size and the workers' memory)")
    g.add_argument("--rounds-per-epoch", type=_rounds, default=default_of(ExecutionOptions, "rounds_per_epoch"),
                   metavar="R",
                   help="1 = compact LSQML; R > 1 = R minibatch updates per epoch; auto: ~150 "
                        "patterns per round, at most one per 6 Mi pattern-pixels (>= 3), 1..16, for "
                        "data held in memory (with OPR: 1 once the probe is seen to vary); 1 out of core")
    g.add_argument("--device", default=default_of(ExecutionOptions, "device"), choices=list(DEVICES),
                   help="cpu: NumPy chunks; gpu: CuPy chunks on GPU workers; auto: gpu when every worker sees one")
    g.add_argument("--persist", default=default_of(ExecutionOptions, "persist"), choices=["auto", "yes", "no"],
                   help="keep the data chunks in worker memory (yes) or re-read them every round (no: out of "
                        "core); auto: persist when they take at most half the cluster memory")
    g.add_argument("--split-every", type=int, default=None, metavar="F",
                   help="fan-in of the tree reduction (default: 4 for up to 16 chunks, else 8)")
    g.add_argument("--tiles", action="store_true",
                   help="cut the object into row tiles, one per worker, instead of a whole copy on every "
                        "worker (only tile borders travel; every engine and feature but AD's CG optimiser; "
                        "in memory or out of core)")

    g = p.add_argument_group(title["run"])
    g.add_argument("-o", "--output", required=True, metavar="RECON",
                   help="reconstruction store to write (the checkpoint)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    g.add_argument("--checkpoint-every", type=int, default=default_of(RunOptions, "checkpoint_every"), metavar="K",
                   help="update the output store every K epochs (and at the end and on Ctrl-C/SIGTERM)")
    g.add_argument("--resume", metavar="RECON", default=None,
                   help="continue from this reconstruction store (e.g. the output of an interrupted "
                        "run; --epochs counts the epochs already done; default: start afresh)")
    g.add_argument("--dashboard", action="store_true",
                   help="publish progress and images to the dask dashboard's /daskpty page")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    g.add_argument("--no-check-data", dest="check_data", action="store_false",
                   help="skip the pass that looks at every intensity once before the first epoch and "
                        "refuses bad values (default: the check runs)")
    g.add_argument("--follow", action="store_true",
                   help="reconstruct a live store while its scan is written (daskpty.ScanWriter): snapshots "
                        "of the frames committed so far "
                        "go to the output store every --snapshot-every seconds; after the scan's end, "
                        "--epochs more on the whole scan (with --resume OUTPUT: go on after a stop)")
    g.add_argument("--follow-min-frames", type=int, default=None, metavar="N",
                   help="frames to wait for before the first snapshot (default: two of the store's chunks, "
                        "at most an eighth of the planned scan)")
    g.add_argument("--snapshot-every", type=float, default=None, metavar="SECONDS",
                   help=f"seconds between snapshots, at least one epoch each (default: {_follow_default('SNAPSHOT')})")
    g.add_argument("--snapshot-frames", type=int, default=None, metavar="N",
                   help="snapshots set by the frames instead of the clock: snapshot k after "
                        "--snapshot-epochs epochs on the first --follow-min-frames + k * N frames; "
                        "reproducible, and a killed follower resumed with --resume ends as one never "
                        "stopped (replaces --snapshot-every; default: off, snapshots by the clock)")
    g.add_argument("--snapshot-epochs", type=int, default=None, metavar="E",
                   help="epochs per snapshot with --snapshot-frames (default: 1)")
    g.add_argument("--follow-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds without a new frame after which an unfinished scan is taken as stopped: "
                        "one line says where, the snapshot is kept, exit code 3 (default: "
                        f"{_follow_default('TIMEOUT')})")
    p._negative_number_matcher = NEGATIVE_NUMBER  # "--slice-spacing -1e-6" is a value (then refused)
    return p


#: what argparse takes for a negative number rather than an option: also ``-1e-6`` and ``-.5``
#: (argparse's own pattern takes only ``-1`` and ``-1.5``); no option of ``reconstruct`` looks like one
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _follow_default(name: str) -> str:
    """The follow loop's default seconds (daskpty.workflows.follow; not imported: it loads dask)."""
    return {"SNAPSHOT": "3", "TIMEOUT": "60"}[name]


def _slices(text):
    """``--slices``: an integer 1 … :data:`MAX_SLICES` (:mod:`daskpty.engines.sample_options`)."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer number of slices, got {text!r}") from None
    if not 1 <= k <= MAX_SLICES:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_SLICES} slices, got {k}")
    return k


def _spacing(text):
    """``--slice-spacing``: a positive, finite number of metres."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of metres, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"the slice spacing must be positive and finite (metres), got {text}")
    return value


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help with every option's default: ``(default: X)`` appended unless the text already
    says it; a switch's default is "off"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.required or "default" in text
                or action.default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction)):
            return text
        if action.const is True and action.default is False:  # store_true
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


GROUP = {group.keyword: group for group in GROUPS}


def _engine_defaults() -> str:
    """``lsqml (LSQMLOptions): beta=0.9, ...; ad (ADOptions): ...`` without the settings that
    have their own flags."""
    own = ("noise", "loss", "optimizer", "lr", "probe_lr")

    def text(name, spec):
        if spec.variant_of:
            return f"{name}: {spec.variant_of}'s with {', '.join(f'{k}={v}' for k, v in spec.defaults.items())}"
        return f"{name} ({spec.options.__name__}): {defaults_text(spec.options, skip=own)}"

    return "; ".join(text(name, spec) for name, spec in ENGINE_SPECS.items())


def _percent(text: str) -> str:
    """``text`` safe inside an argparse help string."""
    return text.replace("%", "%%")


def _rounds(text):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


def run(args) -> int:
    import daskpty

    from daskpty.io.lock import check_unlocked
    from daskpty.io.safety import check_replaceable, check_separate, check_writable, interrupted_copy

    if os.path.abspath(args.output) == os.path.abspath(args.data):
        raise ValueError("the output store must not be the data store; choose another -o path")
    check_separate(args.output, args.data, "the output store")
    check_unlocked(args.output)  # a second writer learns who the first one is
    resuming_in_place = args.resume is not None and os.path.abspath(args.resume) == os.path.abspath(args.output)
    lone = interrupted_copy(args.output)
    if lone is not None and not (args.overwrite or resuming_in_place):
        raise FileExistsError(f"{args.output} exists only as {lone} (a checkpoint swap was "
                              f"interrupted); continue it with --resume {args.output}, or pass "
                              f"--overwrite to replace it")
    if os.path.lexists(args.output) and not (args.overwrite or resuming_in_place):
        raise FileExistsError(f"{args.output} exists; choose another output, pass --overwrite, "
                              f"or --resume {args.output} to continue it")
    check_replaceable(args.output, "the output")  # --overwrite replaces daskpty's stores only
    check_writable(args.output)
    if args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.epochs < 0:
        raise ValueError(f"--epochs must be >= 0, got {args.epochs}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.protocol is not None:
        if args.scheduler:
            raise ValueError("--protocol sets the embedded cluster's transport; a --scheduler "
                             "address carries its own (tcp://..., ucx://...)")
        from daskpty.execution.cluster import comm_options

        try:
            comm_options(args.protocol)
        except ImportError as exc:
            raise ValueError(str(exc)) from None
    if args.fft_backend is not None:
        _choose_fft_backend(args.fft_backend)
    if args.slice_spacing is not None and (args.slices or 1) == 1:
        raise ValueError(f"--slice-spacing {args.slice_spacing:g} is the distance between object slices but "
                         f"the run has one slice; add --slices K (K > 1) for a thick sample, or drop "
                         f"--slice-spacing")
    if not ENGINE_SPECS[args.engine].gradient_based and any(v is not None for v in (args.loss, args.optimizer,
                                                                                     args.lr, args.probe_lr)):
        takers = " or ".join(n for n, s in ENGINE_SPECS.items() if s.gradient_based)
        raise ValueError(f"--loss, --optimizer, --lr and --probe-lr apply to --engine {takers} only")
    from daskpty.options import resolve

    _check_follow_flags(args)
    given = {k: v for k, v in _shortcuts(args).items() if v is not None}
    options = resolve(args.engine, **given)  # bad values and conflicts: one line, before the data are read
    if args.follow:  # the store may not hold a frame yet: its geometry is checked by the first snapshot
        return _run_follow(args, given)
    data = daskpty.open_data(args.data)
    options.sample.resolve(data.metadata, data.pattern_shape[-1])  # multislice needs the data's geometry
    if args.epochs == 0 and args.resume is None:  # documented no-op (docs/reliability.md)
        print(f"daskpty: --epochs 0: nothing to do; {args.output} was not written", file=sys.stderr)
        return 0
    held = _kept_epoch(args.resume) if args.resume is not None else None
    if held is not None and held >= args.epochs:  # --epochs counts all epochs (docs/cli.md)
        import numpy as np

        from daskpty.io.inputs import resumed_store  # the store must still fit the data

        resumed_store(args.resume, np.asarray(data.positions, dtype=np.float64), data.pattern_shape[-1])
        print(f"daskpty: {args.resume} already holds epoch {held} (--epochs {args.epochs} counts "
              f"the resumed epochs too): nothing to run, {args.output} was not written; pass "
              f"--epochs above {held} to continue", file=sys.stderr)
        return 0
    client, scope = _client(args)
    try:
        rec = daskpty.reconstruct(data, args.engine, args.epochs, client=client, probe=args.probe,
                                  probe_modes=args.probe_modes, progress=not args.quiet, checkpoint=args.output,
                                  **given)
    except KeyboardInterrupt:
        kept = _kept(args.output)
        if kept is not None:
            print(f"daskpty: interrupted; {kept}", file=sys.stderr)
            return 130
        raise
    finally:
        scope.close()
    _summary(args, rec, data)
    return 0


def _check_follow_flags(args) -> None:
    """The follow flags: positive, and only with --follow."""
    values = {"--follow-min-frames": args.follow_min_frames, "--snapshot-every": args.snapshot_every,
              "--snapshot-frames": args.snapshot_frames, "--snapshot-epochs": args.snapshot_epochs,
              "--follow-timeout": args.follow_timeout}
    given = [flag for flag, value in values.items() if value is not None]
    if given and not args.follow:
        raise ValueError(f"{', '.join(given)} apply with --follow only; add --follow or drop them")
    if args.snapshot_frames is not None and args.snapshot_every is not None:
        raise ValueError("--snapshot-frames sets the snapshots by frames, --snapshot-every by the clock; "
                         "give one of them")
    if args.snapshot_epochs is not None and args.snapshot_frames is None:
        raise ValueError("--snapshot-epochs applies with --snapshot-frames only; add it or drop --snapshot-epochs")
    for flag in given:
        if not (values[flag] > 0 and math.isfinite(values[flag])):
            raise ValueError(f"{flag} must be a positive number, got {values[flag]:g}")


def _run_follow(args, given: dict) -> int:
    """``reconstruct --follow``: :func:`daskpty.workflows.follow` into the output store, one line
    per snapshot on stderr, the usual summary at the end; a stopped scan (``ScanStopped``) is one
    line, exit 3 (``daskpty.cli.EXIT_CODES``)."""
    import daskpty
    from daskpty.workflows import follow

    given = dict(given)
    resume = given.pop("resume", None)
    timing = {k: v for k, v in (("min_frames", args.follow_min_frames), ("snapshot_every", args.snapshot_every),
                                 ("snapshot_frames", args.snapshot_frames),
                                 ("snapshot_epochs", args.snapshot_epochs),
                                 ("timeout", args.follow_timeout)) if v is not None}
    client, scope = _client(args)
    try:
        rec = follow(args.data, args.output, args.epochs, resume=resume, client=client, probe=args.probe,
                     probe_modes=args.probe_modes, progress=not args.quiet,
                     on_snapshot=None if args.quiet else _snapshot_line, **timing, **given)
    except KeyboardInterrupt:
        kept = _kept(args.output)
        if kept is not None:
            print(f"daskpty: interrupted; {kept[:-1]} --follow)", file=sys.stderr)  # (... --resume OUT --follow)
            return 130
        raise
    finally:
        scope.close()
    _summary(args, rec, daskpty.open_data(args.data))
    return 0


def _snapshot_line(rec) -> None:
    live = rec.live or {}
    phase = "final" if "final_from_epoch" in live else "snapshot"
    loss = rec.history[-1].get("loss") if rec.history else None
    print(f"daskpty: {phase}: {live.get('frames_used', len(rec.positions)):,} frames, epoch {rec.epochs}"
          + (f", loss {loss:.4g}" if loss is not None else ""), file=sys.stderr, flush=True)


def _client(args):
    """The client the flags ask for (None: the embedded default) and the scope closing it."""
    from .interrupts import set_exit_note

    client = None
    scope = contextlib.ExitStack()  # closes the client (and a cluster started here) at the end
    set_exit_note(lambda: _kept(args.output))  # what a forced exit after Ctrl-C reports as kept
    scope.callback(set_exit_note, None)
    if args.scheduler:
        from daskpty.execution.cluster import connect

        client = connect(args.scheduler)  # a closed or HTTP port: one line within seconds
        scope.callback(client.close)
        if args.fft_backend is not None:  # running workers: set it in each (restarted ones follow their environment)
            from daskpty.physics.fftw import set_fft_backend

            try:
                client.run(set_fft_backend, args.fft_backend)
            except ImportError as exc:
                raise ValueError(f"a worker of {args.scheduler}: {exc}") from None
    elif args.protocol is not None:
        from daskpty.execution.cluster import client_context

        client = scope.enter_context(client_context(None, n_workers=args.workers, protocol=args.protocol))
    return client, scope


def _summary(args, rec, data) -> None:
    """The final line on stdout: what was written, the final loss, the NRMSE vs truth/."""
    last = rec.history[-1] if rec.history else {}
    line = f"wrote {args.output}: object {rec.object.shape}, probe {rec.probe.shape}"
    if last:
        from daskpty.monitor.progress import loss_label

        kind = (args.loss or args.noise) if ENGINE_SPECS[args.engine].gradient_based else args.noise
        line += f", final {loss_label(kind)} {last['loss']:.4g}, {last['seconds']:.3g} s/epoch"
    if _has_truth_object(getattr(data, "truth", None)):
        line += _nrmse_vs_truth(rec, data)
    print(line, file=sys.stdout)


def _shortcuts(args) -> dict:
    """``reconstruct``'s groups and keyword shortcuts from the flags (None where not given)."""
    return dict(noise=args.noise, loss=args.loss, optimizer=args.optimizer, lr=args.lr, probe_lr=args.probe_lr,
                seed=args.seed, opr_modes=args.opr_modes, fit_intensity=args.fit_intensity or None,
                background=args.background, probe_model=_probe_model_settings(args.probe_model),
                refine_positions=_position_settings(args.refine_positions), slices=args.slices,
                slice_spacing_m=args.slice_spacing, n_workers=args.workers, chunk_length=args.chunk_length,
                rounds_per_epoch=args.rounds_per_epoch, checkpoint_every=args.checkpoint_every,
                resume=args.resume, dashboard=args.dashboard or None, device=args.device,
                persist={"yes": True, "no": False}.get(args.persist, args.persist), split_every=args.split_every,
                tiles=args.tiles or None, check_data=args.check_data,
                **_key_values(args.engine_settings, "--engine-settings"))


def _key_values(text, flag: str) -> dict:
    """``KEY=VALUE,...`` → a dict of settings (values parsed by :func:`_setting_value`)."""
    settings = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag}: expected KEY=VALUE items, got {item!r}")
        settings[key.strip()] = _setting_value(value.strip())
    return settings


def _probe_model_settings(text):
    """``--probe-model KEY=VALUE,...`` → the ``probe_model`` group (None when not given; its keys
    are checked by :func:`daskpty.options.resolve`, a typo with its close match)."""
    return _key_values(text, "--probe-model") or None


def _position_settings(text):
    """``--refine-positions [KEY=VALUE,...]`` → the ``refine_positions`` group (False: not given)."""
    if text is None:
        return False
    return _key_values(text, "--refine-positions") or True


def _setting_value(text):
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _kept_epoch(store):
    """The epoch a reconstruction store (or its ``.previous``) holds, or None."""
    from daskpty.io.safety import stored_epoch

    for where in (store, store.rstrip("/") + ".previous"):
        epoch = stored_epoch(where)
        if epoch is not None:
            return epoch
    return None


def _kept(output):
    """Which epoch the output store really holds after an interrupt (read back from it: a
    second Ctrl-C may have stopped the stop checkpoint, leaving an older epoch), or None."""
    from daskpty.io.safety import stored_epoch

    for where in (output, output.rstrip("/") + ".previous"):
        epoch = stored_epoch(where)
        if epoch is not None:
            return f"epoch {epoch} is saved in {where} (continue with --resume {output})"
    return None


def _nrmse_vs_truth(rec, data, max_side=None) -> str:
    """The NRMSE of the reconstruction against truth/ on the well-illuminated region, truth frame,
    as the text of the final line; an object wider than ``max_side`` (default
    :data:`daskpty.metrics.NRMSE_CROP`) is compared on a central crop, said in the line. A
    multislice object (K, H, W): each slice against the true slice (when truth/object holds K
    slices) and the projected object (the product of the slices) against the true projection
    (truth/object itself when it is 2-D)."""
    from types import SimpleNamespace

    import numpy as np

    from daskpty.metrics import NRMSE_CROP, nrmse_vs_truth

    max_side = NRMSE_CROP if max_side is None else max_side
    obj, truth = np.asarray(rec.object), data.truth
    illumination = np.asarray(rec.illumination)
    if obj.ndim == 3 and illumination.ndim == 3:
        illumination = illumination[0]  # the entrance slice's
    t_obj = _truth_object(data) if obj.ndim == 2 else np.asarray(truth.object)
    windows = []

    def against(estimate, true_object):
        ref = SimpleNamespace(object=true_object, positions=truth.positions)
        value, window = nrmse_vs_truth(estimate, rec.positions, illumination, ref, max_side=max_side,
                                       return_window=True)
        windows.append(window)
        return value

    if obj.ndim == 2:
        text = f", object NRMSE vs truth {against(obj, t_obj):.4f}"
    else:
        text = ""
        if t_obj.ndim == 3 and t_obj.shape[0] == obj.shape[0]:
            per = ", ".join(f"{against(obj[k], t_obj[k]):.4f}" for k in range(obj.shape[0]))
            text += f", object NRMSE vs truth per slice [{per}]"
        if t_obj.ndim == 3:  # the true projection (also when the slice counts differ)
            t_obj = np.prod(t_obj, axis=0)
        text += f", projected object NRMSE vs truth {against(np.prod(obj, axis=0), t_obj):.4f}"
    window = windows[-1]
    if window is not None:
        y0, y1, x0, x1 = window
        side = f"{y1 - y0}²" if y1 - y0 == x1 - x0 else f"{y1 - y0}×{x1 - x0}"
        text += f" (central {side} crop)"
    return text


def _has_truth_object(truth) -> bool:
    """Whether the data hold truth/object, without reading it."""
    if truth is None:
        return False
    shapes = getattr(truth, "shapes", None)
    return "object" in shapes() if callable(shapes) else getattr(truth, "object", None) is not None


def _truth_object(data):
    """truth/object of a data set: the store's Zarr array when there is one (only the compared
    crop is then read), else the in-memory array."""
    import os

    path = getattr(data, "path", None)
    if path and os.path.isfile(os.path.join(path, "truth", "object", "zarr.json")):
        import zarr

        return zarr.open_array(os.path.join(path, "truth", "object"), mode="r")
    return data.truth.object


def _choose_fft_backend(name: str) -> None:
    """``--fft-backend``: check it here (pyFFTW importable for ``fftw``) and hand it to the
    embedded cluster's workers, which read ``DASKPTY_FFT_BACKEND`` when they start."""
    from daskpty.physics.fftw import set_fft_backend

    try:
        set_fft_backend(name)
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    os.environ["DASKPTY_FFT_BACKEND"] = name
