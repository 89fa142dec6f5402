"""Bytes the live view sends to the browser per cell, against plotly's own FigureWidget, in one run.

    python benchmarks/live_view_bytes.py [--cells 3]

Each cell's live view gets two ranks' training (nested progress bars, a loss every step and an
accuracy per epoch: 124 points) through the real widgets, whose messages a recording comm keeps
(`tests/test_widgets.py`'s); printed: every cell's bytes (message JSON and binary buffers), with
the live view's figure as ddp_notebook makes it and with plotly's own `FigureWidget`, which
carries plotly.js in its state.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def measure(cells: int, plotly_own: bool) -> list[int]:
    import comm
    import plotly.graph_objects as go

    from ddp_notebook.live import plotly_adapter
    from ddp_notebook.live.feed import Feed
    from ddp_notebook.live.widgets import LiveView
    from tests.support.comms import RecordingComm
    from tests.support.widgets import Clock, bytes_sent, train

    created: list[RecordingComm] = []

    def create(*args: object, **kwargs: object) -> RecordingComm:
        created.append(RecordingComm(*args, **kwargs))
        return created[-1]

    comm.create_comm = create  # the documented place to plug a comm implementation in
    made = plotly_adapter.figure_widget
    if plotly_own:
        plotly_adapter.figure_widget = lambda **options: go.FigureWidget(**options)
    try:
        clock, sent = Clock(), []
        for _ in range(cells):
            before = bytes_sent(created)
            view = LiveView()
            feed = Feed(lambda view=view: view, ranks=[0, 1], clock=clock)
            with contextlib.redirect_stdout(io.StringIO()):  # display() outside a kernel prints a repr
                for rank in (0, 1):
                    train(feed, clock, rank)
            sent.append(bytes_sent(created) - before)
        return sent
    finally:
        plotly_adapter.figure_widget = made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=3)
    args = parser.parse_args()
    ours, theirs = measure(args.cells, False), measure(args.cells, True)
    print(f"{'cell':>5} {'ddp_notebook (bytes)':>22} {'plotly FigureWidget (bytes)':>29} {'ratio':>7}")
    for number, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"{number:>5} {a:>22,} {b:>29,} {a / b:>7.3f}")
    print(f"total {sum(ours):>22,} {sum(theirs):>29,} {sum(ours) / sum(theirs):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
