"""%ddp_sync: which files it sends, its refusals, and (in a real world) that only what changed is
sent and ranks import what they got; the rank's side writes inside its folder only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddp_notebook.errors import DDPUsageError
from ddp_notebook.rank import files as rank_files
from ddp_notebook.world import sync


def make_project(folder: Path) -> None:
    (folder / "model.py").write_text("X = 1\n")
    (folder / "notes.txt").write_text("not code\n")
    (folder / "pkg" / "sub").mkdir(parents=True)
    (folder / "pkg" / "__init__.py").write_text("")
    (folder / "pkg" / "sub" / "__init__.py").write_text("")
    (folder / "pkg" / "sub" / "layers.py").write_text("Y = 2\n")
    (folder / "pkg" / "config.yaml").write_text("lr: 0.1\n")
    (folder / "data").mkdir()  # not a package: never walked by default
    (folder / "data" / "loader.py").write_text("")
    (folder / "pkg" / "__pycache__").mkdir()
    (folder / "pkg" / "__pycache__" / "x.py").write_text("")
    (folder / ".hidden.py").write_text("")


def test_the_default_files_are_the_folders_modules_and_packages(tmp_path: Path) -> None:
    make_project(tmp_path)
    assert sync.default_files(str(tmp_path)) == [
        "model.py",
        os.path.join("pkg", "__init__.py"),
        os.path.join("pkg", "sub", "__init__.py"),
        os.path.join("pkg", "sub", "layers.py"),
    ]


def test_named_paths_send_every_file_under_them_and_nothing_outside_the_folder(tmp_path: Path) -> None:
    make_project(tmp_path)
    assert sync.chosen_files(["pkg"], str(tmp_path)) == sorted(
        [os.path.join("pkg", name) for name in ("__init__.py", "config.yaml", "sub/__init__.py", "sub/layers.py")]
    )
    assert sync.chosen_files(["notes.txt", "model.py"], str(tmp_path)) == ["model.py", "notes.txt"]
    with pytest.raises(DDPUsageError, match=r"\.\./elsewhere\.py is outside it"):
        sync.chosen_files(["../elsewhere.py"], str(tmp_path))
    with pytest.raises(DDPUsageError, match=r"no file or folder nothere\.py in "):
        sync.chosen_files(["nothere.py"], str(tmp_path))


def test_more_than_the_limit_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_bytes(b"#" * (2 * 2**20))
    syncer = sync.Syncer(str(tmp_path), limit_mb=1)
    with pytest.raises(DDPUsageError, match=r"hold 2\.0 MB, more than the 1 MB a sync sends; .*--max-mb N"):
        syncer.check_size(["big.py"])
    assert sync.Syncer(str(tmp_path), limit_mb=3).check_size(["big.py"]) == 2 * 2**20


def test_the_rank_side_writes_inside_its_folder_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert rank_files.receive({"pkg/new.py": b"Z = 3\n"}) == 6
    assert (tmp_path / "pkg" / "new.py").read_bytes() == b"Z = 3\n"
    assert (tmp_path / "pkg" / "new.py").stat().st_mode & 0o077 == 0  # private, like the key files
    assert rank_files.digests(["pkg/new.py", "missing.py"])["missing.py"] is None
    for escape in ("../outside.py", "/etc/passwd", "pkg/../../outside.py"):
        with pytest.raises(ValueError, match="leaves the working folder"):
            rank_files.receive({escape: b"x"})
    assert not (tmp_path.parent / "outside.py").exists()
    assert [p.name for p in (tmp_path / "pkg").iterdir()] == ["new.py"]  # no temporary file left


def test_a_rank_elsewhere_works_in_the_notebooks_folder_if_it_exists_there_else_in_a_sync_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    assert rank_files.enter_working_folder("another-host", str(shared)) == str(shared)
    assert os.getcwd() == str(shared)
    missing = "/no/such/notebook/folder"
    folder = rank_files.enter_working_folder("another-host", missing)
    assert folder == rank_files.sync_folder("another-host", missing) and os.getcwd() == folder
    assert folder.startswith(str(tmp_path / "home" / ".cache" / "ddp_notebook" / "sync"))
    assert os.stat(folder).st_mode & 0o077 == 0
    rank_files.leave_sync_folder()
    assert not os.path.exists(folder) and os.getcwd() == str(tmp_path / "home")
