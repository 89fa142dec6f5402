"""Unit tests: the world's state diagram and how a cell's outcome maps to the caller's error."""

from __future__ import annotations

import pytest

from ddp_notebook import (
    CellInterruptedError,
    CellOutcome,
    CellResult,
    CellTimeoutError,
    Ending,
    RankDiedError,
    RankError,
    WorldState,
)
from ddp_notebook.errors import RankFailure
from ddp_notebook.wire.results import Death
from ddp_notebook.world.state import IllegalTransition, WorldLifecycle

EXITED_3 = Death("exited", "exited with code 3", 3)


def test_a_world_goes_through_its_life() -> None:
    life = WorldLifecycle()
    assert life.state is WorldState.STOPPED and not life.running
    life.starting()
    life.ready()
    assert life.state == "healthy" and life.running  # compares with its name, as before
    life.group_broke()
    life.group_broke()  # a second failing cell before the heal changes nothing
    assert life.state is WorldState.NEEDS_HEALING
    life.healed()
    killed = Death("signal", "was killed by SIGKILL", -9)
    life.ranks_died({1: killed})
    assert life.state is WorldState.BROKEN and life.dead == {1: killed}
    life.stopped()
    assert life.state is WorldState.STOPPED and life.dead == {}


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ((), "ready"),  # stopped -> healthy without starting
        ((), "group_broke"),
        (("starting",), "group_broke"),  # a world that is not up cannot break its group
        (("starting", "ready", "ranks_died"), "healed"),  # only a restart leaves broken
        (("starting", "ready", "ranks_died"), "group_broke"),
        (("starting", "ready"), "starting"),  # a running world is stopped before it starts again
    ],
)
def test_moves_the_diagram_lacks_are_refused(path: tuple[str, ...], illegal: str) -> None:
    life = WorldLifecycle()
    for move in path:
        getattr(life, move)({0: "exited"}) if move == "ranks_died" else getattr(life, move)()
    before = life.state
    with pytest.raises(IllegalTransition):
        getattr(life, illegal)({0: "exited"}) if illegal == "ranks_died" else getattr(life, illegal)()
    assert life.state is before


def test_any_state_can_be_stopped() -> None:
    for moves in ((), ("starting",), ("starting", "ready"), ("starting", "ready", "group_broke")):
        life = WorldLifecycle()
        for move in moves:
            getattr(life, move)()
        life.stopped()
        assert life.state is WorldState.STOPPED


def _result() -> CellResult:
    return CellResult(ranks=(0, 1), values={0: {"text/plain": "1"}})


def test_a_clean_outcome_gives_the_result() -> None:
    outcome = CellOutcome(result=_result())
    assert outcome.ok and outcome.error() is None and outcome.view_state is None
    assert outcome.raise_for_error().value_text(0) == "1"


def test_each_ending_maps_to_one_error() -> None:
    failure = RankFailure(1, "ValueError", "bad batch", failed_at=2.0)
    earlier = RankFailure(0, "RuntimeError", "Connection closed by peer", failed_at=1.0)
    cases = [
        (CellOutcome(result=_result(), ending=Ending.INTERRUPTED, unfinished=(1,)), CellInterruptedError, "stopped"),
        (
            CellOutcome(result=_result(), ending=Ending.TIMEOUT, timeout=5.0, unfinished=(0,), stuck_report="r0"),
            CellTimeoutError,
            "stopped",
        ),
        (CellOutcome(result=_result(), dead={1: EXITED_3}, failures=(earlier,)), RankDiedError, "failed"),
        (CellOutcome(result=_result(), failures=(failure, earlier), heal_note="\nhealed"), RankError, "failed"),
    ]
    for outcome, kind, view_state in cases:
        error = outcome.error()
        assert type(error) is kind and outcome.view_state == view_state
        with pytest.raises(kind):
            outcome.raise_for_error()
    interrupted, timed_out, died, raised = (case[0].error() for case in cases)
    assert "still running: rank 1" in str(interrupted)
    assert "5 s limit" in str(timed_out) and "r0" in str(timed_out)
    assert died.dead == {1: EXITED_3} and [f.rank for f in died.failures] == [0]  # type: ignore[union-attr]
    assert str(died).startswith("rank 1 exited with code 3. ")
    assert raised.root_cause.rank == 0 and raised.note == "healed"  # type: ignore[union-attr]  (first to fail)
