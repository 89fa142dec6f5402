"""Which notebook this kernel runs, as Jupyter tells the kernel: tracker runs are named after it,
and a detached world records it."""

from __future__ import annotations

import os


def notebook_path() -> str:
    """The path of this kernel's notebook (its session), or "" when the kernel does not know it:
    Jupyter's `JPY_SESSION_NAME`, else the `__session__` IPython sets in the user's namespace."""
    path = os.environ.get("JPY_SESSION_NAME", "")
    if not path:
        try:
            from IPython import get_ipython

            shell = get_ipython()
            path = str(shell.user_ns.get("__session__", "")) if shell is not None else ""
        except Exception:  # noqa: BLE001  (no shell: a script)
            path = ""
    return os.path.abspath(path) if path else ""
