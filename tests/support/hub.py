"""A real JupyterHub on this machine, with real Linux users, for tests of ddp_notebook under a hub.

Not a test file: a context manager, a fixture and a small client for tests/test_jupyterhub.py. It
needs root (CI is root), `jupyterhub` and `jupyterhub-idle-culler` (the `test` extra) and
`configurable-http-proxy` (npm; .ci/install adds it); without them it skips with the reason.

- `running_hub()` -> Hub: creates the Linux users `ddphub-a` and `ddphub-b` (`useradd
  --create-home`), writes the `jupyterhub_config.py` of docs/jupyterhub.md ("A hub to try it
  on", read from the page, so the page shows what runs) into a temporary folder and starts
  `jupyterhub` there, its proxy, API and hub on free ports of 127.0.0.1. The hub starts each
  user's server with its default LocalProcessSpawner, as that user; the idle culler runs as a
  hub-managed service.
- `Hub.start_server(user)`, `Hub.stop_server(user)`, `Hub.user_token(user)`: the hub's REST API
  with the admin service's token.
- `Hub.kernel(user)` -> HubKernel: a kernel made through the user's server (`POST
  /user/NAME/api/kernels`, through the proxy, with a token of that user), driven over its
  websocket (`/user/NAME/api/kernels/ID/channels`) with the Jupyter message protocol, as a
  browser does; `HubKernel.run(code)` collects the output.
- fixture: `hub` (module scope: one hub for the tests of a module).

The interpreter lives under /root (mode 0700), which the users cannot enter. Rather than opening
/root (`chmod o+x` would let every local user in, and stays open if the run is killed), the hub
runs in a private mount namespace (`unshare --mount`) where the 0700 folders above the
interpreter are replaced by an empty tmpfs holding only the interpreter's folder, bind-mounted at
its own path: every path (sys.executable, the scripts' #! lines, libpython's rpath) stays valid for
the hub, its proxy and services, the users' servers, kernels and ranks, and nothing changes
outside that namespace, which ends with its last process. The editable install points at the
checkout (/work/main here), which every user can read already.

Teardown stops the hub (it stops the servers, proxy and services), then stops what is left in its
namespace or runs as a test user (and fails the test if anything was left), removes what the users
left in /tmp, /var/tmp and /dev/shm, and the users with their homes. A run killed before its
teardown is cleaned up by the next one (records in /tmp/ddp-hub).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import requests

from tests.support import memory_cgroup
from tests.support.kernel import CellOutput
from tests.support.run_records import RunRecord, left_after, locked, reap_stale_runs, start_time, stop_pids

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: tests/support/ is two below
HUB_DOC = ROOT / "docs" / "jupyterhub.md"
HUB_DOC_SECTION = "A hub to try it on"
USERS = ("ddphub-a", "ddphub-b")
STATE_DIR = Path(tempfile.gettempdir()) / "ddp-hub"
# each user's server, its kernels and their worlds share this much memory (a cgroup per user)
MEMORY_LIMIT = 1280 * 2**20  # 2 ranks fit, 4 do not (at 340 MiB a rank, the estimate)
HUB_COMMAND = (sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py")
HUB_START_SECONDS = 90.0
REQUIRED_TOOLS = ("configurable-http-proxy", "useradd", "userdel", "unshare", "mount")
BROWSER_POLL_SECONDS = 5.0  # JupyterLab polls the server's kernels this often while a tab is open


# ---------------------------------------------------------------------------------------------
# the configuration, from the docs


def hub_config_text() -> str:
    """The `jupyterhub_config.py` block of docs/jupyterhub.md, as written there."""
    text = HUB_DOC.read_text()
    section = text.split(f"## {HUB_DOC_SECTION}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(# jupyterhub_config\.py\n.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"{HUB_DOC.name}: no single jupyterhub_config.py block under '## {HUB_DOC_SECTION}'"
    return blocks[0]


def culler_setting(config: str, option: str) -> float:
    """A number given to jupyterhub_idle_culler in `config` (`--timeout=20` -> 20.0)."""
    match = re.search(rf'"--{option}=(\d+)"', config)
    assert match, f"the hub config gives the culler no --{option}"
    return float(match.group(1))


# ---------------------------------------------------------------------------------------------
# processes


def mount_namespace(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/mnt")
    return None


def processes_of(uids: set[int], namespace: str | None, since: float) -> dict[int, float | None]:
    """Live processes that run as one of `uids`, or in the mount namespace `namespace` and
    started at `since` or later (a namespace's id can be reused once it is gone): pid -> start."""
    if namespace == mount_namespace(os.getpid()):
        namespace = None  # never this process's own (the machine's): only the hub's private one
    found: dict[int, float | None] = {}
    for process in psutil.process_iter(["uids", "create_time", "status"]):
        if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        ours = process.info["uids"] is not None and process.info["uids"].real in uids
        # psutil's start times can be off by a second from time.time(): a few seconds of slack
        if not ours and namespace is not None and (process.info["create_time"] or 0) >= since - 5.0:
            ours = mount_namespace(process.pid) == namespace
        if ours:
            found[process.pid] = process.info["create_time"]
    return found


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# what the hub needs here


def require_hub() -> None:
    """Skip, with the reason, where a hub with real users cannot run."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates Linux users and runs a hub that spawns servers as them")
    for module, package in (("jupyterhub", "jupyterhub"), ("jupyterhub_idle_culler", "jupyterhub-idle-culler")):
        if _missing_module(module):
            pytest.skip(f"needs {package} (pip install -e '.[test]')")
    missing = [tool for tool in REQUIRED_TOOLS if not _tool(tool)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (installed by .ci/install)")
    unreachable = _package_outside_this_folder()
    if unreachable:
        pytest.fail(unreachable, pytrace=False)


def _package_outside_this_folder() -> str:
    """Why the users' kernels would not import ddp_notebook ('' if they would): they start outside
    this checkout, where only the installed package is found (an editable install that points to a
    folder since moved fails there, in every user's traceback)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import ddp_notebook"], cwd="/", capture_output=True, text=True, timeout=60
    )
    if probe.returncode == 0:
        return ""
    said = (probe.stderr.strip().splitlines() or ["?"])[-1]
    return f"the hub's users could not import ddp_notebook outside this folder ({said}): pip install -e . here"


def _missing_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def _tool(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"]))


def _closed_ancestor(path: Path) -> Path | None:
    """The topmost folder above `path` that other users cannot enter (no o+x), if any."""
    for folder in reversed(path.parents):
        if folder != Path("/") and not folder.stat().st_mode & 0o001:
            return folder
    return None


def interpreter_paths() -> list[Path]:
    """The folders the users' processes need from this interpreter: its prefixes."""
    paths = {Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    return sorted(p for p in paths if not any(other != p and other in p.parents for other in paths))


def namespace_command(stage: Path) -> list[str]:
    """`unshare` + a script that hides each closed folder above the interpreter behind a tmpfs
    showing only the interpreter's folders, then execs its arguments (the pid stays the same).
    With nothing to hide it only makes the namespace, which still tells the hub's processes apart."""
    lines = ["set -e"]
    moves = []
    closed: set[Path] = set()
    for index, path in enumerate(interpreter_paths()):
        top = _closed_ancestor(path)
        if top is None:
            continue
        closed.add(top)
        (stage / str(index)).mkdir()
        target, staged = shlex.quote(str(path)), shlex.quote(str(stage / str(index)))
        lines.append(f"mount --bind {target} {staged}")
        moves.append(f"mkdir -p {target} && mount --move {staged} {target}")
    lines += [f"mount -t tmpfs -o mode=0755,size=1m ddphub {shlex.quote(str(top))}" for top in sorted(closed)]
    lines += moves
    lines.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh"]


# ---------------------------------------------------------------------------------------------
# run records: what a run created, so a later run can clean up after one that was killed


@dataclass
class _Record(RunRecord):
    state_dir: ClassVar[Path] = STATE_DIR
    pid_maps: ClassVar[tuple[str, ...]] = ("hub",)
    users: list[str] = field(default_factory=list)
    namespace: str | None = None
    folder: str | None = None  # the hub's folder: its config, database and log
    hub: dict[int, float | None] = field(default_factory=dict)  # the hub's pid -> start time
    started: float = field(default_factory=time.time)
    cgroup: str | None = None  # the memory cgroup the users' cgroups are made in


def _uids(users: list[str]) -> set[int]:
    uids = set()
    for user in users:
        with contextlib.suppress(KeyError):
            uids.add(pwd.getpwnam(user).pw_uid)
    return uids


def files_of(uids: set[int]) -> list[Path]:
    """What the users of `uids` left at the top of the shared temporary folders (their homes go
    with them): torch's caches, folders of worlds that ended without their kernel's %ddp_stop."""
    found = []
    for folder in {Path(tempfile.gettempdir()), Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")}:
        with contextlib.suppress(OSError):
            found += [path for path in folder.iterdir() if path.lstat().st_uid in uids]
    return sorted(found)


def _remove(record: _Record) -> list[str]:
    """Stop the processes, remove the files and the users of `record`; what could not be done."""
    problems = []
    uids = _uids(record.users)
    left = stop_pids({**record.hub, **processes_of(uids, record.namespace, record.started)})
    if left:
        problems.append(f"processes still alive: {left}")
    for path in files_of(uids) if uids else []:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for user in record.users:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(user)
            result = _run("userdel", "--remove", user, check=False)
            if result.returncode not in (0, 12):  # 12: the home folder was gone already
                problems.append(f"userdel {user}: {result.stderr.strip()}")
    if record.cgroup:
        problems += remove_cgroups(Path(record.cgroup))
    if record.folder:
        shutil.rmtree(record.folder, ignore_errors=True)
    return problems


def _make_cgroup_parent(record: _Record) -> Path:
    """A memory cgroup the config makes each user's in (v2: with memory delegated to them)."""
    return make_cgroup_parent(f"ddphub-{record.run_id}", record)


def make_cgroup_parent(name: str, record: _Record | None = None) -> Path:
    """A memory cgroup for the config's per-user cgroups (v2: with memory delegated to them);
    noted in `record`, if given, before anything can fail."""
    cgroup, _ = memory_cgroup.make(name)
    if record is not None:
        record.cgroup = str(cgroup.directory)
        record.save()
    if cgroup.version == 2:
        try:
            (cgroup.directory / "cgroup.subtree_control").write_text("+memory")
        except OSError as failure:
            memory_cgroup.remove(cgroup.directory)
            raise memory_cgroup.Unavailable(f"cannot delegate memory below {cgroup.directory}: {failure}") from None
    return cgroup.directory


def remove_cgroups(parent: Path) -> list[str]:
    """Each user's cgroup (the config's post-stop hook removes it, a killed run does not), then the parent."""
    problems = []
    for folder in [*(child for child in parent.glob("jupyter-*") if child.is_dir()), parent]:
        try:
            memory_cgroup.remove(folder)
        except memory_cgroup.Unavailable as failure:
            problems.append(str(failure))
    return problems


def _remove_orphaned_home(user: str) -> None:
    """A home of `user` left by a run killed between its userdel and the home's removal: owned by
    a uid no user has now, it would keep the new user (another uid) out of its own home."""
    home = Path("/home") / user
    try:
        owner = home.lstat().st_uid
    except FileNotFoundError:
        return
    try:
        pwd.getpwuid(owner)
    except KeyError:
        shutil.rmtree(home)
        return
    pytest.skip(f"{home} exists already and belongs to an existing user (uid {owner}), not to this run")


def _create_users(record: _Record) -> list[pwd.struct_passwd]:
    created = []
    for user in USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(user)
            pytest.skip(f"the Linux user {user} exists already and is not this run's")
        _remove_orphaned_home(user)
        record.users.append(user)
        record.save()
        _run("useradd", "--create-home", "--shell", "/bin/bash", "--comment", "ddp_notebook hub test", user)
        created.append(pwd.getpwnam(user))
    return created


# ---------------------------------------------------------------------------------------------
# the hub and its client


@dataclass
class HubUser:
    name: str
    uid: int
    home: Path


@dataclass
class CellResult:
    text: str  # stream text, execute_result / display_data text/plain, error tracebacks
    error: str | None  # the error's ename, None if the cell succeeded
    sent: float  # time.time() when the request went out
    done: float  # time.time() when the kernel went idle


class Hub:
    """A running hub: its URLs, the admin service's token, its users, its log."""

    def __init__(
        self,
        url: str,
        admin_token: str,
        users: list[HubUser],
        config: str,
        log: Path,
        pid: int,
        user_password: str = "",
    ) -> None:
        self.url = url  # the proxy's public URL: what a browser opens
        self.admin_token = admin_token
        self.users = {user.name: user for user in users}
        self.config = config
        self.log = log
        self.pid = pid
        self.user_password = user_password  # the users' shared password of the login page
        self.namespace = mount_namespace(pid)
        self.memory_limit = MEMORY_LIMIT  # bytes, each server's cgroup (where one could be made)
        self.cgroup_parent: Path | None = None  # the users' cgroups are in it, jupyter-<name>
        self.no_cgroup = ""  # why no cgroup could be made here, if so

    def api(self, method: str, path: str, token: str | None = None, timeout: float = 30, **kwargs: Any) -> Any:
        """A request to the hub's REST API (`/hub/api` + path); the JSON answer, or None."""
        response = requests.request(
            method,
            f"{self.url}/hub/api{path}",
            headers={"Authorization": f"token {token or self.admin_token}"},
            timeout=timeout,
            **kwargs,
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def server(self, user: str) -> dict[str, Any] | None:
        """The hub's model of the user's default server; None when it has none."""
        return self.api("GET", f"/users/{user}")["servers"].get("")

    def start_server(self, user: str, timeout: float = 150) -> dict[str, Any]:
        response = requests.post(
            f"{self.url}/hub/api/users/{user}/server",
            headers={"Authorization": f"token {self.admin_token}"},
            timeout=30,
        )
        if response.status_code not in (201, 202, 400):  # 400: it runs already
            said = f"{response.status_code} {response.text[:500]}"
            raise RuntimeError(f"the hub refused to start {user}'s server: {said}\n{self.log_tail()}")
        return self._wait_for_server(user, lambda s: s is not None and s["ready"], timeout, "ready")

    def stop_server(self, user: str, timeout: float = 60) -> None:
        response = requests.delete(
            f"{self.url}/hub/api/users/{user}/server",
            headers={"Authorization": f"token {self.admin_token}"},
            timeout=30,
        )
        if response.status_code not in (202, 204, 400):  # 400: not running
            response.raise_for_status()
        self._wait_for_server(user, lambda s: s is None, timeout, "stopped")

    def _wait_for_server(self, user: str, done: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            server = self.server(user)
            if done(server):
                return server
            if time.monotonic() > deadline:
                raise TimeoutError(f"{user}'s server not {what} within {timeout} s: {server}\n{self.log_tail()}")
            time.sleep(0.3)

    def user_token(self, user: str) -> str:
        """A new API token of `user` (what the browser's session holds)."""
        return self.api("POST", f"/users/{user}/tokens", json={"note": "ddp_notebook test", "expires_in": 3600})[
            "token"
        ]

    @contextlib.contextmanager
    def kernel(self, user: str) -> Iterator[HubKernel]:
        kernel = HubKernel(self, user, self.user_token(user))
        try:
            yield kernel
        finally:
            kernel.close()

    def server_pid(self, user: str) -> float | None:
        """The pid of the user's single-user server process, from the processes running as them."""
        for process in psutil.process_iter(["uids", "cmdline"]):
            cmdline = process.info["cmdline"] or []
            if process.info["uids"] and process.info["uids"].real == self.users[user].uid:
                if "jupyterhub.singleuser" in cmdline:
                    return process.pid
        return None

    def log_times(self, pattern: str) -> list[float]:
        """time.time() of each hub log line matching `pattern` (a regular expression)."""
        times = []
        for line in self.log.read_text(errors="replace").splitlines():
            stamp = re.match(r"\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ", line)
            if stamp and re.search(pattern, line):
                times.append(datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp())
        return times

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class HubKernel:
    """A kernel of `user`'s server, made and driven through the proxy as a browser does."""

    def __init__(self, hub: Hub, user: str, token: str) -> None:
        import websocket

        self.hub, self.user, self.token = hub, user, token
        self.base = f"{hub.url}/user/{user}/api"
        self.session = uuid.uuid4().hex
        self.id = self._request("POST", "/kernels", json={"name": "python3"})["id"]
        ws_url = self.base.replace("http://", "ws://", 1) + f"/kernels/{self.id}/channels?session_id={self.session}"
        self.ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"], timeout=60)
        # an open tab polls the kernel's model on a timer of its own, cell or no cell: activity
        # the hub sees, so the idle culler leaves the server of an open tab alone
        self._tab_closed = threading.Event()
        self._poller = threading.Thread(target=self._poll_like_a_browser, daemon=True, name=f"tab of {user}")
        self._poller.start()
        self.run("pass", timeout=120)  # the kernel answers: it is ready

    def _request(self, method: str, path: str, timeout: float = 60, **kwargs: Any) -> Any:
        response = requests.request(
            method, self.base + path, headers={"Authorization": f"token {self.token}"}, timeout=timeout, **kwargs
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def _poll_like_a_browser(self) -> None:
        """GET the kernel's model every few seconds until the tab is closed, as JupyterLab does."""
        while not self._tab_closed.wait(BROWSER_POLL_SECONDS):
            with contextlib.suppress(requests.RequestException):  # a stopped server: the test says so
                self._request("GET", f"/kernels/{self.id}", timeout=BROWSER_POLL_SECONDS)

    def run(self, code: str, timeout: float = 120) -> CellResult:
        """Execute `code`; what it printed and showed, and its error's name (None if none)."""
        from websocket import WebSocketTimeoutException

        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps(_execute_request(code, msg_id, self.session, self.user)))
        sent = time.time()
        deadline = time.monotonic() + timeout
        output = CellOutput()
        self.ws.settimeout(1.0)
        while True:
            if time.monotonic() > deadline:
                so_far = "".join(output.text)
                raise TimeoutError(f"{self.user}: cell did not finish within {timeout} s; so far:\n{so_far}")
            try:
                msg = json.loads(self.ws.recv())
            except WebSocketTimeoutException:
                continue
            if msg.get("channel") != "iopub" or msg["parent_header"].get("msg_id") != msg_id:
                continue
            if output.take(msg["msg_type"], msg["content"]):
                return CellResult("".join(output.text), output.error, sent, time.time())

    def close(self) -> None:
        """Close the websocket (the tab is closed); the kernel keeps running."""
        self._tab_closed.set()
        self._poller.join(timeout=BROWSER_POLL_SECONDS + 5)
        with contextlib.suppress(Exception):
            self.ws.close()


def _execute_request(code: str, msg_id: str, session: str, user: str) -> dict[str, Any]:
    """An execute_request as JupyterLab sends it over the kernel's websocket (JSON frames)."""
    return {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "session": session,
            "username": user,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        "channel": "shell",
        "buffers": [],
    }


# ---------------------------------------------------------------------------------------------
# starting and stopping


def _hub_environment(users: list[str], ports: dict[str, int], admin_token: str) -> dict[str, str]:
    """What the config of docs/jupyterhub.md reads, on top of this process's environment."""
    env = dict(os.environ)
    env.update({name: str(port) for name, port in ports.items()})
    env.update(
        {
            "HUB_USERS": ",".join(users),
            "HUB_USER_PASSWORD": secrets.token_urlsafe(24),
            "HUB_ADMIN_TOKEN": admin_token,
            "CONFIGPROXY_AUTH_TOKEN": secrets.token_hex(32),
        }
    )
    # the servers see the interpreter's folder first on their PATH (pyenv's shims are hidden)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
    return env


def _wait_for_api(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/hub/api", timeout=5).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {process.returncode}" if process.poll() is not None else f"no answer in {timeout} s"
            raise RuntimeError(f"jupyterhub {state}:\n{log.read_text(errors='replace')[-6000:]}")
        time.sleep(0.3)


# the hub stops each server (up to its spawner's 10 + 5 + 5 s of signals, the servers' worlds
# ending with them), then its proxy and services; on a loaded machine that took over 30 s, and a
# hub killed then leaves its proxy and idle culler running
HUB_STOP_SECONDS = 90.0


def _stop_hub(process: subprocess.Popen[bytes], seconds: float = HUB_STOP_SECONDS) -> str:
    """SIGTERM: the hub stops the servers, the proxy and its services, then exits; how it went."""
    if process.poll() is not None:
        return f"the hub had exited ({process.returncode})"
    began = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        return f"the hub did not stop within {seconds:.0f} s of its SIGTERM and was killed"
    return f"the hub stopped in {time.monotonic() - began:.1f} s"


@contextlib.contextmanager
def running_hub() -> Iterator[Hub]:
    """A hub with the users of USERS, from the config of docs/jupyterhub.md; see the module's doc."""
    require_hub()
    with locked(STATE_DIR):
        reap_stale_runs(_Record, _remove)
        folder = Path(tempfile.mkdtemp(prefix="ddp-hub-"))  # 0700: the config's secrets stay root's
        record = _Record(secrets.token_hex(4), folder=str(folder))
        record.save()
    failure: BaseException | None = None
    process: subprocess.Popen[bytes] | None = None
    leftover: dict[int, str] = {}
    try:
        users = [HubUser(u.pw_name, u.pw_uid, Path(u.pw_dir)) for u in _create_users(record)]
        config = hub_config_text()
        (folder / "jupyterhub_config.py").write_text(config)
        (folder / "stage").mkdir()
        ports = {name: free_port() for name in ("HUB_PUBLIC_PORT", "HUB_PORT", "HUB_PROXY_API_PORT")}
        admin_token = secrets.token_hex(32)
        log = folder / "jupyterhub.log"
        env = _hub_environment([u.name for u in users], ports, admin_token)
        cgroup_parent, no_cgroup = None, ""
        try:
            cgroup_parent = _make_cgroup_parent(record)
            env.update({"HUB_CGROUP_PARENT": str(cgroup_parent), "HUB_MEMORY_LIMIT": str(MEMORY_LIMIT)})
        except memory_cgroup.Unavailable as failure:
            no_cgroup = str(failure)  # the hub runs without limits; the limits test says why it skips
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [*namespace_command(folder / "stage"), *HUB_COMMAND],
                cwd=folder,  # the hub's database, cookie secret and proxy pid file go here
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        record.hub[process.pid] = start_time(process.pid)
        record.save()
        url = f"http://127.0.0.1:{ports['HUB_PUBLIC_PORT']}"
        _wait_for_api(url, process, log, HUB_START_SECONDS)
        record.namespace = mount_namespace(process.pid)  # unshare has run: the hub's own
        record.save()
        running = Hub(url, admin_token, users, config, log, process.pid, env["HUB_USER_PASSWORD"])
        running.cgroup_parent, running.no_cgroup = cgroup_parent, no_cgroup
        yield running
    except BaseException as exc:
        failure = exc
        raise
    finally:
        stopping = _stop_hub(process) if process is not None else "no hub"
        # the worlds of servers stopped with the hub exit by themselves within seconds
        leftover = left_after(
            lambda: {
                pid: _describe(pid) for pid in processes_of(_uids(record.users), record.namespace, record.started)
            },
            20.0,
            0.2,
        )
        problems = _remove(record)
        if not problems:
            record.path.unlink(missing_ok=True)
        if failure is None and (problems or leftover):
            raise AssertionError(f"hub: processes outlived its stop {leftover} (stopped now; {stopping}); {problems}")


def _describe(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline())[:200]
    return "?"


@pytest.fixture(scope="module")
def hub() -> Iterator[Hub]:
    """One hub for the tests of a module."""
    with running_hub() as running:
        yield running


def run_in_threads(*jobs: Any, timeout: float) -> list[Any]:
    """Run each callable in its own thread at once; their results, or the first error raised."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def call(index: int, job: Any) -> None:
        try:
            results[index] = job()
        except BaseException as error:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"threads still running after {timeout} s")
    return results


if __name__ == "__main__":  # python3 tests/support/hub.py: bring a hub up, print how to reach it
    with running_hub() as running:
        print(f"hub at {running.url}; admin token {running.admin_token}; users {', '.join(running.users)}")
        print(f"log: {running.log}    (Enter to tear down)")
        sys.stdin.readline()
