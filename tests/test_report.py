"""Unit tests of the text views."""

from __future__ import annotations

from ddp_notebook.wire.results import CellResult
from ddp_notebook.world.report import format_values, table


def test_table_aligns_columns() -> None:
    text = table(("rank", "device"), [(0, "cpu"), (10, "cuda:0")])
    assert text.splitlines() == ["rank  device", "0     cpu", "10    cuda:0"]


def test_values_are_tagged_per_rank_and_multiline_values_indented() -> None:
    result = CellResult(ranks=(0, 1, 2), values={0: {"text/plain": "42"}, 2: {"text/plain": "a\nb"}})
    assert format_values(result) == "[rank 0] Out: 42\n[rank 2] Out: a\n              b"
