"""How a cell's supervisor names the dead (world/supervision.py), on the pure logic: the verdicts of
the watch connections to ranks on other hosts are given here; the real connections, hosts and
links are in tests/test_multinode.py and the fault storm across hosts."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddp_notebook.cell import xray
from ddp_notebook.wire.results import Death, RankInfo
from ddp_notebook.world.running import RunningWorld
from ddp_notebook.world.supervision import WorldSupervisor


class Verdicts:
    """A watch whose connections say what the test sets."""

    def __init__(self, seen: dict[int, str]) -> None:
        self.seen = seen

    def ended(self, reach: Any, infos: Any) -> dict[int, str]:
        return dict(self.seen)


def supervisor(seen: dict[int, str]) -> WorldSupervisor:
    ranks = {
        0: RankInfo(0, 10, "h0", 100, "", "", None),
        1: RankInfo(1, 11, "h1", 101, "", "", None),
        2: RankInfo(2, 12, "h1", 102, "", "", None),
        3: RankInfo(3, 13, "h2", 103, "", "", None),
    }
    provisioner = SimpleNamespace(dead_ranks=lambda infos: {})
    controller = SimpleNamespace(lost=lambda: None)
    watching = WorldSupervisor(provisioner, controller, lambda: ranks, stack_dir="/nowhere")  # type: ignore[arg-type]
    watching.process_watch = Verdicts(seen)  # type: ignore[assignment]
    watching.reach = lambda: SimpleNamespace(remote={r: ("10.0.0.1", 1) for r in ranks})  # type: ignore[method-assign]
    return watching


@pytest.mark.parametrize("asked", [(0, 1, 2, 3), (0, 2)], ids=["every-rank", "a-cell-on-some-ranks"])
def test_a_silent_host_is_lost_with_every_rank_on_it(asked: tuple[int, ...]) -> None:
    """Rank 2's connection gave up on its host first; rank 1, on the same host, is named with it
    (its own keepalive would give up a moment later, after the comeback kept it as a survivor)."""
    dead = supervisor({2: xray.SILENT}).find_dead(asked)
    assert sorted(dead) == [1, 2]
    assert all(death.cause == "lost" and "its host stopped answering" in death.how for death in dead.values())


def test_a_rank_whose_process_ended_takes_no_other_rank_of_its_host_with_it() -> None:
    dead = supervisor({2: xray.ENDED}).find_dead((0, 1, 2, 3))
    assert list(dead) == [2] and isinstance(dead[2], Death) and dead[2].cause == "exited"


def test_an_opened_world_is_supervised_with_its_rank_map_of_now(tmp_path: Path) -> None:
    """`RunningWorld.open` connects a world's parts: its supervisor reads the rank map the world
    has when asked, the one a heal or a comeback left as well."""
    here = socket.gethostname()
    first = {0: RankInfo(0, 10, here, 100, "", "", None), 1: RankInfo(1, 11, here, 101, "", "", None)}
    provisioner = SimpleNamespace(
        client=None,
        controller_pid=os.getpid(),  # a controller that runs: the death check asks the processes
        dead_ranks=lambda infos: {info.rank: Death("exited", f"pid {info.pid}") for info in infos},
        opened=lambda world: opened.append(world),  # told once the group formed (a detached world records it)
    )
    opened: list[RunningWorld] = []
    world = RunningWorld.open(provisioner, None, first, str(tmp_path))  # type: ignore[arg-type]
    assert opened == [world]
    assert world.controller.controller_pid == os.getpid() and world.supervisor.provisioner is provisioner
    assert {rank: death.how for rank, death in world.supervisor.find_dead((0, 1, 2)).items()} == {
        0: "pid 100",
        1: "pid 101",
    }
    healed = {0: first[0], 1: RankInfo(1, 12, here, 102, "", "", None), 2: RankInfo(2, 13, here, 103, "", "", None)}
    world.regrouped(healed)
    assert {rank: death.how for rank, death in world.supervisor.find_dead((0, 1, 2)).items()} == {
        0: "pid 100",
        1: "pid 102",
        2: "pid 103",
    }
    world.supervisor.close()
