"""ddp_notebook under a real JupyterHub (tests/support/hub.py): real Linux users, their servers spawned
as them by LocalProcessSpawner, kernels driven through the proxy as a browser does, and the
jupyterhub-idle-culler service stopping a server whose kernel holds a world."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch

from tests.support import hub as hub_module
from tests.support import memory_cgroup
from tests.support.hub import Hub, HubKernel, culler_setting, run_in_threads
from tests.support.processes import owned_pids, pid_alive
from tests.support.training import BATCH_PER_RANK, LR, MODEL_CODE, STEPS, train_single_process

pytestmark = [pytest.mark.integration, pytest.mark.jupyterhub, pytest.mark.timeout(600)]

hub = hub_module.hub

WORLD_START_SECONDS = 300  # two worlds starting at once on 2 busy cores
PARAMS_FILE = "ddphub-params-rank{rank}.pt"
WORLD_TEMP_PREFIXES = ("ddp-notebook-", "ddp-template-")  # tempfile.mkdtemp in world/cluster.py, world/template.py

# the training of tests/test_ddp_correctness.py, as a %%ddp cell; each rank saves its parameters
# in the user's home and prints its pid, uid and when it trained (a short sleep per step keeps
# the two users' cells overlapping)
TRAIN_CELL = f"""%%ddp
import json, os, time
began = time.time()
{MODEL_CODE}
STEPS, BATCH, LR = {STEPS}, {BATCH_PER_RANK}, {LR}
model = ddp_notebook.prepare_model(make_model(seed=1234 + rank))
x, y = make_data(STEPS, BATCH * world_size)
loader = ddp_notebook.prepare_loader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
for xb, yb in loader:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    optimizer.step()
    time.sleep(0.2)
params = {{k: v.detach().clone() for k, v in model.module.state_dict().items()}}
torch.save(params, os.path.expanduser({PARAMS_FILE!r}.format(rank=rank)))
print(json.dumps({{"pid": os.getpid(), "uid": os.getuid(), "began": began, "ended": time.time()}}))
"""

WORLD_PIDS_CELL = (
    "import json, os\n"
    "world = get_ipython().magics_manager.registry['DDPMagics'].world\n"
    "print(json.dumps({'kernel': os.getpid(), 'world': world.all_pids}))"
)


@dataclass
class World:
    kernel: int  # the kernel's pid
    pids: list[int]  # the controller, the ranks and what they started


def start_world(kernel: HubKernel) -> World:
    """`%ddp_start 2` in the kernel; the world's processes (what the kernel reports, what carries
    the kernel's pid as owner, and the kernel's descendants)."""
    result = kernel.run("%load_ext ddp_notebook\n%ddp_start 2", timeout=WORLD_START_SECONDS)
    assert result.error is None and "DDP world ready: 2 ranks" in result.text, result.text
    result = kernel.run(WORLD_PIDS_CELL)
    assert result.error is None, result.text
    reported = json.loads(result.text.strip().splitlines()[-1])
    descendants = [child.pid for child in psutil.Process(reported["kernel"]).children(recursive=True)]
    pids = set(reported["world"]) | owned_pids(reported["kernel"]) | set(descendants)
    return World(reported["kernel"], sorted(pids))


def rank_reports(text: str) -> dict[int, dict]:
    """The JSON line each rank printed, by rank."""
    return {int(rank): json.loads(line) for rank, line in re.findall(r"\[rank (\d+)\] (\{.*\})", text)}


def uids_of(pids: list[int]) -> dict[int, int]:
    return {pid: psutil.Process(pid).uids().real for pid in pids}


def profile_files(home: Path) -> set[str]:
    """The files of the user's default IPython profile's logs and connection files."""
    profile = home / ".ipython" / "profile_default"
    return {str(path) for folder in ("log", "security") for path in (profile / folder).glob("*")}


def listening_ports(pids: list[int]) -> set[int]:
    ports = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        ports |= {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    return ports


def listeners_on(ports: set[int]) -> list[str]:
    return [
        f"{c.laddr.ip}:{c.laddr.port} (pid {c.pid})"
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    ]


def train_as(hub: Hub, user: str, barrier: threading.Barrier) -> dict:
    """User's session: server, kernel, world, then the training cell once the other user is
    ready too; what it saw."""
    try:
        hub.start_server(user)
        with hub.kernel(user) as kernel:
            world = start_world(kernel)
            uids = uids_of([world.kernel, *world.pids])
            barrier.wait()
            training = kernel.run(TRAIN_CELL, timeout=180)
            stop = kernel.run("%ddp_stop", timeout=60)
        return {"world": world, "uids": uids, "training": training, "stop": stop}
    except BaseException:
        barrier.abort()  # the other user must not wait for this one
        raise


@contextlib.contextmanager
def started_then_kernel(hub: Hub, user: str) -> Iterator[HubKernel]:
    """The user's server started, then a kernel of it opened right away, as a person's tab does."""
    hub.start_server(user)
    with hub.kernel(user) as kernel:
        yield kernel


def stop_servers(hub: Hub, names: list[str]) -> None:
    """Stop each user's server (all of them, even when one fails to stop); the first error."""
    errors = []
    for name in names:
        try:
            hub.stop_server(name)
        except Exception as error:  # noqa: BLE001  (raised once every server was asked to stop)
            errors.append(error)
    if errors:
        raise errors[0]


