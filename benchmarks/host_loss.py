"""A host lost: how soon it is named, and how soon the training goes on, shrunk or replaced.

Two "hosts" made of network namespaces with an sshd each (tests/support/multihost.py: needs root and the
Debian packages .ci/install adds); a world started by the SSH launcher over a hosts list of three
slots (host 2: one, host 1: two), two ranks started, one per host, the third slot spare. Each
round trains a tracked model (a snapshot every 5 steps), then takes host 2 off the network in one
of two ways, mid-cell:

- `kill`: its rank's process is SIGKILLed (its host still answers);
- `link`: its link to the bridge goes down (nothing answers; the link comes back after the round).

and records, from that moment: when the cell ended naming the lost rank (detection plus the
comeback), the comeback itself as ddp_notebook reports it, and, after `resize(2)` brings the world
back to its size, one more cell. With `--on-loss shrink` (the default of launcher worlds) the world
goes on with the survivor; with `replace` a new rank starts on the spare slot over ssh. Run from the
repository root, as root:

    python benchmarks/host_loss.py [--rounds 3] [--on-loss shrink|replace] [--ways kill,link]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_notebook import DDPCluster, InsecureNetworkWarning, RankDiedError
from tests.support.multihost import network_namespaces, ssh_hosts
from tests.support.processes import wait_gone

SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
model = ddp_notebook.prepare_model(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step = 0
ddp_notebook.track(model=model, opt=opt, step=step, snapshot_every=5)
"""
TRAIN = """
import time
for _ in range(STEPS):
    x = torch.randn(32, 16)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    step += 1
    time.sleep(0.02)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--on-loss", default="shrink", choices=("shrink", "replace"))
    parser.add_argument("--ways", default="kill,link")
    args = parser.parse_args()
    ways = [way for way in args.ways.split(",") if way]
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    # replace: a third host is the spare slot the new rank starts on
    with network_namespaces(3 if args.on_loss == "replace" else 2) as network, ssh_hosts(network) as ssh:
        by_name = {host.name: host for host in network}
        world = DDPCluster(
            2,
            launcher="ssh",
            hosts=",".join(f"{host.name}:1" for host in network),
            ssh_args=ssh.ssh_args,
            ip=network.address,
            backend="gloo",
            on_loss=args.on_loss,
            max_restarts=1000,
            collective_timeout=60,
            start_timeout=120,
        )
        seen: set[int] = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureNetworkWarning)
            world.start()
            try:
                world.execute(SETUP, setup=True, stream=False)
                for _ in range(args.rounds):
                    for way in ways:
                        if len(world.hosts) != 2:
                            raise RuntimeError(f"the world is not one rank per host: {world.hosts}")
                        seen.update(info.pid for info in world.ranks)
                        results[way].append(_lose(world, way, by_name[world.ranks[1].host]))
                        seen.update(info.pid for info in world.ranks)
                        if world.world_size < 2:
                            world.resize(2)  # onto the free slot: the lost host's, back on the network
                        world.push({"STEPS": 5})
                        world.execute(TRAIN, stream=False)
            finally:
                world.stop()
        left = wait_gone(sorted(seen), 30)
    print(f"--on-loss {args.on_loss}, {args.rounds} round(s), 2 ranks on {len(by_name)} namespace hosts over ssh")
    for way, samples in results.items():
        ended = statistics.median(s[0] for s in samples)
        comeback = statistics.median(s[1] for s in samples)
        what = "process SIGKILLed" if way == "kill" else "link down"
        print(
            f"{what}: the cell ends naming it {ended:.2f} s after (median of {len(samples)}; "
            f"all: {', '.join(f'{s[0]:.2f}' for s in samples)}), of which the comeback {comeback:.2f} s"
        )
    print(f"processes left: {left or 'none'}")
    return 1 if left else 0


def _lose(world: DDPCluster, way: str, host: object) -> tuple[float, float]:
    """Lose rank 1's host a second into a training cell; (seconds to the cell's end, comeback seconds)."""
    victim = world.ranks[1]
    world.push({"STEPS": 400})
    began = 0.0

    def lose() -> None:
        nonlocal began
        time.sleep(1.0)
        began = time.monotonic()
        if way == "kill":
            os.kill(victim.pid, signal.SIGKILL)
        else:
            subprocess.run(["ip", "link", "set", host.veth, "down"], check=True)  # type: ignore[attr-defined]

    thread = threading.Thread(target=lose, daemon=True)
    thread.start()
    try:
        world.execute(TRAIN, stream=False, timeout=120)
        raise RuntimeError(f"losing rank 1's host ({way}) did not end the cell")
    except RankDiedError:
        ended = time.monotonic() - began
    finally:
        thread.join(10)
        if way == "link":
            subprocess.run(["ip", "link", "set", host.veth, "up"], check=True)  # type: ignore[attr-defined]
            if victim.pid:
                try:
                    os.kill(victim.pid, signal.SIGKILL)  # the cut-off process: its host would end it at stop
                except ProcessLookupError:
                    pass
    return ended, world.last_comeback_seconds or 0.0


if __name__ == "__main__":
    sys.exit(main())
