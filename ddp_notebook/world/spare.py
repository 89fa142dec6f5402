"""A rank template started before the first world, so that `%ddp_start` finds torch imported.

Starting a template (one interpreter importing torch) takes a few seconds, most of a first
`%ddp_start`. `%load_ext ddp_notebook` (or `ddp_notebook.warm_up()`) starts one in the
background; the next local world forks its processes from it instead of starting its own.
(The kernel's own import of ipyparallel is not moved to a background thread: a package with
circular imports, imported on two threads at once, can hand one of them a half-initialised
module, as a `%ddp_start` or the user's own `import ipyparallel` racing it would.) It is
the kernel's like every process of ours: it exits when the kernel dies (the template watches
its owner), and `%ddp_stop` / `%unload_ext` end it if no world took it.

A spare is only handed over while it is still equivalent to a template started now: the same
interpreter and the same start-up environment (the variables Python reads when it starts);
otherwise it is stopped and the world starts its own.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Mapping

from ..platform.processes import owner_environment
from . import template

# set to "0" to start no spare (e.g. on a shared login node where the memory matters more)
SPARE_ENV = "DDP_NOTEBOOK_SPARE"

_lock = threading.Lock()
_spare: template.TemplateClient | None = None
_signature: tuple[str, tuple[tuple[str, str], ...]] = ("", ())


def start_spare(wait: float = 0.0) -> bool:
    """Start a spare template in the background; with `wait`, wait up to that long until it is ready.

    False where none is started, or it was not ready within `wait`.
    """
    global _spare, _signature
    if os.environ.get(SPARE_ENV, "1") == "0" or template.can_fork_ranks({}) is not None:
        return False
    with _lock:
        spare = _spare
        if spare is None or not spare.running:
            if spare is not None:
                spare.stop()  # it died: remove what is left of it
            spare = template.TemplateClient(sys.executable, owner_environment())
            spare.start()
            _spare, _signature = spare, template.start_signature()
    if wait <= 0:
        return True
    try:
        spare.wait_ready(time.monotonic() + wait)
    except (TimeoutError, RuntimeError):
        return False
    return True


def hand_over(started: template.TemplateClient) -> None:
    """Make `started`, a template started by other means (the test suite forks its spares from one
    template of its own), the spare the next local world takes; a spare waiting is ended."""
    global _spare, _signature
    with _lock:
        waiting, _spare, _signature = _spare, started, template.start_signature()
    if waiting is not None:
        waiting.stop()


def take_spare(rank_env: Mapping[str, str]) -> template.TemplateClient | None:
    """The spare template for a world whose ranks get `rank_env`, if it suits them (it is then theirs)."""
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    if spare.running and _signature == template.start_signature() and template.can_fork_ranks(rank_env) is None:
        return spare
    spare.stop()
    return None


def discard_spare() -> None:
    """End the spare template if no world took it."""
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is not None:
        spare.stop()


def spare_pid() -> int | None:
    """The spare template's PID while one waits (for status and tests)."""
    spare = _spare
    return spare.pid if spare is not None and spare.running else None


atexit.register(discard_spare)  # a clean kernel exit ends a template no world took
