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
    later = RankFailure(0, "RuntimeError", "Connection closed by peer", failed_at=20.0)
    first = RankFailure(
        1, "ValueError", "bad batch", traceback=("Traceback ...", "ValueError: bad batch"), failed_at=10.0
    )
    error = RankError([later, first], busy_ranks=(3,))
    assert error.root_cause.rank == 1
    assert str(error) == "rank 1 raised ValueError: bad batch"
    rendered = error._render_traceback_()
    assert rendered[0] == "rank 1 failed first (root cause):"
    assert rendered[1:3] == ["Traceback ...", "ValueError: bad batch"]
    assert "rank 0 also failed: RuntimeError: Connection closed by peer" in rendered
    assert rendered[-1] == "still running when the cell ended: rank 3"
    doing = RankError([first], busy_ranks=(2, 3), busy_doing="ranks 2-3 running cell line 3, in no collective")
    assert (
        doing._render_traceback_()[-1]
        == "still running when the cell ended: ranks 2-3 running cell line 3, in no collective"
    )


def test_failures_without_timestamps_sort_by_rank_after_timed_ones() -> None:
    error = RankError([RankFailure(2, "E", ""), RankFailure(1, "E", ""), RankFailure(3, "E", "", failed_at=5.0)])
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

    root = RankFailure(512, "ValueError", "bad batch", traceback=("ValueError: bad batch",), failed_at=1.0)
    released = [
        RankFailure(rank, "RuntimeError", f"Connection closed by peer [127.0.0.1]:{40000 + rank}", failed_at=2.0)
        for rank in range(1024)
        if rank not in (512, 700)
    ]
    odd_one = RankFailure(700, "KeyError", "'x'", failed_at=3.0)
    where = {failure.rank: "all_reduce #412 at cell line 7" for failure in released}
    rendered = RankError([root, *released, odd_one], released_from=where)._render_traceback_()
    assert rendered == [
        "rank 512 failed first (root cause):",
        "ValueError: bad batch",
        "ranks 0-511, 513-699, 701-1023 (1,022 ranks) also failed: RuntimeError: Connection closed by peer "
        "[127.0.0.1]:40000 (released from all_reduce #412 at cell line 7)",
        "rank 700 also failed: KeyError: 'x'",
    ]
    # without the X-ray's word on where they were, the same error (numbers aside) still groups them
    rendered = RankError([root, *released])._render_traceback_()
    assert rendered[2:] == [
        "ranks 0-511, 513-699, 701-1023 (1,022 ranks) also failed: RuntimeError: Connection closed by peer "
        "[127.0.0.1]:40000 (numbers vary)"
    ]
    died = RankDiedError({1023: Death("exited", "exited with code 3", 3)}, released[:-1], released_from=where)
    lines = died._render_traceback_()
    assert len(lines) == 2 and lines[1].startswith("ranks 0-511, 513-699, 701-1022 (1,021 ranks) then failed: ")


# what gloo raises in a rank released from a collective (torch 2.13), its peer's port aside
GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:{port}. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error. GLHF! \N{UMBRELLA ON GROUND}"
)


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16, 1024])
def test_a_failure_report_has_the_same_shape_at_every_size(size: int) -> None:
    root = RankFailure(
        0, "ValueError", "bad batch", traceback=("Traceback ...", "ValueError: bad batch"), failed_at=1.0
    )
    released = [RankFailure(r, "RuntimeError", GLOO.format(port=40000 + r), failed_at=2.0) for r in range(1, size)]
    where = {r: "all_reduce #1 at cell line 5" for r in range(1, size)}
    rendered = RankError([root, *released], released_from=where, note="the process group was set up again")
    others = "rank 1" if size == 2 else f"ranks 1-{size - 1}"
    # gloo's source file and advice left out: the line says what happened and where each was released from
    assert rendered._render_traceback_() == [
        "rank 0 failed first (root cause):",
        "Traceback ...",
        "ValueError: bad batch",
        f"{others} also failed: RuntimeError: Connection closed by peer [127.0.0.1]:40001 "
        "(released from all_reduce #1 at cell line 5)",
        "the process group was set up again",
    ]


def test_ranks_released_from_different_collectives_and_different_errors_get_a_line_each() -> None:
    root = RankFailure(2, "ValueError", "bad", failed_at=1.0)
    failures = [
        root,
        RankFailure(0, "RuntimeError", GLOO.format(port=1), failed_at=2.0),
        RankFailure(1, "RuntimeError", GLOO.format(port=2), failed_at=2.0),
        RankFailure(3, "RuntimeError", GLOO.format(port=3), failed_at=2.0),
        RankFailure(4, "KeyError", "'x'", failed_at=3.0),
        RankFailure(5, "KeyError", "'x'", failed_at=3.0),
    ]
    where = {0: "all_reduce #4 at cell line 5", 1: "all_reduce #4 at cell line 5", 3: "barrier #5 at cell line 6"}
    assert RankError(failures, released_from=where)._render_traceback_()[2:] == [
        "ranks 0-1 also failed: RuntimeError: Connection closed by peer [127.0.0.1]:1 "
        "(released from all_reduce #4 at cell line 5)",
        "rank 3 also failed: RuntimeError: Connection closed by peer [127.0.0.1]:3 "
        "(released from barrier #5 at cell line 6)",
        "ranks 4-5 also failed: KeyError: 'x'",
    ]


def test_ranks_are_named_as_runs_everywhere() -> None:
    from ddp_notebook.errors import name_counted, name_deaths, name_ranks, rank_ranges
    from ddp_notebook.wire.results import Death

    assert name_ranks([3]) == "rank 3"
    assert name_ranks([]) == ""
    assert name_ranks((2, 1, 0, 1)) == "ranks 0-2"
    assert name_ranks([0, 2, 3, 4, 7]) == "ranks 0, 2-4, 7"
    assert name_ranks(range(0, 1024, 2)) == "ranks 0, 2, 4, 6, 8, 10, 12, 14, ... (504 more)"
    assert name_ranks(range(0, 1024, 2), limit=None).endswith(", 1020, 1022")
    assert rank_ranges(r for r in range(1024) if r != 5) == "0-4, 6-1023"
    assert name_counted(range(1, 16)) == "ranks 1-15"  # one run says its count
    assert name_counted([0, 1, 2, 3, 5]) == "ranks 0-3, 5"  # a few: counted at a glance
    assert name_counted([0, *range(2, 18)]) == "ranks 0, 2-17 (17 ranks)"
    assert name_counted([7]) == "rank 7"
    killed, exited = Death("signal", "was killed by SIGKILL", -9), Death("exited", "exited with code 3", 3)
    assert (
        name_deaths({3: killed, 2: killed, 5: exited}) == "ranks 2-3 were killed by SIGKILL; rank 5 exited with code 3"
    )
    assert name_deaths({1: killed}) == "rank 1 was killed by SIGKILL"


def test_rank_lists_in_messages_are_runs_at_every_size() -> None:
    from ddp_notebook.errors import CellTimeoutError

    assert "still running: ranks 0-1, 3" in str(CellTimeoutError(5.0, (0, 1, 3)))
    assert "still running: ranks 0-4, 6-1023" in str(CellTimeoutError(5.0, tuple(r for r in range(1024) if r != 5)))
    assert str(CellTimeoutError(5.0, ())) == "cell exceeded its 5 s limit; every rank was stopped"
