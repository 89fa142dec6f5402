"""The logs ipyparallel's SSH launcher leaves on other hosts, removed when their rank ends.

Each rank started over SSH writes its output to a file on its host
(`~/.ipython/<profile>/log/ipengine-<time>.out`). ipyparallel removes it only on the stop path it
drives for a whole engine set; a rank that ended while the world ran (lost and replaced, or left
in a resize) is dropped from its set first, and its file stayed on its host for good.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from typing import Any

log = logging.getLogger("ddp_notebook")

# one removal over ssh may take this long (a host that went silent does not answer at all)
REMOVE_SECONDS = 10.0


class RemoteLogs:
    """Removes each watched SSH launcher's remote log once its rank's process has ended."""

    def __init__(self, seconds: float = REMOVE_SECONDS) -> None:
        self.seconds = seconds
        self._watched: set[int] = set()
        self._running: list[subprocess.Popen[bytes]] = []
        self._pending = 0  # removals asked for and not ended: counted before their thread starts
        self._lock = threading.Lock()
        self._closed = False
        self.removed: list[str] = []  # "host:path" of each log removed (what the tests read)

    def watch(self, launcher: Any) -> None:
        """Remove `launcher`'s remote log when its process ends (at once if it already has)."""
        if id(launcher) in self._watched or not getattr(launcher, "remote_output_file", ""):
            return
        self._watched.add(id(launcher))
        # called on ipyparallel's event loop, after the engine set has read the log: never block it
        launcher.on_stop(lambda _data, launcher=launcher: self._remove_soon(launcher))

    def _remove_soon(self, launcher: Any) -> None:
        where, path = str(launcher.location), str(launcher.remote_output_file)
        command = [*launcher.ssh_cmd, *launcher.ssh_args, where, "rm", "-f", shlex.quote(path)]
        with self._lock:
            if self._closed:
                return
            self._pending += 1
        what = f"{where}:{path}"
        threading.Thread(target=self._run, args=(command, what), name="ddp-remote-log", daemon=True).start()

    def _run(self, command: list[str], what: str) -> None:
        try:
            with self._lock:
                if self._closed:
                    return
                child = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                self._running.append(child)
            try:
                if child.wait(self.seconds) == 0:
                    self.removed.append(what)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            finally:
                with self._lock:
                    self._running.remove(child)
        except OSError:
            log.debug("removing %s failed", what, exc_info=True)
        finally:
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        """Wait for the removals under way (each bounded), end what is still running, start no more."""
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(0.05)
        with self._lock:
            self._closed = True
            left = list(self._running)
        for child in left:  # a host that did not answer within the bound: its log stays there
            child.kill()
            child.wait()
