"""The ``daskpty`` command line.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``;
adding one means importing it and appending it to :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings

from .. import __version__, _interrupted_while_starting
from ..execution.watchdog import install_loss_filter, quiet_handled_losses
from ..faults import ReconstructionDiverged, ReconstructionStalled, ScanStopped, StateLost, StoreWriteError
from . import export, import_data, info, reconstruct, show, simulate
from .interrupts import INTERRUPTED, InterruptGuard, forget_handled_interrupt

#: subcommand modules, in the order ``daskpty --help`` lists them
COMMANDS = [simulate, info, import_data, reconstruct, show, export]

#: exceptions that mean "bad input" or a run that cannot go on as asked (daskpty.faults)
USER_ERRORS = (ValueError, FileExistsError, FileNotFoundError, NotADirectoryError,
               IsADirectoryError, PermissionError, StoreWriteError, ReconstructionStalled, ReconstructionDiverged,
               StateLost)

#: the exit code of each error a command reports as one line on stderr, the first match wins;
#: an interrupt is 130 (:data:`~.interrupts.INTERRUPTED`), anything else a traceback and 1
EXIT_CODES = (
    (ScanStopped, 3),   # a live scan's writer stopped without ending it: the snapshot is kept
    (USER_ERRORS, 2),   # what the user can fix: input, options, stores, the cluster, a diverged run
)


def exit_code(exc: BaseException) -> int | None:
    """The exit code :data:`EXIT_CODES` gives ``exc``, or None (not one the command reports)."""
    return next((code for kinds, code in EXIT_CODES if isinstance(exc, kinds)), None)


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line: ``daskpty: error: ...``."""

    def error(self, message):
        self.exit(2, f"daskpty: error: {one_line(message)} (see '{self.prog} --help')\n")


def one_line(message) -> str:
    return " ".join(str(message).split()) or "unknown error"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="daskpty",
                     description="Out-of-core ptychographic reconstruction on chunked Zarr data "
                                 "over dask clusters.")
    parser.add_argument("--version", action="version", version=f"daskpty {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        p = module.add_parser(sub)
        p.set_defaults(run=module.run)
    return parser


def main(argv=None) -> int:
    """Run the command line; return the exit code (0 ok, 2 bad input or usage, 130 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "run", None) is None:
        print("daskpty: error: choose a command (see 'daskpty --help')", file=sys.stderr)
        return 2
    if argv is None:  # as a command of its own (not called from Python code)
        # Worker processes killed by a signal (handled: the run restarts or ends in one line)
        # leave their semaphores to multiprocessing's resource tracker, which removes them at
        # exit with a "leaked semaphore" warning; it takes its warning filters from these options.
        sys.warnoptions.append("ignore:resource_tracker:UserWarning")
        install_loss_filter()  # also for what asyncio reports as the process ends
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:  # (set while importing)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # as a command of its own: Ctrl-C ends it even when stuck
    with InterruptGuard() if argv is None else contextlib.nullcontext():
        code = _run_command(args)
    if code == INTERRUPTED:
        forget_handled_interrupt()
    return code


def _run_command(args) -> int:
    try:
        from ..io.checkpoint import sigterm_as_interrupt  # lazy: it loads zarr, kept out of the CLI's start

        # SIGTERM (a batch system's wall time) at any moment ends like Ctrl-C: one line, exit 130
        # distributed's tracebacks of a handled loss or interrupt go to INFO during the command
        with warnings.catch_warnings(record=True) as caught, sigterm_as_interrupt(), quiet_handled_losses():
            warnings.simplefilter("always", UserWarning)
            code = args.run(args)
        for w in caught:
            if issubclass(w.category, UserWarning) and w.filename.find("daskpty") >= 0:
                print(f"daskpty: warning: {one_line(w.message)}", file=sys.stderr)
        sys.stdout.flush()
        return int(code or 0)
    except BrokenPipeError:  # `daskpty info X | head -1`: the reader had enough, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ScanStopped as exc:  # (not an error of the run: the scan it followed stopped)
        print(f"daskpty: {one_line(exc)}", file=sys.stderr)
        return exit_code(exc)
    except USER_ERRORS as exc:
        print(f"daskpty: error: {one_line(exc)}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        print("daskpty: interrupted; no output was left behind", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "EXIT_CODES", "build_parser", "exit_code", "main"]
