"""Every ```python block of README.md and docs/**/*.md runs as a script, in an empty directory.

A block that genuinely cannot run here (a GPU, a SLURM cluster, a file of the reader's own) is
marked in the markdown by the line just before its fence,
``<!-- snippet: skip (the reason) -->``; the skip names that reason. A block that needs an
optional package says so the same way, ``<!-- snippet: requires (module, ...) -->``, and runs
wherever those import. A block that only embeds a
script (``--8<-- "examples/x.py"``) is run by tests/test_examples.py, which this file checks.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.S | re.M)
MARK = re.compile(r"<!--\s*snippet:\s*(?P<kind>skip|requires)\s*\((?P<what>.+)\)\s*-->\s*$")
INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"\s*$')
#: a block with any of these starts dask worker processes, which re-import the main module
SPAWNS = re.compile(r"\b(simulate|reconstruct|LocalCluster|LocalCUDACluster|cuda_cluster|Client)\(")
#: at most this many blocks may be skipped (GPU, SLURM, remote scheduler, the reader's own file)
MAX_SKIPS = 9
#: scripts run at once: most of a block's time is its cluster starting and closing, which waits
#: more than it computes, so two at a time take about half the wall time on two cores
CONCURRENCY = 2


@dataclass(frozen=True)
class Snippet:
    page: str            # relative to the repository root
    line: int            # of the opening fence
    code: str
    skip: str | None     # the reason, from the marker before the fence
    include: str | None  # the embedded file, for a --8<-- block
    requires: tuple = ()  # optional modules it imports

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> list[Snippet]:
    """The ```python blocks of the README and the docs, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            kind = mark.group("kind") if mark else None
            code = textwrap.dedent(m.group("body"))
            include = INCLUDE.match(code.strip())
            found.append(Snippet(
                str(page.relative_to(ROOT)), line, code,
                mark.group("what") if kind == "skip" else None,
                include.group("path") if include else None,
                tuple(x.strip() for x in mark.group("what").split(",")) if kind == "requires" else ()))
    return found


ALL = snippets()
RUNNABLE = [s for s in ALL if s.skip is None and s.include is None]


def test_blocks_are_found():
    pages = {s.page for s in ALL}
    assert len(ALL) >= 25 and "README.md" in pages and "docs/index.md" in pages
    assert len(RUNNABLE) >= 15


def test_skips_are_few_and_say_why():
    skipped = [s for s in ALL if s.skip]
    assert len(skipped) <= MAX_SKIPS, [s.id for s in skipped]
    for s in skipped:
        assert len(s.skip) > 10 and s.skip.startswith("needs"), f"{s.id}: give a reason: {s.skip!r}"


def test_embedded_scripts_run_in_test_examples():
    tested = (ROOT / "tests" / "test_examples.py").read_text()
    included = [s for s in ALL if s.include]
    assert included
    for s in included:
        assert (ROOT / s.include).is_file(), f"{s.id}: {s.include} does not exist"
        assert f'"{Path(s.include).name}"' in tested, f"{s.id}: {s.include} is not run by test_examples.py"


@pytest.mark.parametrize("snippet", [s for s in ALL if not s.include], ids=lambda s: s.id)
def test_block_is_a_guarded_script(snippet):
    """Valid Python, importing what it uses, with the ``__main__`` guard where workers spawn."""
    compile(snippet.code, snippet.id, "exec")
    if SPAWNS.search(snippet.code) and "SLURMCluster" not in snippet.code:
        assert 'if __name__ == "__main__":' in snippet.code, (
            f"{snippet.id}: dask's worker processes re-import the main module; put the work "
            f"under `if __name__ == \"__main__\":`")
    if "daskpty." in snippet.code:
        assert re.search(r"^import daskpty\b|^from daskpty", snippet.code, re.M), snippet.id


def _run(snippet: Snippet, directory: Path) -> subprocess.CompletedProcess:
    """Run ``snippet`` as ``snippet.py`` in the empty ``directory`` with the installed package only."""
    script = directory / "snippet.py"
    script.write_text(snippet.code)
    env = {**os.environ, "PYTHONPATH": ""}   # what a reader has: the installed package only
    return subprocess.run([sys.executable, script.name], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def snippet_runs(request, tmp_path_factory):
    """The selected blocks' runs, started :data:`CONCURRENCY` at a time in test order as soon as
    the first of them is asked for; each test waits for its own."""
    selected = [item.callspec.params["snippet"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_block_runs_as_a_script"]
    runnable = [s for s in selected if all(importlib.util.find_spec(m) for m in s.requires)]
    pool = ThreadPoolExecutor(max_workers=CONCURRENCY)
    yield {s.id: pool.submit(_run, s, tmp_path_factory.mktemp("snippet")) for s in runnable}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_block_runs_as_a_script(snippet, snippet_runs):
    for module in snippet.requires:
        pytest.importorskip(module, reason=f"{snippet.id} needs {module}")
    proc = snippet_runs[snippet.id].result()
    assert proc.returncode == 0, f"{snippet.id} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    # no traceback, except those distributed logs when a worker loses the scheduler while the
    # cluster shuts down on a loaded machine (a log record, not an error of the script)
    lines = proc.stderr.splitlines()
    stray = [i for i, ln in enumerate(lines) if ln.startswith("Traceback")
             and not (i and " - distributed." in lines[i - 1] and "heartbeat" in lines[i - 1])]
    assert not stray, f"{snippet.id}:\n{proc.stderr[-6000:]}"
