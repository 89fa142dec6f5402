"""The import path a rank runs with: the engine start's repeats left out, nothing else changed."""

from __future__ import annotations

from ddp_notebook.rank.membership import without_repeats


def test_repeated_entries_are_left_out_in_order() -> None:
    # what an engine's start leaves: '' from ipyparallel's engine and again from IPython's shell
    found = ["", "", "/work/bench", "/opt/lib", "/work/bench", "/site-packages"]
    assert without_repeats(found) == ["", "/work/bench", "/opt/lib", "/site-packages"]


def test_a_path_without_repeats_is_kept_as_it_is() -> None:
    found = ["", "/opt/lib", "/site-packages"]
    assert without_repeats(found) == found


def test_an_unhashable_entry_leaves_the_path_alone() -> None:
    found: list = ["", ["odd"], ""]
    assert without_repeats(found) == found
