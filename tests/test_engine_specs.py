"""The engine spec table is the one place that names engines, and it loads without dask."""
import ast
import pathlib
import subprocess
import sys

import daskpty
from daskpty.engines.specs import ENGINE_SPECS

PACKAGE = pathlib.Path(daskpty.__file__).parent
#: the tables that name every engine: the specs and execution's adapters
TABLES = {"engines/specs.py", "execution/engine_registry.py"}


def _docstrings(tree) -> set:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _own(path: pathlib.PurePath, name: str) -> bool:
    """An engine's own modules name it: those named after the module family of its options class
    (``pie_adapter.py`` for ePIE's ``PIEOptions`` in ``daskpty.engines.pie``, ``ad/opr.py``)."""
    family = ENGINE_SPECS[name].options.__module__.split(".")[2]
    return family in path.parts[:-1] or family in path.stem.split("_")


def test_engine_names_only_in_the_tables():
    named = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.as_posix() in TABLES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        found = {node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and node.value in ENGINE_SPECS and id(node) not in docs
                 and not _own(relative, node.value)}
        if found:
            named[relative.as_posix()] = sorted(found)
    assert named == {}


def test_spec_module_loads_without_dask():
    code = ("import sys, daskpty.engines.specs as s, daskpty.options, daskpty.cli.reconstruct; "
            "assert s.ENGINE_SPECS; print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_options_defaults_come_from_the_specs():
    """Every spec's position and probe-model defaults are what ``for_engine`` resolves."""
    from daskpty.engines.position_options import PositionOptions
    from daskpty.engines.probe_model import ProbeModelOptions

    for name, spec in ENGINE_SPECS.items():
        for cls, defaults in ((PositionOptions, spec.position_defaults), (ProbeModelOptions, spec.probe_model_defaults)):
            if defaults is not None:
                resolved = cls().for_engine(name)
                assert {k: getattr(resolved, k) for k in defaults} == defaults
