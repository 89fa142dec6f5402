"""The docs site: built from the notebooks this test run executed, then read in chromium.

The build is docs/build.py's (Sphinx, warnings are errors: a broken internal link, a reference
that does not resolve, a widget with no static form, a notebook without its executed copy fail
it), from the notebooks tests/conftest.py executed once for the whole session. Then every page
is opened in Debian's chromium (Playwright, as tests/test_browser.py drives it): it renders,
its figures are drawn, its images load, and no cell shows an error it was not meant to show.
Skipped, with the reason, where the docs extra (the build) or chromium or Playwright (the
reading) is missing.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.support.jupyterlab_server import CHROMIUM, CHROMIUM_ARGS
from tests.support.notebooks import ExecutedNotebooks

pytestmark = [pytest.mark.notebook, pytest.mark.browser, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BUILD_SECONDS = 600
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

# what a page shows: its title, figures, images, and the cells' outputs
PAGE_JS = """() => {
  const main = document.querySelector('article') || document.body;
  const cells = Array.from(main.querySelectorAll('div.cell'));
  return {
    title: document.title,
    text: main.innerText,
    figures: Array.from(main.querySelectorAll('.plotly-graph-div')).map(div => ({
      drawn: !!div.querySelector('svg.main-svg'),
      points: (div.data || []).map(t => (t.y || t.x || t.z || []).length),
      live: !!div.closest('.ddp-live'),
      names: (div.data || []).map(t => t.name || ''),
    })),
    images: Array.from(main.querySelectorAll('img')).map(i => [i.getAttribute('src'), i.naturalWidth]),
    cells: cells.map(c => ({
      raises: c.classList.contains('tag_raises-exception'),
      tracebacks: c.querySelectorAll('.output.traceback').length,
      output: Array.from(c.querySelectorAll('.cell_output')).map(o => o.innerText).join('\\n'),
    })),
    links: Array.from(main.querySelectorAll('a[href]')).map(a => a.getAttribute('href')),
    ids: Array.from(main.querySelectorAll('[id]')).map(e => e.id),
  };
}"""
# what a page may not show outside a cell tagged raises-exception: a traceback, a widget
# left as its text form, a widget manager's error
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|Error displaying widget|[A-Za-z]*Box\(children=|Widget\(")


def missing_docs_extra() -> str | None:
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        return "the docs extra is not installed (pip install -e '.[docs]'; .ci/install does)"
    return None


def missing_browser() -> str | None:
    if not CHROMIUM.exists():
        return f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/install does)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


def shown_figures(notebook: nbformat.NotebookNode) -> int:
    """Figures a reader must see: plotly outputs, and the FigureWidgets with data in each widget
    view shown (a view shown twice counts twice)."""
    models = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def figures_in(model_id: str) -> int:
        state = models.get(model_id, {}).get("state", {})
        if str(state.get("_anywidget_id", "")).endswith("FigureWidget"):
            return int(bool(state.get("_widget_data")))
        return sum(figures_in(child.removeprefix("IPY_MODEL_")) for child in state.get("children", []))

    count = 0
    for output in (o for cell in notebook.cells for o in cell.get("outputs", [])):
        data = output.get("data", {})
        count += PLOTLY_MIME in data
        if WIDGET_MIME in data:
            count += figures_in(data[WIDGET_MIME]["model_id"])
    return count


@pytest.fixture(scope="module")
def site(executed_notebooks: ExecutedNotebooks, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The built site: its folder, the build time, and each notebook's expected figure count."""
    reason = missing_docs_extra()
    if reason:
        pytest.skip(reason)
    executed = tmp_path_factory.mktemp("executed")
    figures = {}
    for path in NOTEBOOKS:
        notebook = executed_notebooks.get(path).notebook
        nbformat.write(notebook, executed / path.name)
        figures[path.stem] = shown_figures(notebook)
    out = tmp_path_factory.mktemp("docs")
    began = time.monotonic()
    build = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build.py"), "--executed", str(executed), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=BUILD_SECONDS,
        check=False,
    )
    assert build.returncode == 0, f"the docs build failed:\n{build.stdout[-4000:]}\n{build.stderr[-8000:]}"
    return {"html": out / "html", "seconds": time.monotonic() - began, "figures": figures}


