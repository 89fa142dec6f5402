"""The loss policy as pure logic: `comeback.recover` decides from `on_loss`, `max_restarts` and what
the world's provisioner can start, and returns a typed `Recovery`; `report.describe_recovery` says
it. The comebacks themselves (new processes, a smaller world) run on real worlds in
tests/test_elastic.py; here the branches that start nothing, on a stand-in for a running world."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from ddp_notebook.wire.results import Death
from ddp_notebook.world import comeback, report
from ddp_notebook.world.comeback import Comeback, Recovered, Recovery

KILLED = Death("signal", "was killed by SIGKILL", -9)


def stand_in(*, starts_ranks: bool = True, here: bool = True, size: int = 4) -> Any:
    """What `recover` reads of a running world before any comeback: the provisioner and the size."""
    provisioner = SimpleNamespace(starts_ranks=starts_ranks, starts_ranks_here=here)
    return SimpleNamespace(provisioner=provisioner, layout=SimpleNamespace(world_size=size), setup_cells=[])


def settings(on_loss: str = "auto", max_restarts: int = 3, launcher: str = "local") -> Any:
    return SimpleNamespace(on_loss=on_loss, max_restarts=max_restarts, launch=SimpleNamespace(launcher=launcher))


def test_auto_replaces_where_ranks_start_here_and_shrinks_elsewhere() -> None:
    assert comeback.loss_policy(stand_in(here=True), settings()) == "replace"
    assert comeback.loss_policy(stand_in(here=False), settings()) == "shrink"
    for asked in ("replace", "shrink", "stop"):
        assert comeback.loss_policy(stand_in(here=False), settings(asked)) == asked


def test_on_loss_stop_breaks_the_world_and_counts_nothing() -> None:
    recovery = comeback.recover(stand_in(), settings("stop"), {2: KILLED}, (), restarts=1)
    assert (recovery.how, recovery.went_on, recovery.restarts) == (Recovered.STOPS, False, 1)
    assert report.describe_recovery(recovery) == ("", "this world stops at a loss (on_loss='stop')")


def test_past_max_restarts_the_world_is_broken() -> None:
    recovery = comeback.recover(stand_in(), settings(max_restarts=3), {1: KILLED, 2: KILLED}, (), restarts=2)
    assert (recovery.how, recovery.restarts, recovery.lost) == (Recovered.NO_RESTARTS_LEFT, 2, {1: KILLED, 2: KILLED})
    assert report.describe_recovery(recovery) == (
        "",
        "this world went on after 2 lost rank(s) already (max_restarts=3)",
    )


def test_replace_asked_of_a_launcher_that_starts_no_ranks_says_what_goes_on() -> None:
    recovery = comeback.recover(
        stand_in(starts_ranks=False), settings("replace", launcher="mpi"), {0: KILLED}, (), restarts=0
    )
    assert recovery.how is Recovered.CANNOT_START_RANKS and not recovery.went_on
    assert report.describe_recovery(recovery) == (
        "",
        "a world started with --launcher mpi cannot start ranks (--on-loss shrink goes on)",
    )


@pytest.mark.parametrize(("policy", "doing"), [("replace", "bringing it back"), ("shrink", "going on without it")])
def test_a_comeback_that_failed_is_said_with_its_cause(policy: str, doing: str) -> None:
    failed = Recovery(Recovered.FAILED, {3: KILLED}, 1, 3, 4, failure="DDPError: no rank survived", policy=policy)
    assert report.describe_recovery(failed) == ("", f"{doing} failed: DDPError: no rank survived")


def test_a_comeback_is_said_with_its_seconds_and_snapshot() -> None:
    done = Comeback({r: None for r in range(4)}, 2.34, "step 40")  # type: ignore[misc]
    replaced = Recovery(Recovered.REPLACED, {2: KILLED, 3: KILLED}, 2, 3, 4, comeback=done, setup_cells=2)
    came_back, why_not = report.describe_recovery(replaced)
    assert why_not == "" and replaced.went_on
    assert came_back == (
        "Ranks 2-3 came back in 2.3 s (a new process, 2 setup cell(s) replayed, the process group formed again; "
        "other variables kept on the surviving ranks): every rank is back at the snapshot taken at step 40; "
        "run the cell again to continue"
    )
    smaller = dataclasses.replace(
        replaced,
        how=Recovered.SHRUNK,
        comeback=Comeback({0: None, 1: None}, 1.0, None),  # type: ignore[dict-item]
    )
    assert report.describe_recovery(smaller)[0] == (
        "The world went on without ranks 2-3 in 1.0 s: 2 rank(s) now (was 4), renumbered 0-1, the process group "
        "formed again, variables kept: nothing is tracked (ddp_notebook.track): the survivors keep what they had"
    )
