"""A world driven from a real Jupyter kernel (jupyter_client): interrupts and kernel death."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.kernel import Kernel, kernel_world_pids, outs, running_kernel
from tests.support.processes import owned_pids, wait_gone

pytestmark = pytest.mark.integration


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    yield from running_kernel()


# whether the kernel's %ddp_* magics hold a running world
WORLD_RUNNING = (
    "magics = get_ipython().magics_manager.registry.get('DDPMagics')\n"
    "print('running:', magics is not None and magics.world is not None and magics.world.running)"
)


@pytest.fixture(scope="module")
def shared() -> Iterator[Kernel]:
    yield from running_kernel()


@pytest.fixture
def worlds_kernel(shared: Kernel) -> Iterator[Kernel]:
    """The module's one kernel, for the tests that start a world in it and stop it (as a user does
    one world after another in a notebook): each test leaves it with no world running, checked here;
    a test that failed midway leaves one, stopped here so the next test starts as from a fresh kernel."""
    yield shared
    out, error = shared.run(WORLD_RUNNING)
    if error is None and "running: False" in out:
        return
    shared.run("%ddp_stop")
    pytest.fail(f"the test left a world running in the module's kernel (stopped now): {out}")


# 3 ranks in the core subset (benchmarks/compat.py): a middle rank, and more than a pair
SIZES = [pytest.param(size, id=f"{size}ranks", marks=[pytest.mark.core] if size == 3 else []) for size in (2, 3, 4)]


@pytest.mark.parametrize("size", SIZES)
def test_a_raise_and_an_interrupt_release_every_rank_and_keep_their_state(worlds_kernel: Kernel, size: int) -> None:
    kernel = worlds_kernel
    out, error = kernel.run(f"%load_ext ddp_notebook\n%ddp_start {size}")
    assert error is None, out
    pids = kernel_world_pids(kernel)
    everyone = range(size)
    kernel.run("%%ddp\nkept = rank + 40")
    began = time.monotonic()
    out, error = kernel.run(
        "%%ddp\nimport time\nfor i in range(1000):\n    time.sleep(0.05)", interrupt_after=1.5, timeout=30
    )
    assert time.monotonic() - began < 1.5 + 5, "the kernel was not idle within 5 s of the interrupt"
    assert error == "CellInterruptedError", out
    assert "interrupted" in out
    out, error = kernel.run("%%ddp\nkept + 2")
    assert error is None, out
    assert outs(out, {rank: 42 + rank for rank in everyone}), out

    # rank 0 raises while the others wait for it in a collective: the root cause, never an interrupt
    began = time.monotonic()
    raising = "%%ddp\nx = torch.ones(1)\nif rank == 0:\n    raise ValueError('first')\ndist.all_reduce(x)"
    out, error = kernel.run(raising)
    assert time.monotonic() - began < 10
    assert error == "RankError", out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)  # the rank's traceback comes in colour
    assert "rank 0 failed first (root cause)" in plain and "ValueError: first" in plain, plain
    assert "the process group was set up again" in out

    # rank 0 blocked inside a collective (which SIGINT cannot break) while rank 1 sleeps
    began = time.monotonic()
    out, error = kernel.run(
        "%%ddp\nimport time\nx = torch.ones(1)\nif rank == 1:\n    time.sleep(600)\ndist.all_reduce(x)",
        interrupt_after=1.5,
        timeout=30,
    )
    assert time.monotonic() - began < 1.5 + 5, "the kernel was not idle within 5 s of the interrupt"
    assert error == "CellInterruptedError", out
    assert "the process group was set up again" in out
    out, error = kernel.run("%%ddp\ny = torch.ones(1)\ndist.all_reduce(y)\n(kept, y.item())")
    assert error is None, out
    assert outs(out, {rank: (40 + rank, float(size)) for rank in everyone}), out
    out, _ = kernel.run("%ddp_stop")
    assert "stopped the world" in out
    assert wait_gone(pids) == []


def _start_tracking_a_step(kernel: Kernel, start: str) -> list[int]:
    """Start a world with the `start` line, track `step` (a setup cell) and end a cell at step 5,
    each rank noting its number then (`was`); the world's PIDs."""
    out, error = kernel.run(f"%load_ext ddp_notebook\n{start}")
    assert error is None, out
    pids = kernel_world_pids(kernel)
    out, error = kernel.run("%%ddp --setup\nstep = 0\nddp_notebook.track(step=step)")
    assert error is None, out
    out, error = kernel.run("%%ddp\nstep = 5\nwas = rank")  # a snapshot at the end of the cell
    assert error is None, out
    return pids


@pytest.mark.parametrize("size", SIZES)
def test_a_dead_rank_comes_back_with_its_state_and_restart_works_in_a_kernel(worlds_kernel: Kernel, size: int) -> None:
    kernel = worlds_kernel
    old = _start_tracking_a_step(kernel, f"%ddp_start {size}")
    last = size - 1
    began = time.monotonic()
    out, error = kernel.run(
        f"%%ddp\nimport os, time\nx = torch.ones(1)\nstep = 6\nif rank == {last}:\n    os._exit(9)\ndist.all_reduce(x)"
    )
    assert time.monotonic() - began < 20
    assert error == "RankDiedError", out
    assert f"rank {last} exited with code 9. Rank {last} came back in " in out
    assert "every rank is back at the snapshot taken at the end of a cell" in out
    out, error = kernel.run("%ddp_status")
    assert "healthy" in out and " gone " not in out, out
    out, error = kernel.run("%%ddp\nprint('step', step)")
    assert error is None and all(f"[rank {rank}] step 5" in out for rank in range(size)), out
    # a cell fails on rank 0 after moving the tracked step: %ddp_rollback puts every rank back
    out, error = kernel.run("%%ddp\nstep = 7 + rank\nif rank == 0:\n    raise RuntimeError('midway')")
    assert error == "RankError", out
    out, error = kernel.run("%ddp_rollback")
    assert error is None and "every rank is back at the snapshot taken at the end of a cell" in out, out
    out, error = kernel.run("%%ddp\nprint('step', step)")
    assert error is None and all(f"[rank {rank}] step 5" in out for rank in range(size)), out
    out, error = kernel.run("%ddp_restart")
    assert error is None and f"DDP world ready: {size} ranks" in out, out
    out, error = kernel.run("%%ddp\nrank * 3")
    assert error is None and f"[rank {last}] Out: {last * 3}" in out, out
    new = kernel_world_pids(kernel)
    kernel.run("%ddp_stop")
    assert wait_gone(sorted(set(old) | set(new))) == []


