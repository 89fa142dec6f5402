"""Unit tests: rank output becomes whole, tagged lines; errors render root cause first."""

from __future__ import annotations

import pytest

from ddp_notebook.cell.output import LineAssembler, tag_lines
from ddp_notebook.cell.syntax import CellSyntaxError, check_syntax
from ddp_notebook.errors import RankError, RankFailure


def test_lines_split_across_chunks_are_joined() -> None:
    assembler = LineAssembler()
    assert assembler.feed(0, "stdout", "hel") == []
    assert assembler.feed(1, "stdout", "other\n") == ["other"]
    assert assembler.feed(0, "stdout", "lo\nwor") == ["hello"]
    assert assembler.feed(0, "stderr", "err\n") == ["err"]
    assert assembler.flush_all() == [(0, "stdout", "wor")]
    assert assembler.flush_all() == []


def test_carriage_returns_keep_the_last_drawing() -> None:
    assembler = LineAssembler()
    assert assembler.feed(0, "stdout", "10%\r50%\r100%\n") == ["100%"]
    assert assembler.feed(0, "stdout", "a\r") == []
    assert assembler.feed(0, "stdout", "b\n") == ["b"]


def test_empty_lines_are_kept() -> None:
    assert LineAssembler().feed(3, "stdout", "a\n\nb\n") == ["a", "", "b"]


def test_tag_lines() -> None:
    assert tag_lines(2, ["x", "y"]) == "[rank 2] x\n[rank 2] y\n"
    assert tag_lines(0, []) == ""


def test_root_cause_is_the_first_rank_that_failed() -> None:
    later = RankFailure(0, "RuntimeError", "Connection closed by peer", completed=20.0)
    first = RankFailure(
        1, "ValueError", "bad batch", traceback=("Traceback ...", "ValueError: bad batch"), completed=10.0
    )
    error = RankError([later, first], busy_ranks=(3,))
    assert error.root_cause.rank == 1
    assert str(error) == "rank 1 raised ValueError: bad batch"
    rendered = error._render_traceback_()
    assert rendered[0] == "rank 1 failed first (root cause):"
    assert rendered[1:3] == ["Traceback ...", "ValueError: bad batch"]
    assert "rank 0 also failed: RuntimeError: Connection closed by peer" in rendered
    assert rendered[-1] == "ranks still running when the cell ended: 3"


def test_failures_without_timestamps_sort_by_rank_after_timed_ones() -> None:
    error = RankError([RankFailure(2, "E", ""), RankFailure(1, "E", ""), RankFailure(3, "E", "", completed=5.0)])
    assert [f.rank for f in error.failures] == [3, 1, 2]


def test_rank_error_needs_a_failure() -> None:
    with pytest.raises(ValueError):
        RankError([])


def test_syntax_errors_are_caught_before_sending() -> None:
    with pytest.raises(CellSyntaxError) as caught:
        check_syntax("x = 1\nfor i in range(3)\n    print(i)\n")
    assert caught.value.original.lineno == 2
    rendered = caught.value._render_traceback_()
    assert rendered[-1] == "(nothing was sent to the ranks)"
    assert any("SyntaxError" in line for line in rendered)


@pytest.mark.parametrize(
    "cell",
    ["%time x = 1", "!echo hi", "await asyncio.sleep(0)", "x = 1\nx", "def f():\n    return 1\n"],
)
def test_valid_notebook_cells_pass(cell: str) -> None:
    check_syntax(cell)


def test_a_large_worlds_failure_report_groups_the_released_ranks() -> None:
    from ddp_notebook.errors import RankDiedError
    from ddp_notebook.wire.results import Death

    root = RankFailure(512, "ValueError", "bad batch", traceback=("ValueError: bad batch",), completed=1.0)
    released = [
        RankFailure(rank, "RuntimeError", f"Connection closed by peer [127.0.0.1]:{40000 + rank}", completed=2.0)
        for rank in range(1024)
        if rank not in (512, 700)
    ]
    odd_one = RankFailure(700, "KeyError", "'x'", completed=3.0)
    where = {failure.rank: "all_reduce #412 at cell line 7" for failure in released}
    rendered = RankError([root, *released, odd_one], released_from=where)._render_traceback_()
    assert rendered == [
        "rank 512 failed first (root cause):",
        "ValueError: bad batch",
        "1,022 ranks were released from all_reduce #412 at cell line 7: 0-511, 513-699, 701-1023 "
        "(RuntimeError: Connection closed by peer [127.0.0.1]:40000)",
        "rank 700 also failed: KeyError: 'x'",
    ]
    # without the X-ray's word on where they were, the same error (numbers aside) still groups them
    rendered = RankError([root, *released])._render_traceback_()
    assert rendered[2:] == [
        "1,022 ranks also failed (0-511, 513-699, 701-1023): RuntimeError: Connection closed by peer [127.0.0.1]:40000"
    ]
    # a small world keeps a line per rank, saying where each was released from
    small = RankError([root, released[0]], released_from={0: "all_reduce #3 at cell line 5"})._render_traceback_()
    assert small[-1] == (
        "rank 0 also failed: RuntimeError: Connection closed by peer [127.0.0.1]:40000 "
        "(released from all_reduce #3 at cell line 5)"
    )
    died = RankDiedError({1023: Death("exited", "exited with code 3", 3)}, released[:-1], released_from=where)
    lines = died._render_traceback_()
    assert len(lines) == 2 and lines[1].startswith("1,021 ranks were released from all_reduce #412 at cell line 7: ")


def test_long_rank_lists_in_messages_become_runs() -> None:
    from ddp_notebook.errors import CellTimeoutError, rank_list

    assert rank_list((0, 1, 3)) == "0, 1, 3"
    assert rank_list(tuple(r for r in range(1024) if r != 5)) == "0-4, 6-1023"
    assert "ranks still running: 0-4, 6-1023" in str(CellTimeoutError(5.0, tuple(r for r in range(1024) if r != 5)))
