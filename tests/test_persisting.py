"""Snapshots on disk (`track(persist=...)`): every rank of a real gloo world SIGKILLed, a new world
resumes from the folder and ends as the uninterrupted run does; the files' rules in pure logic."""

from __future__ import annotations

import json
import os
import random
import re
import select
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from ddp_notebook import DDPCluster, RankDiedError
from ddp_notebook.rank import persisting
from tests.support import elastic_training
from tests.support.elastic_training import DDP, DROP, EPOCHS
from tests.support.processes import wait_gone

TRACK = (
    "ddp_notebook.track(model=model, opt=opt, loader=loader, step=step, seen=seen, snapshot_every=3, "
    "persist={folder!r}, persist_every={every})"
)
# as tests.support.elastic_training's TRAIN, but every rank dies at KILL_AT, once its snapshot writer is idle
TRAIN_UNTIL_ALL_KILLED = """
import os, signal
from ddp_notebook.rank.calls import persist_wait
while loader.epoch < {epochs}:
    for x, y, ids in loader:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, ids.tolist())
        seen.append(sum(gathered, []))
        if step == KILL_AT:
            assert persist_wait(60)["idle"]
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
"""
RESUME = "from ddp_notebook.rank import elastic\nresumed = elastic.resume({folder!r}).said"


def _lose_every_rank(world: DDPCluster, kill_at: int) -> list[int]:
    pids = world.all_pids
    world.push({"KILL_AT": kill_at})
    with pytest.raises(RankDiedError):
        world.execute(TRAIN_UNTIL_ALL_KILLED.format(epochs=EPOCHS))
    return pids


def _resume(world: DDPCluster, folder: Path, every: int, drop: float) -> str:
    setup = world.execute(
        elastic_training.build("", DDP, drop) + TRACK.format(folder=str(folder), every=every), setup=True, stream=False
    )
    # said once, by rank 0, under the cell that names the folder: what to type next
    assert (
        f"holds snapshot {persisting.whole_snapshots(folder)[-1][0]} of an earlier run: %ddp_resume" in setup.stderr[0]
    )
    assert all("earlier run" not in setup.stderr.get(r, "") for r in range(1, world.world_size))
    world.execute(RESUME.format(folder=str(folder)))
    said = world.pull("resumed")
    assert len(set(said.values())) == 1, said
    return said[0]


@pytest.mark.parametrize("size", [pytest.param(2, id="2ranks"), pytest.param(3, id="3ranks")])
def test_a_run_whose_every_rank_was_killed_resumes_from_disk_bitwise_equal(
    no_leaks: None, tmp_path: Path, size: int
) -> None:
    folder = tmp_path / "ckpt"
    kill_at = elastic_training.steps_per_epoch(size) + 5  # epoch 1, after the snapshot at its batch 3
    with DDPCluster(size, backend="gloo", collective_timeout=60) as world:
        reference, reference_seen = elastic_training.reference(world, DDP)
        world.execute(elastic_training.build("", DDP, DROP) + TRACK.format(folder=str(folder), every=1), setup=True)
        pids = _lose_every_rank(world, kill_at)
    assert wait_gone(pids) == []

    whole = persisting.whole_snapshots(folder)
    assert len(whole) == persisting.KEEP_WRITTEN  # older ones pruned
    newest, marker = whole[-1]
    assert marker["where"] == "epoch 1, batch 3" and marker["world_size"] == size
    assert sorted(p.name for p in (folder / f"snapshot-{newest:08d}.ranks").iterdir()) == [
        f"rank-{r:05d}.pt" for r in range(size)
    ]

    with DDPCluster(size, backend="gloo", collective_timeout=60) as world:
        said = _resume(world, folder, every=1, drop=DROP)
        assert said == f"snapshot {newest} (epoch 1, batch 3) of a world of {size} ranks"
        assert world.pull("step") == {r: elastic_training.steps_per_epoch(size) + 3 for r in range(size)}
        elastic_training.train(world, "")
        elastic_training.ends_like(world, reference, reference_seen)
        # the resumed world goes on writing there, numbered after what it resumed from
        world.execute("from ddp_notebook.rank.calls import persist_wait\nstate = persist_wait(60)")
        assert all(s["idle"] and s["error"] is None for s in world.pull("state").values())
        assert persisting.whole_snapshots(folder)[-1][0] > newest
        pids = world.all_pids
    assert wait_gone(pids) == []


