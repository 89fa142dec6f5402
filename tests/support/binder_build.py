"""The Binder environment's build for tests/test_binder.py: repo2docker's steps 1-3, in a thread.

1. Python of the version in binder/runtime.txt: here the same version's interpreter from this
   machine (the test is skipped, saying so, where there is none).
2. The repository is copied in, and from its root  pip install -r binder/requirements.txt  runs
   (the local `.` line installs this package). Here: the files a clone would hold (tracked, and
   untracked ones not ignored) are copied to a temporary folder, a fresh `python -m venv` is made,
   and the same pip command runs from the copy's root, with nothing else installed first.
3. binder/postBuild runs once after the install (only if present).

The build is mostly pip on one core. tests/conftest.py starts it when the session starts, at the
lowest CPU priority (nice 19), so it takes only what the tests before the Binder test leave idle;
the test then waits for what is left of it, at normal priority where this user may raise it back.
Under `pytest -n` the controller starts it (which worker runs the test is known only then) and
hands the tour out once it has ended (`ended`, tests/support/parallel.py); should the tour be all
that is left before then, the worker that runs the test waits for it through its folder
(`BinderBuild.elsewhere`): the controller's build writes `built.json` or `failed.json` there when it
ends, and the pid of the step it runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: tests/support/ is two below
BINDER = ROOT / "binder"
VENV_SECONDS = 120
PIP_SECONDS = 480
POSTBUILD_SECONDS = 300
# a step's limit while the build runs beside other tests, at nice 19: they may leave it no CPU for
# long; once the test waits, what is left of the build (mostly pip) must end within WAIT_SECONDS
BACKGROUND_SECONDS = 3600
WAIT_SECONDS = PIP_SECONDS
# in the build's folder: how it ended, the step it runs now, and a waiting test's word to hurry
BUILT, FAILED, RUNNING, WANTED = "built.json", "failed.json", "running.pid", "wanted"
ELSEWHERE_POLL_SECONDS = 0.5


def runtime_python() -> str:
    """An interpreter of the Python version binder/runtime.txt names (python-X.Y)."""
    text = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(\d+)\.(\d+)(\.\d+)?", text)
    assert match, f"binder/runtime.txt should read python-X.Y, not {text!r}"
    wanted = (int(match.group(1)), int(match.group(2)))
    if sys.version_info[:2] == wanted:
        return sys.executable
    found = shutil.which(f"python{wanted[0]}.{wanted[1]}")
    if found is None:
        pytest.skip(f"binder/runtime.txt asks for Python {wanted[0]}.{wanted[1]}, which this machine lacks")
    return found


def copy_repository(target: Path) -> None:
    """Copy what a clone of the repository would hold (tracked files, and new files not ignored)."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell which files a clone (and so Binder) would have")
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not there
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def index_answers(url: str, seconds: float = 5.0) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 443), timeout=seconds):
            return True
    except OSError:
        return False


def drop_unreachable_indexes(requirements: Path) -> list[str]:
    """Comment out the extra indexes that do not answer from here; return their URLs."""
    dropped = []
    lines = requirements.read_text().splitlines()
    for number, line in enumerate(lines):
        option = re.match(r"\s*--extra-index-url[\s=]+(\S+)", line)
        if option and not index_answers(option.group(1)):
            dropped.append(option.group(1))
            lines[number] = f"# left out by tests/test_binder.py, unreachable from here: {line}"
    requirements.write_text("\n".join(lines) + "\n")
    return dropped


def run_checked(
    command: list[str],
    cwd: Path,
    env: dict[str, str],
    seconds: float,
    log: Path,
    started: threading.Event | None = None,
    running: list[subprocess.Popen[bytes]] | None = None,
    pid_file: Path | None = None,
) -> None:
    """Run a command in its own process group, output to `log`; kill the group if it overruns.
    `running` (if given) holds the process while it runs, for whoever must stop it early;
    `pid_file` (if given) names it to another process."""
    with log.open("ab") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        if running is not None:
            running[:] = [process]
        if pid_file is not None:
            pid_file.write_text(str(process.pid))
        try:
            code = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            pytest.fail(f"{' '.join(command[:4])} ... did not finish within {seconds:g} s; see {log}")
        finally:
            if running is not None:
                running.clear()
    if code != 0:
        tail = log.read_text(errors="replace")[-4000:]
        pytest.fail(f"{' '.join(command[:4])} ... exited with {code}:\n{tail}")


