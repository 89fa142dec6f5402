"""A template started ahead of the first world (`%load_ext`, `warm_up()`): the world's processes are
forked from it, it is replaced when it no longer suits, and it never outlives `%ddp_stop` or the kernel."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import psutil
import pytest

import ddp_notebook
from ddp_notebook import DDPCluster
from ddp_notebook.world import spare
from ddp_notebook.world.provisioning import LocalProvisioner
from tests.support.kernel import Kernel, running_kernel
from tests.support.processes import pid_alive, wait_gone

pytestmark = pytest.mark.integration


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    yield from running_kernel()


def test_a_warmed_up_template_forks_the_next_worlds_controller_and_ranks(no_spare_left: None) -> None:
    assert ddp_notebook.warm_up(wait=60)
    template_pid = spare.spare_pid()
    assert template_pid is not None and psutil.Process(template_pid).ppid() == os.getpid()
    with DDPCluster(2, backend="gloo") as world:
        provisioner = world.provisioner
        assert isinstance(provisioner, LocalProvisioner) and provisioner.template is not None
        assert provisioner.template.pid == template_pid and spare.spare_pid() is None  # taken, not copied
        assert {psutil.Process(info.pid).ppid() for info in world.ranks} == {template_pid}
        controller = provisioner.controller_pid
        assert controller is not None and psutil.Process(controller).ppid() == template_pid
        # a fork keeps the template's command line; its name says what it is (ps, top)
        assert psutil.Process(controller).name() == "ddp-controller"
        assert [psutil.Process(info.pid).name() for info in world.ranks] == ["ddp-rank0", "ddp-rank1"]
        # the controller runs its schedulers as threads: of a process this size it forks only the
        # heart monitor (ipyparallel keeps that one apart, so beats go on while the hub is busy)
        assert len(psutil.Process(controller).children(recursive=True)) == 1
        # what the template imported is frozen out of the collector in every fork (a fresh process
        # freezes nothing): the ranks' collections never walk torch's objects
        frozen = world.execute("import gc\ngc.get_freeze_count()", stream=False)
        assert all(int(frozen.value_text(rank)) > 10_000 for rank in (0, 1))
        assert (
            world.execute(
                "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()", stream=False
            ).value_text(1)
            == "2.0"
        )
        # a restart keeps the template, and forks the new controller from it too
        world.restart()
        assert provisioner is not world.provisioner
        assert world.provisioner.template is not None and world.provisioner.template.pid == template_pid
        assert psutil.Process(world.provisioner.controller_pid or 0).ppid() == template_pid
        pids = world.all_pids
    assert wait_gone([*pids, template_pid]) == []


def test_a_template_that_no_longer_suits_is_stopped_not_used(
    monkeypatch: pytest.MonkeyPatch, no_spare_left: None
) -> None:
    # a variable Python reads at start-up changed since the template started: a fork would not see it
    assert ddp_notebook.warm_up(wait=60)
    first = spare.spare_pid()
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    assert spare.take_spare({}) is None
    assert first is not None and wait_gone([first]) == []
    # ranks that must start fresh (their own LD_PRELOAD) leave no spare behind either
    monkeypatch.delenv("PYTHONSAFEPATH")
    assert ddp_notebook.warm_up()
    second = spare.spare_pid()
    assert spare.take_spare({"LD_PRELOAD": "/x.so"}) is None
    assert second is not None and wait_gone([second]) == []
    # a dead spare is not handed over: a new one is started in its place
    assert ddp_notebook.warm_up(wait=60)
    third = spare.spare_pid()
    os.kill(third or 0, signal.SIGKILL)
    assert wait_gone([third or 0]) == []
    assert spare.take_spare({}) is None


def test_no_spare_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(spare.SPARE_ENV, "0")
    assert ddp_notebook.warm_up() is False and spare.spare_pid() is None


def test_load_ext_starts_a_template_that_ddp_stop_and_the_kernels_death_end(kernel: Kernel) -> None:
    show = "import ddp_notebook.world.spare\nprint(ddp_notebook.warm_up(wait=60), ddp_notebook.world.spare.spare_pid())"
    out, error = kernel.run(f"%load_ext ddp_notebook\n{show}")
    assert error is None and out.split()[0] == "True", out
    template_pid = int(out.split()[-1])
    assert pid_alive(template_pid)
    modules, _ = kernel.run("import sys, threading; print(sorted(sys.modules))")
    assert "'torch'" not in modules  # the kernel never imports it
    # the live view's imports ran once the cell was over, on the kernel's own thread (no thread
    # of ours imports beside the user's cells)
    assert "'plotly.graph_objs._figurewidget'" in modules and "'ipywidgets'" in modules
    assert "ddp-preload" not in kernel.run("print(threading.enumerate())")[0]
    out, error = kernel.run("%ddp_stop")
    assert error is None and "nothing to stop" in out
    assert wait_gone([template_pid]) == []
    # started again by the next %load_ext; the kernel killed, it notices and goes
    out, error = kernel.run(f"%reload_ext ddp_notebook\n{show}")
    assert error is None and out.split()[0] == "True", out
    template_pid = int(out.split()[-1])
    assert pid_alive(template_pid)
    os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
    assert wait_gone([template_pid], seconds=15) == []
