"""The Binder build followed from another process (`pytest -n`: the controller builds, the worker
that runs the Binder test waits), through the build's folder: pure logic on files."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import binder_build
from tests.support.binder_build import BinderBuild

# BinderBuild.wait is what the suite's cost plugin counts as a build: out of the fast lane with the builds
pytestmark = pytest.mark.integration


def _later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_a_build_elsewhere_is_waited_for_and_hurried_only_once_its_test_waits(tmp_path: Path) -> None:
    build = BinderBuild.elsewhere(tmp_path)
    time.sleep(3 * binder_build.ELSEWHERE_POLL_SECONDS)
    assert not (tmp_path / binder_build.WANTED).exists(), "hurried before its test waited"
    done = {"dropped": ["https://download.pytorch.org/whl/cpu"], "seconds": 12.5}
    _later(1.0, lambda: (tmp_path / binder_build.BUILT).write_text(json.dumps(done)))
    assert build.wait(30) is build
    assert (tmp_path / binder_build.WANTED).exists()  # the builder runs its next steps un-niced
    assert (build.dropped, build.seconds) == (done["dropped"], 12.5)
    assert build.python == tmp_path / "venv" / "bin" / "python"


@pytest.mark.parametrize(("kind", "raised"), [("skip", pytest.skip.Exception), ("fail", pytest.fail.Exception)])
def test_a_build_that_ended_elsewhere_without_an_environment_says_why_here(
    tmp_path: Path, kind: str, raised: type[BaseException]
) -> None:
    (tmp_path / binder_build.FAILED).write_text(json.dumps({"kind": kind, "message": "no Python 3.11 here"}))
    with pytest.raises(raised, match=r"no Python 3\.11 here"):
        BinderBuild.elsewhere(tmp_path).wait(30)


def test_a_wait_for_a_build_elsewhere_ends_at_its_limit(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        BinderBuild.elsewhere(tmp_path).wait(1)
    assert time.monotonic() - began < 10
