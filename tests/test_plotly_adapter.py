"""Each use of plotly's private internals (ddp_notebook.live.plotly_adapter), on a real FigureWidget.

benchmarks/compat.py runs them on every plotly of the supported range (docs/compatibility.md); test_widgets checks the
live view that relies on it end to end (the saved state of a finished cell holds every curve).
"""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from ddp_notebook.live import plotly_adapter

pytestmark = pytest.mark.core


def test_the_current_figure_is_kept_in_the_widget_state() -> None:
    figure = go.FigureWidget()
    figure.add_scatter(y=[1.0, 2.0, 3.0], name="rank 0")
    figure.update_layout(title="loss")
    # updates made after the widget exists go to plotly.js as messages, not into its synced state
    assert list(figure._widget_data) == []
    plotly_adapter.keep_current_figure(figure)
    kept = figure.get_state()
    assert [(trace["name"], list(trace["y"])) for trace in kept["_widget_data"]] == [("rank 0", [1.0, 2.0, 3.0])]
    assert kept["_widget_layout"]["title"]["text"] == "loss"
    # a copy: later updates do not reach the kept state
    figure.data[0].name = "rank 1"
    assert figure.get_state()["_widget_data"][0]["name"] == "rank 0"


def test_a_live_figure_sends_no_plotly_js_of_its_own() -> None:
    """plotly's FigureWidget carries plotly.js (about 5 MB) in its state; the live view's figures
    carry a few hundred bytes that load it from the kernel's one holder, sent once."""
    import json
    from pathlib import Path

    import plotly

    bundle = (Path(plotly.__file__).parent / "package_data" / "widgetbundle.js").read_text(encoding="utf8")
    assert go.FigureWidget().get_state()["_esm"] == bundle and len(bundle) > 4_000_000  # plotly's own
    holder = plotly_adapter.plotly_code()
    assert holder.get_state()["code"] == bundle
    # the page imports it once per plotly version, as soon as it has the holder (its `initialize`)
    assert holder.get_state()["version"] == plotly.__version__ and "initialize" in holder.get_state()["_esm"]
    figures = [plotly_adapter.figure_widget(), plotly_adapter.figure_widget(layout={"height": 300})]
    figures[1].add_scatter(y=[1.0, 2.0], name="rank 0")
    for figure in figures:
        state = figure.get_state()
        assert state["_plotly_code"] == f"IPY_MODEL_{holder.model_id}"  # the one holder
        assert state["_anywidget_id"].endswith("FigureWidget")  # as the docs site recognises it
        sent = len(json.dumps({k: v for k, v in state.items() if isinstance(v, (str, int, float, list, dict))}))
        assert sent < 20_000, sent
    plotly_adapter.keep_current_figure(figures[1])  # the saved state keeps working as for plotly's own
    assert [t["name"] for t in figures[1].get_state()["_widget_data"]] == ["rank 0"]
    assert plotly_adapter.plotly_code() is holder
    for widget in (*figures, holder):
        widget.close()  # closed (Widget.close_all()): the next figure gets a holder of its own again
    assert plotly_adapter.plotly_code() is not holder
