"""Edited modules reloaded on a rank before each cell (`%ddp_autoreload`, on by default).

A rank imports the user's `model.py` once; edit the file, and without this the rank keeps
running the old code while the notebook's own kernel (with IPython's `%autoreload`) runs the
new. Before each cell, every rank reloads the user modules whose file changed since it last
looked, with IPython's `superreload`: the functions and classes of the old module are updated
in place, so a model built before the edit runs the new `forward`.

Only the user's modules are watched: a module whose file lies outside the interpreter's own
folders (standard library, site-packages) and outside this package. torch alone brings more
than a thousand modules; stat-ing them every cell would cost milliseconds, and nobody edits them
mid-session.

A module that fails to reload stops the cell on the rank before any line of it runs (a cell run
on the old code by some ranks and the new by others would be worse than no cell), and names the
file and line; the module stays as it was, so the world stays usable: fix the file and run the
cell again, or turn reloading off (`%ddp_autoreload off`).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import site
import sys
import sysconfig
import traceback
from importlib import reload
from types import ModuleType
from typing import Any

from IPython.core.error import InputRejected

from .state import RANK


class ModuleReloadError(InputRejected):
    """A user module changed on disk and could not be reloaded: the cell did not run."""


def _library_roots() -> tuple[str, ...]:
    """Folders whose modules are not the user's: the interpreter's, installed packages', ours."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(getattr(site, "getsitepackages", list)())
    user_site = getattr(site, "getusersitepackages", lambda: "")()
    if user_site:
        roots.add(user_site)
    roots.update({sys.prefix, sys.base_prefix, sys.exec_prefix})
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ddp_notebook itself
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots if root)


def _source_file(module: ModuleType, real_folders: dict[str, str]) -> str | None:
    """The module's file with every link resolved; `real_folders` caches each folder's resolution
    (a rank holds some 2,700 modules in a few hundred folders: a full `realpath` of each file took
    0.38 s of a rank's start)."""
    name = getattr(module, "__name__", None)
    filename = getattr(module, "__file__", None)
    if not filename or name in (None, "__main__", "__mp_main__"):
        return None
    if not filename.endswith(".py"):
        return None  # extension modules and namespace packages cannot be reloaded
    if os.path.islink(filename):
        return os.path.realpath(filename)
    folder, base = os.path.split(os.path.abspath(filename))
    real = real_folders.get(folder)
    if real is None:
        real = real_folders[folder] = os.path.realpath(folder)
    return os.path.join(real, base)


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None  # removed: nothing to reload from


def _forget_bytecode(path: str) -> None:
    """Remove the file's cached bytecode: it records the source's mtime in whole seconds and its
    size, so an edit within the same second that keeps the size (`return 1` -> `return 2`, a file
    synced right after the import) would reload the old code from it."""
    try:
        os.unlink(importlib.util.cache_from_source(path))
    except (OSError, ValueError, NotImplementedError):
        pass  # none was written (read-only folder, PYTHONDONTWRITEBYTECODE)


# the modules a warm template imported that are not the user's (`note_template_modules`): a rank
# forked from it starts knowing them, so its first look walks only what was imported after the fork
_TEMPLATE_LIBRARY_MODULES: frozenset[str] = frozenset()


def note_template_modules() -> None:
    """Run in the warm template after its imports: sort what it imported once, for all its forks."""
    global _TEMPLATE_LIBRARY_MODULES
    reloader = Reloader()
    reloader.discover()
    _TEMPLATE_LIBRARY_MODULES = frozenset(reloader.not_user)