def test_two_users_train_at_once_each_world_as_its_user(hub: Hub) -> None:
    names = list(hub.users)
    barrier = threading.Barrier(len(names), timeout=WORLD_START_SECONDS + 120)
    try:
        sessions = dict(
            zip(names, run_in_threads(*(lambda u=u: train_as(hub, u, barrier) for u in names), timeout=540))
        )
    finally:
        stop_servers(hub, names)
    expected = train_single_process(STEPS, BATCH_PER_RANK * 2)
    reports = {}
    for name, session in sessions.items():
        user = hub.users[name]
        training, world = session["training"], session["world"]
        assert training.error is None, training.text
        assert "stopped the world" in session["stop"].text, session["stop"].text
        # every process of the world runs as the user, and the ranks are among them
        assert len(world.pids) >= 3, world  # the controller and 2 ranks at least
        assert set(session["uids"].values()) == {user.uid}, (name, session["uids"])
        reports[name] = rank_reports(training.text)
        assert sorted(reports[name]) == [0, 1], training.text
        for report in reports[name].values():
            assert report["uid"] == user.uid and report["pid"] in world.pids, (name, report, world)
        # DDP: the ranks agree, and match one process trained on the combined batch
        per_rank = [torch.load(user.home / PARAMS_FILE.format(rank=rank)) for rank in (0, 1)]
        for key, value in expected.items():
            assert torch.equal(per_rank[0][key], per_rank[1][key]), f"{name}: ranks disagree on {key}"
            torch.testing.assert_close(per_rank[0][key], value, rtol=1e-5, atol=1e-6)
    first, second = (sessions[name]["world"] for name in names)
    assert not set(first.pids) & set(second.pids)
    # the two users' training overlapped: every rank of both began before any of them ended
    ranks = [report for per_user in reports.values() for report in per_user.values()]
    assert max(r["began"] for r in ranks) < min(r["ended"] for r in ranks), reports


