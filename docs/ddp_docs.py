"""Sphinx extension of the docs site: the tour's notebooks as a reader sees them, and the magics.

- Each notebooks/*.ipynb page is built from its executed copy (config `ddp_executed_notebooks`,
  a folder docs/build.py or the test suite fills) instead of the stored notebook, which has no
  outputs. MyST-NB executes nothing.
- Outputs a static page cannot run become static HTML drawn with plotly.js (shipped with the
  site, no network): plotly figures (`fig.show()`), and widgets (the live view, a rank's own
  tqdm bars and FigureWidgets) in the final state the kernel left them, read from the widget
  state nbclient saved in the notebook.
- `ddp-magics`: every magic's help (what `%ddp_start?` prints), taken from the magics themselves.
"""

from __future__ import annotations

import base64
import hashlib
import html
import inspect
import json
from pathlib import Path
from typing import Any

import nbformat
import plotly
import plotly.io
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


# ---------------------------------------------------------------- figures


def figure_html(figure: dict[str, Any], instance: int = 0) -> str:
    """A plotly figure as a div drawn by plotly.js once the page has loaded it (the theme puts
    scripts at the end of the page). The id is the figure's hash and `instance` (a widget shown
    twice is drawn twice), so a rebuild is identical."""
    spec = plotly.io.to_json(figure, validate=False).replace("</", "<\\/")  # nothing closes the script
    figure_id = f"plotly-{hashlib.sha1(spec.encode()).hexdigest()[:16]}-{instance}"
    height = figure.get("layout", {}).get("height") or 450
    return (
        f'<div id="{figure_id}" class="plotly-graph-div" style="height:{height}px;width:100%"></div>'
        f"<script>document.addEventListener('DOMContentLoaded', () => {{"
        f" const figure = {spec};"
        f" Plotly.newPlot('{figure_id}', figure.data, figure.layout, {{responsive: true}}); }});</script>"
    )


