"""The session's template source (tests/support/template_source.py): a spare forked from it is
handed over with `spare.hand_over` and forks a world as a spare started afresh does, with nothing
imported again; it ends with its world, and every fork ends with the source."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

from ddp_notebook import DDPCluster
from ddp_notebook.platform.processes import OWNER_PID_ENV
from ddp_notebook.world import spare
from ddp_notebook.world.provisioning import LocalProvisioner
from tests.support.kernel import Kernel, adopt_spare_code, kernel_world_pids
from tests.support.processes import owned_pids, pid_alive, wait_gone
from tests.support.template_source import TemplateSource

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def source() -> Iterator[TemplateSource]:
    started = TemplateSource()
    try:
        yield started
    finally:
        started.stop()


def test_a_spare_forked_from_the_source_forks_a_world_and_ends_with_it(
    source: TemplateSource, no_spare_left: None
) -> None:
    forked = source.fork_template()
    assert forked is not None and source.pid is not None
    began = time.monotonic()
    forked.wait_ready(time.monotonic() + 10)
    assert time.monotonic() - began < 2, "a fork imports nothing: it listens at once"
    assert psutil.Process(forked.pid).ppid() == source.pid
    assert psutil.Process(forked.pid).environ()[OWNER_PID_ENV] == str(os.getpid())  # it watches this process

    spare.hand_over(forked)
    assert spare.spare_pid() == forked.pid
    with DDPCluster(2, backend="gloo") as world:
        provisioner = world.provisioner
        assert isinstance(provisioner, LocalProvisioner) and provisioner.template is forked
        assert spare.spare_pid() is None  # taken
        assert {psutil.Process(info.pid).ppid() for info in world.ranks} == {forked.pid}
        frozen = world.execute("import gc\ngc.get_freeze_count()", stream=False)
        assert all(int(frozen.value_text(rank)) > 10_000 for rank in (0, 1)), "torch imported before the fork"
        total = world.execute(
            "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()", stream=False
        )
        assert total.value_text(1) == "2.0"
        pids = [info.pid for info in world.ranks]
    assert wait_gone([forked.pid, *pids]) == []
    assert source.pid is not None, "the source outlives the worlds forked from it"


def test_a_kernels_spare_forked_from_the_source_is_the_kernels_and_its_world_forks_from_it(
    source: TemplateSource,
) -> None:
    """What a test's kernel runs before its first cell (tests/support/kernel.py): its spare is a fork
    of the source whose /proc/PID/environ names the kernel (the leak checks find a kernel's processes
    by it), `%ddp_start` forks the ranks from it, and they end with the kernel."""
    path = source.socket_path()
    assert path is not None
    kernel = Kernel(spare_from_source=False)
    try:
        kernel._run_quietly(adopt_spare_code(path, source.signature))
        out, error = kernel.run("from ddp_notebook.world import spare\nprint(spare.spare_pid())")
        assert error is None, out
        template_pid = int(out.strip())
        kernel_pid = kernel.manager.provisioner.process.pid  # type: ignore[union-attr]
        assert psutil.Process(template_pid).ppid() == source.pid
        assert psutil.Process(template_pid).environ()[OWNER_PID_ENV] == str(kernel_pid)
        out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2", timeout=120)
        assert error is None, out
        pids = kernel_world_pids(kernel)
        forked = [pid for pid in pids if psutil.Process(pid).ppid() == template_pid]  # the ranks, the controller
        assert len(forked) == 3, (pids, template_pid)
        assert {template_pid, *forked} <= owned_pids(kernel_pid)
        assert not {template_pid, *forked} & owned_pids(), "none of them is the test process's"
    finally:
        kernel.close()
    assert wait_gone([template_pid, *pids], seconds=30) == []


def test_handing_over_a_spare_ends_the_one_waiting(source: TemplateSource, no_spare_left: None) -> None:
    first, second = source.fork_template(), source.fork_template()
    assert first is not None and second is not None and first.pid != second.pid
    spare.hand_over(first)
    spare.hand_over(second)
    assert spare.spare_pid() == second.pid
    assert wait_gone([first.pid]) == [], "a spare no world took is not left running"


def test_the_forks_end_with_the_source_and_a_new_source_starts_on_next_use(source: TemplateSource) -> None:
    forked = source.fork_template()
    assert forked is not None
    forked.wait_ready(time.monotonic() + 10)
    old = source.pid
    assert old is not None
    source.stop()
    assert wait_gone([old, forked.pid]) == [], "a fork watches its source, as a template watches its kernel"
    forked.stop()  # its folder
    again = source.fork_template()
    assert again is not None and source.pid not in (None, old) and pid_alive(again.pid)
    again.stop()
    assert wait_gone([again.pid]) == []
