"""Each use of plotly's private internals (ddp_notebook.live.plotly_adapter), on a real FigureWidget.

plotly is bounded in pyproject.toml to the versions these tests pass on; test_widgets checks the
live view that relies on it end to end (the saved state of a finished cell holds every curve).
"""

from __future__ import annotations

import plotly.graph_objects as go

from ddp_notebook.live import plotly_adapter


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
