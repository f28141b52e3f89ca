"""The package's import structure (issue 33.6): no import cycle among daskpty's modules, function-
local imports included (they hid five); every module imports on its own in a fresh interpreter;
the light entry points stay free of dask (physics and engines by design, the command line's start
for speed). The layers themselves are import-linter's contracts in pyproject.toml."""
from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import grimp
import pytest

import daskpty

#: cycles known in modules of other owners, to be broken there; each entry must still be a cycle
#: (the test fails once it is gone, so the entry is deleted with the fix)
KNOWN_CYCLES: list[frozenset] = []


def _cycles(graph) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def _describe(graph, cycle) -> str:
    lines = []
    for importer in sorted(cycle):
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & cycle):
            for d in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer}:{d['line_number']} -> {imported}: {d['line_contents']}")
    return "\n".join(lines)


def test_no_import_cycle_among_daskpty_modules():
    graph = grimp.build_graph("daskpty", exclude_type_checking_imports=True, cache_dir=None)
    cycles = _cycles(graph)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n\n".join(_describe(graph, c) for c in new)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, delete it from KNOWN_CYCLES: {gone}"


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.d", "p.e")]:
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [frozenset({"p.a", "p.b", "p.c"})]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(daskpty.__file__)))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_physics_engines_and_the_command_line_start_without_dask():
    loaded = _run(
        "import importlib, pkgutil, sys\n"
        "import daskpty.engines, daskpty.physics\n"
        "for pkg in (daskpty.engines, daskpty.physics):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "print(sorted(k for k in ('dask', 'distributed') if k in sys.modules))")
    assert loaded == "[]", f"physics/engines import {loaded}"
    loaded = _run("import sys, daskpty.cli\n"
                  "print(sorted(k for k in ('dask', 'distributed', 'zarr') if k in sys.modules))")
    assert loaded == "[]", f"the command line's start imports {loaded}"


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """Each module in a fresh process of its own (forked from one that has loaded the third-party
    packages but no daskpty module), so an import-order dependency or a cycle cannot hide."""
    names = ["daskpty"] + [m.name for m in pkgutil.walk_packages(daskpty.__path__, "daskpty.")]
    script = (
        "import importlib, importlib.metadata, os, sys\n"
        "import numpy, scipy.fft, scipy.ndimage, scipy.spatial, dask.array, distributed, zarr\n"
        "assert not any(m == 'daskpty' or m.startswith('daskpty.') for m in sys.modules)\n"
        "failed, running = [], {}\n"
        "def reap():\n"
        "    pid, status = os.wait()\n"
        "    if status:\n"
        "        failed.append(running[pid])\n"
        "    del running[pid]\n"
        "for name in sys.argv[1:]:\n"
        "    if len(running) >= 2:\n"
        "        reap()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except BaseException as exc:\n"
        "            print(f'{name}: {type(exc).__name__}: {exc}', flush=True)\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    running[pid] = name\n"
        "while running:\n"
        "    reap()\n"
        "print('FAILED', sorted(failed))\n")
    out = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(daskpty.__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("FAILED []"), out.stdout
    assert len(names) > 100
