"""Each use of ipyparallel's private internals (ddp_notebook.cell.ipp_adapter), and of ipykernel's on
a rank's side (ddp_notebook.rank.ipp_process_adapter), on real clusters.

benchmarks/compat.py runs them on every ipyparallel and ipykernel of the supported ranges
(docs/compatibility.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster, RankError
from ddp_notebook.cell import ipp_adapter
from ddp_notebook.world.provisioning.local import engine_set_id

pytestmark = [pytest.mark.integration, pytest.mark.core]


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


def test_an_execute_watched_hands_each_future_over_before_its_request_is_sent(world: DDPCluster) -> None:
    """`execute_watched`: each engine's future, in the view's order, before anything of its reply
    arrived; a callback registered then sees every message, the first one too."""
    client = _client(world)
    engines = [info.engine_id for info in world.ranks]
    view = client.direct_view(engines)
    seen: dict[int, list[str]] = {}
    fresh: list[bool] = []

    def watch(index: int, future: object) -> None:
        fresh.append(not future.done() and not future.output.metadata["stdout"])  # type: ignore[attr-defined]
        kinds = seen.setdefault(index, [])
        future.iopub_callbacks.append(lambda msg: kinds.append(msg["header"]["msg_type"]))  # type: ignore[attr-defined]

    result = ipp_adapter.execute_watched(view, "import os\nprint(os.getpid(), flush=True)\n7 * 6", watch)
    result.get(timeout=30)
    result.wait_for_output(timeout=30)
    assert fresh == [True] * len(engines) and sorted(seen) == list(range(len(engines)))
    for index, future in enumerate(ipp_adapter.message_futures(result)):
        assert future.output.metadata["engine_id"] == engines[index]
        assert future.output.metadata["stdout"].strip() == str(world.ranks[index].pid)
        assert future.output.metadata["execute_result"]["data"]["text/plain"] == "42"
        # the first message of a reply, the rank's busy status, too
        assert seen[index][0] == "status" and {"stream", "execute_result"} <= set(seen[index]), seen[index]


def _status(result: object) -> str:
    """An execute reply's status, as the engine sent it (ipyparallel hands it over as the
    future's result: a RemoteError, a TaskAborted, or the reply)."""
    from ipyparallel.error import RemoteError, TaskAborted

    reply = ipp_adapter.message_futures(result)[0].result()
    return "error" if isinstance(reply, RemoteError) else "aborted" if isinstance(reply, TaskAborted) else "ok"


def test_a_cell_queued_behind_a_failing_one_still_runs(world: DDPCluster) -> None:
    """`execute_watched` marks its requests `stop_on_error: false`: a request that reaches an
    engine while it is done with an error is run, not aborted. `DirectView.execute`'s own requests
    are aborted there, which is what made a rank skip the cell after a failed one on ipykernel 6.

    The watched pair goes first: a failed `DirectView.execute` opens an abort window on the engine
    that can outlive the replies (ipykernel 6), and would abort whatever is sent next, watched or
    not. The test waits that window out at its end, so that no later test meets it."""
    client = _client(world)
    engine = world.ranks[0].engine_id
    view = client.direct_view([engine])
    failing = "import time\ntime.sleep(0.5)\nraise ValueError('first')"

    watched = [ipp_adapter.execute_watched(view, code, lambda i, f: None) for code in (failing, "'second'")]
    assert watched[1].wait(timeout=30)
    assert [_status(r) for r in watched] == ["error", "ok"]
    watched[1].wait_for_output(timeout=30)  # the result comes on iopub, maybe after the reply
    second = ipp_adapter.message_futures(watched[1])[0].output.metadata
    assert second["execute_result"]["data"]["text/plain"] == "'second'"

    plain = [view.execute(failing, silent=False, block=False), view.execute("'second'", silent=False, block=False)]
    assert plain[1].wait(timeout=30)
    assert [_status(r) for r in plain] == ["error", "aborted"]
    _wait_until_the_engine_stops_aborting(view)