# What user B tries, in B's own notebook, against user A's running world (the ports, the paths and
# the pids are A's, handed in as B would find them: /proc/net/tcp lists every listening port, /tmp
# every folder's name, /proc every pid). One JSON line per attempt: [what, "got ..." or "refused: ..."].
PROBE_CELL = """
import datetime, glob, json, multiprocessing, os, signal, socket, time
import torch.distributed as dist
import zmq
from jupyter_client.session import Session

A_HOME, A_PIDS, A_PORTS, A_PRIVATE, MARK = {args}


def attempt(what, action):
    try:
        outcome = "got " + repr(action())[:600]
    except Exception as error:
        outcome = f"refused: {{type(error).__name__}}: {{str(error)[:100]}}"
    print(json.dumps([what, outcome]), flush=True)


def in_a_child(action, seconds):
    # a forked child, killed when it has not answered: a store client stuck in torch's C++ can hold
    # the GIL past its own timeout, and a thread of this kernel would then hang the whole cell
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:
        try:
            writer.send(("answer", action()))
        except BaseException as error:
            writer.send(("error", type(error).__name__, str(error)))
        finally:
            os._exit(0)
    writer.close()
    try:
        if not reader.poll(seconds):
            raise TimeoutError("no answer")
        answer = reader.recv()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if answer[0] == "error":
        raise type(answer[1], (Exception,), {{}})(answer[2])
    return answer[1]


def junk(port):
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(os.urandom(64))
        s.settimeout(0.3)
        try:
            return s.recv(64)
        except socket.timeout:
            return b""


def zmtp_1_frames(port):
    # libzmq speaks ZMTP 1.0 to a peer that greets it so (an identity frame), checking no socket type
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"\\x01\\x00" + b"\\x05\\x00junk" + b"\\x0a\\x00more junk")
        time.sleep(0.05)
    return "sent"


def store(port):
    store = dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=0.5), use_libuv=False)
    store.set("written by B", "x")
    return f"a rendezvous store, {{store.num_keys()}} keys"


def execute_unsigned(port):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 1000  # a DEALER waits for a peer to send to: a port that is not ZMQ never becomes one
    sock.connect(f"tcp://127.0.0.1:{{port}}")
    session = Session(key=b"", username="b")  # B has no key: A's are in A's connection files
    code = f"open({{MARK!r}}, 'w').write('B ran code here')"
    session.send(sock, "execute_request", content=dict(code=code, silent=False, store_history=False,
                                                       user_expressions={{}}, allow_stdin=False))
    time.sleep(0.3)
    try:
        return sock.recv_multipart(zmq.NOBLOCK)[:2]
    except zmq.Again:
        return "no reply"
    finally:
        sock.close()
        context.term()


# torch's store client logs every failed try with its C++ stack: B's notebook does not need to see them
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
listed = {{line.split()[1].split(":")[1] for line in open("/proc/net/tcp").read().splitlines()[1:]
          if line.split()[3] == "0A"}}
wanted = {{f"{{port:04X}}" for port in A_PORTS}}
attempt("A's listening ports in /proc/net/tcp", lambda: sorted(int(port, 16) for port in listed & wanted))
attempt("A's connection files", lambda: os.listdir(os.path.join(A_PRIVATE, "ipython", "security")))
attempt("A's world folder", lambda: os.listdir(A_PRIVATE))
attempt("A's world key", lambda: open(os.path.join(A_PRIVATE, "xray.key")).read())
xray = os.path.join(A_PRIVATE, "rank0.xray")
attempt("A's ranks' X-ray sockets", lambda: socket.socket(socket.AF_UNIX).connect(xray))
attempt("A's processes' environment", lambda: [open(f"/proc/{{pid}}/environ", "rb").read(8) for pid in A_PIDS])
attempt("a signal to A's processes", lambda: [os.kill(pid, 0) for pid in A_PIDS])
for port in A_PORTS:
    attempt(f"port {{port}}: bytes of its own", lambda: junk(port))
    attempt(f"port {{port}}: frames in ZMTP 1.0", lambda: zmtp_1_frames(port))
    attempt(f"port {{port}}: a rendezvous store", lambda: in_a_child(lambda: store(port), 2))
    attempt(f"port {{port}}: an unsigned execute_request", lambda: in_a_child(lambda: execute_unsigned(port), 3))
"""

ISOLATION_MARK = "/tmp/ddphub-b-ran-code-in-a-world-of-a"
# A's ranks all-reduce while B probes, until B is done (a file B's probe cannot write: A's own home)
BUSY_CELL = """%%ddp
import os, time
done = os.path.expanduser("~/probe-done")
count = 0
while count < 6000:
    flags = torch.tensor([1.0 + rank, float(os.path.exists(done))])
    dist.all_reduce(flags)  # every rank leaves the loop at the same step
    assert flags[0].item() == 3.0, flags
    count += 1
    if flags[1].item() > 0:
        break
    time.sleep(0.01)
print(f"{count} all-reduces, each 3.0")
"""


def probe_outcomes(text: str) -> dict[str, str]:
    return dict(json.loads(line) for line in text.splitlines() if line.startswith('["'))


