"""Detached worlds in real kernels: a world started with `%ddp_start N --detach` outlives its kernel
(SIGKILLed mid-training), a new kernel's `%ddp_attach` finds it with every variable and its process
group, `%ddp_wait` shows the training cell from its start and follows it to its end (the run ends
bitwise equal to an uninterrupted one), `%ddp_worlds` lists it, `%ddp_stop` ends it with every
process and file of it; a world nobody attaches ends itself after its idle limit."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_notebook.platform.processes import descendants
from ddp_notebook.wire import detached as wire
from tests.support.kernel import Kernel, outs
from tests.support.processes import pid_alive, wait_gone

pytestmark = pytest.mark.integration

SIZES = [pytest.param(size, id=f"{size}ranks", marks=[pytest.mark.core] if size == 2 else []) for size in (2, 3, 4)]


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's registry of detached worlds in this test's folder (the kernels started next inherit
    it), and their notebook's path; nothing of a world found here may outlive the test."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "train.ipynb"))
    folder = tmp_path / "state" / "ddp_notebook" / "worlds"
    yield folder
    leftover = processes_of(folder)
    for pid in leftover:  # fail loudly, but never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert leftover == set(), "processes of a detached world outlived its test"


def processes_of(folder: Path) -> set[int]:
    """Every live process of a detached world whose entry is in `folder` (they carry its path)."""
    marker = f"{wire.DETACHED_ENV}={folder}/".encode()
    found = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if any(item.startswith(marker) for item in handle.read().split(b"\0")) and pid_alive(int(name)):
                    found.add(int(name))
        except (OSError, ValueError):
            continue
    return found


def only_entry(folder: Path) -> wire.Entry:
    (path,) = folder.glob("*.json")
    entry = wire.read_entry(path)
    assert entry is not None
    return entry


# a training cell: STEPS steps of a DDP model, each printed and logged; every rank waits at step HOLD_AT
# until the file `hold` names is gone (so that the test knows the cell still runs while it looks);
# then each keeps its weights and raises (every rank: their tracked snapshots stay the same)
STEPS, HOLD_AT = 30, 20
TRAIN = (
    "%%ddp\nimport os, time\ngen = torch.Generator().manual_seed(rank)\n"
    f"for i in range({STEPS}):\n"
    "    loss = model(torch.randn(8, 2, generator=gen)).pow(2).mean()\n"
    "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    "    ddp_notebook.log(loss=loss.item())\n"
    "    print(f'step {i} loss {loss.item():.6f}', flush=True)\n"
    f"    while i == {HOLD_AT} and os.path.exists(hold):\n"
    "        time.sleep(0.05)\n"
    "weights = [p.detach().clone() for p in model.parameters()]\n"
    "raise ValueError(f'checked after the last step, rank {rank}')"
)


def start_and_kill(folder: Path, start: str, training: Path | None = None) -> tuple[wire.Entry, list[int]]:
    """A kernel starts a detached world with `start`, sets `kept` on every rank and is SIGKILLed (with
    `training`, once TRAIN runs, held at its step HOLD_AT while that file is there): the world's entry,
    and its processes (controller, ranks, what they started)."""
    kernel = Kernel()
    try:
        out, error = kernel.run(f"%load_ext ddp_notebook\n{start}")
        assert error is None and "detached: the world outlives this kernel" in out, out
        out, error = kernel.run(
            "%%ddp --setup\nkept = rank + 40\nmodel = ddp_notebook.prepare_model(torch.nn.Linear(2, 1))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
            # DDP's first backward all-reduces its bucket in the parameters' order, every later one in
            # the order the gradients came: on 3+ ranks that sums in another order (other bits), so both
            # runs TRAIN compares start past that first backward (no step: the weights stay)
            "model(torch.zeros(1, 2)).sum().backward()\nopt.zero_grad()\n"
            "start_state = {name: value.clone() for name, value in model.state_dict().items()}\n"
            "step = 0\nddp_notebook.track(step=step)"
        )
        assert error is None, out
        out, error = kernel.run(f"%%ddp\nstep = 5\nhold = {str(training)!r}")  # a snapshot at the end of the cell
        assert error is None, out
        if training is not None:
            training.touch()
            kernel.client.execute(TRAIN)
            kernel.wait_for_output(f"step {HOLD_AT} loss", seconds=60)
        entry = only_entry(folder)
        pids = [entry["controller_pid"], *entry["rank_pids"]]
        family = pids + descendants(pids)
        assert set(family) <= processes_of(folder), "every process of the world carries its entry's path"
        kernel_pid = kernel.manager.provisioner.process.pid
        assert kernel_pid not in {os.getpgid(pid) for pid in pids}, "not in the kernel's process group"
        os.kill(kernel_pid, signal.SIGKILL)
        assert wait_gone([kernel_pid], seconds=10) == []
    finally:
        kernel.close()
    return entry, family


@pytest.mark.parametrize("size", SIZES)
def test_a_detached_world_outlives_its_kernel_and_a_new_kernel_attaches_again(
    registry: Path, tmp_path: Path, size: int
) -> None:
    hold = tmp_path / "hold"
    entry, family = start_and_kill(registry, f"%ddp_start {size} --detach", training=hold)
    time.sleep(1.0)  # a world watching its kernel would be gone by now
    pids = [entry["controller_pid"], *entry["rank_pids"]]
    assert [pid for pid in pids if pid_alive(pid)] == pids, "the world outlived its kernel"
    kernel = Kernel()
    try:
        out, error = kernel.run("%load_ext ddp_notebook\n%ddp_worlds")
        assert error is None, out
        row = next(line for line in out.splitlines() if line.startswith(entry["id"]))
        assert f"{size} gloo" in row and " running a cell " in row and "train.ipynb" in row, out
        out, error = kernel.run("%ddp_wait")
        assert "UsageError: no world is attached: %ddp_attach" in out, out
        out, error = kernel.run("%ddp_attach --world nope")
        assert "UsageError: no detached world of yours has the id 'nope'" in out, out
        assert entry["id"] in out, "naming the worlds there are"
        began = time.monotonic()
        out, error = kernel.run("%ddp_attach")
        attached_in = time.monotonic() - began
        assert error is None and f"attached again to the detached world {entry['id']}" in out, out
        assert attached_in <= 2.0, f"%ddp_attach took {attached_in:.2f} s"
        assert "a cell sent by an earlier kernel ('import os, time') began" in out, out
        assert f"still runs on ranks 0-{size - 1}: %ddp_wait shows its output and follows it" in out, out
        follow_cell_of_an_earlier_kernel(kernel, hold, size)
        out, error = kernel.run("%%ddp\ny = torch.ones(1)\ndist.all_reduce(y)\n(kept, y.item(), type(model).__name__)")
        assert error is None, out
        assert outs(out, {rank: (40 + rank, float(size), "DistributedDataParallel") for rank in range(size)}), out
        out, error = kernel.run("%ddp_worlds")
        assert error is None and " attached " in next(line for line in out.splitlines() if entry["id"] in line), out
        out, error = kernel.run("%ddp_status")
        assert error is None and "healthy" in out and "all_reduce" in out, out
        # the tracked state: a failed cell, then every rank back at the snapshot the first kernel left
        out, error = kernel.run("%%ddp\nstep = 7 + rank\nif rank == 0:\n    raise RuntimeError('midway')")
        assert error == "RankError", out
        out, error = kernel.run("%ddp_rollback")
        assert error is None and "every rank is back at the snapshot taken at the end of a cell" in out, out
        out, error = kernel.run("%ddp_restart")
        assert "UsageError: the detached world" in out and "cannot restart from here: %ddp_stop ends it" in out, out
        # the supervision: a rank that dies is named, and the world goes on with the others at the snapshot
        last = size - 1
        out, error = kernel.run(f"%%ddp\nimport os\nstep = 6\nif rank == {last}:\n    os._exit(9)\ndist.barrier()")
        assert error == "RankDiedError" and f"The world went on without rank {last}" in out, out
        out, error = kernel.run("%%ddp\nprint('step', step, 'of', world_size)")
        assert all(f"[rank {rank}] step 5 of {last}" in out for rank in range(last)), out
        if last > 2:  # it shrinks (it cannot grow: it starts no process)
            out, error = kernel.run("%ddp_resize 2")
            assert error is None and "the world has 2 ranks now" in out, out
            out, error = kernel.run(f"%ddp_resize {last}")
            assert "UsageError: an attached world cannot add ranks" in out, out
            last = 2
        out, error = kernel.run("%ddp_stop")
        assert error is None and f"ended the detached world of {last} ranks" in out, out
        assert wait_gone(family) == []
        assert list(registry.glob("*")) == [] and not os.path.exists(entry["private_dir"])
        out, error = kernel.run("%ddp_worlds")
        assert "no detached world of yours is running" in out, out
    finally:
        kernel.close()


def follow_cell_of_an_earlier_kernel(kernel: Kernel, hold: Path, size: int) -> None:
    """The training cell the killed kernel left held at step HOLD_AT: shown from its start, refused a cell
    behind it, followed to its end with its error and every point of its live view, and its weights
    those of the same training run again, uninterrupted."""
    out, error = kernel.run("%ddp_wait --follow-timeout 1")
    assert error is None and "the cell still runs on" in out and "after 1 s: it goes on" in out, out
    for rank in range(size):  # what each rank printed before this kernel existed, from its first step
        assert f"[rank {rank}] step 0 loss" in out and f"[rank {rank}] step {HOLD_AT} loss" in out, out
    out, error = kernel.run("%%ddp\nprint('behind it')")
    assert "UsageError: a cell an earlier kernel sent still runs on" in out and "behind it" not in out, out
    hold.unlink()
    out, error = kernel.run("%ddp_wait")
    followed = out
    assert error == "RankError", out
    assert "failed first (root cause)" in out and "ValueError: checked after the last step, rank" in out, out
    assert "also failed: ValueError" in out, out
    for rank in range(size):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] step ")]
        assert [line.split()[3] for line in lines] == [str(i) for i in range(STEPS)], out
    out, error = kernel.run(
        f"m = %ddp_metrics\nprint(sorted(len(m.series('loss', rank)[0]) for rank in range({size})))"
    )
    assert error is None and f"{[STEPS] * size}" in out, "the live view has every point, those sent before too"
    out, error = kernel.run("%ddp_wait")  # the cell is over: shown again, whole
    assert error == "RankError" and f"[rank 0] step {STEPS - 1} loss" in out, out
    out, error = kernel.run(
        "%%ddp\nfollowed = weights\nmodel.load_state_dict(start_state)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)"
    )
    assert error is None, out
    rerun, error = kernel.run(TRAIN)  # the same run, uninterrupted (nothing holds it now)
    assert error == "RankError" and "checked after the last step" in rerun, rerun
    out, error = kernel.run("%%ddp\nall(torch.equal(a, b) for a, b in zip(weights, followed)) and len(weights)")
    if not (error is None and outs(out, dict.fromkeys(range(size), 2))):  # what differs, and the runs' output
        shown, _ = kernel.run("%%ddp\nprint([(a - b).abs().max().item() for a, b in zip(weights, followed)])")
        raise AssertionError(f"{out}\n{shown}\nfollowed:\n{followed}\nrun again:\n{rerun}")


@pytest.mark.parametrize("warm", ["", " --no-warm-start"], ids=["forked", "fresh"])
def test_a_detached_world_nobody_attaches_ends_itself_after_its_idle_limit(registry: Path, warm: str) -> None:
    entry, family = start_and_kill(registry, f"%ddp_start 2 --detach --idle-limit 3{warm}")
    # forked (the default): from the world's own template, which ends after its last rank; fresh: none
    template = [entry["template_pid"]] if entry["template_pid"] else []
    assert bool(template) == (warm == "")
    pids = [entry["controller_pid"], *entry["rank_pids"], *template]
    assert [pid for pid in pids if pid_alive(pid)] == pids, "the world outlived its kernel"
    # the limit counts from the kernel's death; the controller looks every 2 s, the ranks get 5 s to leave
    began = time.monotonic()
    assert wait_gone(family + template, seconds=30) == []
    assert 1.0 < time.monotonic() - began < 3 + 2 + 5 + 5
    assert list(registry.glob("*")) == [] and not os.path.exists(entry["private_dir"])


def test_a_kernel_that_exits_leaves_its_detached_world_running_until_stopped_from_another(
    registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel shut down (as a restart does) mid-training leaves its detached world running;
    `DDPCluster.attach_detached()` from another process attaches, and `wait()` follows the training
    cell: a rank killed meanwhile is named, the world goes on without it; `stop()` ends it."""
    hold = tmp_path / "hold"
    kernel = Kernel()
    try:
        out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2 --detach --idle-limit 600")
        assert error is None, out
        out, error = kernel.run(
            "%%ddp\nmodel = ddp_notebook.prepare_model(torch.nn.Linear(2, 1))\n"
            f"opt = torch.optim.SGD(model.parameters(), lr=0.05)\nhold = {str(hold)!r}"
        )
        assert error is None, out
        hold.touch()
        kernel.client.execute(TRAIN)
        kernel.wait_for_output(f"step {HOLD_AT} loss", seconds=60)
        kernel.manager.shutdown_kernel(now=False)
    finally:
        kernel.close()
    entry = only_entry(registry)
    # the ranks' template, forked from as an ordinary world's are, lasts while they do
    pids = [entry["controller_pid"], *entry["rank_pids"], entry["template_pid"]]
    time.sleep(1.0)
    assert [pid for pid in pids if pid_alive(pid)] == pids
    from ddp_notebook import DDPCluster
    from ddp_notebook.errors import RankDiedError

    world = DDPCluster.attach_detached(entry["id"][:12])
    world.start()
    try:
        assert world.pids == pids and world.world_size == 2
        os.kill(entry["rank_pids"][1], signal.SIGKILL)
        assert wait_gone([entry["rank_pids"][1]]) == []
        hold.unlink()  # rank 0 goes on, into an all-reduce with a rank that is gone
        with pytest.raises(RankDiedError) as died:
            world.wait(timeout=60)
        assert "rank 1 exited" in str(died.value), died.value  # not a child of this process: no exit status
        assert "The world went on without rank 1" in str(died.value), died.value
        printed = capsys.readouterr().out
        assert f"[rank 0] step {HOLD_AT} loss" in printed and "[rank 1] step 0 loss" not in printed, printed
        assert world.world_size == 1
        result = world.execute("y = torch.ones(1)\ndist.all_reduce(y)\ny.item()", stream=False)
        assert result.value_text(0) == "1.0"
    finally:
        world.stop()
    assert wait_gone(pids) == [] and list(registry.glob("*")) == []


