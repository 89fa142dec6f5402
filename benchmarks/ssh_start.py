"""A world started over SSH on two hosts: seconds from `start()` to ready, and to stopped.

Two "hosts" made of network namespaces with an sshd each (tests/support/multihost.py: needs root and the
Debian packages .ci/install adds); `--ranks-per-host` ranks on each. Side by side, alternating in
one run:

- `ddp_notebook`: as it starts SSH worlds (one shared ssh connection per host, opened while the
  controller starts; every host started at once);
- `ipyparallel steps`: ipyparallel's own SSH engine set (hosts one after another, each engine
  through its own ssh connections: `-o ControlMaster=no`), everything else the same: how
  ddp_notebook started SSH worlds before.

Run from the repository root, as root:

    python benchmarks/ssh_start.py [--rounds 3] [--ranks-per-host 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import exit_on_sigterm, print_table

from ddp_notebook import DDPCluster, InsecureNetworkWarning
from ddp_notebook.world.provisioning import launcher as launcher_provisioning
from tests.support.multihost import network_namespaces, ssh_hosts

SUBJECTS = ("ddp_notebook", "ipyparallel steps")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: the hosts are network namespaces with an sshd each", file=sys.stderr)
        return 2
    exit_on_sigterm()
    warnings.simplefilter("ignore", InsecureNetworkWarning)
    times: dict[str, list[tuple[float, float]]] = {subject: [] for subject in SUBJECTS}
    with network_namespaces(2) as network, ssh_hosts(network) as ssh:
        for round_number in range(args.rounds):
            order = SUBJECTS if round_number % 2 == 0 else SUBJECTS[::-1]
            for subject in order:
                times[subject].append(start_and_stop(subject, network, ssh, args.ranks_per_host))
                ready, stopped = times[subject][-1]
                print(f"round {round_number + 1} {subject}: ready {ready:.2f} s, stopped {stopped:.2f} s", flush=True)
    ranks = 2 * args.ranks_per_host
    print(f"\n{ranks} ranks on 2 hosts over SSH, median of {args.rounds} (min-max)")
    rows = []
    for subject in SUBJECTS:
        ready = [r for r, _ in times[subject]]
        stopped = [s for _, s in times[subject]]
        rows.append([subject, _spread(ready), _spread(stopped)])
    print_table(["", "start to ready (s)", "stop (s)"], rows)
    ours = statistics.median(r for r, _ in times["ddp_notebook"])
    before = statistics.median(r for r, _ in times["ipyparallel steps"])
    print(f"start to ready: {ours / before:.2f}x the time of ipyparallel's steps")
    return 0


def start_and_stop(subject: str, network: object, ssh: object, per_host: int) -> tuple[float, float]:
    ssh_args = list(ssh.ssh_args)  # type: ignore[attr-defined]
    concurrent = launcher_provisioning.ConcurrentSSHEngineSetLauncher
    if subject == "ipyparallel steps":
        from ipyparallel.cluster.launcher import SSHEngineSetLauncher

        ssh_args += ["-o", "ControlMaster=no"]
        launcher_provisioning.ConcurrentSSHEngineSetLauncher = SSHEngineSetLauncher  # type: ignore[misc]
    try:
        world = DDPCluster(
            launcher="ssh",
            hosts=",".join(f"{host}:{per_host}" for host in ssh.hosts),  # type: ignore[attr-defined]
            ssh_args=ssh_args,
            ip=network.address,  # type: ignore[attr-defined]
            backend="gloo",
            collective_timeout=60,
            start_timeout=120,
        )
        began = time.monotonic()
        world.start()
        ready = time.monotonic() - began
        try:
            assert world.execute("rank", stream=False).value_text(2 * per_host - 1) == str(2 * per_host - 1)
        finally:
            began = time.monotonic()
            world.stop()
            stopped = time.monotonic() - began
    finally:
        launcher_provisioning.ConcurrentSSHEngineSetLauncher = concurrent  # type: ignore[misc]
    return ready, stopped


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    sys.exit(main())
