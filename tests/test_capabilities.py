"""What an older release lacks is said once at %ddp_start (`world.capabilities`), found by feature."""

from __future__ import annotations

import ipywidgets
import plotly.graph_objects as go
import pytest

from ddp_notebook.live import plotly_adapter
from ddp_notebook.wire.results import RankInfo
from ddp_notebook.wire.xray_messages import OWN_RECORD_LIMIT
from ddp_notebook.world import capabilities


def _rank(rank: int, off_here: tuple[str, ...]) -> RankInfo:
    return RankInfo(rank, rank, "here", 100 + rank, "cpu", "cpu", None, off_here=off_here)


def test_the_ranks_lines_are_said_once_each_and_name_the_xrays_source() -> None:
    ranks = [_rank(0, (OWN_RECORD_LIMIT,)), _rank(1, (OWN_RECORD_LIMIT,))]
    lines = capabilities.missing_features(ranks)
    assert lines == [OWN_RECORD_LIMIT]  # this kernel's plotly lacks nothing; two ranks, one line
    assert capabilities.not_yet_said(lines) == [OWN_RECORD_LIMIT]
    assert capabilities.not_yet_said(lines) == []  # a restart does not say it again
    assert capabilities.collectives_source(ranks) == "each rank's record of its torch.distributed calls"
    assert capabilities.collectives_source([_rank(0, ())]) == "torch's flight recorder"


def test_a_plotly_whose_figure_widget_needs_a_frontend_extension_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plotly_adapter.missing_features() == []

    class FigureWidget(ipywidgets.DOMWidget):  # plotly 5's shape: a widget of its own frontend extension
        pass

    monkeypatch.setattr(go, "FigureWidget", FigureWidget)
    (line,) = plotly_adapter.missing_features()
    assert line.startswith("the live view's plots: plotly ") and "plotly>=6" in line