def test_another_user_reaches_nothing_of_a_running_world(hub: Hub) -> None:
    a, b = (hub.users[name] for name in hub.users)
    try:
        # each server's tab opened as soon as it is up: a server idle for the culler's --timeout
        # (a loaded machine starting the other's kernel) would be culled
        hub.start_server(a.name)
        with hub.kernel(a.name) as kernel_a, started_then_kernel(hub, b.name) as kernel_b:
            world = start_world(kernel_a)
            before = kernel_a.run(TRAIN_CELL, timeout=180)
            assert before.error is None, before.text
            private = kernel_a.run("print(get_ipython().magics_manager.registry['DDPMagics'].world.private_dir)")
            private_dir = private.text.strip().splitlines()[-1]
            ports = sorted(listening_ports(world.pids))
            assert ports, "the world listens on no port"
            args = (str(a.home), world.pids, ports, private_dir, ISOLATION_MARK)
            # A's ranks run collectives all the while B tries (an open tab, too: the culler leaves A be)
            done = a.home / "probe-done"

            def probe_then_done() -> Any:
                try:
                    return kernel_b.run(PROBE_CELL.format(args=repr(args)), timeout=300)
                finally:
                    done.touch()

            busy, probe = run_in_threads(lambda: kernel_a.run(BUSY_CELL, timeout=330), probe_then_done, timeout=340)
            done.unlink()
            assert probe.error is None, probe.text
            assert busy.error is None, busy.text
            assert busy.text.count("all-reduces, each 3.0") == 2, busy.text
            outcomes = probe_outcomes(probe.text)
            print("\nwhat user B tried against user A's running world, from B's notebook:")
            for what, outcome in outcomes.items():
                print(f"  {what}: {outcome}")
            # B sees that the ports exist, and nothing more
            assert outcomes["A's listening ports in /proc/net/tcp"] == f"got {ports}"
            for what in ("A's connection files", "A's world folder", "A's world key", "A's ranks' X-ray sockets",
                         "A's processes' environment", "a signal to A's processes"):  # fmt: skip
                assert outcomes[what].startswith(("refused: PermissionError", "refused: FileNotFoundError")), what
            for port in ports:
                # no rendezvous store to write into (a world on one host forms in a file of its private
                # folder), and no unsigned message is answered
                assert outcomes[f"port {port}: a rendezvous store"].startswith("refused: "), port
                # a ZMQ port answers nothing; one whose handshake B cannot finish (CurveZMQ) refuses the send
                unsigned = outcomes[f"port {port}: an unsigned execute_request"]
                assert unsigned == "got 'no reply'" or unsigned.startswith("refused: "), (port, unsigned)
            # A's world noticed nothing: it trains on, to the same parameters, and ran none of B's code
            after = kernel_a.run(TRAIN_CELL, timeout=180)
            assert after.error is None, after.text
            assert not Path(ISOLATION_MARK).exists()
            per_rank = [torch.load(a.home / PARAMS_FILE.format(rank=rank)) for rank in (0, 1)]
            expected = train_single_process(STEPS, BATCH_PER_RANK * 2)
            for key, value in expected.items():
                torch.testing.assert_close(per_rank[0][key], value, rtol=1e-5, atol=1e-6)
                assert torch.equal(per_rank[0][key], per_rank[1][key])
            # the key that signs the world's messages is in no process's command line (every user reads those)
            security = Path(private_dir) / "ipython" / "security"  # the world's own profile
            keys = {json.loads(path.read_text())["key"] for path in security.glob("ipcontroller-*.json")}
            assert keys and all(keys), "no connection file with a key"
            for pid in world.pids:
                command_line = " ".join(psutil.Process(pid).cmdline())
                assert not [key for key in keys if key in command_line], pid
            kernel_a.run("%ddp_stop", timeout=60)
    finally:
        stop_servers(hub, [a.name, b.name])


# rank 1 grows in steps until its cgroup (the user's, shared with the server, the kernel and the
# other rank) is 93% full, holds it while the notebook reads the memory, then lets it go
GROW_CELL = """%%ddp
import time
from ddp_notebook.platform.limits import Platform

held = []
if rank == 1:
    platform = Platform()
    while True:
        reading = platform.memory_limit()
        if reading.source != "cgroup memory limit" or reading.used >= 0.93 * reading.limit or len(held) > 200:
            break
        held.append(torch.ones(16 * 2**20 // 4))  # 16 MiB, every page touched
        time.sleep(0.02)
    print(f"grew by {len(held) * 16} MiB, to {reading.used / reading.limit:.0%} of {reading.source}")
    time.sleep(3)  # the notebook reads the ranks' memory a few times a second
held.clear()
dist.barrier()
"""


