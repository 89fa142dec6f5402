"""On JupyterHub, which process is the user's server: a detached world ends with it.

jupyter_client tells each kernel it starts the PID of the process that started it (`JPY_PARENT_PID`,
on Linux and macOS the server itself), whatever runs between the two: a kernelspec whose command is
a wrapper script that does not `exec` puts a shell between them, and the kernel's parent is then
the shell, which a server's stop may leave running. The server is that PID where it is one of this
kernel's ancestors, else the kernel's parent where it runs a Jupyter server; else it is not found,
and `%ddp_start --detach` says in one line what ends the world then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..platform.processes import ancestors, command_line

# what a Jupyter server's command line holds (jupyterhub-singleuser, jupyter-lab, jupyter-server,
# python -m jupyter_server, the notebook server, jupyter-labhub)
SERVER_COMMANDS = ("jupyterhub-singleuser", "jupyterhub.singleuser", "jupyter-lab", "jupyter-server",
                   "jupyter_server", "jupyter-notebook", "jupyterlab", "jupyter-labhub")  # fmt: skip
SHOWN_COMMAND = 60  # characters of the parent's command line a line shows


@dataclass(frozen=True)
class UsersServer:
    """The user's server as this kernel finds it: its PID, or None with the kernel's parent as a
    line shows it (`PID 412, bash /opt/kernel-wrapper.sh`)."""

    pid: int | None
    parent: str = ""

    def ends_the_world(self) -> str:
        """What the server's stop does to a detached world: the end of %ddp_start's note on it."""
        if self.pid is not None:
            return f", or when your server stops (PID {self.pid})"
        return (
            "; your server's stop does not end it: the Jupyter server was not found among this kernel's "
            f"parents (its parent is {self.parent}; a kernelspec wrapper that does not exec runs between them)"
        )


def on_jupyterhub() -> bool:
    """Whether this kernel was started by a JupyterHub single-user server (or under one)."""
    return bool(os.environ.get("JUPYTERHUB_USER"))


def find_users_server() -> UsersServer:
    """The server that started this kernel (see the module's note)."""
    named = os.environ.get("JPY_PARENT_PID", "")
    if named.isdigit() and int(named) in ancestors(os.getpid()):
        return UsersServer(int(named))
    parent = os.getppid()
    command = command_line(parent)
    if any(name in command for name in SERVER_COMMANDS):
        return UsersServer(parent)
    shown = command if len(command) <= SHOWN_COMMAND else command[: SHOWN_COMMAND - 3] + "..."
    return UsersServer(None, f"PID {parent}, {shown}" if shown else f"PID {parent}")
