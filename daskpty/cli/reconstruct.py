"""``daskpty reconstruct DATA.zarr -o RECON.zarr``: run LSQML on a data-set store."""
from __future__ import annotations

import contextlib
import os
import sys

NAME = "reconstruct"


def add_parser(subparsers):
    p = subparsers.add_parser(
        NAME, help="reconstruct object and probe from a data-set store",
        description="Reconstruct a data-set store with the LSQML engine on a dask cluster (the "
                    "embedded local cluster unless --scheduler is given) and write a "
                    "reconstruction store. Prints the object NRMSE when the store holds truth/.")
    p.add_argument("data", metavar="DATA", help="data-set store (.zarr)")
    p.add_argument("-o", "--output", required=True, metavar="RECON", help="reconstruction store to write")
    p.add_argument("--engine", default="lsqml", choices=["lsqml", "ad"])
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--noise", default="gaussian", choices=["gaussian", "poisson"])
    p.add_argument("--loss", default=None, choices=["gaussian", "poisson", "intensity"],
                   help="AD loss (default: --noise)")
    p.add_argument("--optimizer", default=None, choices=["adam", "sgd", "cg"], help="AD optimiser (default sgd; adam for --loss intensity)")
    p.add_argument("--lr", type=float, default=None, help="AD object step size (relative)")
    p.add_argument("--probe-lr", type=float, default=None, help="AD probe step size (relative)")
    p.add_argument("--rounds-per-epoch", type=_rounds, default="auto",
                   help="1 = compact LSQML; R > 1 = R minibatch updates per epoch; "
                        "auto (default): ~150 patterns per round, at most one per 6 Mi pattern-pixels (>= 3), 1..16, for data held in memory; 1 out of core")
    p.add_argument("--probe-modes", type=int, default=None, help="incoherent probe modes")
    p.add_argument("--slices", type=int, default=None, metavar="K",
                   help="multislice: K object slices (needs the data's wavelength and object pixel size)")
    p.add_argument("--slice-spacing", type=float, default=None, metavar="METRES",
                   help="multislice: distance between neighbouring slices, m")
    p.add_argument("--probe", default=None, choices=["aperture"],
                   help="initial probe from the data's geometry (default: from the mean pattern)")
    p.add_argument("--refine-positions", nargs="?", const="", default=None, metavar="KEY=VALUE,...",
                   help="refine the scan positions (both engines); optional settings, e.g. "
                        "start_epoch=5,max_step=0.5,affine=true,affine_blend=0.02,lr=0.1 "
                        "(see daskpty.engines.positions.PositionOptions)")
    p.add_argument("--opr-modes", type=int, default=None, metavar="K",
                   help="a probe varying over the scan: K modes of orthogonal probe relaxation "
                        "(the mean probe and K - 1 eigen-probes with per-pattern weights)")
    p.add_argument("--fit-intensity", action="store_true", help="fit a per-pattern intensity factor")
    p.add_argument("--background", default=None, choices=["constant", "pixel"],
                   help="fit a background added to the model intensity")
    p.add_argument("--probe-model", default=None, metavar="KEY=VALUE,...",
                   help="settings of the varying probe, e.g. start_epoch=10,weight_smoothing=8 "
                        "(see daskpty.engines.probe_model.ProbeModelOptions)")
    p.add_argument("--workers", type=int, default=None, help="local worker processes (default: one per core)")
    p.add_argument("--scheduler", default=None, help="address of a running dask scheduler")
    p.add_argument("--protocol", default=None, choices=["tcp", "ucx"],
                   help="transport of the embedded cluster (default tcp; ucx needs distributed-ucxx)")
    p.add_argument("--chunk-length", type=int, default=None, help="patterns per chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                   help="update the output store every K epochs (and at the end and on Ctrl-C/SIGTERM)")
    p.add_argument("--resume", metavar="RECON", default=None,
                   help="continue from this reconstruction store (e.g. the output of an interrupted run); "
                        "--epochs counts the epochs already done")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.add_argument("--dashboard", action="store_true",
                   help="publish progress and images to the dask dashboard's /daskpty page")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _rounds(text):
    import argparse

    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


def run(args) -> int:
    import daskpty

    from .interrupts import set_exit_note

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
    ad_args = {}
    if args.engine == "ad":
        ad_args = {k: v for k, v in (("loss", args.loss), ("optimizer", args.optimizer), ("lr", args.lr),
                                     ("probe_lr", args.probe_lr)) if v is not None}
    elif any(v is not None for v in (args.loss, args.optimizer, args.lr, args.probe_lr)):
        raise ValueError("--loss, --optimizer, --lr and --probe-lr apply to --engine ad only")
    from daskpty.sample import SampleOptions

    sample = SampleOptions.from_arguments(None, args.slices, args.slice_spacing)  # bad values: one line
    data = daskpty.open_data(args.data)
    sample.resolve(data.metadata, data.pattern_shape[-1])  # multislice needs the data's geometry
    if args.epochs == 0 and args.resume is None:  # documented no-op (docs/reliability.md)
        print(f"daskpty: --epochs 0: nothing to do; {args.output} was not written", file=sys.stderr)
        return 0
    held = _kept_epoch(args.resume) if args.resume is not None else None
    if held is not None and held >= args.epochs:  # --epochs counts all epochs (docs/cli.md)
        import numpy as np

        from daskpty.api import _resume_from  # the store must still fit the data

        _resume_from(args.resume, np.asarray(data.positions, dtype=np.float64), data.pattern_shape[-1])
        print(f"daskpty: {args.resume} already holds epoch {held} (--epochs {args.epochs} counts "
              f"the resumed epochs too): nothing to run, {args.output} was not written; pass "
              f"--epochs above {held} to continue", file=sys.stderr)
        return 0
    client = None
    scope = contextlib.ExitStack()  # closes the client (and a cluster started here) at the end
    set_exit_note(lambda: _kept(args.output))  # what a forced exit after Ctrl-C reports as kept
    scope.callback(set_exit_note, None)
    if args.scheduler:
        from daskpty.execution.cluster import connect

        client = connect(args.scheduler)  # a closed or HTTP port: one line within seconds
        scope.callback(client.close)
    elif args.protocol is not None:
        from daskpty.execution.cluster import client_context

        client = scope.enter_context(client_context(None, n_workers=args.workers, protocol=args.protocol))
    try:
        rec = daskpty.reconstruct(data, engine=args.engine, epochs=args.epochs, noise=args.noise,
                                  rounds_per_epoch=args.rounds_per_epoch, probe_modes=args.probe_modes,
                                  client=client, n_workers=args.workers, seed=args.seed,
                                  chunk_length=args.chunk_length, progress=not args.quiet,
                                  checkpoint=args.output, checkpoint_every=args.checkpoint_every,
                                  resume=args.resume, dashboard=args.dashboard,
                                  refine_positions=_position_settings(args.refine_positions),
                                  opr_modes=args.opr_modes, fit_intensity=args.fit_intensity,
                                  background=args.background,
                                  probe_model=_probe_model_settings(args.probe_model),
                                  slices=args.slices, slice_spacing_m=args.slice_spacing, probe=args.probe,
                                  **ad_args)
    except KeyboardInterrupt:
        kept = _kept(args.output)
        if kept is not None:
            print(f"daskpty: interrupted; {kept}", file=sys.stderr)
            return 130
        raise
    finally:
        scope.close()
    last = rec.history[-1] if rec.history else {}
    line = f"wrote {args.output}: object {rec.object.shape}, probe {rec.probe.shape}"
    if last:
        line += f", final loss {last['loss']:.4g}, {last['seconds']:.3g} s/epoch"
    truth = getattr(data, "truth", None)
    if truth is not None and getattr(truth, "object", None) is not None:
        line += _nrmse_vs_truth(rec, data)
    print(line, file=sys.stdout)
    return 0


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
    """``--probe-model KEY=VALUE,...`` → the ``probe_model`` argument (None when not given)."""
    settings = _key_values(text, "--probe-model")
    if not settings:
        return None
    from daskpty.engines.probe_model import ProbeModelOptions

    unknown = sorted(set(settings) - set(ProbeModelOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"--probe-model: unknown option(s) {unknown}; valid: "
                         f"{sorted(ProbeModelOptions.__dataclass_fields__)}")
    return settings


def _position_settings(text):
    """``--refine-positions [KEY=VALUE,...]`` → the ``refine_positions`` argument."""
    if text is None:
        return False
    settings = _key_values(text, "--refine-positions")
    from daskpty.engines.positions import PositionOptions

    try:
        return PositionOptions.from_argument(settings or True)
    except TypeError as exc:  # unknown keys: a usage error like any other
        raise ValueError(str(exc)) from None


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


def _nrmse_vs_truth(rec, data) -> str:
    """The NRMSE of the reconstruction against truth/ on the well-illuminated region, truth frame,
    as the text of the final line. A multislice object (K, H, W): each slice against the true
    slice (when truth/object holds K slices) and the projected object (the product of the slices)
    against the true projection (truth/object itself when it is 2-D)."""
    from types import SimpleNamespace

    import numpy as np

    from daskpty.metrics import nrmse_vs_truth

    obj, truth = np.asarray(rec.object), data.truth
    if obj.ndim == 2:
        return f", object NRMSE vs truth {nrmse_vs_truth(obj, rec.positions, rec.illumination, truth):.4f}"
    illumination = np.asarray(rec.illumination)
    illumination = illumination[0] if illumination.ndim == 3 else illumination  # the entrance slice's
    t_obj = np.asarray(truth.object)

    def against(estimate, true_object):
        ref = SimpleNamespace(object=true_object, positions=truth.positions)
        return nrmse_vs_truth(estimate, rec.positions, illumination, ref)

    text = ""
    if t_obj.ndim == 3 and t_obj.shape[0] == obj.shape[0]:
        per = ", ".join(f"{against(obj[k], t_obj[k]):.4f}" for k in range(obj.shape[0]))
        text += f", object NRMSE vs truth per slice [{per}]"
        t_obj = np.prod(t_obj, axis=0)
    elif t_obj.ndim == 3:  # a different number of slices: only the projections compare
        t_obj = np.prod(t_obj, axis=0)
    return text + f", projected object NRMSE vs truth {against(np.prod(obj, axis=0), t_obj):.4f}"