@pytest.mark.parametrize("size", SIZES)
def test_a_world_started_to_shrink_goes_on_with_the_survivors_in_a_kernel(worlds_kernel: Kernel, size: int) -> None:
    kernel = worlds_kernel
    """`%ddp_start N --on-loss shrink`, as launcher worlds do by default: rank 0 is lost (the
    rendezvous moves), the others go on renumbered, at the snapshot; %ddp_restart is whole again."""
    old = _start_tracking_a_step(kernel, f"%ddp_start {size} --on-loss shrink")
    out, error = kernel.run(
        "%%ddp\nimport os\nx = torch.ones(1)\nstep = 6\nif rank == 0:\n    os._exit(9)\ndist.all_reduce(x)"
    )
    assert error == "RankDiedError", out
    now = size - 1
    assert "rank 0 exited with code 9. The world went on without rank 0 in " in out, out
    assert f"{now} rank(s) now (was {size})" in out and "the snapshot taken at the end of a cell" in out, out
    out, error = kernel.run("%ddp_status")
    assert error is None and "healthy" in out, out
    out, error = kernel.run("%%ddp\nprint('step', step, 'was', was, 'now', rank, 'of', world_size)")
    for rank in range(now):  # old rank r + 1 is rank r now; its other variables are its own
        assert f"[rank {rank}] step 5 was {rank + 1} now {rank} of {now}" in out, out
    out, error = kernel.run("%ddp_restart")
    assert error is None and f"DDP world ready: {size} ranks" in out, out
    new = kernel_world_pids(kernel)
    kernel.run("%ddp_stop")
    assert wait_gone(sorted(set(old) | set(new))) == []


@pytest.mark.core
def test_ddp_start_names_once_what_this_torch_lacks_and_status_names_the_xrays_source(kernel: Kernel) -> None:
    """Where torch keeps no flight recorder for gloo (torch 2.6), the X-ray's collectives come from
    the ranks' own record, which does not see DDP's gradient all-reduce; where its fully_shard
    cannot run on CPU, FSDP2 is off on CPU ranks: %ddp_start says each once."""
    from ddp_notebook.rank.membership import FSDP2_ON_CPU_LIMIT
    from ddp_notebook.rank.torch_adapter import fsdp2_on_cpu, native_flight_recorder
    from ddp_notebook.wire.xray_messages import OWN_RECORD_LIMIT

    out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2")
    assert error is None, out
    said = [line.removeprefix("off here: ") for line in out.splitlines() if line.startswith("off here: ")]
    lacking = [OWN_RECORD_LIMIT] if not native_flight_recorder() else []
    assert said == lacking + ([] if fsdp2_on_cpu() else [FSDP2_ON_CPU_LIMIT]), out
    out, error = kernel.run("%ddp_start 2 --restart")
    assert error is None and "DDP world ready: 2 ranks" in out and "off here:" not in out, out
    kernel.run("%%ddp\ndist.all_reduce(torch.ones(3))")
    out, error = kernel.run("%ddp_status")
    source = "torch's flight recorder" if native_flight_recorder() else "each rank's record of its torch.distributed"
    assert error is None and f"collectives: {source}" in out and "all_reduce" in out, out
    kernel.run("%ddp_stop")


WORKERS_UP = (
    "%%ddp\nfrom torch.utils.data import DataLoader\n"
    "loader = DataLoader(list(range(10_000)), batch_size=1, num_workers=2, persistent_workers=True)\n"
    "batches = iter(loader); next(batches)"
)


def test_ranks_and_their_dataloader_workers_exit_when_the_kernel_is_killed(kernel: Kernel) -> None:
    out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2")
    assert error is None, out
    pids = kernel_world_pids(kernel)
    out, error = kernel.run(WORKERS_UP)  # each rank's own children, which a rank's exit does not end
    assert error is None, out
    kernel_pid = kernel.manager.provisioner.process.pid
    family = owned_pids(kernel_pid)
    assert family >= set(pids) and len(family) >= len(pids) + 4, "two DataLoader workers per rank"
    os.kill(kernel_pid, signal.SIGKILL)
    # within seconds, the workers included (their own watchdog would take 5 s after their rank)
    assert wait_gone(sorted(family), seconds=3) == []
    leftover = wait_gone(sorted(set(pids) | owned_pids(kernel_pid)), seconds=30)
    for pid in leftover:  # fail loudly, but never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


def test_a_kernel_shut_down_without_ddp_stop_leaves_nothing(kernel: Kernel) -> None:
    out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2")
    assert error is None, out
    pids = kernel_world_pids(kernel)
    kernel_pid = kernel.manager.provisioner.process.pid
    kernel.manager.shutdown_kernel(now=False)
    assert wait_gone(sorted(set(pids) | owned_pids(kernel_pid)), seconds=30) == []
