"""The documentation site builds with ``mkdocs build --strict`` (skipped without mkdocs)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    # no --quiet: every warning must show, and any one fails the test even where mkdocs
    # would only log it (a plugin's warning, a page left out of the nav, a dead anchor)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [ln for ln in log.splitlines() if "WARNING" in ln or ln.startswith(("WARN", "ERROR"))]
    assert not warnings, "mkdocs warned:\n" + "\n".join(warnings)
    assert "Documentation built" in log        # the log was really captured
    return out


def test_every_page_is_in_the_nav():
    """mkdocs only warns about pages left out of the nav; here that fails by itself."""
    import yaml

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for v in node.values():
                yield from pages(v)
        elif isinstance(node, list):
            for v in node:
                yield from pages(v)

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)   # !!python/name tags
    nav = set(pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]))
    docs = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert docs - nav == set(), "pages missing from mkdocs.yml's nav"


def test_index_lists_every_command_and_how_to():
    index = (ROOT / "docs" / "index.md").read_text()
    row = next(ln for ln in index.splitlines() if ln.startswith("| [Command line]"))
    for command in ("simulate", "import", "info", "reconstruct", "show", "export"):
        assert f"`{command}`" in row or f"`daskpty {command}`" in row, command
    row = next(ln for ln in index.splitlines() if ln.startswith("| How-to guides"))
    for page in sorted((ROOT / "docs" / "howto").glob("*.md")):
        assert f"(howto/{page.name})" in row, f"docs/index.md's how-to list lacks {page.name}"


@pytest.mark.slow          # builds the site: ~5-10 s
def test_every_page_is_built(site):
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("")
                   for p in (ROOT / "docs").rglob("*.md"))
    assert len(pages) >= 15
    for page in pages:
        html = site / ("index.html" if str(page) == "index" else f"{page}/index.html")
        assert html.is_file(), f"{page}.md was not built"


@pytest.mark.slow          # builds the site: ~5-10 s
def test_api_reference_is_generated(site):
    html = (site / "api" / "index.html").read_text()
    for name in ("daskpty.api.reconstruct", "daskpty.io.store.open_data", "daskpty.io.store.from_arrays",
                 "daskpty.io.results.Reconstruction", "daskpty.execution.gpu.cuda_cluster",
                 "daskpty.metrics.nrmse", "daskpty.monitor.dashboard.DashboardPublisher"):
        assert f'id="{name}"' in html, f"{name} missing from the API page"
    assert "rounds_per_epoch" in html          # parameters come from the docstrings


@pytest.mark.slow          # builds the site: ~5-10 s
def test_examples_are_embedded_and_figure_is_shown(site):
    page = (site / "howto" / "cpu-laptop" / "index.html").read_text()
    assert "nrmse_vs_truth" in page            # the script itself, via pymdownx.snippets
    assert (site / "img" / "summary.png").is_file()
    assert "img/summary.png" in (site / "index.html").read_text()


@pytest.mark.slow          # builds the site: ~5-10 s
def test_site_works_offline(site):
    """No page loads scripts or styles from a CDN (highlight.js is off; Pygments colours code)."""
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "cdnjs.cloudflare.com" not in text, html
        assert "<script src=\"http" not in text, html
