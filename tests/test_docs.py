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
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_every_page_is_built(site):
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("")
                   for p in (ROOT / "docs").rglob("*.md"))
    assert len(pages) >= 15
    for page in pages:
        html = site / ("index.html" if str(page) == "index" else f"{page}/index.html")
        assert html.is_file(), f"{page}.md was not built"


def test_api_reference_is_generated(site):
    html = (site / "api" / "index.html").read_text()
    for name in ("daskpty.api.reconstruct", "daskpty.io.store.open_data", "daskpty.io.store.from_arrays",
                 "daskpty.results.Reconstruction", "daskpty.execution.gpu.cuda_cluster",
                 "daskpty.metrics.nrmse", "daskpty.monitor.dashboard.DashboardPublisher"):
        assert f'id="{name}"' in html, f"{name} missing from the API page"
    assert "rounds_per_epoch" in html          # parameters come from the docstrings


def test_examples_are_embedded_and_figure_is_shown(site):
    page = (site / "howto" / "cpu-laptop" / "index.html").read_text()
    assert "nrmse_vs_truth" in page            # the script itself, via pymdownx.snippets
    assert (site / "img" / "summary.png").is_file()
    assert "img/summary.png" in (site / "index.html").read_text()


def test_site_works_offline(site):
    """No page loads scripts or styles from a CDN (highlight.js is off; Pygments colours code)."""
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "cdnjs.cloudflare.com" not in text, html
        assert "<script src=\"http" not in text, html