class BinderBuild:
    """The copy of the repository (`repo`), the venv built in it (`venv`, its python `python`),
    the environment the build ran in (`env`), the indexes left out (`dropped`), the build's log
    and seconds. `start` begins it in a thread; `wait` gives it back built, or raises what
    stopped it (a pytest skip or failure)."""

    def __init__(self, folder: Path, background: bool) -> None:
        self.folder = folder
        self.repo, self.venv, self.log = folder / "repo", folder / "venv", folder / "build.log"
        self.python = self.venv / "bin" / "python"
        self.dropped: list[str] = []
        self.seconds = 0.0
        self.env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_PROGRESS_BAR": "off"}
        for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            self.env.pop(name, None)
        self.env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"
        # pip's temporary files stay in the build's folder: tests that look at the shared one
        # may run meanwhile
        self._build_env = {**self.env, "TMPDIR": str(folder / "tmp")}
        self._background = background
        self._running: list[subprocess.Popen[bytes]] = []
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="binder-build", daemon=True)

    def start(self) -> BinderBuild:
        self._thread.start()
        return self

    @classmethod
    def elsewhere(cls, folder: Path) -> BinderBuild:
        """The build another process of this session runs in `folder` (the controller of `-n`):
        `wait` waits for its end there, asking it to hurry."""
        build = cls(folder, background=True)  # until its test waits
        build._thread = threading.Thread(target=build._follow, name="binder-build-elsewhere", daemon=True)
        return build.start()

    def _follow(self) -> None:
        try:
            while not self._stopping:
                if (self.folder / FAILED).exists():
                    ended = json.loads((self.folder / FAILED).read_text())
                    (pytest.skip if ended["kind"] == "skip" else pytest.fail)(ended["message"])
                if (self.folder / BUILT).exists():
                    built = json.loads((self.folder / BUILT).read_text())
                    self.dropped, self.seconds = built["dropped"], built["seconds"]
                    return
                if not self._background and not (self.folder / WANTED).exists():
                    (self.folder / WANTED).touch()  # the steps still to come run at normal priority
                    self._hurry(self.folder / RUNNING)
                time.sleep(ELSEWHERE_POLL_SECONDS)
            raise RuntimeError("the wait for the Binder environment's build was stopped")
        except BaseException as error:  # noqa: BLE001  (a skip or a failure too: raised again in wait)
            self._error = error

    def ended(self) -> bool:
        """Whether the build has ended, built or not (read from its folder: any process may ask)."""
        return (self.folder / BUILT).exists() or (self.folder / FAILED).exists()

    @staticmethod
    def _hurry(pid_file: Path) -> None:
        try:  # raising a priority back needs CAP_SYS_NICE
            os.setpriority(os.PRIO_PGRP, int(pid_file.read_text()), 0)
        except (OSError, ValueError):
            pass

    def wait(self, seconds: float = WAIT_SECONDS) -> BinderBuild:
        """The built environment, once what is left of the build has run (at most `seconds`)."""
        self._background = False  # the steps still to come run at normal priority
        for process in list(self._running):
            try:  # and the one running now: raising a priority back needs CAP_SYS_NICE
                os.setpriority(os.PRIO_PGRP, process.pid, 0)
            except OSError:
                pass
        self._thread.join(seconds)
        if self._thread.is_alive():
            self.stop()
            pytest.fail(f"the Binder environment's build did not finish within {seconds:g} s; see {self.log}")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """End the build where it is (its command's whole process group)."""
        self._stopping = True
        for process in list(self._running):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._thread.join(60)

    def _step(self, command: list[str], seconds: float) -> None:
        if self._stopping:
            raise RuntimeError("the Binder environment's build was stopped")
        if self._background and not (self.folder / WANTED).exists():
            command, seconds = ["nice", "-n", "19", *command], BACKGROUND_SECONDS
        run_checked(
            command,
            self.repo,
            self._build_env,
            seconds,
            self.log,
            running=self._running,
            pid_file=self.folder / RUNNING,
        )

    def _build(self) -> None:
        try:
            python = runtime_python()
            self.repo.mkdir(parents=True)
            (self.repo.parent / "tmp").mkdir()
            copy_repository(self.repo)
            self.dropped = drop_unreachable_indexes(self.repo / "binder" / "requirements.txt")
            began = time.monotonic()
            self._step([python, "-m", "venv", str(self.venv)], VENV_SECONDS)
            self._step([str(self.python), "-m", "pip", "install", "-r", "binder/requirements.txt"], PIP_SECONDS)
            post_build = self.repo / "binder" / "postBuild"
            if post_build.exists():
                os.chmod(post_build, 0o755)
                self._step([str(post_build)], POSTBUILD_SECONDS)
            self.seconds = time.monotonic() - began
            (self.folder / BUILT).write_text(json.dumps({"dropped": self.dropped, "seconds": self.seconds}))
        except BaseException as error:  # noqa: BLE001  (a skip or a failure too: raised again in wait)
            self._error = error
            kind = "skip" if isinstance(error, pytest.skip.Exception) else "fail"
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / FAILED).write_text(json.dumps({"kind": kind, "message": str(error)}))
