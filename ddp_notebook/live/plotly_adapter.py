"""Every use of plotly's private internals, in one place.

Curve updates reach plotly.js as messages, so a FigureWidget's synced state still holds the
figure it was shown with. What saves widget state (a saved notebook, nbclient, the docs site)
would then keep a plot with no curves. plotly offers no public way to store the figure as it is
now into that state; `keep_current_figure` does what plotly itself does when a figure is shown.

A FigureWidget carries plotly.js (about 5 MB) in its `_esm`: every cell's live view sent it to
the browser again and kept it in the saved widget state. `figure_widget` makes a FigureWidget
whose `_esm` is a few hundred bytes: it imports plotly's own widget code from one widget per
kernel that holds it (sent once, and imported by the page as soon as it arrives: `plotly_code()`
between cells spares the first live view that wait), and hands plotly's widget the same model and
element.
Exercised by `tests/test_plotly_adapter.py` (and the browser test that draws a live view), which
`benchmarks/compat.py` runs on every plotly of the range `pyproject.toml` declares (6.0 to 7.x).
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

# the widget code FigureWidget loads (plotly 7: its `_esm`, a file of the plotly package)
_PLOTLY_ESM = "package_data/widgetbundle.js"

# plotly's widget code, imported from a holder's text once per page and plotly version (a Blob URL)
_LOADER_JS = """
const loaded = (globalThis.__ddpNotebookPlotly ??= new Map());
function plotlyFrom(holder) {
  const key = String(holder.get("version"));
  if (!loaded.has(key)) {
    loaded.set(key, (async () => {
      const url = URL.createObjectURL(new Blob([holder.get("code")], { type: "text/javascript" }));
      try { return await import(url); } finally { URL.revokeObjectURL(url); }
    })());
  }
  return loaded.get(key);
}
"""

# the holder's `_esm`: it starts that import as soon as the page has the holder. Evaluating plotly.js
# takes the page most of a second (on a slow CPU); started between cells (`preload`), it is done
# before a cell's live view appears instead of freezing the page as the view comes in.
HOLDER_ESM = (
    _LOADER_JS
    + """
export default {
  initialize({ model }) {
    setTimeout(() => plotlyFrom(model).catch(() => {}), 0);  // a figure that needs it reports a failure
  },
};
"""
)

# a figure's `_esm`: plotly's widget code from the kernel's holder of it (imported once per page),
# then plotly's own widget (a factory, one per figure) does the rest
SHIM_ESM = (
    _LOADER_JS
    + """
async function plotlyModule(model) {
  const id = String(model.get("_plotly_code")).replace(/^IPY_MODEL_/, "");
  return plotlyFrom(await model.widget_manager.get_model(id));
}
export default () => {
  let plotly;
  return {
    async initialize(context) {
      const module = await plotlyModule(context.model);
      plotly = typeof module.default === "function" ? module.default() : module.default;
      return plotly.initialize?.(context);
    },
    render(context) {
      return plotly.render(context);
    },
  };
};
"""
)

_holder: Any = None


def missing_features() -> list[str]:
    """What the live view lacks with this plotly, one line each (said at %ddp_start). plotly 5's
    FigureWidget needs a frontend extension of its own, which JupyterLab 4 has not: no plot at all."""
    try:
        import anywidget
        import plotly
        import plotly.graph_objects as go
    except ImportError as missing:
        return [f"the live view's plots: {missing.name} is not installed (pip install 'plotly>=6')"]
    if not issubclass(go.FigureWidget, anywidget.AnyWidget):
        return [
            f"the live view's plots: plotly {plotly.__version__}'s FigureWidget needs a frontend extension "
            "JupyterLab 4 lacks (plotly 6.0 has one that needs none: pip install 'plotly>=6')"
        ]
    return []


def keep_current_figure(figure: Any) -> None:
    """Store `figure`'s data and layout as they are now in its widget state (plotly.js ignores the
    change; the saved state then shows every curve)."""
    figure._widget_data = copy.deepcopy(figure._data)
    figure._widget_layout = copy.deepcopy(figure._layout_obj._props)


def plotly_code() -> Any:
    """The kernel's one widget holding plotly's widget code (made, and sent, on first use)."""
    global _holder
    if _holder is None or getattr(_holder, "comm", None) is None:  # closed: a new one
        import plotly

        _holder = _code_holder_class()(code=_plotly_esm_text(), version=plotly.__version__)
    return _holder


def figure_widget(**options: Any) -> Any:
    """A plotly FigureWidget (`options` as FigureWidget takes them) that sends no plotly.js of its own."""
    return _figure_class()(**options)


def _plotly_esm_text() -> str:
    import plotly

    return (pathlib.Path(plotly.__file__).parent / _PLOTLY_ESM).read_text(encoding="utf8")


_classes: dict[str, Any] = {}


def _code_holder_class() -> Any:
    if "holder" not in _classes:
        import anywidget
        import traitlets

        class PlotlyCode(anywidget.AnyWidget):  # type: ignore[misc]
            """plotly's widget code, for the figures of this kernel (never displayed)."""

            _esm = HOLDER_ESM
            code = traitlets.Unicode().tag(sync=True)
            version = traitlets.Unicode().tag(sync=True)

        _classes["holder"] = PlotlyCode
    return _classes["holder"]


def _figure_class() -> Any:
    if "figure" not in _classes:
        import ipywidgets
        import plotly.graph_objects as go
        import traitlets

        # named FigureWidget: what reads saved widget state (the docs site) knows plotly's by that name
        class FigureWidget(go.FigureWidget):  # type: ignore[misc]
            """A FigureWidget whose plotly.js comes from the kernel's one holder of it."""

            _esm = SHIM_ESM
            _plotly_code = traitlets.Instance(_code_holder_class()).tag(sync=True, **ipywidgets.widget_serialization)

            @traitlets.default("_plotly_code")
            def _default_code(self) -> Any:
                return plotly_code()

        _classes["figure"] = FigureWidget
    return _classes["figure"]