def test_a_users_memory_limit_is_what_ddp_start_reads(hub: Hub) -> None:
    if hub.cgroup_parent is None:
        pytest.skip(f"no memory cgroup for the users' servers here: {hub.no_cgroup}")
    name = next(iter(hub.users))
    cgroup = hub.cgroup_parent / f"jupyter-{name}"
    hub.start_server(name)
    try:
        with hub.kernel(name) as kernel:
            # the server, and so the kernel, run in the user's cgroup, made by the spawner's hook
            pid = kernel.run("import os; print(os.getpid())")
            kernel_pid = int(pid.text.strip().splitlines()[-1])
            members = {int(line) for line in (cgroup / "cgroup.procs").read_text().split()}
            assert kernel_pid in members, (kernel_pid, members)
            # a world that does not fit the user's limit is refused before anything starts
            refused = kernel.run("%load_ext ddp_notebook\n%ddp_start 4", timeout=60)
            # IPython shows a magic's UsageError as one line on stderr, not as a traceback
            assert refused.text.startswith("UsageError: 4 CPU ranks do not fit here"), refused.text
            assert "free of the cgroup memory limit of 1.2 GiB" in refused.text, refused.text
            assert re.search(r"start at most [1-3] \(%ddp_start [1-3]\)", refused.text), refused.text
            started = kernel.run("%ddp_start 2", timeout=WORLD_START_SECONDS)
            assert started.error is None and "DDP world ready: 2 ranks" in started.text, started.text
            world = kernel.run(WORLD_PIDS_CELL)
            world_pids = json.loads(world.text.strip().splitlines()[-1])["world"]
            members = {int(line) for line in (cgroup / "cgroup.procs").read_text().split()}
            assert set(world_pids) <= members, "the world's processes are in the user's cgroup"
            # a rank that grows is named before the out-of-memory killer acts
            grown = kernel.run(GROW_CELL, timeout=180)
            assert grown.error is None, grown.text
            assert re.search(r"\[rank 1\] grew by \d+ MiB, to 9\d% of cgroup memory limit", grown.text), grown.text
            # named as the one that grew since the notebook first read it, or, grown before that, the largest
            warning = re.search(
                r"warning: memory is (\d+)% full \(.*?\); (rank 1 grew most|the largest rank is rank 1 )", grown.text
            )
            assert warning and 90 <= int(warning.group(1)) < 100, grown.text
            kernel.run("%ddp_stop", timeout=60)
    finally:
        stop_servers(hub, [name])
    # the post-stop hook removes the user's cgroup once the server's last process is gone
    deadline = time.monotonic() + 30
    while cgroup.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not cgroup.exists(), "the user's cgroup outlived the server"


def config_hooks(monkeypatch: pytest.MonkeyPatch, cgroup_parent: Path) -> tuple[Any, Any]:
    """The pre-spawn and post-stop hooks of the docs' hub config, as the hub loads them."""
    from traitlets.config import Config

    environment = {"HUB_CGROUP_PARENT": str(cgroup_parent), "HUB_MEMORY_LIMIT": str(hub_module.MEMORY_LIMIT)}
    for name in ("HUB_PUBLIC_PORT", "HUB_PORT", "HUB_PROXY_API_PORT"):
        environment[name] = "1"
    environment.update(HUB_USER_PASSWORD="unused", HUB_USERS="ddphub-a", HUB_ADMIN_TOKEN="unused")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = Config()
    exec(compile(hub_module.hub_config_text(), "jupyterhub_config.py", "exec"), {"get_config": lambda: config})
    return config.Spawner.pre_spawn_hook, config.Spawner.post_stop_hook


def test_a_server_started_again_while_its_cgroup_is_being_removed_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop's hook removes the user's cgroup once its last process exits; the user's next start
    must not lose the cgroup its server is about to enter (a hub's 500, "Exception occurred in
    preexec_fn", when a stopped world's rank exited between that start's hook and its server)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes cgroups")
    pytest.importorskip("jupyterhub")
    try:
        parent = hub_module.make_cgroup_parent(f"ddphub-restart-{os.getpid()}")
    except memory_cgroup.Unavailable as why:
        pytest.skip(f"no memory cgroup here: {why}")
    lingering = None
    try:
        pre_spawn, post_stop = config_hooks(monkeypatch, parent)
        spawner = SimpleNamespace(user=SimpleNamespace(name="ddphub-a"))
        cgroup = parent / "jupyter-ddphub-a"
        pre_spawn(spawner)
        # a process of the stopped server that outlives the stop (a rank exiting) keeps it in use
        lingering = subprocess.Popen(["sleep", "60"])
        (cgroup / "cgroup.procs").write_text(str(lingering.pid))
        post_stop(spawner)
        time.sleep(0.3)  # the removal is waiting
        pre_spawn(spawner)  # the user's server starts again
        lingering.kill()
        lingering.wait(timeout=10)
        time.sleep(1.0)  # the removal tries every 0.1 s
        assert cgroup.is_dir(), "the cgroup of a server starting again was removed under it"
        server = subprocess.Popen(["sleep", "60"])  # what the spawner's preexec_fn does
        try:
            (cgroup / "cgroup.procs").write_text(str(server.pid))
        finally:
            server.kill()
            server.wait(timeout=10)
        # that server's stop removes it once it is empty
        post_stop(spawner)
        deadline = time.monotonic() + 30
        while cgroup.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not cgroup.exists(), "the user's cgroup outlived the server"
    finally:
        if lingering is not None and lingering.poll() is None:
            lingering.kill()
            lingering.wait(timeout=10)
        problems = hub_module.remove_cgroups(parent)
        assert not problems, problems


