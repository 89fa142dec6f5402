"""A fault storm: a world trains for a long run while a seeded schedule injects faults; at the end
its parameters must equal, bitwise, those of a fault-free run of the same steps.

    python benchmarks/fault_storm.py [--ranks 3] [--minutes 10] [--seed 1] [--json PATH]

The world (CPU ranks on gloo, `on_loss="replace"`) trains a small MLP with dropout, SGD with
momentum, on a tracked loader (`ddp_notebook.track`, a snapshot every 5 steps), one epoch per cell.
Before each cell the seeded schedule draws a fault, or none (one cell in four), among:

- `kill`: SIGKILL of a random rank at a random moment of the cell, from outside;
- `raise`: a random rank raises at a random step;
- `skip`: a random rank skips a step's collective (the others hang in it: the X-ray names it);
- `interrupt`: the notebook interrupts every rank at a random moment (the stop button);
- `stop`: SIGSTOP of a random rank for 12 s, past the controller's 10 s heartbeat limit, then SIGCONT;
- `oom`: a random rank grows at a random step until the out-of-memory killer of a memory cgroup
  ends it (as root: the driver and the world run in a cgroup of their own, limited to what the
  world used after its first epoch plus OOM_HEADROOM; elsewhere this kind is left out, and says so).

After a fault the cell runs again: a dead or lost rank came back by itself, at the newest snapshot
every survivor holds; after the others the driver brings every rank to the newest snapshot they
share (`world.rollback()`, `%ddp_rollback`). When the time is up, the same world trains a
fault-free copy of the run (its own variables, the same seed) for as many epochs, and every
rank's parameters and sample log must equal it bitwise; otherwise the driver names the first
fault after which they differ.

Printed per kind of fault: injected, survived (the world healthy again and the run going on),
seconds from the fault to the world ready again (p50, p95), steps redone (the steps trained past
the snapshot it went back to, where rank 0 could say). At the end every process the world
started must be gone.

With `--hosts` (as root; the Debian packages .ci/install adds): the world runs across three
"hosts" made of network namespaces with an sshd each (tests/support/multihost.py), started by the SSH
launcher over a hosts list of RANKS-1 slots on the first, one on the second and RANKS-1 spare ones
on the third (the first RANKS-1 ranks on host 1, the last on host 2). A lost rank comes back on
its own host where only its process died, or on the list's first free slot where its host went
silent; and one more kind of fault is drawn:

- `link`: the link of a host that holds ranks (not rank 0's: its host is the world's rendezvous)
  goes down at a random moment of the cell, and comes back up once the cell has ended; the ranks
  cut off there are SIGKILLed then (their host would end them at the world's stop).

    python benchmarks/fault_storm.py --hosts [--ranks 3] [--minutes 10] [--seed 1]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import exit_on_sigterm, machine_info, percentile, print_table

sys.path.append(str(Path(__file__).resolve().parent.parent))  # ddp_notebook as installed, tests.support

KINDS = ("kill", "raise", "skip", "interrupt", "stop", "oom", "link")
HOST_KINDS = ("link",)  # drawn only where the ranks span hosts (--hosts)
STOP_SECONDS = 12.0  # SIGSTOP past the controller's heartbeat limit (10 s)
SNAPSHOT_EVERY = 5
OOM_HEADROOM = 768 << 20  # the cgroup's limit: what the world used after its first epoch, plus this
OOM_CHUNK = 64 << 20  # an oom victim grows by this much at a time
OOM_MOST = 8 << 30  # and never past this (a limit not enforced: the fault then raises instead)

BUILD = """
import torch
SNAPSHOT_EVERY = {snapshot_every}
OOM_CHUNK, OOM_MOST = {oom_chunk}, {oom_most}
from torch.utils.data import TensorDataset
torch.manual_seed(0)
{p}data = TensorDataset(torch.randn({samples}, 16), torch.randn({samples}, 1), torch.arange({samples}))
{p}net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1))
{p}model = ddp_notebook.prepare_model({p}net)
{p}opt = torch.optim.SGD({p}model.parameters(), lr=0.02, momentum=0.9)
{p}loader = ddp_notebook.prepare_loader({p}data, batch_size=8, seed=1)
{p}step = 0
{p}seen = []
"""
TRACK = "ddp_notebook.track(model=model, opt=opt, loader=loader, step=step, seen=seen, snapshot_every=SNAPSHOT_EVERY)"
# one cell: train until the loader started epoch EPOCH_END; the fault, if any, comes from inside
TRAIN = """
while {p}loader.epoch < EPOCH_END:
    for x, y, ids in {p}loader:
        if rank == FAULT_RANK and {p}step == FAULT_AT and FAULT_KIND == "raise":
            raise RuntimeError("an injected fault")
        if rank == FAULT_RANK and {p}step == FAULT_AT and FAULT_KIND == "oom":
            _hog = [b"o" * OOM_CHUNK for _ in range(OOM_MOST // OOM_CHUNK)]  # the killer ends it on the way
            raise RuntimeError("the out-of-memory killer never came")
        gathered = [None] * world_size
        if not (rank == FAULT_RANK and {p}step == FAULT_AT and FAULT_KIND == "skip"):
            dist.all_gather_object(gathered, ids.tolist())
        {p}seen.append(sum((g or [] for g in gathered), []))  # a skipper goes on to the backward's all-reduce
        loss = torch.nn.functional.mse_loss({p}model(x), y)
        {p}opt.zero_grad()
        loss.backward()
        {p}opt.step()
        {p}step += 1
"""
PARAMS = "[p.detach().clone() for p in {p}model.parameters()]"


@dataclass
class Fault:
    number: int
    kind: str
    rank: int
    epoch: int
    at: float  # seconds into the cell (kill, interrupt, stop, link) or the step (raise, skip, oom)
    host: str = ""  # link: the host taken off the network
    survived: bool = False
    recover_seconds: float | None = None
    steps_redone: int | None = None
    error: str = ""  # what the cell ended with
    problem: str = ""  # why it was not survived


@dataclass
class Storm:
    hosts: list[str] = field(default_factory=list)  # --hosts: the namespace hosts' names
    faults: list[Fault] = field(default_factory=list)
    epochs: int = 0
    cells: int = 0
    equal: bool | None = None
    first_difference: str = ""
    leftovers: list[int] = field(default_factory=list)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", type=int, default=1536, help="samples in the data set (one epoch per cell)")
    parser.add_argument("--kinds", default=None, help="the faults to draw from (default: every kind that applies)")
    parser.add_argument("--hosts", action="store_true", help="ranks across three network-namespace hosts (root)")
    parser.add_argument("--faults", type=int, default=None, help="end after this many faults (default: at the time)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--stacks-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a storm still running this long prints every thread's stack and exits (where it waits)",
    )
    args = parser.parse_args()
    exit_on_sigterm()
    if args.stacks_after is not None:
        faulthandler.dump_traceback_later(args.stacks_after, exit=True)
    kinds = [kind for kind in (args.kinds or "").split(",") if kind] or [
        kind for kind in KINDS if args.hosts or kind not in HOST_KINDS
    ]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    if not args.hosts and set(kinds) & set(HOST_KINDS):
        parser.error(f"{', '.join(HOST_KINDS)} faults need ranks on several hosts: add --hosts")
    if args.hosts and os.geteuid() != 0:
        parser.error("--hosts makes network namespaces and runs an sshd in each: run it as root")
    from tests.support import memory_cgroup

    cgroup = home = None
    if "oom" in kinds:
        try:  # this process, and every process of the world it starts, in a memory cgroup of its own
            cgroup, home = memory_cgroup.make(f"ddp-fault-storm-{os.getpid()}")
            memory_cgroup.enter(cgroup, os.getpid())
        except (memory_cgroup.Unavailable, OSError) as why:
            if args.kinds:
                parser.error(f"oom faults need a memory cgroup of their own: {why}")
            kinds.remove("oom")
            print(f"oom: not injected ({why})", flush=True)
    try:
        storm = run_storm(
            args.ranks, args.minutes * 60, args.seed, args.samples, kinds, args.faults, cgroup, args.hosts
        )
    finally:
        if cgroup is not None and home is not None:
            home.write_text(str(os.getpid()))
            memory_cgroup.remove(cgroup.directory, 30)
    report(storm, args)
    return 0 if storm.equal and not storm.leftovers and all(f.survived for f in storm.faults) else 1


def run_storm(
    ranks: int,
    seconds: float,
    seed: int,
    samples: int,
    kinds: list[str],
    most: int | None = None,
    cgroup: Any = None,
    hosts: bool = False,
) -> Storm:
    from tests.support.processes import wait_gone

    schedule = random.Random(seed)
    storm = Storm()
    with _world(ranks, hosts) as (world, network):
        storm.hosts = [host.name for host in network] if network is not None else []
        started: set[int] = set()
        try:
            _storm(world, network, storm, schedule, seconds, samples, kinds, most, cgroup, started)
        finally:
            started.update(world.all_pids)
            world.stop()
        storm.leftovers = wait_gone(sorted(started), 30)
    return storm


@contextmanager
def _world(ranks: int, hosts: bool) -> Iterator[tuple[Any, Any]]:
    """(a started world, the namespace hosts or None): on this machine, or across three hosts."""
    from ddp_notebook import DDPCluster, InsecureNetworkWarning

    settings: dict[str, Any] = {
        "backend": "gloo",
        "collective_timeout": 60,
        "on_loss": "replace",
        "max_restarts": 10_000,
    }
    if not hosts:
        yield DDPCluster(ranks, **settings).start(), None
        return
    from tests.support.multihost import network_namespaces, ssh_hosts

    with network_namespaces(3) as network, ssh_hosts(network) as ssh, warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureNetworkWarning)  # a bridge of this machine's own
        first, second, spare = (host.name for host in network)
        slots = f"{first}:{ranks - 1},{second}:1,{spare}:{ranks - 1}"
        world = DDPCluster(
            ranks, launcher="ssh", hosts=slots, ssh_args=ssh.ssh_args, ip=network.address, start_timeout=120, **settings
        )
        yield world.start(), network


def _storm(
    world: Any,
    network: Any,
    storm: Storm,
    schedule: random.Random,
    seconds: float,
    samples: int,
    kinds: list[str],
    most: int | None,
    cgroup: Any,
    started: set[int],
) -> None:
    started.update(world.all_pids)
    world.execute(_build("", samples) + TRACK, setup=True, stream=False)
    deadline = time.monotonic() + seconds
    cell_seconds = _timed_epoch(world, storm)  # a first epoch without a fault: how long a cell takes
    if cgroup is not None:
        from tests.support import memory_cgroup

        memory_cgroup.set_limit(cgroup, (cgroup.memory_used() or 0) + OOM_HEADROOM)
    while time.monotonic() < deadline and (most is None or len(storm.faults) < most):
        kind = schedule.choice([*kinds, "none"]) if kinds else "none"
        if kind == "none":
            _train(world, storm.epochs + 1)
            storm.epochs += 1
            storm.cells += 1
            continue
        fault = _draw(schedule, len(storm.faults) + 1, kind, world.world_size, storm.epochs, cell_seconds, samples)
        if kind == "link":
            fault.rank, fault.host = _link_victim(schedule, world)
        storm.faults.append(fault)
        _inject(world, fault, storm, network)
        started.update(world.all_pids)
        if not fault.survived:
            break
    if all(fault.survived for fault in storm.faults):
        storm.equal, storm.first_difference = _compare(world, storm, samples)


def _build(prefix: str, samples: int) -> str:
    return BUILD.format(
        p=prefix, samples=samples, snapshot_every=SNAPSHOT_EVERY, oom_chunk=OOM_CHUNK, oom_most=OOM_MOST
    )


def _timed_epoch(world: Any, storm: Storm) -> float:
    began = time.monotonic()
    _train(world, 1)
    storm.epochs, storm.cells = 1, 1
    return time.monotonic() - began


def _train(world: Any, epoch_end: int, fault: Fault | None = None) -> None:
    world.push(
        {
            "EPOCH_END": epoch_end,
            "FAULT_RANK": fault.rank if fault else -1,
            "FAULT_AT": int(fault.at) if fault else -1,
            "FAULT_KIND": fault.kind if fault else "",
        }
    )
    world.execute(TRAIN.format(p=""), stream=False, timeout=600)


def _draw(schedule: random.Random, number: int, kind: str, size: int, epochs: int, cell: float, samples: int) -> Fault:
    rank = schedule.randrange(size)
    if kind in ("raise", "skip", "oom"):
        steps_per_epoch = -(-samples // size) // 8
        at = float(epochs * steps_per_epoch + schedule.randrange(1, steps_per_epoch))  # a step of this cell
    else:
        at = schedule.uniform(0.1, 0.8) * cell  # a moment of this cell
    return Fault(number, kind, rank, epochs, round(at, 3))


def _link_victim(schedule: random.Random, world: Any) -> tuple[int, str]:
    """(a rank, its host): a host that holds ranks, not rank 0's."""
    rank_0_host = world.ranks[0].host
    rank = schedule.choice([r for r, info in enumerate(world.ranks) if info.host != rank_0_host])
    return rank, world.ranks[rank].host


def _inject(world: Any, fault: Fault, storm: Storm, network: Any = None) -> None:
    """Run one cell with `fault`, then recover and finish the epoch; records how it went."""
    began = time.monotonic()
    timer: threading.Timer | None = None
    victim = world.ranks[fault.rank].pid
    link = next(host for host in network if host.name == fault.host).veth if fault.kind == "link" else ""
    cut_off = [info.pid for info in world.ranks if info.host == fault.host] if link else []
    if fault.kind == "link":
        timer = threading.Timer(fault.at, _set_link, (link, "down"))
    elif fault.kind == "kill":
        timer = threading.Timer(fault.at, _signal, (victim, signal.SIGKILL))
    elif fault.kind == "interrupt":
        timer = threading.Timer(fault.at, world.interrupt)
    elif fault.kind == "stop":
        timer = threading.Timer(fault.at, _stop_then_continue, (victim,))
    if timer is not None:
        timer.daemon = True
        timer.start()
    failed_at: float | None = None
    try:
        _train(world, storm.epochs + 1, fault)
    except Exception as failure:  # noqa: BLE001  (what the cell ended with is the fault's outcome)
        failed_at = time.monotonic()
        fault.error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
    if timer is not None:
        timer.join(STOP_SECONDS + 5)
    if link:  # back on the network; what ran there was cut off from the world: gone now
        _set_link(link, "up")
        for pid in cut_off:
            _signal(pid, signal.SIGKILL)
    injected_at = began + (fault.at if fault.kind in ("kill", "interrupt", "stop", "link") else 0.0)
    between_cells = False
    if failed_at is None and fault.kind in ("kill", "stop", "link"):
        # its moment came after the cell ended (the cell ran faster than the first epoch): a rank
        # killed, stopped or cut off between cells is met by the world's next call, which names it,
        # brings it back at the snapshot of that cell's end and sends nothing ("push again")
        if timer is not None:
            timer.join(fault.at + STOP_SECONDS + 5)
        try:
            world.push({"FAULT_RANK": -1})
        except Exception as failure:  # noqa: BLE001  (the fault's outcome, as in the cell)
            failed_at, between_cells = time.monotonic(), True
            fault.error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
            storm.epochs += 1  # the cell before it ended its epoch, and the comeback kept it
            storm.cells += 1
    if failed_at is None:
        # the fault came after the cell ended (its moment drawn past the cell's end), or did not bite
        fault.survived = world.state == "healthy"
        fault.recover_seconds = 0.0
        storm.epochs += 1
        storm.cells += 1
        return
    try:
        if world.state == "broken":
            raise RuntimeError("the world is broken after the fault")
        if fault.kind not in ("kill", "stop", "oom", "link"):  # a death: the comeback brought them back
            fault.steps_redone = _back_to_snapshot(world)  # its first cell sets the group up again
        fault.recover_seconds = round(time.monotonic() - injected_at, 3)
        _train(world, storm.epochs + 1)  # the same cell again (the next, after one between cells)
        storm.epochs += 1
        storm.cells += 1 if between_cells else 2
        fault.survived = world.state == "healthy" and world.world_size == len(world.ranks)
        if not fault.survived:
            raise RuntimeError(f"the world is {world.state} after the cell that followed the fault")
    except Exception as failure:  # noqa: BLE001  (not survived: say why; the storm ends there)
        fault.problem = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"


def _back_to_snapshot(world: Any) -> int | None:
    """Every rank to the newest snapshot all of them hold (`world.rollback()`, `%ddp_rollback`);
    returns the steps rank 0 goes back."""
    before = world.pull("step", ranks=[0])[0]
    world.rollback()
    after = world.pull("step", ranks=[0])[0]
    return int(before) - int(after)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _set_link(veth: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", veth, state], check=True, timeout=30)


def _stop_then_continue(pid: int) -> None:
    _signal(pid, signal.SIGSTOP)
    time.sleep(STOP_SECONDS)
    _signal(pid, signal.SIGCONT)  # a process the world replaced meanwhile was ended: nothing to wake


def _compare(world: Any, storm: Storm, samples: int) -> tuple[bool, str]:
    """The fault-free copy of the run, trained as many epochs in the same world, bitwise against it."""
    import torch

    world.execute(_build("ref_", samples), stream=False)
    world.push({"EPOCH_END": storm.epochs, "FAULT_RANK": -1, "FAULT_AT": -1, "FAULT_KIND": ""})
    world.execute(TRAIN.format(p="ref_"), stream=False, timeout=3600)
    world.execute(f"_ours = {PARAMS.format(p='')}\n_theirs = {PARAMS.format(p='ref_')}", stream=False)
    ours, theirs = world.pull("_ours"), world.pull("_theirs")
    seen, reference_seen = world.pull("seen"), world.pull("ref_seen", ranks=[0])[0]
    for rank in sorted(ours):
        if not all(torch.equal(a, b) for a, b in zip(ours[rank], theirs[rank])):
            return False, f"rank {rank}'s parameters differ from the fault-free run's; {_suspect(storm)}"
        if seen[rank] != reference_seen:
            steps = [i for i, (a, b) in enumerate(zip(seen[rank], reference_seen)) if a != b]
            first = steps[0] if steps else min(len(seen[rank]), len(reference_seen))
            return False, f"rank {rank}'s sample log differs from step {first} on; {_suspect(storm)}"
    return True, ""


def _suspect(storm: Storm) -> str:
    survived = [f for f in storm.faults if f.survived]
    if not survived:
        return "no fault was survived"
    last = survived[-1]
    return f"the faults survived were {', '.join(f'#{f.number} {f.kind}' for f in survived)} (last: #{last.number})"


def report(storm: Storm, args: argparse.Namespace) -> None:
    rows = []
    for kind in [*KINDS, "all"]:
        chosen = [f for f in storm.faults if kind in ("all", f.kind)]
        if not chosen:
            continue
        seconds = [f.recover_seconds for f in chosen if f.recover_seconds is not None and f.recover_seconds > 0]
        redone = [f.steps_redone for f in chosen if f.steps_redone is not None]
        rows.append(
            [
                kind,
                len(chosen),
                sum(f.survived for f in chosen),
                f"{percentile(seconds, 50):.2f}" if seconds else "-",
                f"{percentile(seconds, 95):.2f}" if seconds else "-",
                f"{sum(redone) / len(redone):.1f}" if redone else "-",
            ]
        )
    where = f" across the namespace hosts {', '.join(storm.hosts)}" if storm.hosts else ""
    print(
        f"{args.ranks} ranks{where}, {args.minutes:g} min, seed {args.seed}: "
        f"{storm.epochs} epochs in {storm.cells} cells"
    )
    print_table(["fault", "injected", "survived", "recover p50 (s)", "recover p95 (s)", "steps redone (mean)"], rows)
    for fault in storm.faults:
        outcome = "survived" if fault.survived else f"NOT survived: {fault.problem}"
        on = f"rank {fault.rank}" + (f" (its host {fault.host})" if fault.host else "")
        print(f"#{fault.number} {fault.kind} on {on} at {fault.at:g}: {fault.error or 'no error'}; {outcome}")
    verdict = (
        "bitwise equal to the fault-free run"
        if storm.equal
        else "not compared: the storm ended at a fault not survived"
        if storm.equal is None
        else f"NOT equal: {storm.first_difference}"
    )
    print(f"parameters and sample logs of every rank: {verdict}")
    print(f"processes left: {storm.leftovers or 'none'}")
    if args.json is not None:
        payload = {"settings": vars(args) | {"json": str(args.json)}, "machine": machine_info(), "storm": asdict(storm)}
        args.json.write_text(json.dumps(payload, indent=1, default=str), encoding="utf8")


if __name__ == "__main__":
    sys.exit(main())
