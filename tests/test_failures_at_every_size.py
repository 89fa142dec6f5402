"""Every failure path at 2, 3 and 4 ranks: the failing rank first, in the middle and last, the
others waiting in each kind of collective. With more than 2 ranks gloo pairs ranks that never
talk to the failing one, so what recovers at 2 ranks is no proof for 4.

One world per size is shared by every case (a case leaves it healthy or the test fails). Across
the cases of one size and one failing position, the others wait in every collective once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from ddp_notebook import (
    CellInterruptedError,
    CellTimeoutError,
    CollectiveMismatchError,
    DDPCluster,
    RankDiedError,
    RankError,
)
from ddp_notebook.errors import name_ranks
from ddp_notebook.wire.results import Death
from tests.support import stop_button
from tests.support.processes import wait_gone

pytestmark = pytest.mark.integration

SIZES = (2, 3, 4)
CASES = ("raise", "hang", "interrupt", "death", "mismatch")
# what the other ranks wait in, while the failing rank never gets there
COLLECTIVES = {
    "all_reduce": "dist.all_reduce(x)",
    "broadcast": "dist.broadcast(x, src=world_size - 1)",  # from a rank other than 0
    "all_gather": "dist.all_gather([torch.zeros(1) for _ in range(world_size)], x)",
    "barrier": "dist.barrier()",
    "backward": "model(torch.randn(8, 4)).sum().backward()",  # DDP's all-reduce of the gradients
}
# a mismatch: the failing rank receives a broadcast its source never sends, the others wait in
# their collective (a broadcast against a broadcast of another source is left out: it may match)
MISMATCHED = [name for name in COLLECTIVES if name != "broadcast"]
FAILING = {
    "raise": "if rank == {f}:\n    raise ValueError('rank {f} fails on purpose')\n",
    "hang": "import time\nif rank == {f}:\n    while True:\n        time.sleep(0.05)\n",
    "death": "import os, signal, time\nif rank == {f}:\n    time.sleep(0.2)\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n",
}
FAILING["interrupt"] = FAILING["hang"]  # the stop button, a second in
SETUP = """
torch.manual_seed(0)
model = ddp_notebook.prepare_model(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
keep = 1000 + rank
"""
# the next cell: a DDP step and a collective on every rank, and the state of earlier cells
AFTER = """
optimizer.zero_grad()
model(torch.randn(8, 4)).sum().backward()
optimizer.step()
total = torch.ones(1)
dist.all_reduce(total)
weights = model.module.weight.detach().clone()
(total.item(), keep)
"""
SECONDS = 15.0  # a generous bound on a busy 2-core machine; benchmarks/run.py failures measures


def _positions(size: int) -> list[tuple[str, int]]:
    found: dict[int, str] = {}
    for name, rank in (("first", 0), ("last", size - 1), ("middle", size // 2)):
        found.setdefault(rank, name)
    return [(name, rank) for rank, name in sorted(found.items())]


def _matrix() -> Iterator[object]:
    for size in SIZES:
        for p, (where, failing) in enumerate(_positions(size)):
            for c, case in enumerate(CASES):
                # each (size, position) meets every collective once across the cases
                names = MISMATCHED if case == "mismatch" else list(COLLECTIVES)
                waits_in = names[(c + p + size) % len(names)]
                # the fast lane (-m fast) takes every case with the first rank failing: a real world per size
                marks = [pytest.mark.fast] if where == "first" else []
                yield pytest.param(
                    size, case, failing, waits_in, id=f"{size}ranks-{case}-{where}-{waits_in}", marks=marks
                )


class Worlds:
    """One running world at a time, of the size the test asks for (the cases come size by size)."""

    def __init__(self) -> None:
        self.world: DDPCluster | None = None
        self.seen: set[int] = set()  # every process any of them had: none may outlive the module

    def of(self, size: int) -> DDPCluster:
        if self.world is not None and (self.world.world_size != size or self.world.state != "healthy"):
            self.close()
        if self.world is None:
            self.world = DDPCluster(size, backend="gloo", collective_timeout=60, max_restarts=100).start()
            self.note()
            self.world.execute(SETUP, setup=True)
        return self.world

    def note(self) -> None:
        if self.world is not None:
            self.seen |= set(self.world.all_pids)

    def close(self) -> None:
        if self.world is not None:
            self.note()
            self.world.stop()
            self.world = None


@pytest.fixture(scope="module")
def worlds() -> Iterator[Worlds]:
    shared = Worlds()
    try:
        yield shared
    finally:
        shared.close()
    assert wait_gone(sorted(shared.seen)) == [], "processes of the worlds outlived stop()"


@pytest.mark.parametrize(("size", "case", "failing", "waits_in"), list(_matrix()))
def test_a_failure_is_named_and_the_next_cell_works_with_state_kept(
    worlds: Worlds, size: int, case: str, failing: int, waits_in: str
) -> None:
    world = worlds.of(size)
    world.execute(f"x = torch.ones(1)\nprobe = {failing} * 100 + rank")
    code = _failing_cell(case, failing, waits_in)
    began = time.monotonic()
    with stop_button.pressed_after(1.0 if case == "interrupt" else None), pytest.raises(_EXPECTED[case]) as caught:
        world.execute(code, stream=False, timeout=2 if case == "hang" else 60)
    took = time.monotonic() - began
    assert took < SECONDS, f"{case} took {took:.1f} s"
    error = caught.value
    text = "\n".join(error._render_traceback_())
    others = [rank for rank in range(size) if rank != failing]
    if case == "raise":
        assert isinstance(error, RankError)
        assert error.root_cause.rank == failing and error.root_cause.evalue == f"rank {failing} fails on purpose"
        # every other rank was released from its collective, none left running
        assert sorted(f.rank for f in error.failures[1:]) == others and error.busy_ranks == ()
        # those released from the same collective share one line naming them as runs (at 3 ranks as at
        # 1,000), with the collective as the X-ray read it before the release (a broadcast's source may
        # be a collective ahead of the others: a line of its own)
        places: dict[str, list[int]] = {}
        for rank in others:
            places.setdefault(error.released_from[rank], []).append(rank)
        lines = [line for line in text.splitlines() if " also failed: " in line]
        assert len(lines) == len(places), text
        for place, ranks in places.items():
            [line] = [line for line in lines if line.endswith(f"(released from {place})")]
            assert line.startswith(f"{name_ranks(ranks)} also failed: ") and "at cell line " in line, line
            assert "pair.cc" not in line and "GLHF" not in line, line  # gloo's source file and advice left out
        assert "the process group was set up again" in text
        assert len(text.splitlines()) - len(error.root_cause.traceback) == 2 + len(places), text
    elif case == "hang":
        assert isinstance(error, CellTimeoutError)
        assert f"\nrank {failing}: running <module> (at cell line 4), never reached the collective" in text
        # the ranks still in the cell at the limit wait in their collective, those in the same place on one
        # line (a broadcast may have let some finish: the source sends and goes on)
        waiting = [line for line in text.splitlines() if ": waiting in " in line]
        assert len(waiting) == 1, text
        named = waiting[0].split(":")[0]
        assert any(named == name_ranks(ranks) for ranks in _subsets(others)), text
        assert "the process group was set up again" in text
    elif case == "interrupt":
        assert f"cell interrupted on ranks 0-{size - 1}" in text and "still running" not in text, text
        assert "the process group was set up again" in text
    elif case == "death":
        assert isinstance(error, RankDiedError)
        assert error.dead == {failing: Death("signal", "was killed by SIGKILL", -9)}
        assert str(error).startswith(f"rank {failing} was killed by SIGKILL. Rank {failing} came back in ")
        # the survivors were released from the collective (a broadcast may have let some finish)
        assert {f.rank for f in error.failures} <= set(others)
    else:
        assert isinstance(error, CollectiveMismatchError)
        assert error.mismatch.waited < 5, "the mismatch was not caught within 5 s"
        # named with the others (gloo checks no op: the broadcast may even pair with DDP's
        # all-reduce at 2 ranks, and the mismatch is then one collective later)
        assert any(line.startswith(f"rank {failing} ") for line in error.mismatch.details), text
        assert "the process group was set up again" in text
    assert world.state == "healthy"

    after = world.execute(AFTER, stream=False, timeout=30)
    assert {rank: value["text/plain"] for rank, value in after.values.items()} == {
        rank: f"({float(size)}, {1000 + rank})" for rank in range(size)
    }
    weights = world.pull("weights")
    assert all(torch.equal(weights[rank], weights[0]) for rank in range(size)), "the ranks' models diverged"
    # the survivors keep the variables of every cell; a new rank has what the setup cells made
    probes = world.pull("probe", ranks=others)
    assert probes == {rank: failing * 100 + rank for rank in others}
    worlds.note()


def _subsets(ranks: list[int]) -> list[list[int]]:
    """Every non-empty subset of a few ranks."""
    return [[r for i, r in enumerate(ranks) if mask >> i & 1] for mask in range(1, 2 ** len(ranks))]


_EXPECTED: dict[str, type[Exception]] = {
    "raise": RankError,
    "hang": CellTimeoutError,
    "interrupt": CellInterruptedError,
    "death": RankDiedError,
    "mismatch": CollectiveMismatchError,
}


def _failing_cell(case: str, failing: int, waits_in: str) -> str:
    collective = COLLECTIVES[waits_in]
    if case == "mismatch":
        # its source is another rank, itself waiting in the others' collective
        return (
            f"if rank == {failing}:\n    dist.broadcast(torch.ones(5), src=(rank + 1) % world_size)\n"
            f"else:\n    {collective}\n"
        )
    return FAILING[case].format(f=failing) + collective + "\n"


@pytest.mark.parametrize("size", SIZES, ids=[f"{size}ranks" for size in SIZES])
def test_a_cell_that_ends_the_process_group_leaves_one_for_the_next_cell(
    worlds: Worlds, size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # a script's last line, or a framework's (Accelerate's end_training()), pasted into a cell
    world = worlds.of(size)
    world.execute("x = torch.ones(1)\nprobe = 7 + rank")
    capsys.readouterr()
    world.execute("dist.destroy_process_group()\nended = not dist.is_initialized()")
    said = capsys.readouterr().err
    assert "the cell ended the process group (torch.distributed.destroy_process_group())" in said
    assert "the process group was set up again in" in said and world.state == "healthy"
    assert world.pull("ended") == {rank: True for rank in range(size)}
    after = world.execute(AFTER, stream=False, timeout=30)
    assert {rank: value["text/plain"] for rank, value in after.values.items()} == {
        rank: f"({float(size)}, {1000 + rank})" for rank in range(size)
    }
    assert world.pull("probe") == {rank: 7 + rank for rank in range(size)}
    worlds.note()
