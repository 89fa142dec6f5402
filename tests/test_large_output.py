"""A large world's output: rank 0's stdout shown, every rank's stderr folded by line, everything
kept per rank within its bound (`cell/large_output.py`); and the rank lists reports use."""

from __future__ import annotations

from ddp_notebook.cell.large_output import SHOW_ALL_UP_TO, KeptOutput, LargeOutput, default_shown
from ddp_notebook.errors import count_ranks, rank_ranges


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rank_ranges_and_counts() -> None:
    assert rank_ranges([9, 0, 1, 2, 3, 5, 7, 8, 3]) == "0-3, 5, 7-9"
    assert rank_ranges([4, 5]) == "4-5"
    assert rank_ranges([12]) == "12"
    assert rank_ranges([]) == ""
    assert rank_ranges(range(1, 1024)) == "1-1023"
    assert count_ranks(1) == "1 rank"
    assert count_ranks(1023) == "1,023 ranks"


def test_small_worlds_show_every_rank_and_large_ones_rank_0() -> None:
    assert default_shown(SHOW_ALL_UP_TO) is None
    assert default_shown(SHOW_ALL_UP_TO + 1) == frozenset({0})


def test_stdout_of_shown_ranks_is_written_at_once_and_the_rest_kept() -> None:
    clock = Clock()
    output = LargeOutput(64, frozenset({0}), clock=clock)
    assert output.take(0, "stdout", ["epoch 0", "loss 1.5"]) == [("stdout", "[rank 0] epoch 0\n[rank 0] loss 1.5\n")]
    for rank in range(1, 64):
        assert output.take(rank, "stdout", [f"epoch 0 on {rank}"]) == []
    assert output.hidden_lines == 63
    assert output.output(17) == "epoch 0 on 17\n"
    assert output.output(0) == "epoch 0\nloss 1.5\n"
    assert output.output(99) == ""
    note = output.finish()
    assert note == [("stdout", output.note() + "\n")]
    assert "63 lines of 63 ranks not shown (1-63)" in note[0][1]
    assert "%ddp_output RANK" in note[0][1]


def test_every_rank_shown_when_asked() -> None:
    output = LargeOutput(64, None, clock=Clock())
    assert output.take(40, "stdout", ["x"]) == [("stdout", "[rank 40] x\n")]
    assert output.finish() == []  # nothing hidden, nothing to say


def test_the_same_stderr_line_of_many_ranks_is_shown_once_with_its_ranks() -> None:
    clock = Clock()
    output = LargeOutput(1024, frozenset({0}), clock=clock, fold_seconds=0.3)
    warning = "UserWarning: the dataloader has 1 worker"
    for rank in range(1024):
        if rank != 512:
            assert output.take(rank, "stderr", [warning]) == []  # still inside the window
        clock.now += 0.0001
    assert output.take(512, "stderr", ["ValueError: only here"]) == []
    clock.now += 0.31
    written = output.due()
    assert written == [("stderr", f"[ranks 0-511, 513-1023] {warning}\n[rank 512] ValueError: only here\n")]
    assert output.due() == []  # said once
    # kept for each rank too, marked as stderr
    assert output.output(3) == f"! {warning}\n"


def test_folding_waits_for_its_window_and_finish_flushes_it() -> None:
    clock = Clock()
    output = LargeOutput(32, frozenset({0}), clock=clock, fold_seconds=0.3)
    output.take(1, "stderr", ["first"])
    clock.now += 0.2
    output.take(2, "stderr", ["second"])
    clock.now += 0.15  # "first" is 0.35 s old, "second" 0.15 s
    assert output.due() == [("stderr", "[rank 1] first\n")]
    output.take(3, "stderr", ["second"])
    assert output.finish() == [("stderr", "[ranks 2-3] second\n")]


def test_kept_output_is_bounded_and_says_what_it_let_go() -> None:
    kept = KeptOutput(limit=100)
    kept.add("stdout", [f"line {i:03d}" for i in range(100)])  # 9 bytes a line with its newline
    assert kept.size <= 100
    text = kept.text()
    assert text.startswith(f"... ({kept.dropped:,} earlier lines not kept)\n")
    assert text.endswith("line 099\n")
    assert kept.dropped == 100 - len(kept.lines)
    assert len(kept.lines) == 100 // 9


def test_each_rank_keeps_its_share_of_the_bound() -> None:
    output = LargeOutput(1024, frozenset({0}), clock=Clock())
    output.take(5, "stdout", ["x" * 1000] * 200)
    assert output.kept[5].size <= 64 * 2**20 // 1024
    assert output.kept[5].dropped > 0


