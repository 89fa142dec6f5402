"""The X-ray's messages: typed, versioned, and a request of another version answered with why.

A real rank-side server (`rank.xray.serve`, in a process of its own) and the notebook's real
`cell.xray.ask` over its Unix socket; a stand-in server only where it must answer wrongly."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_notebook.cell.xray import Reach, ask
from ddp_notebook.wire import xray as xray_wire
from ddp_notebook.wire import xray_messages as messages

SERVER = (
    "import sys, time\n"
    "import torch  # a rank has it imported before it answers\n"
    "from ddp_notebook.rank import xray\n"
    "xray.serve(sys.argv[1], 0)\n"
    "def waiting_here():\n"
    "    print('ready', flush=True)  # from in here: the stack asked for at once is already here\n"
    "    time.sleep(120)\n"
    "waiting_here()\n"
)


@pytest.fixture(scope="module")
def rank_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("xray")
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield directory
    finally:
        process.kill()
        process.wait(timeout=10)


def _raw(directory: Path, request: object) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5)
        connection.connect(str(xray_wire.socket_path(str(directory), 0)))
        connection.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(connection.makefile("r", encoding="utf8").readline())  # type: ignore[no-any-return]


def test_every_request_is_answered_in_its_typed_shape(rank_server: Path) -> None:
    reach = Reach(str(rank_server))
    stack: messages.StackAnswer = ask(reach, 0, messages.stack_request())
    assert stack["v"] == messages.XRAY_VERSION
    assert any(function == "waiting_here" for _, _, function in stack["frames"])
    report: messages.ReportAnswer = ask(reach, 0, messages.report_request(full=True))
    assert set(messages.ReportAnswer.__annotations__) == set(report)  # every field, no other
    assert report["entries"] == [] and report["debugger"] is None and report["memory"]["rss"] > 0
    released: messages.ReleaseAnswer = ask(reach, 0, messages.release_request())
    assert released == {"v": messages.XRAY_VERSION, "released": 0}  # no group: nothing to shut
    debug: messages.DebugAnswer = ask(reach, 0, messages.debug_request(None))
    assert debug == {"v": messages.XRAY_VERSION, "output": "", "waiting": False, "active": False}


def test_a_request_of_another_version_is_answered_with_why(rank_server: Path) -> None:
    answer = _raw(rank_server, {**messages.stack_request(), "v": messages.XRAY_VERSION + 1})
    assert answer["v"] == messages.XRAY_VERSION
    assert answer["error"] == (
        f"X-ray message version {messages.XRAY_VERSION + 1}, this side reads version {messages.XRAY_VERSION}: "
        "install the same ddp_notebook on every host"
    )
    assert "error" in _raw(rank_server, {"ask": "stack"})  # no version at all: refused too
    assert _raw(rank_server, {"v": messages.XRAY_VERSION, "ask": "reboot"}) == messages.error_answer(
        "unknown request 'reboot'"
    )
    assert ask(Reach(str(rank_server)), 0, messages.stack_request()) is not None  # the server lives on


def test_an_answer_of_another_version_is_no_answer(tmp_path: Path) -> None:
    """A rank of another install answering in a newer format: the notebook does not misread it."""
    path = xray_wire.socket_path(str(tmp_path), 0)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(2)
    answers = [{"v": messages.XRAY_VERSION + 1, "frames": []}, {"v": messages.XRAY_VERSION, "frames": []}]

    def answer_twice() -> None:
        for answer in answers:
            connection, _ = server.accept()
            with connection:
                connection.makefile("r").readline()
                connection.sendall(json.dumps(answer).encode() + b"\n")

    thread = threading.Thread(target=answer_twice, daemon=True)
    thread.start()
    try:
        assert ask(Reach(str(tmp_path)), 0, messages.stack_request(), timeout=5) is None
        assert ask(Reach(str(tmp_path)), 0, messages.stack_request(), timeout=5) == answers[1]
    finally:
        thread.join(timeout=5)
        server.close()


def test_the_version_check_names_both_versions() -> None:
    assert messages.version_problem(messages.report_request()) is None
    assert "version None" in (messages.version_problem({"ask": "report"}) or "")
    assert "version None" in (messages.version_problem(["not", "a", "message"]) or "")
