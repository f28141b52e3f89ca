"""The errors daskpty raises on purpose live in one module (daskpty.faults), and the command line
gives each one that reaches the user an exit code from one table (daskpty.cli.EXIT_CODES)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import daskpty
from daskpty import faults
from daskpty.cli import exit_code


def _modules():
    for info in pkgutil.walk_packages(daskpty.__path__, "daskpty."):
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # an optional extra (CuPy, dask-cuda) this machine lacks
            continue


def test_every_public_error_class_is_defined_in_daskpty_faults():
    elsewhere = set()
    for module in _modules():
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
                    and obj.__module__ == module.__name__ and not name.startswith("_")
                    and module.__name__ != "daskpty.faults"):
                elsewhere.add(f"{module.__name__}.{name}")
    assert not elsewhere, f"define these in daskpty/faults.py: {sorted(elsewhere)}"


@pytest.mark.parametrize("name", [n for n in faults.__all__ if n != "HANDLED_INSIDE"])
def test_each_fault_that_reaches_the_user_has_an_exit_code(name):
    cls = getattr(faults, name)
    code = exit_code(cls("what went wrong"))
    if cls in faults.HANDLED_INSIDE:
        assert code is None  # a restart or a discarded write, never a line of its own
    else:
        assert code == (3 if cls is faults.ScanStopped else 2)


def test_the_modules_that_raise_a_fault_name_the_same_class():
    from daskpty.execution.cluster import WorkersPaused
    from daskpty.io.validate import DataError
    from daskpty.workflows import ScanStopped

    assert DataError is faults.DataError and WorkersPaused is faults.WorkersPaused
    assert ScanStopped is faults.ScanStopped and issubclass(faults.DamagedStoreError, DataError)