# a night of nested progress bars in seconds: every step publishes a live-view message (far more than
# the journal's MESSAGES_LIMIT), then every rank waits until the file `hold` names is gone and prints
# what its journal of the cell holds
EPOCHS, STEPS_PER_EPOCH = 3, 1200
NIGHT = (
    "%%ddp\nimport os, time\nfrom ddp_notebook.rank.channel import rank_channel\n"
    "from ddp_notebook.rank.state import RANK\n"
    "rank_channel().flush_seconds = 0.0\n"
    f"for epoch in ddp_notebook.progress(range({EPOCHS}), desc='epochs'):\n"
    f"    for step in ddp_notebook.progress(range({STEPS_PER_EPOCH}), desc=f'epoch {{epoch}}'):\n"
    "        ddp_notebook.log(loss=1.0 / (1 + step))\n"
    "print('[night] held', flush=True)\n"
    "while os.path.exists(hold):\n    time.sleep(0.05)\n"
    "held = RANK.journal.footprint()\n"
    "print(f\"[night] sent {rank_channel()._seq} kept {held['messages']} points {held['points']}\")"
)


def test_one_kernel_at_a_time_drives_a_detached_world_and_its_cell_record_stays_bounded(
    registry: Path, tmp_path: Path
) -> None:
    """A second live kernel's `%ddp_attach` is refused naming the first; `--take-over` takes the world,
    follows the first kernel's cell (its journal bounded, every point and each bar's end kept); the
    first kernel's next cell is refused in one line and a cell of any other ipyparallel client is
    refused on the ranks, nothing of either run; `%ddp_stop` ends the world."""
    from ddp_notebook.wire import journal as bounds

    hold = tmp_path / "hold"
    first, second = Kernel(), Kernel()
    try:
        out, error = first.run("%load_ext ddp_notebook\n%ddp_start 2 --detach --idle-limit 600")
        assert error is None, out
        out, error = first.run(f"%%ddp\nx = rank + 1\nhold = {str(hold)!r}")
        assert error is None, out
        hold.touch()
        first.client.execute(NIGHT)
        first.wait_for_output("[night] held", seconds=120)
        first_pid = first.manager.provisioner.process.pid
        entry = only_entry(registry)
        out, error = second.run("%load_ext ddp_notebook\n%ddp_attach")
        assert f"UsageError: the detached world {entry['id']} is attached to another kernel, PID {first_pid} " in out
        assert "(train.ipynb), attached at " in out and "%ddp_attach --take-over takes it" in out, out
        out, error = second.run("%ddp_attach --take-over")
        assert error is None and f"attached again to the detached world {entry['id']}" in out, out
        hold.unlink()
        out, error = second.run("%ddp_wait")
        assert error is None, out
        for rank in range(2):
            line = next(line for line in out.splitlines() if line.startswith(f"[rank {rank}] [night] sent"))
            sent, kept, points = (int(word) for word in line.split()[4::2])
            assert sent > bounds.MESSAGES_LIMIT >= kept and points == EPOCHS * STEPS_PER_EPOCH, line
        out, error = second.run(
            "feed = get_ipython().magics_manager.registry['DDPMagics'].world.recorder.latest\n"
            "print(sorted((rank, level, bar.desc, bar.n, bar.total) for (rank, level), bar in feed.bars.items()))\n"
            "print([len(feed.metrics.series('loss', rank)[0]) for rank in range(2)])"
        )
        last = EPOCHS - 1
        bars = [(rank, 0, "epochs", EPOCHS, EPOCHS) for rank in range(2)]
        bars += [(rank, 1, f"epoch {last}", STEPS_PER_EPOCH, STEPS_PER_EPOCH) for rank in range(2)]
        assert error is None and str(sorted(bars)) in out, out
        assert str([EPOCHS * STEPS_PER_EPOCH] * 2) in out, "every point of the night, kept"
        # the kernel the world was taken from: its next cell is refused in one line, and it let go
        out, error = first.run("%%ddp\nx = 100")
        second_pid = second.manager.provisioner.process.pid
        assert f"UsageError: another kernel took this detached world, PID {second_pid} (train.ipynb)" in out, out
        assert "this kernel let go of it (nothing of it ended); %ddp_attach --take-over takes it back" in out, out
        # any other client of the world's controller: the ranks refuse its cell before it runs
        import ipyparallel as ipp

        client = ipp.Client(entry["connection_file"], timeout=10)
        try:
            with pytest.raises(ipp.error.CompositeError) as refused:
                client[:].execute("x = 100", block=True)
            assert "InputRejected" in str(refused.value) and "another kernel took this detached world" in str(
                refused.value
            ), refused.value
        finally:
            client.close()
        out, error = second.run("%%ddp\nx")
        assert error is None and outs(out, {0: 1, 1: 2}), out
        out, error = second.run("%ddp_stop")
        assert error is None and "ended the detached world of 2 ranks" in out, out
        assert list(registry.glob("*")) == [] and not os.path.exists(entry["private_dir"])
    finally:
        first.close()
        second.close()