class Reloader:
    """The user modules a rank imported, and the version of each file it runs."""

    def __init__(self) -> None:
        self.enabled = True
        self.roots = _library_roots()
        self.watched: dict[str, tuple[str, int]] = {}  # module name -> (file, mtime it runs)
        self.not_user: set[str] = set(_TEMPLATE_LIBRARY_MODULES)
        self.old_objects: dict[Any, Any] = {}  # superreload's record of the old functions and classes
        self._modules_seen = 0
        self._real_folders: dict[str, str] = {}

    def _is_user_file(self, path: str) -> bool:
        return not path.startswith(self.roots)

    def discover(self) -> None:
        """Watch the user modules imported since the last look, at the version they run now."""
        if len(sys.modules) == self._modules_seen:
            return  # nothing imported since (the usual cell): no walk over a thousand modules
        for name, module in list(sys.modules.items()):
            if name in self.watched or name in self.not_user:
                continue
            path = _source_file(module, self._real_folders) if module is not None else None
            # the folder test first: most modules are the interpreter's and need no stat
            mtime = _mtime(path) if path is not None and self._is_user_file(path) else None
            if path is None or mtime is None:
                self.not_user.add(name)
                continue
            self.watched[name] = (path, mtime)
        self._modules_seen = len(sys.modules)

    def check(self) -> list[str]:
        """Reload every watched module whose file changed; the names reloaded, in import order.

        Raises ModuleReloadError, naming the file and line, for the first that fails.
        """
        if not self.enabled:
            return []
        self.discover()
        reloaded = []
        for name, (path, mtime) in list(self.watched.items()):
            now = _mtime(path)
            if now is None or now == mtime:
                continue
            module = sys.modules.get(name)
            if module is None:  # removed from sys.modules by the user: imported afresh next time
                del self.watched[name]
                continue
            _forget_bytecode(path)
            try:
                from IPython.extensions.autoreload import superreload

                superreload(module, reload, self.old_objects)
            except Exception as error:  # noqa: BLE001  (any failure of the user's module)
                # not recorded as run: the next cell tries again, and fails again until it is fixed
                raise ModuleReloadError(describe_failure(name, path, error)) from None
            self.watched[name] = (path, now)
            reloaded.append(name)
        return reloaded


def describe_failure(name: str, path: str, error: BaseException) -> str:
    """'model.py, line 3: SyntaxError: ...' and what to do, for a module that failed to reload."""
    where, line = path, None
    if isinstance(error, SyntaxError) and error.filename:
        where, line = error.filename, error.lineno
    else:
        frames = traceback.extract_tb(error.__traceback__)
        # the deepest frame in a file of the user's (the module itself, or one it imports)
        mine = [frame for frame in frames if "importlib" not in frame.filename and frame.filename.endswith(".py")]
        if mine:
            where, line = mine[-1].filename, mine[-1].lineno
    shown = os.path.relpath(where) if not os.path.relpath(where).startswith("..") else where
    at = f"{shown}, line {line}" if line else shown
    summary = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1]
    return (
        f"module {name} changed on disk and could not be reloaded: {at}: {summary}. "
        "The cell did not run; the rank keeps the module as it was: fix the file and run the cell "
        "again (or %ddp_autoreload off)"
    )


class _ReloadBeforeCell(ast.NodeTransformer):
    """An AST transformer of the rank's shell: IPython runs it on every cell before executing it,
    and a ModuleReloadError raised here (an InputRejected) fails the cell without running it."""

    def __init__(self, reloader: Reloader) -> None:
        self.reloader = reloader

    def visit(self, node: ast.AST) -> ast.AST:
        self.reloader.check()
        return node


def set_autoreload(enabled: bool) -> None:
    """Turn reloading before each cell on or off on this rank (installed on first use)."""
    files = RANK.user_files
    if files.reloader is None:
        if not enabled:
            return
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            return  # not an engine (a script under torchrun): nothing runs cells here
        reloader = files.reloader = Reloader()
        reloader.discover()  # what is imported now runs as it is now: changes from here on count
        shell.ast_transformers.append(_ReloadBeforeCell(reloader))
        # a module a cell imported is watched from the end of that cell (silent ones included: a new
        # rank replaying the setup cells), not from the next one
        # (an edit in between would otherwise be taken for the version the rank runs)
        shell.events.register("post_execute", reloader.discover)
    files.reloader.enabled = enabled