def _decoded(value: Any) -> Any:
    """plotly's widget serialization of numpy arrays ({dtype, shape, buffer}) back to lists."""
    if isinstance(value, dict):
        if {"dtype", "shape", "buffer"} <= value.keys() and isinstance(value["buffer"], bytes):
            import numpy

            return numpy.frombuffer(value["buffer"], dtype=value["dtype"]).reshape(value["shape"]).tolist()
        return {key: _decoded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value


def _with_buffers(state: dict[str, Any], buffers: list[dict[str, Any]]) -> dict[str, Any]:
    """A model's state with its binary buffers put back where the kernel took them from."""
    state = json.loads(json.dumps(state))
    for buffer in buffers:
        *parents, last = buffer["path"]
        target: Any = state
        for key in parents:
            target = target[key] if isinstance(target, (dict, list)) else None
        # nbclient keeps the buffers of an earlier update whose value was reset since: skip them
        if isinstance(target, dict) or (isinstance(target, list) and isinstance(last, int) and last < len(target)):
            target[last] = base64.b64decode(buffer["data"])
    return state


# ---------------------------------------------------------------- widgets


class StaticWidgets:
    """Static HTML of widget views, from the widget state saved in an executed notebook."""

    def __init__(self, notebook: nbformat.NotebookNode) -> None:
        saved = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
        self.models = {
            model_id: _decoded(_with_buffers(model["state"], model.get("buffers", [])))
            for model_id, model in saved.items()
        }
        self.drawn: dict[str, int] = {}  # FigureWidget: how many times drawn so far

    def html(self, model_id: str) -> str | None:
        """The view of `model_id`, or None where a model it needs was not saved."""
        try:
            return self._render(model_id)
        except KeyError:
            return None

    def _child(self, reference: str) -> str:
        return self._render(reference.removeprefix("IPY_MODEL_"))

    def _render(self, model_id: str) -> str:
        state = self.models[model_id]
        name = state["_model_name"]
        classes = " ".join(["ddp-static-widget", *state.get("_dom_classes", [])])
        description = state.get("description") or ""
        label = f'<span class="ddp-static-description">{html.escape(description)}</span>' if description else ""
        if name in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel"):
            direction = "row" if name == "HBoxModel" else "column"
            children = "".join(self._child(child) for child in state.get("children", []))
            return f'<div class="{classes}" style="display:flex;flex-direction:{direction};gap:4px">{children}</div>'
        if name in ("HTMLModel", "HTMLMathModel"):
            return f'<div class="{classes}">{label}{state.get("value", "")}</div>'
        if name in ("LabelModel", "TextModel"):
            return f'<div class="{classes}">{label}{html.escape(str(state.get("value", "")))}</div>'
        if name in ("IntProgressModel", "FloatProgressModel"):
            value, high = state.get("value", 0), state.get("max", 100)
            style = "success" if state.get("bar_style") == "success" else state.get("bar_style") or ""
            return (
                f'<div class="{classes} ddp-static-progress {style}">{label}'
                f'<progress value="{value}" max="{high}"></progress></div>'
            )
        if name in ("FloatSliderModel", "IntSliderModel"):
            return f'<div class="{classes}">{label} {state.get("value")}</div>'
        if name == "OutputModel":
            return f'<div class="{classes}">{"".join(_output_html(o) for o in state.get("outputs", []))}</div>'
        if name == "AnyModel" and str(state.get("_anywidget_id", "")).endswith("FigureWidget"):
            figure = {"data": state.get("_widget_data", []), "layout": state.get("_widget_layout", {})}
            self.drawn[model_id] = self.drawn.get(model_id, -1) + 1
            return f'<div class="{classes}">{figure_html(figure, self.drawn[model_id])}</div>'
        raise KeyError(name)


def _output_html(output: dict[str, Any]) -> str:
    data = output.get("data", {})
    if "text/html" in data:
        return data["text/html"]
    text = output.get("text") or data.get("text/plain", "")
    return f"<pre>{html.escape(text)}</pre>"


def static_outputs(notebook: nbformat.NotebookNode, docname: str) -> nbformat.NotebookNode:
    """The notebook with plotly figures and widget views as static HTML, and no widget state
    (which would make MyST-NB load the widget manager from a CDN). A widget that cannot be
    drawn is a warning (an error under -W), and its plain-text form is shown."""
    widgets = StaticWidgets(notebook)
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY_MIME in data:
                data["text/html"] = figure_html(data.pop(PLOTLY_MIME))
            if WIDGET_MIME in data:
                drawn = widgets.html(data.pop(WIDGET_MIME)["model_id"])
                if drawn is None:
                    logger.warning(
                        f"cell {index}: a widget with no static form: {data.get('text/plain')}", location=docname
                    )
                else:
                    data["text/html"] = drawn
    notebook.metadata.pop("widgets", None)
    return notebook


def use_executed_notebook(app: Sphinx, docname: str, source: list[str]) -> None:
    """source-read: a notebook page is read from its executed copy."""
    if not docname.startswith("notebooks/"):
        return
    folder = app.config.ddp_executed_notebooks
    executed = Path(folder) / f"{Path(docname).name}.ipynb" if folder else None
    if executed is None or not executed.is_file():
        raise ExtensionError(
            f"{docname}.ipynb has no executed copy in {folder or '(ddp_executed_notebooks unset)'}: "
            "build the site with  python3 docs/build.py"
        )
    notebook = static_outputs(nbformat.read(executed, as_version=4), docname)
    source[0] = nbformat.writes(notebook)


def add_plotly_js(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    """html-page-context: plotly.js only on the pages that draw figures."""
    if "Plotly.newPlot" in context.get("body", ""):  # the pages that draw figures
        app.add_js_file("plotly.min.js")


def redirect_to_root(app: Sphinx, error: Exception | None) -> None:
    """build-finished: index.html at the top of the site opens the root page (docs/index.html)."""
    if error is None and app.builder.format == "html":
        target = app.builder.get_target_uri(app.config.root_doc)
        (Path(app.outdir) / "index.html").write_text(
            f'<!DOCTYPE html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url={target}">'
            f'<title>ddp_notebook</title><a href="{target}">ddp_notebook</a>\n'
        )


# ---------------------------------------------------------------- magics


class MagicsDirective(SphinxDirective):
    """Every magic's help text, as `%name?` shows it."""

    def run(self) -> list[nodes.Node]:
        from ddp_notebook.magics import MAGICS_CLASSES

        found = []
        for cls in MAGICS_CLASSES:
            for kind, table in cls.magics.items():
                for name in table:
                    prefix = "%%" if kind == "cell" else "%"
                    doc = inspect.getdoc(getattr(cls, table[name])) or "(no help text)"
                    # IPython's magic_arguments starts the usage with an rst "::" line: not for a literal block
                    found.append((name, prefix, doc.removeprefix("::\n").lstrip("\n")))
        result: list[nodes.Node] = []
        for name, prefix, doc in sorted(found):
            section = nodes.section(ids=[f"magic-{name}"])
            section += nodes.title(text=f"{prefix}{name}")
            section += nodes.literal_block(text=doc, language="none")
            result.append(section)
        return result


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("ddp_executed_notebooks", "", "env", str)
    app.connect("source-read", use_executed_notebook)
    app.connect("html-page-context", add_plotly_js)
    app.connect("build-finished", redirect_to_root)
    app.add_directive("ddp-magics", MagicsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