def _wait_until_the_engine_stops_aborting(view: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        probe = ipp_adapter.execute_watched(view, "'probe'", lambda i, f: None)
        assert probe.wait(timeout=30)
        if _status(probe) == "ok":
            return
        assert time.monotonic() < deadline, "the engine kept aborting execute requests after a failed cell"
        time.sleep(0.05)


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


def test_engines_a_client_never_heard_of_are_learned_from_the_controller(world: DDPCluster) -> None:
    """A second client of the world's controller misses a registration (as one does whose
    connection request is answered just before a rank registers, and whose subscription to the
    announcements opens just after): asking the controller brings it back, and a start waiting
    for its ranks (forming.wait_for_engines) asks by itself."""
    from ddp_notebook.world import forming

    assert world.provisioner is not None and world.provisioner.cluster is not None
    engines = sorted(info.engine_id for info in world.ranks)
    client = world.provisioner.cluster.connect_client_sync()
    try:
        assert sorted(client.ids) == engines
        missed = engines[-1]
        forgotten = threading.Event()

        def forget() -> None:
            client._ids.remove(missed)
            client._engines.pop(missed)
            forgotten.set()

        ipp_adapter.on_io_thread(client, forget)
        assert forgotten.wait(10) and missed not in client.ids
        assert ipp_adapter.learn_registered_engines(client).wait(10)
        deadline = time.monotonic() + 10
        while missed not in client.ids and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(client.ids) == engines

        forgotten.clear()
        ipp_adapter.on_io_thread(client, forget)
        assert forgotten.wait(10) and missed not in client.ids

        class Waiting:  # the provisioner's part in a start, over this client
            def __init__(self) -> None:
                self.client, self.learned = client, []

            def expected_ranks(self) -> int:
                return len(engines)

            def start_failure(self) -> None:
                return None

            def too_few_message(self, registered: int, wanted: int) -> str:
                return f"only {registered} of {wanted}"

            def engine_ids(self, wanted: int) -> list[int]:
                return sorted(client.ids)[:wanted]

            def learn(self, identities: list) -> None:  # type: ignore[type-arg]
                self.learned = identities

        waiting = Waiting()
        began = time.perf_counter()
        identities = forming.wait_for_engines(waiting, began + 30)  # type: ignore[arg-type]
        assert sorted(identity.engine_id for identity in identities) == engines
        assert time.perf_counter() - began < forming.ASK_CONTROLLER_SECONDS + 5
    finally:
        client.close()


DATES = [
    "2026-11-27T00:49:52.123456Z",
    "2026-11-27T00:49:52Z",
    "2026-11-27T00:49:52.1+01:00",
    "2026-11-27T00:49:52.123456+0000",
    "2026-11-27T00:49:52.123456",  # naive: ipyparallel's own parser decides (local time, a warning)
    "not a date",
    None,
]


def test_reply_dates_are_read_as_ipyparallels_parser_reads_them(world: DDPCluster) -> None:
    import warnings

    from ipyparallel import util

    assert getattr(util._parse_date, "quick", False)  # a started world installed it
    original = util._parse_date.__closure__[0].cell_contents  # type: ignore[attr-defined]
    assert not getattr(original, "quick", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for text in DATES:
            assert util._parse_date(text) == original(text), text
    ipp_adapter.parse_reply_dates_quickly()  # twice is once
    assert util._parse_date.__closure__[0].cell_contents is original  # type: ignore[attr-defined]
    client = _client(world)
    result = client[world.ranks[0].engine_id].execute("x = 1", block=False)
    result.get(timeout=30)
    started = ipp_adapter.message_futures(result)[0].output.metadata["started"]
    assert started.tzinfo is not None and abs(started.timestamp() - time.time()) < 60


def test_the_controller_keeps_no_record_of_cells(world: DDPCluster) -> None:
    """Its hub stores nothing (NoDB): by default it held every request and its output for the
    world's life, which nothing here reads back."""
    from ipyparallel.error import RemoteError

    world.execute("print('kept nowhere')")
    with pytest.raises(RemoteError, match="NoDB backend doesn't store any data"):
        _client(world).db_query({"msg_id": {"$ne": ""}}, keys=["msg_id"])


def test_a_rank_does_not_echo_the_cells_code(world: DDPCluster, tmp_path: Path) -> None:
    """No execute_input on IOPub (a quarter of a trivial cell's messages per rank); the output,
    the statuses and the reply still come."""
    client = _client(world)
    seen: list[str] = []
    engines = [info.engine_id for info in world.ranks]
    # the ranks print once the callbacks are on: a loaded machine's IO thread could otherwise take
    # the output before they are (ipyparallel's own record, `metadata["execute_input"]`, has no such race)
    gate = tmp_path / "callbacks-on"
    code = (
        f"import os, time\ndeadline = time.monotonic() + 30\nwhile not os.path.exists({str(gate)!r})"
        " and time.monotonic() < deadline:\n    time.sleep(0.01)\nprint('still here')"
    )
    result = client[engines].execute(code, silent=False, block=False)
    for future in ipp_adapter.message_futures(result):
        future.iopub_callbacks.append(lambda msg: seen.append(msg["header"]["msg_type"]))
    gate.touch()
    result.get(timeout=30)
    result.wait_for_output(timeout=30)
    for future in ipp_adapter.message_futures(result):
        metadata = future.output.metadata
        assert metadata["execute_input"] is None and metadata["stdout"] == "still here\n", metadata
    assert "execute_input" not in seen and "stream" in seen, seen


SLOW_TO_FORMAT = """
import os, time
marker = {marker!r}
# the traceback's formatting, as 64 ranks on two cores take it: once, in code not of the cell (as
# IPython's formatting is not), so that the X-ray sees the rank past its cell and the relay waits
slow = {{}}
exec(compile(
    "def slow_str(self):\\n    import time\\n    if not self.formatted:\\n        time.sleep(1.5)\\n"
    "    self.formatted = True\\n    return 'raised first, formatted slowly'",
    "formatting.py", "exec"), slow)
class SlowToFormat(Exception):
    formatted = False
    __str__ = slow["slow_str"]
if rank == 1:
    open(marker, "w").close()
    raise SlowToFormat()
deadline = time.monotonic() + 30
while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)
raise RuntimeError("gave up waiting for rank 1")
"""


def test_the_rank_that_raised_first_is_the_root_cause_however_long_its_traceback_takes(
    world: DDPCluster, tmp_path: Path
) -> None:
    """Rank 1 raises 0.3 s before rank 0, and its reply goes 1.2 s after rank 0's: the root cause is
    taken from when each raised (the reply's `engine_info`), not when it replied."""
    with pytest.raises(RankError) as caught:
        world.execute(SLOW_TO_FORMAT.format(marker=str(tmp_path / "rank-1-raised")))
    first, second = caught.value.failures
    assert (first.rank, first.ename, second.rank, second.ename) == (1, "SlowToFormat", 0, "RuntimeError")
    assert first.failed_at is not None and second.failed_at is not None
    assert 0.25 < second.failed_at - first.failed_at < 1.2, (first.failed_at, second.failed_at)
    world.execute("x = 1")  # the world goes on


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


def test_an_ssh_engines_exit_is_left_to_a_watch_of_its_host() -> None:
    """`WatchedExit` replaces ipyparallel's waiting thread per SSH engine (which holds an ssh session
    open for the engine's life) by the subclass's watch, and tells ipyparallel of the exit as that
    thread did. A renamed `_start_waiting` would leave the thread in place: it fails here first."""
    from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHLauncher

    assert "_start_waiting" in vars(SSHLauncher), "ipyparallel no longer starts its waiting thread there"
    watches: list[object] = []

    class Watched(ipp_adapter.WatchedExit, SSHEngineLauncher):
        def watch_exit(self) -> None:
            watches.append(self)

    async def run() -> None:
        engine = Watched()
        engine.pid = 4242
        engine.notify_start({"host": "h1", "pid": 4242})
        threads = threading.active_count()
        engine._start_waiting()  # what ipyparallel's start calls once the engine runs on its host
        assert watches == [engine] and threading.active_count() == threads
        assert engine.watched
        stopped: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        engine.on_stop(stopped.set_result)
        engine.exited(-1)
        data = await asyncio.wait_for(stopped, 5)
        assert (data["exit_code"], data["pid"]) == (-1, 4242)
        assert engine.state == "after" and not engine.watched

        other = Watched()
        other.notify_start({"host": "h1", "pid": 4343})
        assert not other.watched  # no watch before ipyparallel asked for one
        other._start_waiting()
        other.end_watch()  # its launcher stopped it (or gave up on its host)
        assert not other.watched and other.state == "running"

    asyncio.run(run())


_CONTROLLER_SLEEPS = """
import sys, time
slept = []
real_sleep = time.sleep
time.sleep = lambda seconds: slept.append(seconds)  # what the controller would have waited
from ddp_notebook.rank import ipp_process_adapter
from ipyparallel.controller.app import IPController
skipped = sys.argv[1] == "skip" and ipp_process_adapter.skip_hub_settle_sleep()
app = IPController.instance()
app.initialize(["--profile-dir=" + sys.argv[2], "--ip=127.0.0.1", "--IPController.db_class=NoDB",
                "--IPController.use_threads=True", "--log-level=ERROR"])
print(skipped, sum(slept) >= 0.25)
sys.stdout.flush()
import os; os._exit(0)
"""


@pytest.mark.parametrize("skip", [True, False])
def test_the_controller_starts_without_the_hubs_settle_sleep(tmp_path, skip: bool) -> None:  # type: ignore[no-untyped-def]
    """A world's controller skips the 0.25 s ipyparallel's hub sleeps before it writes its connection
    files (time for a task database to connect; a world keeps none); without the skip, it sleeps."""
    import subprocess
    import sys

    from ddp_notebook.rank import ipp_process_adapter

    found = ipp_process_adapter.hub_settle_sleep_found()
    ran = subprocess.run(
        [sys.executable, "-c", _CONTROLLER_SLEEPS, "skip" if skip else "keep", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    skipped, slept = ran.stdout.split()
    assert skipped == str(skip and found)
    assert slept == str(found and not skip)  # where this ipyparallel sleeps, only the skip removes it


def test_a_rank_sees_each_message_its_kernel_sends_and_the_request_it_runs(world: DDPCluster) -> None:
    """What a detached world's cell journal hooks (`watch_sent`, `current_request`): the output, the
    displays and the reply of a cell, each with the cell's request as parent, from whichever thread."""
    client = _client(world)
    engine = client[world.ranks[0].engine_id]
    engine.execute(
        "from ddp_notebook.rank import ipp_process_adapter as adapter\n"
        "seen = []\n"
        "adapter.watch_sent(get_ipython(), lambda kind, content, parent: seen.append((kind, parent.get('msg_id'))))",
        silent=False,
    ).get(timeout=30)
    try:
        cell = engine.execute(
            "request = adapter.current_request(get_ipython())\n"
            "print('watched')\n"
            "from IPython.display import display\n"
            "display({'text/plain': 'shown'}, raw=True)",
            silent=False,
        )
        cell.get(timeout=30)
        (msg_id,) = cell.msg_ids
        request, session = engine.pull("request", block=False).get(timeout=30)
        assert request == msg_id and session == client.session.session
        engine.execute(f"kinds = [kind for kind, parent in seen if parent == {msg_id!r}]").get(timeout=30)
        kinds = engine.pull("kinds", block=False).get(timeout=30)
        assert {"stream", "display_data", "execute_reply"} <= set(kinds), kinds
    finally:
        engine.execute("del get_ipython().kernel.session.send", silent=False).get(timeout=30)


# a ZMTP 1.0 greeting (an empty identity: its length byte, then its flags), then two frames each
# sent as a message of its own: libzmq takes a peer that greets it so, with no socket type check
ZMTP_1_FRAMES = b"\x01\x00" + b"\x05\x00junk" + b"\x0a\x00more junk"


def _send_frames(port: int) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(ZMTP_1_FRAMES)
            time.sleep(0.05)  # the frames are read before the connection goes
    except OSError:
        pass


def test_frames_anyone_sends_the_controllers_ports_stop_none_of_the_clients_streams(world: DDPCluster) -> None:
    """Any local user can connect to the controller's loopback ports; frames sent in ZMTP 1.0 reach
    its queues, which forward them to the client with no delimiter. The client drops them
    (`drop_malformed_messages`): the running cell's every line and its reply arrive, the next runs."""
    import psutil
    import zmq

    assert world.provisioner is not None and world.provisioner.controller_pid is not None
    controller = psutil.Process(world.provisioner.controller_pid)
    ports = sorted({c.laddr.port for c in controller.net_connections("inet") if c.status == psutil.CONN_LISTEN})
    assert ports, "the controller listens on no port"
    client = _client(world)
    assert ipp_adapter.drop_malformed_messages() == list(ipp_adapter._CLIENT_DISPATCHERS)
    assert client._dispatch_iopub([zmq.Frame(b"junk")]) is None  # dropped, nothing raised

    def send_while_the_cell_runs() -> None:
        time.sleep(0.5)
        for port in ports:
            _send_frames(port)

    sender = threading.Thread(target=send_while_the_cell_runs)
    sender.start()
    try:
        result = world.execute(
            "import time\nfor i in range(30):\n    print('line', i, flush=True)\n    time.sleep(0.05)\n'done'",
            stream=False,
            timeout=60,
        )
    finally:
        sender.join(30)
    for rank in range(len(world.ranks)):
        assert result.stdout[rank].split("\n").count("line 29") == 1, result.stdout[rank]
        assert len(result.stdout[rank].strip().splitlines()) == 30, result.stdout[rank]
        assert result.value_text(rank) == "'done'"
    last = len(world.ranks) - 1
    assert world.execute("rank", stream=False).value_text(last) == str(last)