def test_the_idle_culler_stops_a_server_and_its_world_with_it(hub: Hub) -> None:
    name = next(iter(hub.users))
    user = hub.users[name]
    files_before = profile_files(user.home)
    hub.start_server(name)
    server_pid = hub.server_pid(name)
    assert server_pid is not None
    with hub.kernel(name) as kernel:
        world = start_world(kernel)
    # the tab is closed: no client, the kernel idle, the world up
    assert set(uids_of([world.kernel, *world.pids]).values()) == {user.uid}
    # the world's connection files, logs and engine registry are in its own folder, not the user's profile
    assert profile_files(user.home) - files_before == set(), "files of the world in the user's profile"
    ports = listening_ports(world.pids)
    assert ports, "the world listens on no port"
    timeout, every = culler_setting(hub.config, "timeout"), culler_setting(hub.config, "cull-every")
    cull = watch_the_cull(hub, name, [world.kernel, *world.pids], server_pid, timeout + every + 60)
    print(
        f"\nculled {cull.culled_at - cull.idle_since:.1f} s after the world was up (culler --timeout={timeout:.0f}); "
        f"from the cull: server process gone after {cull.server_gone:.2f} s, kernel after {cull.kernel_gone:.2f} s, "
        f"last process of the world after {cull.world_gone:.2f} s"
    )
    assert cull.world_gone < 10, f"the world outlived the cull by {cull.world_gone:.1f} s"
    assert profile_files(user.home) - files_before == set(), "files of the world left in the profile"
    assert listeners_on(ports) == [], "ports of the world still listening"
    # the world's own temporary folders (its key, the rank sockets, the warm-start template's): the
    # controller and the template remove them when they see the kernel gone, as they exit
    left = [str(path) for path in hub_module.files_of({user.uid}) if path.name.startswith(WORLD_TEMP_PREFIXES)]
    assert left == [], f"left in the temporary folder by the culled world: {left}"


@dataclass
class Cull:
    idle_since: float  # time.time() when the watch began (the world up, the tab closed)
    culled_at: float  # time.time() of the culler's "Culling server" line in the hub's log
    server_gone: float  # seconds from culled_at to the server process gone
    kernel_gone: float  # seconds from culled_at
    world_gone: float  # seconds from culled_at to the last process of the world gone


def watch_the_cull(hub: Hub, user: str, pids: list[int], server_pid: int, timeout: float) -> Cull:
    """Poll the hub and the processes until the server is stopped and every pid is gone; the
    cull is when the culler logged it (its decision, to the millisecond)."""
    began = time.time()
    watched = [server_pid, *pids]
    gone_at: dict[int, float] = {}  # when each pid was first seen gone (polled every 50 ms)
    deadline = time.monotonic() + timeout
    while True:
        now = time.time()
        gone_at.update({pid: now for pid in watched if pid not in gone_at and not pid_alive(pid)})
        if len(gone_at) == len(watched) and hub.server(user) is None:
            break
        if time.monotonic() > deadline:
            alive = sorted(set(watched) - set(gone_at))
            raise TimeoutError(f"{user}'s server not culled, or still alive: {alive}, after {timeout:.0f} s")
        time.sleep(0.05)
    culls = hub.log_times(rf"IdleCuller .*Culling server {user} ")
    assert len(culls) == 1, f"the idle culler did not stop {user}'s server (or not once): {culls}"
    assert hub.log_times(rf"DELETE /hub/api/users/{user}/server \(idle-culler@")

    def gone(*some: int) -> float:
        return max(gone_at[pid] for pid in some) - culls[0]

    return Cull(began, culls[0], gone(server_pid), gone(pids[0]), gone(*pids))


# ---------------------------------------------------------------------------------------------
# the live view in a browser, through the hub: chromium logs in on the hub's login page and opens
# a notebook in JupyterLab, then in Notebook 7, both served by the user's server behind the proxy

