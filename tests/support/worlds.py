"""Worlds the tests share: the body of a fixture yielding a running n-rank gloo world (nothing of it may
outlive its stop), and an IPython shell whose %ddp magics drive a world the test already holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ddp_notebook import DDPCluster
from tests.support.processes import wait_gone


def shared_world(n_ranks: int) -> Iterator[DDPCluster]:
    """Body of a fixture yielding a running n-rank gloo world; nothing of it may outlive its stop()."""
    cluster = DDPCluster(n_ranks, backend="gloo", collective_timeout=60)
    cluster.start()
    pids = cluster.all_pids
    try:
        yield cluster
    finally:
        cluster.stop()
        assert wait_gone(pids) == [], "processes of the shared world outlived stop()"


@contextlib.contextmanager
def magics_driving(world: DDPCluster) -> Iterator[Any]:
    """An IPython shell (no kernel: the text view) whose magics drive `world`, which stays running."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "ddp_notebook")
    magics = ip.magics_manager.registry["DDPMagics"]
    magics.world = world
    try:
        yield ip
    finally:
        magics.world = None  # the world is not the shell's to stop
        ip.run_line_magic("unload_ext", "ddp_notebook")