def test_a_small_world_shows_every_line_as_it_comes_and_keeps_it() -> None:
    from ddp_notebook.cell.large_output import for_world

    output = for_world(4)
    assert output.take(3, "stderr", ["warning"]) == [("stderr", "[rank 3] warning\n")]
    assert output.take(2, "stdout", ["x"]) == [("stdout", "[rank 2] x\n")]
    assert output.output(3) == "! warning\n"
    assert output.finish() == []
    large = for_world(64, show=[5])
    assert large.fold and large.shown == frozenset({5})
    assert large.take(0, "stdout", ["hidden"]) == []


def test_rank_lists_past_their_limit_count_the_rest() -> None:
    assert rank_ranges(range(0, 1024, 2), limit=3) == "0, 2, 4, ... (509 more)"
    assert rank_ranges([1, 2, 3], limit=3) == "1-3"


def test_reports_group_ranks_that_say_the_same_at_every_size() -> None:
    from ddp_notebook.live.grouping import grouped_lines

    few = [(1, "in all_reduce #4"), (0, "in all_reduce #4"), (2, "running <module> (cell line 3)")]
    assert grouped_lines(few) == ["ranks 0-1: in all_reduce #4", "rank 2: running <module> (cell line 3)"]
    many = [(rank, "in all_reduce #412 (cell line 7)") for rank in range(1024) if rank != 5]
    many.append((5, "running <module> (cell line 3), never reached the collective"))
    assert grouped_lines(many) == [
        "ranks 0-4, 6-1023 (1,023 ranks): in all_reduce #412 (cell line 7)",
        "rank 5: running <module> (cell line 3), never reached the collective",
    ]


def test_a_fold_stays_open_while_ranks_keep_adding_to_it_up_to_its_limit() -> None:
    from ddp_notebook.cell.large_output import FOLD_MAX_SECONDS

    clock = Clock()
    output = LargeOutput(1024, frozenset({0}), clock=clock, fold_seconds=0.3)
    written = []
    for rank in range(60):  # a rank every 0.125 s: the ranks starting the cell one after another
        written += output.take(rank, "stderr", ["slow start"])
        clock.now += 0.125
    last = int(FOLD_MAX_SECONDS / 0.125)  # the rank whose line came as the fold reached its limit
    assert written == [("stderr", f"[ranks 0-{last}] slow start\n")]
    # the ranks that came later are named once, at the end, with the line's first characters
    assert output.finish() == [
        (
            "stderr",
            f'(the line "slow start" came {59 - last} more times, after it was shown, from '
            f"{59 - last} ranks ({last + 1}-59): %ddp_output RANK shows each)\n",
        )
    ]


def test_a_line_shown_once_is_counted_when_it_comes_again_and_named_at_the_end() -> None:
    from ddp_notebook.cell.large_output import REMEMBERED_LINES

    clock = Clock()
    output = LargeOutput(64, frozenset({0}), clock=clock, fold_seconds=0.3)
    warning = "UserWarning: the learning rate scheduler was stepped before the optimizer"
    for rank in range(63):
        assert output.take(rank, "stderr", [warning]) == []
    # the last rank to say it closes the fold at once: no wait once every rank said it
    assert output.take(63, "stderr", [warning]) == [("stderr", f"[ranks 0-63] {warning}\n")]
    for _step in range(100):  # the same warning in every step of a loop, from every rank
        for rank in range(64):
            assert output.take(rank, "stderr", [warning]) == []
        clock.now += 0.1
    output.take(7, "stderr", ["ValueError: a new line is shown as it comes"])
    clock.now += 0.5
    assert output.due() == [("stderr", "[rank 7] ValueError: a new line is shown as it comes\n")]
    assert output.finish() == [
        (
            "stderr",
            '(the line "UserWarning: the learning rate…" came 6,400 more times, after it was shown, '
            "from 64 ranks (0-63): %ddp_output RANK shows each)\n",
        )
    ]
    assert output.output(7).count(warning) == 101  # each rank keeps every line it printed

    # a cell whose every stderr line differs: what is remembered of them stays bounded
    many = LargeOutput(64, frozenset({0}), clock=clock, fold_seconds=0.3)
    for line in range(REMEMBERED_LINES + 10):
        many.take(1, "stderr", [f"line {line}"])
        clock.now += 0.5
        many.due()
    assert len(many._again) == REMEMBERED_LINES
    many.take(2, "stderr", ["line 0"])  # forgotten: shown again, as new
    clock.now += 0.5
    assert many.due() == [("stderr", "[rank 2] line 0\n")]
