"""The collective X-ray across hosts: how long a reading of ranks on other hosts takes, and how
soon a mismatch between them ends the cell.

Two "hosts" made of network namespaces with an sshd each (tests/support/multihost.py: needs root and
the Debian packages .ci/install adds), a world of one rank per host started by the SSH
launcher, the controller on the bridge with CurveZMQ. Run from the repository root:

    python benchmarks/xray_across_hosts.py [--readings 50] [--mismatches 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_notebook import InsecureNetworkWarning
from ddp_notebook.cell import xray
from ddp_notebook.cell.xray import CollectiveMismatchError
from tests.support.launchers import ssh_world
from tests.support.multihost import network_namespaces, ssh_hosts

MISMATCH = "t = torch.ones(5)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readings", type=int, default=50, help="X-ray readings timed (default: 50)")
    parser.add_argument("--mismatches", type=int, default=3, help="mismatched cells timed (default: 3)")
    args = parser.parse_args()
    with network_namespaces(2) as network, ssh_hosts(network) as ssh:
        world = ssh_world(network, ssh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureNetworkWarning)
            world.start()
        try:
            world.execute("dist.all_reduce(torch.ones(1))", stream=False)
            reach = xray.Reach.of(world.private_dir or "", world.ranks)
            assert reach.remote, "no rank is on another host"
            for full in (False, True):
                times = []
                for _ in range(args.readings):
                    began = time.perf_counter()
                    found = xray.read_ranks(reach, [info.rank for info in world.ranks], full=full)
                    times.append(time.perf_counter() - began)
                    assert len(found) == world.world_size, found
                kind = "full" if full else "light (what a running cell's watch asks)"
                median_ms = statistics.median(times) * 1e3
                print(f"one {kind} X-ray reading of {world.world_size} remote ranks: {median_ms:.2f} ms")
            for _ in range(args.mismatches):
                began = time.monotonic()
                try:
                    world.execute(MISMATCH, stream=False, timeout=60)
                except CollectiveMismatchError as caught:
                    ended = time.monotonic() - began
                    found_s = caught.mismatch.waited
                    print(f"mismatch across hosts: found {found_s:.2f} s after it began; cell ended in {ended:.2f} s")
                else:
                    print("mismatch across hosts: not caught")
            began = time.perf_counter()
            world.where_stuck()
            print(f"where_stuck over the remote ranks: {(time.perf_counter() - began) * 1e3:.1f} ms")
        finally:
            world.stop()


if __name__ == "__main__":
    main()
