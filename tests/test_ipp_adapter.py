"""Each use of ipyparallel's private internals (ddp_notebook.world.ipp_adapter), on real clusters.

ipyparallel is bounded in pyproject.toml to the versions these tests pass on.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ddp_notebook import DDPCluster
from ddp_notebook.world import ipp_adapter
from ddp_notebook.world.provisioning.local import engine_set_id

pytestmark = pytest.mark.integration


def _client(world: DDPCluster):  # type: ignore[no-untyped-def]
    assert world.provisioner is not None
    return world.provisioner.client


def test_message_futures_follow_the_targets(world: DDPCluster) -> None:
    client = _client(world)
    engines = [info.engine_id for info in world.ranks]
    result = client[engines].execute("import os; os.getpid()", silent=False, block=False)
    result.get(timeout=30)
    futures = ipp_adapter.message_futures(result)
    assert len(futures) == len(engines)
    assert all(f.done() and f.output.metadata["engine_id"] == e for f, e in zip(futures, engines))


def test_callbacks_run_on_the_io_thread(world: DDPCluster) -> None:
    ran_on: list[int] = []
    done = threading.Event()

    def callback() -> None:
        ran_on.append(threading.get_ident())
        done.set()

    ipp_adapter.on_io_thread(_client(world), callback)
    assert done.wait(10)
    assert ran_on and ran_on[0] != threading.get_ident()


def test_queue_request_answers_per_engine(world: DDPCluster) -> None:
    reply = ipp_adapter.send_queue_request(_client(world))
    assert reply.wait(10)
    content = reply.result()["content"]
    assert content["status"] == "ok"
    assert {str(info.engine_id) for info in world.ranks} <= set(content)


def test_error_replies_unwrap_to_remote_errors(world: DDPCluster) -> None:
    # the content of an engine's error reply, as the relay meets it when the metadata has none
    content = {
        "status": "error",
        "ename": "ValueError",
        "evalue": "on purpose",
        "traceback": ["Traceback (most recent call last):\n", "ValueError: on purpose\n"],
        "engine_info": {"engine_id": world.ranks[0].engine_id, "method": "execute"},
    }
    error = ipp_adapter.unwrap_exception(_client(world), content)
    assert (error.ename, error.evalue) == ("ValueError", "on purpose")
    assert "ValueError: on purpose" in "\n".join(error.render_traceback())


def test_the_exit_code_of_a_killed_rank_is_recorded(no_leaks: None) -> None:
    # ipyparallel's own local launcher records it (forked ranks get theirs from the template)
    with DDPCluster(1, backend="gloo", warm_start=False) as one:
        assert one.provisioner is not None
        engine_set = one.provisioner.cluster.engines[engine_set_id(0)]
        assert ipp_adapter.recorded_exit(engine_set) is None  # still running
        os.kill(one.ranks[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while ipp_adapter.recorded_exit(engine_set) is None and time.monotonic() < deadline:
            # in a kernel the launcher's periodic poll records the exit; a script has no running
            # event loop, so poll by hand (what the kernel's loop would do)
            for launcher in list(engine_set.launchers.values()):
                launcher.poll()
            time.sleep(0.05)
        assert ipp_adapter.recorded_exit(engine_set) == -signal.SIGKILL
