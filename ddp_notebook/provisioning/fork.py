"""ipyparallel launchers whose engines are forked from a warm template instead of started fresh.

Selected like any other engine launcher (`Cluster(engines=ForkEngineSetLauncher)`): the
engine set, its per-engine launchers, their logs, signals and stop notices all behave as
ipyparallel's local ones do; only the start differs, and the exit code comes from the
template, which is the ranks' parent.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil  # ipyparallel depends on it
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, ProcessStateError
from traitlets import Any as AnyTrait

from ..template import TemplateClient


class ForkEngineLauncher(LocalEngineLauncher):
    """One engine, forked from the engine set's template."""

    @property
    def template(self) -> TemplateClient:
        return self.parent.template  # type: ignore[no-any-return]

    def start(self) -> None:
        if self.state != "before":
            raise ProcessStateError(f"The process was already started and has state: {self.state}")
        env = {**os.environ, **self.get_env()}
        argv = self.args[len(self.engine_cmd) :]
        self.pid = self.template.fork(argv, env, self.output_file, os.path.abspath(self.work_dir))
        self.process = psutil.Process(self.pid)
        self.loop  # noqa: B018  (bound to this thread's loop before the exit notice comes from another)
        self.notify_start(self.pid)
        self.template.on_exit(self.pid, self._exited)

    def _exited(self, code: int) -> None:
        data = {"exit_code": code, "pid": self.pid, "identifier": self.identifier}
        self.loop.add_callback(lambda: self.notify_stop(data))

    def poll(self) -> int | None:
        return self.template.exits.get(self.pid)

    async def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pid not in self.template.exits and psutil.pid_exists(self.pid):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Process {self.pid} did not exit in {timeout} seconds.")
            await asyncio.sleep(0.02)


class ForkEngineSetLauncher(LocalEngineSetLauncher):
    """A set of engines forked from one template (give it as `template=` when starting engines)."""

    launcher_class = ForkEngineLauncher
    template = AnyTrait()