HUB_BROWSER_STEPS = 60
HUB_BROWSER_RUN_SECONDS = 150.0
HUB_BROWSER_CELL = f"""%%ddp
import time
torch.manual_seed(rank)
model = ddp_notebook.prepare_model(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
weights = torch.arange(8.0)
for step in ddp_notebook.progress(range({HUB_BROWSER_STEPS}), desc="step"):
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ weights)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ddp_notebook.log(loss=loss.item())
    time.sleep(0.2)  # slow enough to watch it live, on a loaded machine too
"""
# the frontends: the URL of a notebook in each (after /user/NAME/), what it is called in the artifacts
HUB_FRONTENDS = {"jupyterlab": "lab/tree/{file}", "notebook7": "notebooks/{file}"}
NO_NEWS_SETTINGS = '{"fetchNews": "false", "checkForUpdates": false}'
KERNEL_INFO_REPLY = "kernel_info_reply"  # in a frame of the kernel's websocket (text, or JupyterLab's bytes)
# the first cell's prompt is no longer "[ ]:": it is queued or ran
FIRST_CELL_RUNS_JS = """() => {
  const prompt = document.querySelector('.jp-Notebook .jp-Cell .jp-InputPrompt');
  return prompt !== null && prompt.innerText.trim() !== '' && !/\\[ \\]/.test(prompt.innerText);
}"""


def write_user_file(user: hub_module.HubUser, relative: str, text: str) -> Path:
    """A file in the user's home, owned by the user (and the folders made for it)."""
    import pwd

    gid = pwd.getpwnam(user.name).pw_gid
    path = user.home / relative
    for folder in reversed([p for p in path.parents if user.home in p.parents]):
        if not folder.exists():
            folder.mkdir()
            os.chown(folder, user.uid, gid)
    path.write_text(text)
    os.chown(path, user.uid, gid)
    return path


def live_notebook_text() -> str:
    from tests.support.jupyterlab_server import notebook_text

    return notebook_text(["%load_ext ddp_notebook\n%ddp_start 2", HUB_BROWSER_CELL, "%ddp_stop"])


def hub_login(page: Any, hub: Hub, user: str) -> None:
    """The hub's login page, filled in and sent as a person does."""
    page.goto(f"{hub.url}/hub/login", timeout=60_000)
    page.locator("#username_input").fill(user)
    page.locator("#password_input").fill(hub.user_password)
    page.locator("#login_submit").click()
    page.wait_for_url(lambda url: "/hub/login" not in url, timeout=60_000)


