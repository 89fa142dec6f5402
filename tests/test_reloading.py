"""Reloading edited user modules (ddp_notebook.rank.reloading), in this process: which modules
are the user's, what a reload keeps (an object built before the edit runs the new code), and
what a failed reload says."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster, RankError
from ddp_notebook.rank.reloading import ModuleReloadError, Reloader
from tests.support.docs_pages import documented_magic_lines
from tests.support.kernel import Kernel, kernel_world_pids, outs
from tests.support.processes import wait_gone


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write(path: Path, text: str) -> None:
    """Write and move the file's mtime on, as an editor's save a moment later would."""
    old = path.stat().st_mtime_ns if path.exists() else time.time_ns() - 10**9
    path.write_text(text)
    os.utime(path, ns=(old + 10**7, old + 10**7))


def test_an_edited_module_is_reloaded_and_old_objects_run_the_new_code(user_folder: Path) -> None:
    write(user_folder / "shapes_mod.py", "class Square:\n    def area(self, s):\n        return s * s\n")
    shapes = importlib.import_module("shapes_mod")
    reloader = Reloader()
    reloader.check()  # watched from here
    square = shapes.Square()
    assert square.area(3) == 9
    assert reloader.check() == []  # nothing changed: nothing reloaded
    write(user_folder / "shapes_mod.py", "class Square:\n    def area(self, s):\n        return s * s + 1\n")
    assert reloader.check() == ["shapes_mod"]
    assert square.area(3) == 10  # the instance built before the edit runs the edited method
    assert reloader.check() == []


def test_an_edit_in_the_same_second_that_keeps_the_size_is_reloaded(
    user_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cached bytecode knows the source by whole seconds and size: it must not stand in for the edit."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as on a rank started over ssh
    source = user_folder / "quick_mod.py"
    source.write_text("def f():\n    return 1\n")
    second = (source.stat().st_mtime_ns // 10**9) * 10**9
    os.utime(source, ns=(second, second))
    module = importlib.import_module("quick_mod")
    assert Path(importlib.util.cache_from_source(str(source))).exists()  # the bytecode that would stand in
    reloader = Reloader()
    reloader.check()
    source.write_text("def f():\n    return 2\n")  # the same size
    os.utime(source, ns=(second + 1000, second + 1000))  # the same second
    assert reloader.check() == ["quick_mod"]
    assert module.f() == 2


def test_only_the_users_modules_are_watched(user_folder: Path) -> None:
    write(user_folder / "mine_mod.py", "X = 1\n")
    importlib.import_module("mine_mod")
    import json  # noqa: F401  (the standard library's)

    import ddp_notebook.rank.files  # noqa: F401  (this package's own)

    reloader = Reloader()
    reloader.check()
    assert "mine_mod" in reloader.watched
    assert "json" not in reloader.watched and "pytest" not in reloader.watched
    assert not any(name.startswith("ddp_notebook") for name in reloader.watched)


def test_a_module_that_fails_to_reload_names_the_file_and_line_and_keeps_the_old_one(user_folder: Path) -> None:
    write(user_folder / "broken_mod.py", "def f():\n    return 1\n")
    module = importlib.import_module("broken_mod")
    reloader = Reloader()
    reloader.check()
    write(user_folder / "broken_mod.py", "def f():\n    return 1\n\ndef g(:\n    pass\n")
    with pytest.raises(ModuleReloadError, match=r"module broken_mod .* broken_mod\.py, line 4: SyntaxError: "):
        reloader.check()
    assert module.f() == 1  # the module as it was
    with pytest.raises(ModuleReloadError):  # tried again at the next cell, until it is fixed
        reloader.check()
    write(user_folder / "broken_mod.py", "def f():\n    return 2\n")
    assert reloader.check() == ["broken_mod"]
    assert module.f() == 2
    write(user_folder / "broken_mod.py", "def f():\n    return 2\n\nraise ValueError('bad value at import')\n")
    with pytest.raises(ModuleReloadError, match=r"broken_mod\.py, line 4: ValueError: bad value at import"):
        reloader.check()


def test_turned_off_nothing_is_reloaded(user_folder: Path) -> None:
    write(user_folder / "off_mod.py", "X = 1\n")
    module = importlib.import_module("off_mod")
    reloader = Reloader()
    reloader.check()
    reloader.enabled = False
    write(user_folder / "off_mod.py", "X = 2\n")
    assert reloader.check() == [] and module.X == 1
    reloader.enabled = True  # on again: brought up to date
    assert reloader.check() == ["off_mod"] and module.X == 2


# ------------------------------------------------------------------ in a world of ranks


def test_a_module_in_a_linked_folder_is_watched_at_its_real_path(user_folder: Path) -> None:
    real = user_folder / "real_code"
    real.mkdir()
    write(real / "linked_mod.py", "X = 1\n")
    (user_folder / "linked_code").symlink_to(real, target_is_directory=True)
    sys.path.insert(0, str(user_folder / "linked_code"))
    try:
        importlib.import_module("linked_mod")
        reloader = Reloader()
        reloader.discover()
        assert reloader.watched["linked_mod"][0] == str((real / "linked_mod.py").resolve())
        write(real / "linked_mod.py", "X = 2\n")
        assert reloader.check() == ["linked_mod"] and sys.modules["linked_mod"].X == 2
    finally:
        sys.path.remove(str(user_folder / "linked_code"))


def test_what_the_template_imported_is_sorted_once_for_every_rank_forked_from_it(
    user_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_notebook.rank import reloading

    monkeypatch.setattr(reloading, "_TEMPLATE_LIBRARY_MODULES", frozenset())
    reloading.note_template_modules()  # as the template does after its imports
    assert "json" in reloading._TEMPLATE_LIBRARY_MODULES and "pytest" in reloading._TEMPLATE_LIBRARY_MODULES
    write(user_folder / "after_fork_mod.py", "X = 1\n")
    importlib.import_module("after_fork_mod")  # a cell's import, after the fork
    reloader = Reloader()
    assert reloader.not_user >= reloading._TEMPLATE_LIBRARY_MODULES  # known without a look
    reloader.discover()
    assert "after_fork_mod" in reloader.watched


def values(world: DDPCluster, code: str) -> dict[int, str]:
    result = world.execute(code)
    return {rank: result.value_text(rank) for rank in range(world.world_size)}


@pytest.mark.integration
def test_every_rank_runs_the_edited_module_at_the_next_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    monkeypatch.chdir(tmp_path)  # the notebook's folder: the ranks work and import there
    source = tmp_path / "edited_model.py"
    version = "class Model:\n    def value(self):\n        return {}\n"
    write(source, version.format(1))
    with DDPCluster(2, backend="gloo") as world:
        if world.provisioner.template is not None:  # forked: the template sorted torch's modules once for all
            known = "from ddp_notebook.rank import reloading\n'torch' in reloading._TEMPLATE_LIBRARY_MODULES"
            assert values(world, known) == {0: "True", 1: "True"}
        world.execute("import edited_model\nm = edited_model.Model()", setup=True)
        assert values(world, "m.value()") == {0: "1", 1: "1"}
        write(source, version.format(2))
        assert values(world, "m.value()") == {0: "2", 1: "2"}  # the object built before the edit too

        # a module that does not reload: the cell runs nowhere, says where, and the world goes on
        write(source, "class Model:\n    def value(self):\n        return (\n")
        with pytest.raises(RankError) as raised:
            world.execute("ran = True")
        message = str(raised.value)
        assert "module edited_model changed on disk and could not be reloaded: edited_model.py, line 3: " in message
        assert message.startswith(("rank 0 raised ModuleReloadError", "rank 1 raised ModuleReloadError")), message
        assert "SyntaxError: '(' was never closed. The cell did not run" in message
        write(source, version.format(3))
        assert values(world, "m.value(), 'ran' in dir()") == {0: "(3, False)", 1: "(3, False)"}

        world.autoreload(False)
        write(source, version.format(4))
        assert values(world, "m.value()") == {0: "3", 1: "3"}  # off: the ranks keep what they imported
        world.autoreload(True)
        assert values(world, "m.value()") == {0: "4", 1: "4"}

        world.resize(3)  # a new rank reloads too (it replayed the setup cell on today's file)
        write(source, version.format(5))
        assert values(world, "m.value()") == {0: "5", 1: "5", 2: "5"}


DOCS = Path(__file__).resolve().parent.parent / "docs" / "your_code.md"


def documented_lines() -> list[str]:
    """The magic lines of docs/your_code.md, as written there (comments left out)."""
    return documented_magic_lines(DOCS)


@pytest.mark.integration
def test_the_autoreload_and_sync_magics_in_a_kernel(tmp_path: Path) -> None:
    source = tmp_path / "kernel_model.py"
    write(source, "def value():\n    return 1\n")
    (tmp_path / "mypackage").mkdir()
    (tmp_path / "mypackage" / "__init__.py").write_text("")
    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    kernel = Kernel()
    ran: list[str] = []

    def magic(line: str) -> tuple[str, str | None]:
        ran.append(line)
        return kernel.run(line)

    try:
        out, error = kernel.run(f"import os\nos.chdir({str(tmp_path)!r})\n%load_ext ddp_notebook\n%ddp_start 2")
        assert error is None, out
        pids = kernel_world_pids(kernel)
        out, error = kernel.run("%%ddp\nimport kernel_model\nkernel_model.value()")
        assert error is None and outs(out, {0: 1, 1: 1}), out
        write(source, "def value():\n    return 2\n")
        out, error = kernel.run("%%ddp\nkernel_model.value()")
        assert error is None and outs(out, {0: 2, 1: 2}), out

        out, error = magic("%ddp_autoreload")
        assert error is None and "autoreload is on" in out, out
        out, error = magic("%ddp_autoreload off")
        assert error is None and "the ranks keep the modules they imported" in out, out
        write(source, "def value():\n    return 3\n")
        out, error = kernel.run("%%ddp\nkernel_model.value()")
        assert error is None and outs(out, {0: 2, 1: 2}), out
        out, error = magic("%ddp_autoreload on")
        assert error is None and "every rank reloads the modules you edit" in out, out
        out, error = kernel.run("%%ddp\nkernel_model.value()")
        assert error is None and outs(out, {0: 3, 1: 3}), out
        out, error = kernel.run("%ddp_autoreload maybe")
        assert "UsageError: %ddp_autoreload takes on or off, got 'maybe'" in out, out

        # local ranks work in the notebook's folder: nothing to send
        out, error = magic("%ddp_sync")
        assert error is None and "every rank's folder holds these 2 files already; nothing sent" in out, out
        out, error = magic("%ddp_sync mypackage config.yaml")
        assert error is None and "every rank's folder holds these 2 files already; nothing sent" in out, out
        out, error = magic("%ddp_sync --max-mb 100")
        assert error is None and "nothing sent" in out, out
        out, error = kernel.run("%ddp_sync ../elsewhere.py")
        assert "UsageError: %ddp_sync sends files under the notebook's folder" in out, out
        assert "../elsewhere.py is outside it" in out and "Traceback" not in out, out
        out, error = kernel.run("%ddp_sync --max-mb 0")
        assert "UsageError: --max-mb must be a positive number of MB, got 0" in out, out
        out, error = kernel.run("%ddp_stop")
        assert error is None and "stopped the world" in out, out
        assert wait_gone(pids) == []
    finally:
        kernel.close()
    missing = [line for line in documented_lines() if line not in ran]
    assert documented_lines() and missing == [], f"documented in {DOCS.name} but not run as written: {missing}"