# a kernelspec whose command is a wrapper script that does not exec: a shell runs between the server
# (here: this test process, which starts the kernel as a server would) and the kernel
WRAPPER = ["/bin/sh", "-c", '"$0" -m ipykernel_launcher -f "$1"; exit $?', sys.executable, "{connection_file}"]


def controller_server(entry: wire.Entry) -> str | None:
    """The user's server a detached world's controller was told (None: none)."""
    with open(f"/proc/{entry['controller_pid']}/environ", "rb") as handle:
        told = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
    value = told.get(wire.SERVER_ENV.encode())
    return value.decode() if value is not None else None


def test_on_jupyterhub_a_detached_world_belongs_to_the_server_behind_a_kernelspec_wrapper(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub's kernel started through a wrapper that does not exec (its parent is a shell): the world
    is told the server that started the kernel (JPY_PARENT_PID, an ancestor), and %ddp_start says
    the server's stop ends it; where no server is found among the kernel's parents, %ddp_start says
    in one line that the server's stop does not end the world, and the world is told no server."""
    from ddp_notebook.platform.processes import started_at

    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    kernel = Kernel(argv=WRAPPER)
    try:
        out, error = kernel.run("import os\nprint('parent', os.getppid(), 'launcher', os.environ['JPY_PARENT_PID'])")
        assert error is None, out
        parent = int(out.split()[1])
        assert parent != os.getpid() and out.split()[3] == str(os.getpid()), out  # a shell between them
        out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2 --detach --idle-limit 600")
        assert error is None, out
        assert f"or with %ddp_stop, or when your server stops (PID {os.getpid()})" in out, out
        assert controller_server(only_entry(registry)) == f"{os.getpid()}:{started_at(os.getpid())}"
        out, error = kernel.run("%ddp_stop")
        assert error is None, out
        # a kernel that cannot tell its server (started without JPY_PARENT_PID, its parent a shell)
        out, error = kernel.run("del os.environ['JPY_PARENT_PID']\n%ddp_start 2 --detach --idle-limit 600")
        assert error is None, out
        line = next((line for line in out.splitlines() if "your server's stop does not end it" in line), "")
        found = f"the Jupyter server was not found among this kernel's parents (its parent is PID {parent}, /bin/sh"
        assert found in line, out
        assert controller_server(only_entry(registry)) is None
        out, error = kernel.run("%ddp_stop")
        assert error is None, out
    finally:
        kernel.close()
    assert list(registry.glob("*.json")) == []
