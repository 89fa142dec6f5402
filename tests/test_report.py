"""Unit tests of the text views."""

from __future__ import annotations

import pytest

from ddp_notebook.wire.results import CellResult
from ddp_notebook.world.report import format_values, table


def test_table_aligns_columns() -> None:
    text = table(("rank", "device"), [(0, "cpu"), (10, "cuda:0")])
    assert text.splitlines() == ["rank  device", "0     cpu", "10    cuda:0"]


def test_values_are_tagged_per_rank_and_multiline_values_indented() -> None:
    result = CellResult(ranks=(0, 1, 2), values={0: {"text/plain": "42"}, 2: {"text/plain": "a\nb"}})
    assert format_values(result) == "[rank 0] Out: 42\n[rank 2] Out: a\n              b"


def test_a_large_worlds_status_counts_its_ranks_and_shows_the_rows_worth_a_look() -> None:
    from types import SimpleNamespace

    from ddp_notebook.wire.results import RankStatus
    from ddp_notebook.world.report import format_status
    from ddp_notebook.world.state import WorldState

    rows = [
        RankStatus(
            rank,
            "busy" if rank == 40 else "idle",
            "node1" if rank < 32 else "node2",
            1000 + rank,
            "cpu",
            270.0 + (100.0 if rank == 7 else rank / 100),
            None,
            24000.0,
        )
        for rank in range(64)
    ]
    world = SimpleNamespace(world_size=64, backend="gloo", state=WorldState.HEALTHY, broken=())
    text = format_status(world, rows)  # type: ignore[arg-type]
    lines = text.splitlines()
    assert lines[1] == "64 ranks: 63 idle, 1 busy (not idle: 40); on 2 hosts (node1 32, node2 32)"
    assert lines[2].startswith("rank memory: median 270") and "max 370 MiB (rank 7)" in lines[2]
    shown = [int(line.split()[0]) for line in lines[4:] if line.split()[0].isdigit()]
    assert shown == [7, 40, 62, 63]  # the busy one and the three holding the most memory, in rank order
    small = format_status(SimpleNamespace(**{**vars(world), "world_size": 2}), rows[:2])  # type: ignore[arg-type]
    assert len(small.splitlines()) == 4  # a small world: its header, the table's head, a row per rank


def test_a_large_worlds_xray_is_grouped_by_collective_and_cell_line() -> None:
    from ddp_notebook.cell.xray import describe_world
    from tests.support.readings import waiting_in

    readings = {rank: waiting_in(rank, 4.0 + rank / 100, seq=412, line=7) for rank in range(64) if rank != 9}
    readings[9] = waiting_in(9, None, line=3)
    lines = describe_world(readings).splitlines()
    assert lines == [
        "ranks 0-8, 10-63 (63 ranks): in all_reduce #412 [4] (cell line 7) (waiting 4.0-4.6 s)",
        "rank 9: running the cell (cell line 3), in no collective",
    ]


def test_a_failure_inside_failing_as_is_one_line_of_the_error_asked_for() -> None:
    from ddp_notebook.errors import DDPError, StartError, failing_as

    class Remote(Exception):  # a rank's exception as ipyparallel relays it
        ename, evalue = "RuntimeError", "Connection closed by peer"

    with pytest.raises(DDPError) as caught, failing_as("roll back", "; %ddp_restart"):
        raise Remote("traceback\nlines")
    assert str(caught.value) == "could not roll back: RuntimeError: Connection closed by peer; %ddp_restart"
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(DDPError) as caught, failing_as("resize the world to 3 ranks"):
        raise DDPError("the new rank 2 did not answer")
    assert str(caught.value) == "could not resize the world to 3 ranks: the new rank 2 did not answer"
    # a DDPError kept as it is, another failure chained under the error asked for
    kept = DDPError("the rank 1 was lost")
    with pytest.raises(DDPError) as caught, failing_as("start the world", keep_ddp_errors=True):
        raise kept
    assert caught.value is kept
    with pytest.raises(StartError) as started, failing_as("start the world", error=StartError, chained=True):
        raise OSError("no such file")
    assert str(started.value) == "could not start the world: no such file"
    assert isinstance(started.value.__cause__, OSError)
    with pytest.raises(KeyboardInterrupt), failing_as("start the world", error=StartError):
        raise KeyboardInterrupt
