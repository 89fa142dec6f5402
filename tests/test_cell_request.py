"""CellRequest.build: every check `DDPCluster.run` makes on a cell before anything is sent, as pure
logic (no world): the ranks read and checked, a setup cell on every rank, the syntax, the tracker,
the time limit, the profiler's settings and the ranks shown, each refused with one line."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest

from ddp_notebook.cell.profiling import DEFAULT_STEPS, ProfileSettings
from ddp_notebook.cell.syntax import CellSyntaxError
from ddp_notebook.errors import DDPUsageError
from ddp_notebook.live.trackers import TrackerSettings
from ddp_notebook.world.cell_request import CellRequest


def build(code: str = "x = 1", ranks: Any = None, **options: Any) -> CellRequest:
    options.setdefault("world_size", 4)
    options.setdefault("default_timeout", None)
    return CellRequest.build(code, ranks, **options)


def test_a_plain_cell_runs_on_every_rank_with_the_defaults() -> None:
    request = build()
    assert request.ranks == (0, 1, 2, 3) and request.everywhere
    assert (request.timeout, request.stream, request.on_data, request.setup) == (None, True, None, False)
    assert (request.tracker, request.params, request.profile, request.show) == (None, (), None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.code = "y = 2"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [("1-2", (1, 2)), ("all", (0, 1, 2, 3)), ("3,0", (0, 3)), ([2, 0, 2], (0, 2)), (range(1, 3), (1, 2))],
)
def test_ranks_are_read_as_a_sorted_tuple(ranks: Any, expected: tuple[int, ...]) -> None:
    request = build(ranks=ranks)
    assert request.ranks == expected
    assert request.everywhere is (expected == (0, 1, 2, 3))


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        ("7", "rank 7 does not exist: this world has ranks 0-3"),
        ([0, 5, 6], "ranks 5-6 do not exist: this world has ranks 0-3"),
        ("2-1", "rank range '2-1' runs backwards; write 1-2"),
        ("one", "cannot read ranks 'one'"),
        ([], "no ranks selected"),
    ],
)
def test_ranks_that_cannot_be_are_refused_in_one_line(ranks: Any, message: str) -> None:
    with pytest.raises(DDPUsageError) as refused:
        build(ranks=ranks)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_ranks_outside_a_large_world_are_named_as_runs() -> None:
    with pytest.raises(DDPUsageError) as refused:
        build(ranks=list(range(1024, 2048)), world_size=1024)
    assert str(refused.value) == "ranks 1024-2047 do not exist: this world has ranks 0-1023"


def test_a_setup_cell_runs_on_every_rank() -> None:
    assert build(setup=True).setup
    with pytest.raises(DDPUsageError, match="a setup cell runs on every rank: leave out --ranks"):
        build(ranks="0", setup=True)


def test_a_cell_that_does_not_parse_is_refused_before_anything_else_is_read() -> None:
    with pytest.raises(CellSyntaxError, match=r"line 1\); nothing was sent to the ranks"):
        build("def f(:")
    # the cell's magics and shell escapes are the ranks' IPython's, top-level await a notebook's
    assert build("%time x = 1\n!true\nawait something()").code.startswith("%time")


def test_a_cell_run_again_is_not_compiled_again_and_a_failing_one_always_is() -> None:
    from ddp_notebook.cell import syntax

    code = "y = [i for i in range(3)]  # run again"
    build(code)
    hits = syntax._compiles.cache_info().hits
    build(code)
    assert syntax._compiles.cache_info().hits == hits + 1
    for _ in range(2):  # not remembered as good
        with pytest.raises(CellSyntaxError):
            build("break  # outside a loop: the compiler's error, not the parser's")


def test_the_time_limit_is_the_worlds_unless_given_and_must_be_seconds() -> None:
    assert build(default_timeout=30.0).timeout == 30.0
    assert build(default_timeout=30.0, timeout=2).timeout == 2
    for bad in (0, -1, float("nan"), True, "5"):
        with pytest.raises(DDPUsageError, match="cell timeout must be a number of seconds > 0"):
            build(timeout=bad)


def test_a_tracker_is_parsed_and_its_package_required_before_the_cell_runs() -> None:
    with pytest.raises(DDPUsageError, match="tracker must be one of tensorboard, mlflow, wandb"):
        build(tracker="nothing")
    settings = TrackerSettings("wandb", "project")
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(DDPUsageError, match="the wandb tracker needs its package: pip install wandb"):
            build(tracker=settings)
    else:
        assert build(tracker=settings).tracker == settings


def test_params_are_kept_as_a_tuple() -> None:
    assert build(params=["lr", "batch_size"]).params == ("lr", "batch_size")


def test_the_profile_is_normalised_to_its_settings() -> None:
    assert build(profile=True).profile == ProfileSettings(steps=DEFAULT_STEPS)
    assert build(profile=3).profile == ProfileSettings(steps=3)
    settings = ProfileSettings(steps=2, wait=0)
    assert build(profile=settings).profile is settings
    for bad in (False, "5", 1.5):
        with pytest.raises(DDPUsageError, match="profile= takes a number of steps or ProfileSettings"):
            build(profile=bad)
    with pytest.raises(DDPUsageError, match="profile steps must be a whole number >= 1, got 0"):
        build(profile=0)


def test_the_ranks_shown_are_read_like_the_ranks_run() -> None:
    assert build(show="all").show == (0, 1, 2, 3)
    assert build(show=[3, 1]).show == (1, 3)
    with pytest.raises(DDPUsageError, match="rank 9 does not exist"):
        build(show="9")


def test_an_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'stream_output'"):
        build(stream_output=False)