def test_a_run_resumes_from_disk_on_another_number_of_ranks_as_one_process_would(
    no_leaks: None, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    with DDPCluster(2, backend="gloo", collective_timeout=60) as world:
        world.execute(elastic_training.build("", DDP, 0.0) + TRACK.format(folder=str(folder), every=2), setup=True)
        pids = _lose_every_rank(world, elastic_training.steps_per_epoch(2) + 5)
    assert wait_gone(pids) == []
    newest, marker = persisting.whole_snapshots(folder)[-1]
    assert marker["world_size"] == 2

    with DDPCluster(3, backend="gloo", collective_timeout=60) as world:
        said = _resume(world, folder, every=2, drop=0.0)
        assert said.startswith(f"snapshot {newest} (") and said.endswith("of a world of 2 ranks")
        elastic_training.train(world, "")
        params, seen = elastic_training.params(world, ""), world.pull("seen")
        assert all(elastic_training.bitwise_equal(params[r], params[0]) and seen[r] == seen[0] for r in range(3))
        # the steps before the loss on 2 ranks' batches, after it on 3 ranks': each sample once an epoch
        for got, expected in zip(params[0], elastic_training.trained_in_one_process(seen[0])):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        pids = world.all_pids
    assert wait_gone(pids) == []


# ---------------------------------------------------------------- the files, in pure logic


def _write(folder: Path, seq: int, world_size: int = 1, every: int = 1) -> None:
    settings = persisting.PersistSettings.build(folder, every, guard=False)
    state = {"model": ("module", {"w": torch.full((2,), float(seq))}), "opt": ("state_dict", {"state": {0: {}}})}
    for rank in range(world_size - 1, -1, -1):  # rank 0 last: it waits for the others' files
        persisting.write(persisting.Job(settings, seq, f"point {seq}", state, {"python": None}, seq, rank, world_size))


def test_the_structure_comes_back_as_it_was_written(tmp_path: Path) -> None:
    state = {"m": ("module", {"w": torch.arange(3.0)}), "o": ("state_dict", {"state": {0: {"buf": torch.ones(2)}}})}
    _write(tmp_path, 1)
    skeleton, tensors = persisting._split(state)
    assert (
        len(tensors) == 2 and persisting._join(skeleton, tensors)["o"][1]["state"][0]["buf"] is tensors["tensor000001"]
    )
    written = persisting.read_newest(tmp_path, rank=0)
    assert written.seq == 1 and written.where == "point 1" and written.steps == 1
    assert written.state["model"][0] == "module" and torch.equal(written.state["model"][1]["w"], torch.full((2,), 1.0))
    assert list(written.state["opt"][1]["state"]) == [0]  # integer keys stay integers


def test_only_whole_snapshots_load_and_the_newest_two_are_kept(tmp_path: Path) -> None:
    for seq in (1, 2, 3):
        _write(tmp_path, seq, world_size=2)
    assert [seq for seq, _ in persisting.whole_snapshots(tmp_path)] == [2, 3]
    assert not any(p.name.startswith("snapshot-00000001") for p in tmp_path.iterdir())
    # a snapshot whose marker never came (its writer killed) is never loaded
    (tmp_path / "snapshot-00000004").mkdir()
    (tmp_path / "snapshot-00000004.ranks").mkdir()
    assert persisting.read_newest(tmp_path, rank=1).seq == 3
    # a rank the written world did not have takes rank 0's generators
    assert persisting.read_newest(tmp_path, rank=5).steps == 3
    os.remove(tmp_path / "snapshot-00000003.json")
    assert persisting.read_newest(tmp_path, rank=0).seq == 2


def _cut_to_half(folder: Path, seq: int) -> tuple[str, int]:
    """The largest data file of snapshot `seq` cut to half its size; (its path in the folder, its size)."""
    data = max((p for p in (folder / persisting._name(seq)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    with open(data, "r+b") as handle:
        handle.truncate(size // 2)
    return str(data.relative_to(folder)), size


def _largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _zero_fill(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def _garble(path: Path) -> None:
    path.write_text('{"seq": 3, "where": ')


# what a crash or a power loss can leave of the newest snapshot: (its damage, what read_newest says)
DAMAGES = {
    "data cut": (lambda f: _cut_to_half(f, 3), r"snapshot-00000003/[^ ]+: [\d.]+ (B|kB) of [\d.]+ (B|kB)\)"),
    "data missing": (lambda f: _largest_file(f / "snapshot-00000003").unlink(), r"snapshot-00000003/\S+ is missing\)"),
    "data zero-filled": (
        lambda f: _zero_fill(_largest_file(f / "snapshot-00000003")),
        r"snapshot-00000003/\S+ does not match its checksum \(zero-filled or overwritten\)\)",
    ),
    "marker without data": (
        lambda f: shutil.rmtree(f / "snapshot-00000003"),
        r"snapshot-00000003/ is missing: the marker has no data\)",
    ),
    "a rank's file cut": (
        lambda f: os.truncate(f / "snapshot-00000003.ranks" / "rank-00001.pt", 10),
        r"snapshot-00000003.ranks/rank-00001.pt: 10 B of [\d.]+ (B|kB)\)",
    ),
    "a rank's file missing": (
        lambda f: (f / "snapshot-00000003.ranks" / "rank-00001.pt").unlink(),
        r"snapshot-00000003.ranks/rank-00001.pt is missing\)",
    ),
    "marker torn": (lambda f: _garble(f / "snapshot-00000003.json"), r"its marker does not read\)"),
}


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_a_damaged_newest_snapshot_is_passed_over_for_the_newest_whole_one(tmp_path: Path, kind: str) -> None:
    for seq in (1, 2, 3):
        _write(tmp_path, seq, world_size=2)
    assert all("files" in marker for _, marker in persisting.whole_snapshots(tmp_path))
    damage, said = DAMAGES[kind]
    damage(tmp_path)
    for rank in (0, 1):  # every rank passes over the same snapshot
        written = persisting.read_newest(tmp_path, rank=rank)
        assert written.seq == 2 and written.steps == 2, kind
        assert torch.equal(written.state["model"][1]["w"], torch.full((2,), 2.0)), kind
        assert len(written.skipped) == 1 and re.fullmatch(r"snapshot 3 is damaged \(" + said, written.skipped[0]), (
            kind,
            written.skipped,
        )


def test_a_snapshot_that_does_not_load_is_passed_over_and_none_whole_says_so(tmp_path: Path) -> None:
    for seq in (2, 3):
        _write(tmp_path, seq)
    # a marker of the first format lists no files: a torn file shows only when it does not load
    for seq in (2, 3):
        marker = tmp_path / f"snapshot-0000000{seq}.json"
        old = json.loads(marker.read_text())
        del old["files"]
        marker.write_text(json.dumps({**old, "version": 1}))
    _zero_fill(_largest_file(tmp_path / "snapshot-00000003"))
    written = persisting.read_newest(tmp_path, rank=0)
    assert written.seq == 2 and written.skipped[0].startswith("snapshot 3 is damaged (it does not load: "), written
    _cut_to_half(tmp_path, 2)
    with pytest.raises(
        FileNotFoundError, match=r"every one is damaged \(snapshot 3 is damaged .*; snapshot 2 is damaged"
    ):
        persisting.read_newest(tmp_path, rank=0)


def _write_until_killed(folder: Path, first: int, starts: int) -> None:
    """The child: snapshots first, first + 1, ... until it is SIGKILLed (a writer a power loss stops);
    a byte on `starts` as each write begins."""
    try:
        seq = first
        while True:
            os.write(starts, b"w")
            _write(folder, seq, world_size=2)
            seq += 1
    finally:
        os._exit(1)  # an error of the child's own: the parent sees no newer snapshot


def _write_started(starts: int) -> float:
    """Wait for the child's next write to begin: when it did (as the parent saw it)."""
    assert select.select([starts], [], [], 30)[0] and os.read(starts, 1) == b"w", "the writer wrote nothing in 30 s"
    return time.perf_counter()


def _unfinished(folder: Path, newest: int) -> bool:
    """Something of a snapshot newer than the newest whole one is on disk: a write was cut."""
    return any((seq := persisting._seq_of(p.name)) is not None and seq > newest for p in folder.iterdir()) or any(
        p.name.endswith(".tmp") for p in folder.rglob("*")
    )


def test_a_writer_killed_anywhere_in_a_write_leaves_the_newest_whole_snapshot_to_resume_from(tmp_path: Path) -> None:
    _write(tmp_path, 1, world_size=2)  # the first in a process is slower: DCP's first call
    draw = random.Random(51)
    kills, cut, one_write = 12, 0, 0.0
    for kill in range(-1, kills):
        newest = persisting.whole_snapshots(tmp_path)[-1][0]
        ready, starts = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(ready)
            _write_until_killed(tmp_path, newest + 1, starts)
        os.close(starts)
        try:
            # the kill falls in the child's first write, or (at first, then every other kill: the
            # writer gets on) in its second, at a point drawn over one write's time as the last one
            # measured took it: a loaded machine's writes are slower, and the point follows them
            began = _write_started(ready)
            if kill < 0 or kill % 2:
                second = _write_started(ready)
                one_write, began = second - began, second
            time.sleep(max(0.0, draw.uniform(0, one_write) - (time.perf_counter() - began)))
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            os.close(ready)  # after the kill: a write to a closed pipe would end the child first
        newest_whole = persisting.whole_snapshots(tmp_path)[-1][0]
        cut += _unfinished(tmp_path, newest_whole)
        written = persisting.read_newest(tmp_path, rank=1)
        # the newest whole snapshot, its state as written: a marker never stands for torn data
        assert written.skipped == (), written.skipped
        assert written.seq == newest_whole >= newest and written.steps == written.seq
        assert torch.equal(written.state["model"][1]["w"], torch.full((2,), float(written.seq)))
    assert cut >= kills // 3, f"only {cut} of {kills} kills fell inside a write ({one_write * 1000:.1f} ms each)"
    assert persisting.whole_snapshots(tmp_path)[-1][0] > 2 + kills // 4, "the writer never got on between kills"


def test_snapshots_are_private_whatever_the_umask_and_load_nothing_pickled_of_a_ranks_file(tmp_path: Path) -> None:
    numpy = pytest.importorskip("numpy")
    folder = tmp_path / "ckpt"
    before = os.umask(0o002)  # a user-private-group umask: files group-writable unless made private
    try:
        settings = persisting.PersistSettings.build(folder, 1, guard=False)
        numpy.random.seed(7)
        rng = {"python": None, "numpy": numpy.random.get_state()}
        state = {"model": ("module", {"w": torch.ones(2)})}
        persisting.write(persisting.Job(settings, 1, "p", state, rng, 1, 0, 1))
    finally:
        os.umask(before)
    modes = {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}
    assert modes["."] == 0o700 and all(m in (0o600, 0o700) for m in modes.values()), modes
    rank_file = folder / "snapshot-00000001.ranks" / "rank-00000.pt"
    torch.load(rank_file, weights_only=True)  # tensors, numbers and containers only
    written = persisting.read_newest(folder, rank=0)
    kind, key, *rest = written.rng["numpy"]
    expected = rng["numpy"]
    assert kind == expected[0] and key.dtype == expected[1].dtype and (key == expected[1]).all()
    assert tuple(rest) == tuple(expected[2:])


def test_a_snapshot_another_user_could_write_is_refused_saying_what_to_fix(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    for seq in (1, 2):
        _write(folder, seq)
    data = _largest_file(folder / "snapshot-00000002")
    os.chmod(data, 0o664)
    with pytest.raises(PermissionError) as refused:
        persisting.read_newest(folder, rank=0)
    assert str(refused.value) == (
        f"ckpt/snapshot-00000002/{data.name} is writable by group or others, who could put code there that every "
        f"rank would run: chmod -R go-w {folder} (or resume from a folder only you can write)"
    )
    os.chmod(data, 0o600)
    os.chmod(folder, 0o777)
    with pytest.raises(PermissionError, match=rf"^{re.escape(str(folder))} is writable by group or others"):
        persisting.read_newest(folder, rank=0)
    os.chmod(folder, 0o700)
    assert persisting.read_newest(folder, rank=0).seq == 2
    if os.geteuid() != 0:
        return  # a file of another user's takes root to make; CI runs as root
    os.chown(folder / "snapshot-00000002.json", 65534, 65534)
    with pytest.raises(
        PermissionError,
        match=r"^ckpt/snapshot-00000002.json is owned by \S+ \(uid 65534\), not by you: resume only from your own",
    ):
        persisting.read_newest(folder, rank=0)


def test_a_folder_holding_a_later_run_is_not_written_over(tmp_path: Path) -> None:
    _write(tmp_path, 7)
    settings = persisting.PersistSettings.build(tmp_path, 1)
    assert settings.earlier == 7
    with pytest.raises(persisting.FolderHoldsNewer, match=r"holds snapshot 7 of an earlier run: %ddp_resume"):
        persisting.write(persisting.Job(settings, 3, "x", {}, {}, 0, 0, 1))
    assert json.loads((tmp_path / "snapshot-00000007.json").read_text())["seq"] == 7


def test_bad_settings_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="persist_every must be a whole number >= 1, got 0"):
        persisting.PersistSettings.build(tmp_path, 0)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match="cannot be written"):
        persisting.PersistSettings.build(blocked / "sub", 1)
    with pytest.raises(FileNotFoundError, match="no whole snapshot"):
        persisting.read_newest(tmp_path, rank=0)


# ---------------------------------------------------------------- as a user types it

SETUP_CELL = """%%ddp --setup
import torch
torch.manual_seed(0)
model = ddp_notebook.prepare_model(torch.nn.Linear(2, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
start_weight = model.module.weight.detach().clone()
ddp_notebook.track(model=model, opt=opt, step=step, persist="ckpt/")"""
TRAIN_CELL = """%%ddp
for _ in range(5):
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
    step += 1"""
# the end-of-cell snapshot is written after the cell: this one waits for it (a test's certainty)
WAIT_CELL = "%%ddp\nfrom ddp_notebook.rank.calls import persist_wait\nassert persist_wait(60)['idle']"


@pytest.mark.integration  # a kernel and a world of its own
def test_ddp_resume_in_a_kernel_after_every_rank_was_lost(tmp_path: Path) -> None:
    from tests.support.kernel import Kernel

    kernel = Kernel(cwd=str(tmp_path))
    try:
        out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2 --backend gloo", timeout=180)
        assert error is None, out
        for cell in (SETUP_CELL, WAIT_CELL):
            out, error = kernel.run(cell)
            assert error is None, out
        state = "%%ddp\nprint(step, model.module.weight.detach().tolist())"
        at_start, error = kernel.run(state)
        assert error is None and "[rank 0] 0 " in at_start, at_start
        # a cell's end writes a snapshot of its own once the one before is done (how many a cell that
        # changes nothing adds depends on the machine's speed), after the cell: the snapshots of step 0
        # are those up to the newest once every write before the training is done, read by its cell
        folder = str(tmp_path / "ckpt")
        out, error = kernel.run(
            "%%ddp\nfrom pathlib import Path\nfrom ddp_notebook.rank import persisting\n"
            "from ddp_notebook.rank.calls import persist_wait\n"
            f"assert persist_wait(60)['idle']\nlast_of_step_0 = persisting.whole_snapshots(Path({folder!r}))[-1][0]\n"
            f"print('last of step 0', last_of_step_0, flush=True)\n{TRAIN_CELL.removeprefix('%%ddp')}"
        )
        assert error is None, out
        # rank 0 writes each marker, after every rank's part: once it is idle, no write is left
        (last_of_step_0,) = (int(n) for n in re.findall(r"\[rank 0\] last of step 0 (\d+)", out))
        out, error = kernel.run(WAIT_CELL)
        assert error is None, out
        trained, error = kernel.run(state)
        assert error is None and "[rank 0] 5 " in trained and trained != at_start, trained
        out, error = kernel.run("%%ddp\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert error is not None and "killed by SIGKILL" in out, out
        out, error = kernel.run("%ddp_stop\n%ddp_start 2 --backend gloo", timeout=180)
        assert error is None, out
        newest = persisting.whole_snapshots(tmp_path / "ckpt")[-1][0]
        out, error = kernel.run(SETUP_CELL)
        assert error is None and f"holds snapshot {newest} of an earlier run: %ddp_resume" in out, out
        # a copy of the folder as a power loss leaves it: the newest snapshot's data cut to half
        torn = tmp_path / "torn"
        shutil.copytree(tmp_path / "ckpt", torn)
        cut, size = _cut_to_half(torn, newest)
        out, error = kernel.run("%ddp_resume torn/")
        assert error is None, out
        print(f"\n%ddp_resume torn/\n{out}")
        older = persisting.whole_snapshots(torn)[-2][0]
        assert (
            f"snapshot {newest} is damaged ({cut}: " in out
            and f"of {persisting._size(size)}): going on from snapshot {older}\n" in out
        ), out
        assert f"every rank goes on from snapshot {older} (" in out and "Traceback" not in out, out
        out, error = kernel.run("%%ddp\nprint(step, torch.equal(model.module.weight.detach(), start_weight))")
        if older <= last_of_step_0:
            assert "[rank 0] 0 True" in out and "[rank 1] 0 True" in out, out
        else:  # the older snapshot is one the end of a later cell wrote, of the trained state
            out, error = kernel.run(state)
            assert sorted(out.splitlines()) == sorted(trained.splitlines()), (older, out, trained)
        out, error = kernel.run("%ddp_resume ckpt/")
        assert error is None, out
        assert f"every rank goes on from snapshot {newest} (the end of a cell) of a world of 2 ranks (" in out
        assert "damaged" not in out, out
        out, error = kernel.run("%%ddp\nprint(step, float(model.module.weight.detach().sum()) != 0)")
        assert "[rank 0] 5 True" in out and "[rank 1] 5 True" in out, out
        # bad input: one line each
        out, error = kernel.run("%ddp_resume")
        assert "the following arguments are required: folder" in out, out
        os.chmod(torn, 0o777)  # a folder anyone may write: refused, before anything of it is unpickled
        out, error = kernel.run("%ddp_resume torn/")
        assert (
            error is None and f"UsageError: could not resume from torn/: {torn} is writable by group or others" in out
        )
        assert "Traceback" not in out, out
        out, error = kernel.run("%ddp_resume nowhere/")
        assert error is None and "UsageError: could not resume from nowhere/: no folder 'nowhere/'" in out, out
        out, error = kernel.run("%ddp_stop")
        assert error is None, out
    finally:
        kernel.close()