def test_tour_lists_every_notebook() -> None:
    """The README's tour table (which the docs' root page includes) names every notebook."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- tour table start -->", 1)[1].split("<!-- tour table end -->", 1)[0]
    listed = re.findall(r"^\| `(\d\d_\w+\.ipynb)` \|", table, re.MULTILINE)
    assert listed == [path.name for path in NOTEBOOKS]


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_file_a_page_links_to_is_in_the_repository() -> None:
    """A clean clone has every file the markdown pages link to (not only this checkout).

    A results file that .gitignore leaves out is on disk here, so the build passes here and
    fails on a fresh clone; git's own list is what a clone gets.
    """
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to tell tracked files from the others")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    tracked = {ROOT / name for name in listed.split("\0") if name}
    folders = {parent for path in tracked for parent in path.parents}
    missing = []
    pages = [path for path in tracked if path.suffix == ".md"]
    assert ROOT / "README.md" in pages and ROOT / "docs" / "elastic.md" in pages
    for page in pages:
        for target in MARKDOWN_LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if path not in tracked and path not in folders:
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, "pages link to files a clone will not have (git add -f them?):\n" + "\n".join(missing)


def test_docs_site_builds(site: dict[str, Any]) -> None:
    """Built without a warning (the build's own check), with a page per notebook and the root page."""
    html = site["html"]
    assert (html / "index.html").is_file() and (html / "docs" / "index.html").is_file()
    assert sorted(p.stem for p in (html / "notebooks").glob("*.html")) == [p.stem for p in NOTEBOOKS]
    assert (html / "_static" / "plotly.min.js").is_file()


def test_docs_site_in_browser(site: dict[str, Any]) -> None:
    reason = missing_browser()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    html = site["html"]
    pages = ["index.html", "README.html", "docs/api.html", "docs/architecture.html"]
    pages += [f"notebooks/{path.stem}.html" for path in NOTEBOOKS]
    seen: dict[str, dict[str, Any]] = {}
    console_errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: console_errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda error: console_errors.append(f"{page.url}: {error}"))
            for name in pages:
                page.goto((html / name).as_uri())
                if name == "index.html":  # it sends the reader on to the root page
                    page.wait_for_url("**/docs/index.html", timeout=10_000)
                page.wait_for_load_state("load")
                seen[name] = page.evaluate(PAGE_JS)
        finally:
            browser.close()

    assert console_errors == [], console_errors
    # the site's index.html leads to the root page, which leads to the rest
    assert "ddp_notebook" in seen["index.html"]["title"]
    assert {"../README.html", "api.html"} <= set(seen["index.html"]["links"]), seen["index.html"]["links"]
    for name, shown in seen.items():
        assert shown["text"].strip(), f"{name} rendered nothing"
        assert all(width > 0 for _, width in shown["images"]), f"{name}: an image did not load: {shown['images']}"
        assert all(figure["drawn"] and figure["points"] for figure in shown["figures"]), (name, shown["figures"])
    assert any("live_view.png" in src for src, _ in seen["README.html"]["images"])
    # the API reference: every name the package exports, and every magic
    import ddp_notebook
    from ddp_notebook.magics import MAGICS_CLASSES

    api_ids = set(seen["docs/api.html"]["ids"])
    exported = [name for name in ddp_notebook.__all__ if not name.startswith("__")]
    assert [name for name in exported if f"ddp_notebook.{name}" not in api_ids] == []
    magics = [name for cls in MAGICS_CLASSES for table in cls.magics.values() for name in table]
    assert [name for name in magics if f"magic-{name}" not in api_ids] == []
    # each notebook: every cell's outputs as they ran, every figure drawn, errors only where meant
    for path in NOTEBOOKS:
        shown = seen[f"notebooks/{path.stem}.html"]
        assert len(shown["figures"]) == site["figures"][path.stem], (path.name, shown["figures"])
        assert any(cell["output"] for cell in shown["cells"]), f"{path.name}: no outputs shown"
        for index, cell in enumerate(shown["cells"]):
            if cell["raises"]:
                # the error as the notebook showed it (ddp_notebook's errors are their message)
                assert cell["tracebacks"] >= 1 and cell["output"].strip(), (path.name, index, cell["output"])
            else:
                assert cell["tracebacks"] == 0 and not ERROR_TEXT.search(cell["output"]), (
                    path.name,
                    index,
                    cell["output"][-2000:],
                )
        assert "stopped the world" in shown["text"], path.name
    # the live view as the cell left it: a curve per rank with every point, the bars full
    # (20 epochs of 8 batches, then 5 more appended to the same view: 200 losses and 25
    # accuracies per rank; the view is shown under both cells)
    live = [f for f in seen["notebooks/02_live_metrics.html"]["figures"] if f["live"]]
    assert len(live) == 2 and live[0] == live[1], live
    assert sorted(zip(live[0]["names"], live[0]["points"])) == [
        ("rank 0", 25),
        ("rank 0", 200),
        ("rank 1", 25),
        ("rank 1", 200),
    ], live
    assert "rank 0 · epoch" in seen["notebooks/02_live_metrics.html"]["text"]
    # the root page links every notebook's page and shows what each one is about (the README's table)
    tour = seen["index.html"]
    for path in NOTEBOOKS:
        assert f"../notebooks/{path.stem}.html" in tour["links"], path.name
        assert path.name in tour["text"], path.name
    print(f"docs site built in {site['seconds']:.0f} s from executed notebooks")
