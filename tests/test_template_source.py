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
from tests.support.processes import pid_alive, wait_gone
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