def run_live_notebook(page: Any, url: str, artifact: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Open the notebook at `url`, run all its cells, sample the page until the world is stopped;
    the last sample and every sample. A screenshot goes to test-artifacts/ either way."""
    import contextlib

    from tests.support.jupyterlab_server import ARTIFACTS, SNAPSHOT_JS

    samples: list[dict[str, Any]] = []
    kernel_ready: list[str] = []  # the kernel's websocket answered the page's kernel_info_request

    def received(url: str, frame: str | bytes) -> None:
        if KERNEL_INFO_REPLY in (frame if isinstance(frame, str) else frame.decode("latin-1")):
            kernel_ready.append(url)

    def watch(ws: Any) -> None:
        if "/channels" in ws.url:
            ws.on("framereceived", lambda frame: received(ws.url, frame))

    page.on("websocket", watch)
    try:
        page.goto(url, timeout=90_000)
        # the kernel connected: a Run All sent before that was dropped by JupyterLab (cells stayed "[ ]")
        deadline = time.monotonic() + 120
        while not kernel_ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{artifact}: the page's kernel did not answer over its websocket in 120 s")
            page.wait_for_timeout(100)
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=30_000)
        # JupyterLab's own dialog when its theme's stylesheet came late through a loaded hub's proxy
        # (the page works without it): a user clicks it away, as this does, before the menu
        theme_error = page.locator('.jp-Dialog[aria-label^="Error Loading Theme"]')
        if theme_error.count():
            print(f"{artifact}: JupyterLab said: {theme_error.first.get_attribute('aria-label')}; dismissed")
            theme_error.first.locator(".jp-Dialog-button").first.click(timeout=10_000)
            theme_error.first.wait_for(state="detached", timeout=10_000)
        page.get_by_role("menuitem", name="Run", exact=True).click(timeout=30_000)
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click(timeout=30_000)
        page.wait_for_function(FIRST_CELL_RUNS_JS, timeout=30_000)
        deadline = time.monotonic() + HUB_BROWSER_RUN_SECONDS
        while True:
            sample = page.evaluate(SNAPSHOT_JS)
            samples.append(sample)
            if "stopped the world" in sample["text"] or sample["errors"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the notebook did not finish in {HUB_BROWSER_RUN_SECONDS:g} s; last: {sample}")
            page.wait_for_timeout(100)
        page.wait_for_timeout(500)  # let plotly finish drawing before the picture
        final = page.evaluate(SNAPSHOT_JS)
        page.screenshot(path=ARTIFACTS / f"hub-{artifact}.png", full_page=True)
        return final, samples
    except BaseException:
        ARTIFACTS.mkdir(exist_ok=True)
        with contextlib.suppress(Exception):
            page.screenshot(path=ARTIFACTS / f"hub-{artifact}-failure.png", full_page=True)
        raise
    finally:
        page.remove_listener("websocket", watch)


def test_live_view_through_the_hub_in_jupyterlab_and_notebook7(hub: Hub, tmp_path: Path) -> None:
    import contextlib
    import importlib.util

    from tests.support.jupyterlab_server import ARTIFACTS, launch_chromium, missing_requirement

    reason = missing_requirement()
    if reason is None and importlib.util.find_spec("notebook") is None:
        reason = "notebook (Notebook 7) is not installed (pip install -e '.[test]')"
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    name = next(iter(hub.users))
    user = hub.users[name]
    # no news toast over the notebook (JupyterLab and Notebook 7 read the same settings)
    write_user_file(
        user,
        ".jupyter/lab/user-settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings",
        NO_NEWS_SETTINGS,
    )
    files = {frontend: f"hub-live-{frontend}.ipynb" for frontend in HUB_FRONTENDS}
    for file in files.values():
        write_user_file(user, file, live_notebook_text())
    console_errors: list[str] = []
    page_errors: list[str] = []
    results: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    began = time.monotonic()
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright, tmp_path / "chromium-profile")  # no cookie of the hub yet
            try:
                # started once the browser is up: a server idle for the culler's --timeout is culled
                hub.start_server(name)
                page = browser.new_page()
                page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda error: page_errors.append(f"{page.url}: {error.stack or error}"))
                try:
                    hub_login(page, hub, name)
                except BaseException:
                    with contextlib.suppress(Exception):
                        page.screenshot(path=ARTIFACTS / "hub-login-failure.png", full_page=True)
                    raise
                base = f"{hub.url}/user/{name}/"
                for frontend, path in HUB_FRONTENDS.items():
                    if frontend == "notebook7":  # Notebook 7's file browser first, as a person comes in
                        page.goto(base + "tree", timeout=90_000)
                        page.get_by_text(files[frontend]).first.wait_for(timeout=60_000)
                    results[frontend] = run_live_notebook(page, base + path.format(file=files[frontend]), frontend)
            finally:
                browser.close()
    finally:
        hub.stop_server(name)
    print(f"\nthe live view through the hub, JupyterLab and Notebook 7: {time.monotonic() - began:.0f} s")
    for error in page_errors:
        print(f"page error: {error}")

    for frontend, (final, samples) in results.items():
        assert final["errors"] == [], (frontend, final["errors"])
        assert final["views"] == 1, (frontend, final)
        labels = sorted(bar["label"].split("\n")[0].strip() for bar in final["bars"])
        assert labels == ["rank 0 · step", "rank 1 · step"], (frontend, final["bars"])
        assert all(bar["width"] == "100%" and bar["done"] for bar in final["bars"]), (frontend, final["bars"])
        assert all(f"{HUB_BROWSER_STEPS}/{HUB_BROWSER_STEPS}" in bar["label"] for bar in final["bars"]), frontend
        expected = [["loss", "rank 0", HUB_BROWSER_STEPS], ["loss", "rank 1", HUB_BROWSER_STEPS]]
        assert sorted(final["traces"]) == expected, (frontend, final["traces"])
        assert final["status"].count("done") == 2, (frontend, final["status"])
        # live: the curves grew and the bars filled while the cell ran
        growing = {max(trace[2] for trace in s["traces"]) for s in samples if s["traces"]}
        assert len([n for n in growing if 0 < n < HUB_BROWSER_STEPS]) >= 3, (frontend, sorted(growing))
        partial = {bar["width"] for s in samples for bar in s["bars"]} - {"0%", "100%", ""}
        assert len(partial) >= 3, (frontend, sorted(partial))
    assert list(results) == list(HUB_FRONTENDS)
    # the widgets' errors, in the console or thrown on the page (and by their stacks: the widgets' bundles);
    # Notebook 7.6 throws two of its own on these pages, printed above ("reading 'schema'" from its
    # shortcuts settings, "Command 'filebrowser:open-path' not registered"), as it does without a hub
    widget_words = ("widget", "plotly", "model", "state")
    widget_errors = [e for e in console_errors + page_errors if any(w in e.lower() for w in widget_words)]
    assert widget_errors == [], widget_errors
