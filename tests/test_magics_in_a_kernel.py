"""The magics' wording in a real Jupyter kernel: the options' old spellings still work and say the
new one (on stderr, once per kernel), and a magic that takes nothing says so in one wording."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.kernel import Kernel
from tests.support.processes import wait_gone

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Printed:
    stdout: str
    stderr: str  # a magic's misuse is here too, as the notebook shows it: `UsageError: ...`
    error: str  # an exception's name and message ('' when there was none)

    def lines(self) -> list[str]:
        return self.stderr.splitlines()


def run(kernel: Kernel, code: str, timeout: float = 120) -> Printed:
    """Run `code`; what it printed on each stream, apart, and its error."""
    msg_id = kernel.client.execute(code)
    streams = {"stdout": "", "stderr": ""}
    error = ""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{code!r} did not finish within {timeout} s; it printed {streams}")
        try:
            msg = kernel.client.get_iopub_msg(timeout=min(left, 1.0))
        except Exception:  # noqa: BLE001  (queue.Empty: nothing yet)
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if msg["msg_type"] == "stream":
            streams[content["name"]] += content["text"]
        elif msg["msg_type"] == "error":
            error = f"{content['ename']}: {content['evalue']}"
        elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
            return Printed(streams["stdout"], streams["stderr"], error)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    started = Kernel(cwd=str(tmp_path_factory.mktemp("notebook")))  # a folder without job records
    try:
        assert run(started, "%load_ext ddp_notebook").error == ""
        yield started
    finally:
        started.close()


NOTE = "note: {old} is spelled {new} now (the old spelling still works)"


@pytest.mark.parametrize(
    ("line", "old", "new", "message"),
    [
        # each old spelling reaches what the new one does: the same check answers
        ("%ddp_start 2 --timeout 0", "--timeout", "--collective-timeout", "timeout must be a number of seconds"),
        (
            "%ddp_attach --profile /nonexistent-profile --cluster-id c1",
            "--profile",
            "--ipp-profile",
            "nonexistent-profile/security/ipcontroller-c1-client.json: is the cluster running?",
        ),
        (
            "%ddp_jobs --log 1 --follow --timeout=0",
            "--timeout",
            "--follow-timeout",
            "--follow-timeout must be a number of seconds > 0, got 0",
        ),
    ],
)
def test_an_old_spelling_works_and_says_the_new_one_once(
    kernel: Kernel, line: str, old: str, new: str, message: str
) -> None:
    note = NOTE.format(old=old, new=new)
    first = run(kernel, line)
    assert len(first.lines()) == 2 and first.lines()[0] == note, first
    assert first.lines()[1].startswith("UsageError: ") and message in first.lines()[1], first
    assert first.stdout == "" and first.error == "", first
    again = run(kernel, line)
    assert again.lines() == first.lines()[1:], again  # the note said once in this kernel


def test_the_old_spellings_start_the_world_the_new_ones_do(kernel: Kernel) -> None:
    """`--timeout` on %ddp_start (noted once above) is the collective timeout, as `--collective-timeout` is."""
    started = run(kernel, "%ddp_start 2 --backend gloo --timeout 45 --start-timeout 120", timeout=240)
    pids: list[int] = []
    try:
        assert started.error == "" and "DDP world ready: 2 ranks, gloo" in started.stdout, started
        shown = run(
            kernel,
            "import json\n"
            "world = get_ipython().magics_manager.registry['DDPMagics'].world\n"
            "print(json.dumps([world.config.timeout, world.all_pids]))",
        )
        timeout, pids = json.loads(shown.stdout.strip().splitlines()[-1])
        assert timeout == 45.0
        # the same world asked for with the new spelling: nothing to do
        again = run(kernel, "%ddp_start 2 --backend gloo --collective-timeout 45 --start-timeout 120")
        assert again.stderr == again.error == "" and "already running; nothing to do" in again.stdout, again
    finally:
        stopped = run(kernel, "%ddp_stop", timeout=120)
    assert "stopped the world of 2 ranks" in stopped.stdout, stopped
    assert len(pids) >= 2 and wait_gone(pids) == []


@pytest.mark.parametrize("magic", ["ddp_stop", "ddp_restart", "ddp_rollback", "ddp_status", "ddp_metrics"])
def test_a_magic_that_takes_nothing_says_so_in_one_wording(kernel: Kernel, magic: str) -> None:
    refused = run(kernel, f"%{magic} now please")
    assert refused.lines() == [f"UsageError: %{magic} takes no arguments, got 'now please'"], refused
    assert refused.stdout == refused.error == "", refused
