"""daskpty: out-of-core ptychographic reconstruction on chunked Zarr data over dask clusters.

Main entry points::

    data = daskpty.open_data("scan.zarr")        # or daskpty.from_arrays(...), daskpty.simulate(...)
    rec = daskpty.reconstruct(data, engine="lsqml", epochs=100)
    rec.to_zarr("recon.zarr")
"""
from __future__ import annotations

import importlib
import os as _os
import signal as _signal
import sys as _sys


def _interrupted_while_starting(signum, frame):  # pragma: no cover - exercised in a subprocess
    _os.write(2, b"daskpty: interrupted while starting; nothing was written\n")
    _os._exit(130)


# The ``daskpty`` command (or ``python -m daskpty``) takes about a second to import; a Ctrl-C,
# SIGTERM or SIGHUP meanwhile ends it with one line (it gave a KeyboardInterrupt traceback or an
# exit status of -15) until daskpty.cli.main installs its own handlers. Library imports: untouched.
# A worker process started by multiprocessing re-imports the command's ``__main__`` with the
# command's ``sys.argv`` before it knows its parent, and must not install these handlers: its
# interpreter's own command line (``sys.orig_argv``) tells it apart
# (it runs ``python -c "from multiprocessing.spawn import spawn_main; ..."``; the forkserver too).
_orig = list(getattr(_sys, "orig_argv", ()))
_pairs = list(zip(_orig, _orig[1:]))
_command = (_os.path.basename(_sys.argv[0]) if _sys.argv else "") == "daskpty" or ("-m", "daskpty") in _pairs
if _command and not any(a == "-c" and "multiprocessing" in b for a, b in _pairs):
    for _name in ("SIGINT", "SIGTERM", "SIGHUP"):
        try:
            if _signal.getsignal(getattr(_signal, _name)) is not _signal.SIG_IGN:
                _signal.signal(getattr(_signal, _name), _interrupted_while_starting)
        except (AttributeError, ValueError):  # no such signal here, or not the main thread
            pass

try:
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("daskpty")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

# ``simulate`` is bound eagerly: the function must shadow the subpackage of the same name, and
# daskpty/simulate/ imports only NumPy/SciPy/physics at module level (dask loads on call).
from .simulate import simulate  # noqa: E402

# Everything else loads lazily (PEP 562) so that ``import daskpty.physics`` does not pull in dask.
_LAZY = {
    "open_data": ("daskpty.io.store", "open_data"),
    "from_arrays": ("daskpty.io.store", "from_arrays"),
    "PtychoData": ("daskpty.io.store", "PtychoData"),
    "ScanWriter": ("daskpty.io.live", "ScanWriter"),
    "LiveStore": ("daskpty.io.live", "LiveStore"),
    "DataError": ("daskpty.io.validate", "DataError"),
    "check_values": ("daskpty.io.validate", "check_values"),
    "reconstruct": ("daskpty.api", "reconstruct"),
    "Reconstruction": ("daskpty.io.results", "Reconstruction"),
    "metrics": ("daskpty.metrics", None),
    "workflows": ("daskpty.workflows", None),
    "half_set_frc": ("daskpty.workflows", "half_set_frc"),
    # reconstruct's option groups (daskpty.options)
    "options": ("daskpty.options", None),
    "EngineOptions": ("daskpty.options", "EngineOptions"),
    "ProbeModelOptions": ("daskpty.options", "ProbeModelOptions"),
    "PositionOptions": ("daskpty.options", "PositionOptions"),
    "SampleOptions": ("daskpty.options", "SampleOptions"),
    "ExecutionOptions": ("daskpty.options", "ExecutionOptions"),
    "RunOptions": ("daskpty.options", "RunOptions"),
    "OptionError": ("daskpty.options", "OptionError"),
}

__all__ = sorted(_LAZY) + ["__version__", "simulate"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'daskpty' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
