"""Worlds spread over hosts: ranks on two network namespaces of this machine (each its own
address, hostname and sshd), started by ipyparallel's SSH launcher, the controller listening on
the bridge with CurveZMQ; gloo traffic between ranks crosses the bridge. Needs root (CI is)."""

from __future__ import annotations

import ast
import builtins
import json
import os
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster, InsecureNetworkWarning, RankDiedError, StartError
from ddp_notebook.cell import xray
from ddp_notebook.cell.xray import CollectiveMismatchError
from ddp_notebook.errors import CellTimeoutError
from ddp_notebook.wire import xray as xray_wire
from ddp_notebook.wire.xray_messages import error_answer, release_request
from ddp_notebook.world.provisioning import ssh_hosts
from tests.support import multihost
from tests.support.launchers import ssh_world
from tests.support.multihost import Network, SlurmCluster, SSHHosts
from tests.support.processes import wait_gone

# the fixtures this module uses
multihost_network = multihost.multihost_network
multihost_ssh = multihost.multihost_ssh
multihost_slurm = multihost.multihost_slurm

pytestmark = [pytest.mark.integration, pytest.mark.multihost]


def tx_bytes(interface: str) -> int:
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes", encoding="ascii") as handle:
        return int(handle.read())


# a cell that runs a collective every 0.1 s for about 10 s
STEPS_FOR_10_S = "import time\nfor _ in range(100):\n    t = torch.ones(1); dist.all_reduce(t)\n    time.sleep(0.1)"


