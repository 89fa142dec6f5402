"""Every use of plotly's private internals, in one place.

Curve updates reach plotly.js as messages, so a FigureWidget's synced state still holds the
figure it was shown with. What saves widget state (a saved notebook, nbclient, the docs site)
would then keep a plot with no curves. plotly offers no public way to store the figure as it is
now into that state; `keep_current_figure` does what plotly itself does when a figure is shown.
Exercised by `tests/test_plotly_adapter.py`; `pyproject.toml` bounds plotly to the versions it covers.
"""

from __future__ import annotations

import copy
from typing import Any


def keep_current_figure(figure: Any) -> None:
    """Store `figure`'s data and layout as they are now in its widget state (plotly.js ignores the
    change; the saved state then shows every curve)."""
    figure._widget_data = copy.deepcopy(figure._data)
    figure._widget_layout = copy.deepcopy(figure._layout_obj._props)
