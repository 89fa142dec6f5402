"""ipyparallel launchers whose processes are forked from a warm template instead of started fresh.

Selected like any other launcher (`Cluster(engines=ForkEngineSetLauncher,
controller=ForkControllerLauncher)`): the engine set, its per-engine launchers, the
controller's launcher, their logs, signals and stop notices all behave as ipyparallel's
local ones do; only the start differs, and the exit code comes from the template, which is
their parent.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil  # ipyparallel depends on it
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    ProcessStateError,
)
from traitlets import Any as AnyTrait

from ..template import TemplateClient


class _Forked:
    """The start, exit notice, poll and join of a launcher whose process the template forks."""

    role = "engine"
    pid: int
    template: TemplateClient

    def _command_length(self) -> int:
        raise NotImplementedError

    def start(self) -> None:
        if self.state != "before":  # type: ignore[attr-defined]
            raise ProcessStateError(f"The process was already started and has state: {self.state}")  # type: ignore[attr-defined]
        env = {**os.environ, **self.get_env()}  # type: ignore[attr-defined]
        argv = self.args[self._command_length() :]  # type: ignore[attr-defined]
        cwd = os.path.abspath(self.work_dir)  # type: ignore[attr-defined]
        self.pid = self.template.fork(argv, env, self.output_file, cwd, role=self.role)  # type: ignore[attr-defined]
        self.process = psutil.Process(self.pid)
        self.loop  # type: ignore[attr-defined]  # noqa: B018  (bound to this thread's loop before the exit notice comes from another)
        self.notify_start(self.pid)  # type: ignore[attr-defined]
        self.template.on_exit(self.pid, self._exited)

    def _exited(self, code: int) -> None:
        data = {"exit_code": code, "pid": self.pid, "identifier": self.identifier}  # type: ignore[attr-defined]
        self.loop.add_callback(lambda: self.notify_stop(data))  # type: ignore[attr-defined]

    def poll(self) -> int | None:
        return self.template.exits.get(self.pid)

    async def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pid not in self.template.exits and psutil.pid_exists(self.pid):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Process {self.pid} did not exit in {timeout} seconds.")
            await asyncio.sleep(0.02)


class ForkEngineLauncher(_Forked, LocalEngineLauncher):
    """One engine, forked from the engine set's template."""

    @property
    def template(self) -> TemplateClient:  # type: ignore[override]
        return self.parent.template  # type: ignore[no-any-return]

    def _command_length(self) -> int:
        return len(self.engine_cmd)


class ForkControllerLauncher(_Forked, LocalControllerLauncher):
    """The controller, forked from a template (give it as `template=` when starting the controller)."""

    role = "controller"
    template = AnyTrait()  # type: ignore[assignment]

    def _command_length(self) -> int:
        return len(self.controller_cmd)


class ForkEngineSetLauncher(LocalEngineSetLauncher):
    """A set of engines forked from one template (give it as `template=` when starting engines)."""

    launcher_class = ForkEngineLauncher
    template = AnyTrait()