def test_ssh_world_spans_two_hosts(
    multihost_network: Network,
    multihost_ssh: SSHHosts,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    h1, h2 = multihost_network
    world = ssh_world(multihost_network, multihost_ssh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        world.start()
    try:
        assert any(issubclass(w.category, InsecureNetworkWarning) for w in caught), "the untrusted-network warning"
        assert world.config.curve, "CurveZMQ is on beyond loopback"
        # every ssh and scp of the world to a host went over one connection: a master per host
        private = world.private_dir or ""
        assert private and len(ssh_masters_of(private)) == len(multihost_ssh.hosts)
        # no ssh session held open per rank (ipyparallel waited on each engine through one, and sshd
        # refuses a shared connection's sessions past its MaxSessions): a host's watch is one short
        # session now and then, so no ssh of this process lives across two looks a second apart
        first = ssh_sessions_of_this_process()
        time.sleep(1.0)
        assert first & ssh_sessions_of_this_process() == set(), "an ssh session stays open while the world idles"
        assert [(r.rank, r.host, r.local_rank, r.local_world_size, r.group_rank) for r in world.ranks] == [
            (0, h1.name, 0, 1, 0),
            (1, h2.name, 0, 1, 1),
        ]
        # MASTER_ADDR is rank 0's address on the hosts' network; each rank's gloo interface is
        # the one its route to rank 0 leaves by (not loopback, not the hostname's guess)
        where = world.execute(
            "import os, socket\n(os.environ['MASTER_ADDR'], os.environ['GLOO_SOCKET_IFNAME'], "
            "os.environ['GROUP_RANK'], socket.gethostname())",
            stream=False,
        )
        assert where.value_text(0) == f"('{h1.address}', 'eth0', '0', '{h1.name}')"
        assert where.value_text(1) == f"('{h1.address}', 'eth0', '1', '{h2.name}')"

        # DDP across the hosts gives what one process gets on the combined batch, and the
        # gradient all-reduce really crosses the bridge (h2's link carries the bytes)
        before = tx_bytes(h2.veth)
        world.execute(
            "torch.manual_seed(0)\n"
            "model = ddp_notebook.prepare_model(torch.nn.Linear(512, 1024))\n"
            "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "generator = torch.Generator().manual_seed(1)\n"
            "x_all, y_all = torch.randn(8, 512, generator=generator), torch.randn(8, 1024, generator=generator)\n"
            "x, y = x_all[rank * 4:(rank + 1) * 4], y_all[rank * 4:(rank + 1) * 4]\n"
            "optimizer.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); optimizer.step()\n"
            "weights = model.module.weight.detach().clone()",
            stream=False,
        )
        crossed = tx_bytes(h2.veth) - before
        assert crossed > 512 * 1024 * 4, f"only {crossed} bytes went to h2: the gradients did not cross the bridge"
        weights = world.pull("weights")
        import torch

        torch.manual_seed(0)
        reference = torch.nn.Linear(512, 1024)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(1)
        x_all, y_all = torch.randn(8, 512, generator=generator), torch.randn(8, 1024, generator=generator)
        torch.nn.functional.mse_loss(reference(x_all), y_all).backward()
        optimizer.step()
        for rank in (0, 1):
            torch.testing.assert_close(weights[rank], reference.weight.detach(), rtol=1e-5, atol=1e-6)

        # a cell past its limit is interrupted on both hosts (over ssh: the ranks run without a nanny)
        with pytest.raises(CellTimeoutError):
            world.execute("import time\ntime.sleep(30)", timeout=2)
        assert world.execute("rank", stream=False).value_text(1) == "1"

        check_xray_across_hosts(world, (h1.address, h2.address))
        check_debugger_across_hosts(world, monkeypatch, capsys)
        rank_pids = [info.pid for info in world.ranks]
    finally:
        world.stop()
    assert wait_gone(rank_pids, 20) == []
    deadline = time.monotonic() + 2
    while ssh_masters_of(private) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ssh_masters_of(private) == [], "a shared ssh connection outlived the world"


def launcher_of(world: DDPCluster, pid: int):  # type: ignore[no-untyped-def]
    """The ipyparallel launcher that started the rank process `pid` on its host."""
    assert world.provisioner is not None
    found = [launcher for _, launcher in world.provisioner._remote_launchers() if launcher.pid == pid]
    assert len(found) == 1, found
    return found[0]


def ssh_sessions_of_this_process() -> set[tuple[int, float]]:
    """(pid, start time) of the ssh clients this process runs (masters are not its children)."""
    import psutil

    return {
        (child.pid, child.create_time())
        for child in psutil.Process().children(recursive=True)
        if child.name() == "ssh" and child.is_running()
    }


def ssh_masters_of(private_dir: str) -> list[int]:
    """The pids of the ssh masters whose sockets are in the world's private folder (a master names
    itself `ssh: SOCKET [mux]`)."""
    import psutil

    masters = []
    for process in psutil.process_iter(["cmdline"]):
        title = " ".join(process.info["cmdline"] or []).strip()
        if title.startswith(f"ssh: {private_dir}/") and title.endswith("[mux]"):
            masters.append(process.pid)
    return masters


def check_xray_across_hosts(world: DDPCluster, addresses: tuple[str, str]) -> None:
    """The X-ray reaches ranks on other hosts (over TCP, signed with the world's key): their
    collectives, where they are stuck, mismatches caught and released, and nothing unsigned."""
    assert [r.xray_address[0] if r.xray_address else None for r in world.ranks] == list(addresses)
    world.execute("kept = rank * 10\ndist.all_reduce(torch.ones(1))")
    before = {rank: reading.last_seq for rank, reading in world.collectives().items()}
    assert sorted(before) == [0, 1] and min(before.values()) > 0, before
    world.execute("dist.all_reduce(torch.ones(3, 2))")
    for rank, reading in world.collectives().items():
        last = reading.history[-1]
        assert (last.seq - before[rank], last.op, last.shapes, last.done) == (1, "all_reduce", ((3, 2),), True)

    # the timeout report says where each remote rank's main thread is, from its X-ray thread
    with pytest.raises(CellTimeoutError) as timed_out:
        world.execute(
            "import time\nif rank == 1:\n    while True:\n        time.sleep(0.05)\ndist.all_reduce(torch.ones(1))",
            timeout=3,
        )
    report = str(timed_out.value)
    assert "rank 0: waiting in torch.distributed.all_reduce (at cell line 5)" in report, report
    assert "rank 1: running <module> (at cell line 4), never reached the collective" in report, report

    # ranks blocked in different collectives on two hosts: named within 5 s, released, state kept
    began = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as caught:
        world.execute(
            "t = torch.ones(5)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)", timeout=60
        )
    assert caught.value.mismatch.waited < 5, "the mismatch was not caught within 5 s"
    assert time.monotonic() - began < 20
    text = "\n".join(caught.value._render_traceback_())
    assert "different ops" in text and "rank 0 waits in all_reduce" in text and "rank 1 waits in broadcast" in text
    assert "cell line 3" in text and "cell line 5" in text, text
    assert world.pull("kept") == {0: 0, 1: 10}
    assert world.execute("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False).value_text(1) == "2.0"

    # a request not signed with the world's key is refused and not acted on, and a signed one
    # does not work twice (each connection has its own challenge)
    host, port = world.ranks[1].xray_address or ("", 0)
    key = xray.Reach.of(world.private_dir or "", world.ranks).key
    assert len(key) == xray_wire.KEY_BYTES
    with socket.create_connection((host, port), timeout=5) as connection:
        reader = connection.makefile("r", encoding="utf8")
        challenge = bytes.fromhex(json.loads(reader.readline())["challenge"])
        forged = xray_wire.signed(b"x" * xray_wire.KEY_BYTES, challenge, xray_wire.ASK, dict(release_request()))
        connection.sendall(xray_wire.line(forged))
        assert json.loads(reader.readline()) == error_answer(xray_wire.REFUSED)
    with socket.create_connection((host, port), timeout=5) as connection:
        reader = connection.makefile("r", encoding="utf8")
        old_challenge = challenge
        challenge = bytes.fromhex(json.loads(reader.readline())["challenge"])
        assert challenge != old_challenge
        replayed = xray_wire.signed(key, old_challenge, xray_wire.ASK, dict(release_request()))
        connection.sendall(xray_wire.line(replayed))
        assert json.loads(reader.readline()) == error_answer(xray_wire.REFUSED)
    # nothing was released: the group still works without a heal
    heals = world.last_heal_seconds
    assert world.execute("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False).value_text(0) == "2.0"
    assert world.last_heal_seconds == heals


def check_debugger_across_hosts(
    world: DDPCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A breakpoint on the rank of the other host: its pdb's lines cross on the signed line, each
    answered at the notebook's prompt (input()); the peer waits in its collective meanwhile."""
    answers, prompts = ["p x", "n", "p y", "c"], []

    def answer(prompt: str = "") -> str:
        prompts.append(prompt)
        return answers.pop(0)

    monkeypatch.setattr(builtins, "input", answer)
    capsys.readouterr()
    world.execute(
        "x = rank * 10\nddp_notebook.breakpoint(rank=1)\ny = x + 1\nt = torch.ones(1)\n"
        "dist.all_reduce(t)\nprint('after', y, t.item())",
        timeout=60,
    )
    out = capsys.readouterr().out
    assert prompts == ["[rank 1] (Pdb) "] * 4, out
    assert "[rank 1] 10\n" in out and "[rank 1] -> t = torch.ones(1)" in out and "[rank 1] 11\n" in out, out
    assert "[rank 0] after 1 2.0" in out and "[rank 1] after 11 2.0" in out, out


def test_a_lost_host_is_named_the_world_goes_on_and_restart_brings_it_back_whole(
    multihost_network: Network, multihost_ssh: SSHHosts
) -> None:
    world = ssh_world(multihost_network, multihost_ssh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)
        world.start()
        try:
            victim = world.ranks[1]
            world.execute("kept = 'on rank 0'")
            began = time.monotonic()
            # rank 1's process is killed on its host: the connection it held open for the notebook
            # closes, which names it well before the controller's heartbeat (10 s) would
            os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(
                RankDiedError,
                match=rf"rank 1 on {victim.host} ended: its connection to the notebook closed.*"
                "The world went on without rank 1",
            ):
                world.execute("t = torch.ones(1); dist.all_reduce(t)", timeout=60)
            assert time.monotonic() - began < 8
            # an SSH world starts no rank in a running world: by default it goes on with the survivor
            assert world.state == "healthy" and world.world_size == 1 and world.config.n_ranks == 2
            assert (
                world.execute("t = torch.ones(1); dist.all_reduce(t); (t.item(), kept)", stream=False).value_text(0)
                == "(1.0, 'on rank 0')"
            )
            world.restart()  # the full world again, as it was asked for
            assert world.execute("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False).value_text(0) == "2.0"
        finally:
            world.stop()


# the elastic tests' tracked run (tests/support/elastic_training.py: model with dropout, SGD with
# momentum, a loader from prepare_loader, a snapshot every 3 batches), 64 samples over 2 ranks: 8
# steps an epoch; a cell trains until step STOP_AT (-1: to the end), mid-epoch, the next cell going
# on from there, and sleeps PAUSE after each step
TRAIN_UNTIL = """
import time
while loader.epoch < 4:
    for x, y, ids in loader:
        if step == STOP_AT:
            break
        gathered = [None] * world_size
        dist.all_gather_object(gathered, ids.tolist())
        seen.append(sum(gathered, []))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        time.sleep(PAUSE)
    else:
        continue
    loader.resume_from(loader.position_state())  # stopped mid-epoch: the next cell goes on from here
    break
"""


def _train_until(world: DDPCluster, stop_at: int, pause: float = 0.0, **options: object) -> None:
    world.push({"STOP_AT": stop_at, "PAUSE": pause})
    world.execute(TRAIN_UNTIL, stream=False, **options)  # type: ignore[arg-type]


def test_a_host_whose_link_goes_down_is_named_before_the_heartbeat_and_the_world_goes_on(
    multihost_network: Network, multihost_ssh: SSHHosts
) -> None:
    """Host 2's link to the bridge goes down mid-epoch: no process ends, no connection closes; the
    keepalive probes of the notebook's watch connection go unanswered and name it in about 5 s
    (the controller's heartbeat would take 10), and the survivor trains on from the snapshot.
    The link back, %ddp_resize grows the world onto host 2 again; the run ends bitwise equal to
    a fault-free one in the same world with the same history of sizes (resized at the same steps)."""
    from tests.support import elastic_training

    h2 = multihost_network[1]
    world = ssh_world(multihost_network, multihost_ssh)
    build = elastic_training.build("", elastic_training.DDP, elastic_training.DROP) + elastic_training.TRACK
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)
        world.start()
        pids = [info.pid for info in world.ranks]
        try:
            world.execute(build + "\nkept = 'on rank 0'", setup=True, stream=False)
            _train_until(world, 11)  # epoch 1, batch 3
            # the link goes down while both ranks train (a step every 0.1 s)
            went_down: list[float] = []

            def take_down() -> None:
                subprocess.run(["ip", "link", "set", h2.veth, "down"], check=True)
                went_down.append(time.monotonic())

            down = threading.Timer(1.0, take_down)
            down.start()
            try:
                with pytest.raises(
                    RankDiedError,
                    match=rf"rank 1 on {h2.name} was lost \(its host stopped answering for 5 s.*"
                    "The world went on without rank 1",
                ):
                    _train_until(world, -1, pause=0.1, timeout=60)
                ended = time.monotonic()
                down.join()
                assert went_down and ended - went_down[0] < 9.5  # the heartbeat alone: 10 s, then the shrink
            finally:
                down.join()
                subprocess.run(["ip", "link", "set", h2.veth, "up"], check=True)
            assert world.world_size == 1
            assert world.pull("kept") == {0: "on rank 0"}
            resumed = world.pull("step")[0]  # the snapshot the survivor went on from
            assert resumed > 11, "the link went down before the cell trained"
            _train_until(world, resumed + 5)  # 5 steps on one rank
            pids += [info.pid for info in world.ranks]
            world.resize(2)  # onto host 2's slot, free again
            assert [info.host for info in world.ranks] == [multihost_network[0].name, h2.name]
            pids += [info.pid for info in world.ranks]
            _train_until(world, -1)
            faulty = elastic_training.params(world, "")
            faulty_seen = world.pull("seen")

            # the fault-free run: the same sizes at the same steps, by resize
            world.execute(build, setup=True, stream=False)
            _train_until(world, 11)
            _train_until(world, resumed)
            world.resize(1)
            _train_until(world, resumed + 5)
            world.resize(2)
            pids += [info.pid for info in world.ranks]
            _train_until(world, -1)
            reference = elastic_training.params(world, "")
            assert world.pull("seen") == faulty_seen
            for rank in (0, 1):
                assert elastic_training.bitwise_equal(faulty[rank], reference[rank]), f"rank {rank} differs"
            assert elastic_training.bitwise_equal(faulty[0], faulty[1])
        finally:
            world.stop()
    assert wait_gone(pids, 30) == []


# a hand-written loop: a model wrapped in DDP by hand, random batches, no loader; model, optimizer
# and step counter tracked, so every 5 optimizer steps is a snapshot point; `done` (untracked) counts
# the steps a rank finished, and is kept on a survivor
HAND_WRITTEN = """
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step = done = 0
ddp_notebook.track(model=model, opt=opt, step=step, snapshot_every=5)
"""
HAND_WRITTEN_TRAIN = """
while step < UNTIL:
    x = torch.randn(8, 4)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    done = step
    time.sleep(0.05)
"""


def test_a_hand_written_loop_loses_at_most_snapshot_every_steps_when_a_host_is_lost(
    multihost_network: Network, multihost_ssh: SSHHosts
) -> None:
    """Host 2's link goes down after about 30 optimizer steps of a tracked model, optimizer and
    counter: the survivor goes on from the newest step point, at most 5 steps back, not from the
    start of the cell. (The SSH ranks import the package installed for this machine's Python.)"""
    h2 = multihost_network[1]
    world = ssh_world(multihost_network, multihost_ssh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)
        world.start()
        pids = [info.pid for info in world.ranks]
        try:
            world.execute(HAND_WRITTEN, setup=True, stream=False)
            world.push({"UNTIL": 10**6})
            down = threading.Timer(1.5, subprocess.run, (["ip", "link", "set", h2.veth, "down"],), {"check": True})
            down.start()
            try:
                lost = rf"rank 1 on {h2.name} was lost.*snapshot taken at optimizer step"
                with pytest.raises(RankDiedError, match=lost):
                    world.execute(HAND_WRITTEN_TRAIN, stream=False, timeout=60)
            finally:
                down.join()
                subprocess.run(["ip", "link", "set", h2.veth, "up"], check=True)
            assert world.world_size == 1
            resumed, done = world.pull("step")[0], world.pull("done")[0]
            assert resumed > 0 and resumed % 5 == 0, resumed
            assert done - resumed <= 5, (done, resumed)
            world.push({"UNTIL": resumed + 5})
            world.execute(HAND_WRITTEN_TRAIN, stream=False)  # the survivor trains on from there
            assert world.pull("step") == {0: resumed + 5}
        finally:
            world.stop()
    assert wait_gone(pids, 30) == []


def test_an_ssh_world_replaces_a_lost_rank_on_a_spare_slot_and_resizes_over_its_hosts(
    multihost_network: Network, multihost_ssh: SSHHosts, capfd: pytest.CaptureFixture[str]
) -> None:
    """--on-loss replace: rank 0's host goes silent, a new process starts on the list's spare slot
    of the other host and the survivor keeps its variables; %ddp_resize shrinks it and grows it
    back onto the first host. Every process ends at stop, and no rank's log stays on its host (the
    hosts share this filesystem): not even those of the ranks that ended while the world ran."""
    h1, h2 = multihost_network
    log_dir = Path.home() / ".ipython" / "profile_default" / "log"
    logs_before = set(log_dir.glob("ipengine-*.out"))
    world = DDPCluster(
        2,  # the list has 3 slots: the first two start (one per host), the third is spare
        launcher="ssh",
        hosts=f"{h2.name}:1,{h1.name}:2",
        ssh_args=multihost_ssh.ssh_args,
        ip=multihost_network.address,
        backend="gloo",
        on_loss="replace",
        collective_timeout=60,
        start_timeout=120,
    )
    seen: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)
        world.start()
        try:
            assert [info.host for info in world.ranks] == [h2.name, h1.name]
            seen.update(info.pid for info in world.ranks)
            world.execute("kept = f'made on {rank}'", stream=False)
            victim = world.ranks[0]
            # rank 0's host goes silent (its process stopped: no heartbeat, no closed connection);
            # the controller names it lost after its heartbeats, and world.stop() ends it
            os.kill(victim.pid, signal.SIGSTOP)
            with pytest.raises(RankDiedError, match=rf"rank 0 on {h2.name} was lost.*Rank 0 came back"):
                world.execute("t = torch.ones(1); dist.all_reduce(t)", timeout=60)
            # the survivor is rank 0 now, the new process rank 1, both on the host with the free slots
            assert [info.host for info in world.ranks] == [h1.name, h1.name]
            assert victim.pid not in {info.pid for info in world.ranks}
            seen.update(info.pid for info in world.ranks)
            check = "t = torch.ones(1); dist.all_reduce(t); (t.item(), globals().get('kept'))"
            assert world.execute(check, stream=False).value_text(0) == "(2.0, 'made on 1')"
            assert world.execute(check, stream=False).value_text(1) == "(2.0, None)"
            left = world.ranks[1].pid
            its_log = Path.home() / launcher_of(world, left).remote_output_file
            assert its_log.is_file()
            world.resize(1)
            assert world.world_size == 1 and wait_gone([left]) == []
            # its host's watch notices it ended, and its log is read and removed from the host then
            deadline = time.monotonic() + ssh_hosts.WATCH_SECONDS + 15
            while its_log.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not its_log.exists(), "the rank that left was never noticed to end"
            world.resize(2)  # the free slots: the first host's comes first in the list
            assert [info.host for info in world.ranks] == [h1.name, h2.name]
            seen.update(info.pid for info in world.ranks)
            assert world.execute(check, stream=False).value_text(1) == "(2.0, None)"
        finally:
            world.stop()
    assert wait_gone(sorted(seen)) == []
    assert set(log_dir.glob("ipengine-*.out")) - logs_before == set()
    # the lost rank was signalled over ssh when it was already gone: nothing of that on the kernel's
    # stderr, which a notebook shows under the cell (ipyparallel's remote kill printed its traceback)
    assert "Traceback" not in capfd.readouterr().err


def test_a_host_that_cannot_reach_rank_0_is_named(multihost_network: Network, multihost_ssh: SSHHosts) -> None:
    h1, h2 = multihost_network
    # h2 can still reach the controller (on the bridge), but not rank 0's host
    subprocess.run(h2.exec_args("ip", "route", "add", "unreachable", f"{h1.address}/32"), check=True)
    world = ssh_world(multihost_network, multihost_ssh)
    with pytest.raises(StartError, match=rf"rank 1 on {h2.name}: No route to host: open TCP between the hosts"):
        world.start()
    assert not world.running


def test_a_rank_that_never_registers_says_why_in_the_start_error(
    multihost_network: Network, multihost_ssh: SSHHosts, tmp_path: object
) -> None:
    """What a rank on another host printed before it failed to register is in the StartError,
    not only in a log file on that host (which is removed once read)."""
    h2 = multihost_network[1]
    hook = Path(str(tmp_path)) / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import socket, sys\n"
        f"if socket.gethostname() == {h2.name!r}:\n"
        "    sys.exit('this host refuses to start a rank, on purpose')\n"
    )
    log_dir = Path.home() / ".ipython" / "profile_default" / "log"
    before = set(log_dir.glob("*.out"))
    world = ssh_world(multihost_network, multihost_ssh, start_timeout=15, env={"PYTHONPATH": str(hook)})
    try:
        with pytest.raises(StartError) as raised:
            world.start()
    finally:
        world.stop()
    message = str(raised.value)
    assert message.startswith("only 1 of 2 ranks registered within 15 s"), message
    said = message.split(f"; {h2.name} said: ")[1]
    assert said.endswith("SystemExit: this host refuses to start a rank, on purpose"), message
    assert " said: " not in said  # the rank that registered has nothing to explain
    assert not world.running
    # the remote log (the same filesystem here) went once read
    assert set(log_dir.glob("*.out")) - before == set()


# one task per node, as a site's template would ask (Slurm packs tasks onto one node otherwise)
SLURM_TEMPLATE = (
    "#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=ipengine-{cluster_id}\n#SBATCH --ntasks={n}\n"
    "#SBATCH --ntasks-per-node=1\n#SBATCH --output={output_file}\nsrun {program_and_args}\n"
)


def slurm_world(
    network: Network, slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch, **options: object
) -> DDPCluster:
    for name, value in slurm.env.items():
        monkeypatch.setenv(name, value)  # where a login node has it: sbatch and scancel read it
    return DDPCluster(
        2,
        launcher="slurm",
        partition=slurm.partition,
        time_limit="10",
        settings=[f"SlurmEngineSetLauncher.batch_template={SLURM_TEMPLATE!r}"],
        ip=network.address,
        backend="gloo",
        collective_timeout=60,
        start_timeout=120,
        **options,  # type: ignore[arg-type]
    )


def test_slurm_world_spans_two_hosts(
    multihost_network: Network, multihost_slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real slurmctld and a slurmd per host: the ranks are the tasks of one sbatch job."""
    h1, h2 = multihost_network
    world = slurm_world(multihost_network, multihost_slurm, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)
        world.start()
    try:
        assert multihost_slurm.jobs() != []
        assert [(r.rank, r.host) for r in world.ranks] == [(0, h1.name), (1, h2.name)]
        value = world.execute(
            "import os\nt = torch.tensor([rank + 1.0]); dist.all_reduce(t)\n"
            "(os.environ['SLURM_PROCID'], os.environ['MASTER_ADDR'], t.item())",
            stream=False,
        )
        assert value.value_text(1) == f"('1', '{h1.address}', 3.0)"
    finally:
        world.stop()
    assert multihost_slurm.wait_for_empty_queue() == [], "stop cancels the job"


def test_a_slurm_world_replaces_a_lost_rank_with_a_job_and_resizes(
    multihost_network: Network, multihost_slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--on-loss replace on Slurm: a killed rank comes back as a job of one task into the same
    partition, with the world's template and settings, the survivor keeping its variables;
    %ddp_resize grows the world by such a job and shrinks it; stop cancels every job."""
    h1, h2 = multihost_network
    world = slurm_world(multihost_network, multihost_slurm, monkeypatch, on_loss="replace")
    pids: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)
        world.start()
    try:
        world.execute("import os", setup=True, stream=False)
        world.execute("kept = f'made on {rank}'", stream=False)
        pids.update(info.pid for info in world.ranks)
        victim = world.ranks[1]
        first_jobs = multihost_slurm.jobs()
        with pytest.raises(
            RankDiedError, match=r"rank 1 on .* ended: its connection to the notebook closed.*Rank 1 came back"
        ):
            world.execute(f"import time\nif rank == 1:\n    os.kill({victim.pid}, 9)\ntime.sleep(30)", timeout=90)
        assert world.world_size == 2 and world.ranks[1].pid != victim.pid
        assert len(multihost_slurm.jobs()) == len(first_jobs) + 1, "the new rank is a job of its own"
        pids.update(info.pid for info in world.ranks)
        check = "t = torch.ones(1); dist.all_reduce(t); (t.item(), globals().get('kept'))"
        found = world.execute(check, stream=False)
        assert found.value_text(0) == "(2.0, 'made on 0')"  # the survivor kept its variables
        assert found.value_text(1) == "(2.0, None)"  # the new rank has what the setup cells made
        world.resize(3)
        assert world.world_size == 3 and {info.host for info in world.ranks} <= {h1.name, h2.name}
        assert len(multihost_slurm.jobs()) == len(first_jobs) + 2
        pids.update(info.pid for info in world.ranks)
        assert world.execute(check, stream=False).value_text(2) == "(3.0, None)"
        world.resize(2)
        assert world.execute(check, stream=False).value_text(1) == "(2.0, None)"
    finally:
        world.stop()
    assert multihost_slurm.wait_for_empty_queue() == [], "stop cancels every job"
    assert wait_gone(sorted(pids), 30) == []


def test_a_host_without_the_notebooks_files_gets_them_and_runs_the_edited_module(
    multihost_network: Network, multihost_ssh: SSHHosts, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host 2 has no copy of the notebook's folder (a tmpfs hides it in that host's mount namespace):
    its rank works in a sync folder, gets the notebook's module before the first cell, and the
    edited module before the next; %ddp_sync sends a named file only where it differs."""
    import io

    from ddp_notebook.errors import DDPUsageError

    hidden = Path(str(tmp_path)) / "hidden"
    notebook = hidden / "notebook"
    notebook.mkdir(parents=True)
    monkeypatch.chdir(notebook)
    (notebook / "synced_model.py").write_text("def value():\n    return 1\n")
    h2_sshd = list(multihost_ssh.pids)[1]
    in_h2 = ["nsenter", "-t", str(h2_sshd), "-m"]
    subprocess.run([*in_h2, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(hidden)], check=True)
    notes = io.StringIO()
    world = ssh_world(multihost_network, multihost_ssh, stderr=notes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureNetworkWarning)
            world.start()
        result = world.execute("import os, synced_model\n(os.getcwd(), synced_model.value())")
        here, there = (ast.literal_eval(result.value_text(rank)) for rank in (0, 1))
        assert here == (str(notebook), 1)  # host 1 shares the folder
        sync_folder = there[0]
        assert there[1] == 1 and sync_folder.startswith(os.path.expanduser("~/.cache/ddp_notebook/sync/")), there
        assert f"ddp-h2:{sync_folder}: synced_model.py" in notes.getvalue(), notes.getvalue()

        # edited here: sent before the next cell, reloaded there
        notes.seek(0)
        notes.truncate()
        (notebook / "synced_model.py").write_text("def value():\n    return 2\n")
        result = world.execute("synced_model.value()")
        assert [result.value_text(rank) for rank in (0, 1)] == ["2", "2"]
        assert notes.getvalue().count("synced_model.py") == 1, notes.getvalue()

        assert not world.sync().sent  # the default files are there already
        (notebook / "settings.txt").write_text("lr=0.1\n")
        report = world.sync(["settings.txt"])
        assert list(report.sent.values()) == [("settings.txt",)] and report.bytes_sent == 7, report
        assert world.execute("open('settings.txt').read()").value_text(1) == "'lr=0.1\\n'"
        assert not world.sync(["settings.txt"]).sent  # unchanged: nothing sent again
        (notebook / "big.bin").write_bytes(b"0" * (2 * 2**20))
        with pytest.raises(DDPUsageError, match="more than the 1 MB a sync sends"):
            world.sync(["big.bin"], max_mb=1)
    finally:
        world.stop()
        subprocess.run([*in_h2, "umount", str(hidden)], check=False)
    assert not os.path.exists(sync_folder)  # the rank's sync folder went with the world
