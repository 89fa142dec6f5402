"""`%%ddp --profile` / `world.run(..., profile=...)` on a real 2-rank gloo world: a timeline with every
rank's lanes on one clock, a Chrome trace per rank in the folder named, the injected straggler named
with its phase; bad input gets one line; profiling off leaves nothing on the ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from ddp_notebook import DDPCluster, DDPUsageError, ProfileSettings
from ddp_notebook.cell.profiling import parse_steps, prepare_folder
from ddp_notebook.live.profile_analysis import CATEGORIES, _sweep, _what_follows
from ddp_notebook.live.profile_view import ProfileReport
from tests.support.docs_pages import documented_magic_lines
from tests.support.worlds import magics_driving

DOCS = Path(__file__).resolve().parent.parent / "docs" / "seeing_inside.md"

MODEL = """
import time
torch.manual_seed(0)
net = ddp_notebook.prepare_model(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
"""
# rank 1 takes 50 ms longer to get each batch: its peer waits for it in the gradient all-reduce
SLOW_DATA = """
class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if rank == 1:
            time.sleep(0.05)
        return torch.randn(8, 16)
for x in torch.utils.data.DataLoader(Batches(), batch_size=None):
    opt.zero_grad()
    net(x).sum().backward()
    opt.step()
"""
# rank 1 sleeps 50 ms between its forward and its backward, outside any torch op
SLOW_BEFORE_BACKWARD = """
for step in range(7):
    opt.zero_grad()
    loss = net(torch.randn(8, 16)).sum()
    if rank == 1:
        time.sleep(0.05)
    loss.backward()
    opt.step()
"""
HOOKS = (
    "from torch.optim import optimizer as _optimizer_module\n"
    "from ddp_notebook.rank.state import RANK as _rank_state\n"
    "_profiling_left = (len(_optimizer_module._global_optimizer_post_hooks), _rank_state.profiling is None)"
)


def left_on_ranks(world: DDPCluster) -> dict[int, tuple[int, bool]]:
    """Each rank's count of torch's global optimizer post-step hooks, and whether no profile is held."""
    world.execute(HOOKS)
    return world.pull("_profiling_left")


# ---------------------------------------------------------------- unit


def test_settings_and_steps_are_checked() -> None:
    assert ProfileSettings.coerce(3) == ProfileSettings(steps=3)
    assert ProfileSettings.coerce(True) == ProfileSettings()
    for bad in (0, -1, True, 2.5):
        with pytest.raises(DDPUsageError, match="whole number"):
            ProfileSettings(steps=bad)  # type: ignore[arg-type]
    with pytest.raises(DDPUsageError, match="wait must be a whole number >= 0"):
        ProfileSettings(wait=-1)
    assert parse_steps("7") == 7
    for text in ("0", "two", "-3", "1.5"):
        with pytest.raises(DDPUsageError, match="--profile takes the number of steps"):
            parse_steps(text)


def test_an_unwritable_folder_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(DDPUsageError, match=r"cannot write the profiles to /dev/null/profiles: .*--profile-dir"):
        prepare_folder("/dev/null/profiles")
    assert prepare_folder(tmp_path / "a" / "b") == (tmp_path / "a" / "b").resolve()


def test_the_native_profilers_chatter_is_dropped_and_every_other_line_kept(capfd: pytest.CaptureFixture[str]) -> None:
    from ddp_notebook.rank.profiling import ChatterFilter

    quiet = ChatterFilter()
    os.write(2, b"USDT:2026-11-26 10:47:54 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start")
    os.write(2, b"\n")  # kineto ends its line with a write of its own
    os.write(2, b"E1126 CUPTI_ERROR_INSUFFICIENT_PRIVILEGES\n")
    os.write(2, b"[W1126 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the profiling\n")
    os.write(2, b"a line of the user's")
    quiet.close()
    os.write(2, b"\nafter\n")
    assert capfd.readouterr().err == "E1126 CUPTI_ERROR_INSUFFICIENT_PRIVILEGES\na line of the user's\nafter\n"


def test_the_sweep_gives_each_moment_one_category() -> None:
    # compute 0-10 with an optimizer op 4-6 inside it, idle 10-12, a collective in flight 12-20
    spans = [(0.0, 10.0, "compute"), (4.0, 6.0, "optimizer"), (12.0, 20.0, "in_flight"), (14.0, 15.0, "data")]
    assert _sweep(0.0, 22.0, spans) == [
        (0.0, 4.0, "compute"),
        (4.0, 6.0, "optimizer"),
        (6.0, 10.0, "compute"),
        (10.0, 12.0, "idle"),
        (12.0, 14.0, "communication"),
        (14.0, 15.0, "data"),
        (15.0, 20.0, "communication"),
        (20.0, 22.0, "idle"),
    ]


def test_an_idle_stretch_is_named_by_the_part_of_the_step_that_follows_it() -> None:
    def named(ops: list[tuple[float, float, str, str]], at: float) -> str:
        return _what_follows(ops, [op[0] for op in ops], at, 10_000.0)

    # backward's seed gradient, then its engine 0.9 ms later (a loaded machine): still backward
    seed_then_engine = [
        (1000.0, 1010.0, "compute", "aten::ones_like"),
        (1001.0, 1009.0, "compute", "aten::empty_like"),
        (1900.0, 2500.0, "compute", "autograd::engine::evaluate_function: SumBackward0"),
    ]
    assert named(seed_then_engine, 1000.0) == "backward"
    # any other op says which part only when its telling op follows within 0.2 ms
    late_forward = [(1000.0, 1010.0, "compute", "aten::randn"), (1900.0, 2500.0, "compute", "nn.Module: Linear")]
    assert named(late_forward, 1000.0) == "aten::randn"
    soon_forward = [late_forward[0], (1100.0, 1200.0, "compute", "nn.Module: Linear")]
    assert named(soon_forward, 1000.0).startswith("the forward")
    assert named(seed_then_engine, 3000.0) == "the end of the step"


# ---------------------------------------------------------------- on a world


@pytest.mark.integration
@pytest.mark.core
def test_a_profiled_cell_gives_every_ranks_lanes_traces_and_the_straggler(
    world: DDPCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world.execute(MODEL)
    before = left_on_ranks(world)
    world.execute(SLOW_DATA)  # profiling off: nothing is made on the ranks
    assert left_on_ranks(world) == before and all(none_held for _, none_held in before.values())

    folder = tmp_path / "profiles"
    capsys.readouterr()
    world.execute(SLOW_DATA, profile=ProfileSettings(steps=3, folder=folder), timeout=120)
    # the native profiler's routine lines at each start and stop are not the rank's output
    shown = capsys.readouterr()
    chatter = ("profiler_start", "profiler_stop", "unknown size")
    assert not [line for line in (shown.out + shown.err).splitlines() if any(c in line for c in chatter)]
    report = world.last_profile
    assert isinstance(report, ProfileReport)

    # the timeline: every rank's lanes, every category drawn
    lanes = report.lanes()
    assert {"rank 0", "rank 0 comm", "rank 1", "rank 1 comm"} <= set(lanes)
    assert all(lanes[f"rank {rank}"] for rank in (0, 1))
    figure = report.figure()
    assert [trace.name for trace in figure.data] == list(CATEGORIES)
    drawn = {y for trace in figure.data for y in trace.y}
    assert {"rank 0", "rank 1", "rank 0 comm", "rank 1 comm"} <= drawn
    # one clock: the ranks end each step together (they leave the same all-reduce), 50 ms apart
    # otherwise. An offset between the ranks' clocks would be in every step's gap; a rank the machine
    # kept waiting for a core after the all-reduce (the suite's other worker) is late in that step only
    steps = {rank: report.analysis.ranks[rank].steps for rank in (0, 1)}
    assert [len(s) for s in steps.values()] == [3, 3]
    gaps = [abs((mine.start + mine.total) - (theirs.start + theirs.total)) for mine, theirs in zip(*steps.values())]
    assert min(gaps) < 0.01 and max(gaps) < 0.05, gaps
    for rank in (0, 1):
        r = report.analysis.ranks[rank]
        assert r.clock.startswith("the rank's clock marks")
        assert r.top_ops and r.overlap is not None and 0.0 <= r.overlap <= 1.0
        assert len(r.memory) >= 3 and all(m["cpu_rss"] for m in r.memory)

    # a Chrome trace per rank, named after it, that parses back
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for rank in (0, 1):
        path = folder / f"rank{rank}.pt.trace.json"
        assert report.files[rank] == path.resolve()
        trace = json.loads(path.read_text())
        events = trace["traceEvents"]
        complete = [e for e in events if e.get("ph") == "X"]
        assert complete and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in complete)
        assert trace["distributedInfo"]["rank"] == rank
        assert any(e["name"].startswith("ProfilerStep#") for e in complete)

    # the straggler, from the traces: rank 1, waiting for its data
    straggler = report.straggler
    assert straggler is not None and (straggler.rank, straggler.phase) == (1, "data"), report.describe()
    assert straggler.busy - straggler.peers_busy > 0.04
    assert report.analysis.ranks[0].per_step("communication") > 0.04  # rank 0 waits for it
    assert "rank 1 is the straggler" in report.describe()
    assert left_on_ranks(world) == before  # the hook and the profiler are gone after the cell


@pytest.mark.integration
def test_time_outside_torch_ops_is_idle_and_named_by_what_follows(world: DDPCluster, tmp_path: Path) -> None:
    world.execute(MODEL)
    world.execute(SLOW_BEFORE_BACKWARD, profile=ProfileSettings(steps=3, wait=1, warmup=1, folder=tmp_path))
    report = world.last_profile
    assert report is not None and report.straggler is not None, report and report.describe()
    assert (report.straggler.rank, report.straggler.phase) == (1, "idle"), report.describe()
    assert report.straggler.where.endswith("before backward"), report.straggler.where
    assert report.analysis.ranks[1].per_step("idle") > 0.04


@pytest.mark.integration
def test_a_cell_too_short_to_record_says_so(world: DDPCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # profile=4: the default folder, ddp_profiles/DATE-TIME here
    world.execute(MODEL)
    world.execute("opt.zero_grad()\nnet(torch.randn(8, 16)).sum().backward()\nopt.step()", profile=4, timeout=60)
    report = world.last_profile
    assert report is not None and report.files == {} and report.analysis.ranks == {}
    assert any("no step was recorded (1 optimizer steps ran while profiled)" in note for note in report.notes)
    assert "the first recorded step is optimizer step 3" in report.describe()
    assert report.folder.parent == (tmp_path / "ddp_profiles").resolve()


# ---------------------------------------------------------------- the magic


@pytest.fixture
def shell(world: DDPCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An IPython shell (no kernel: the text view) whose magics drive the shared world, in tmp_path."""
    monkeypatch.chdir(tmp_path)
    with magics_driving(world) as ip:
        yield ip


def documented_lines() -> list[str]:
    """The magic lines of docs/seeing_inside.md's profiling section, as written there."""
    return documented_magic_lines(DOCS, "Profiling a few steps")


TRAINING_BODY = """
for x, y in loader:
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()
"""
SETUP = """
torch.manual_seed(0)
model = ddp_notebook.prepare_model(torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = torch.nn.MSELoss()
loader = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(9)]
"""


@pytest.mark.integration
def test_the_documented_magic_lines_and_bad_input(
    shell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = documented_lines()
    assert lines == ["%%ddp --profile", "%%ddp --profile 3 --profile-dir profiles/run1"]
    assert shell.run_cell("%%ddp\n" + SETUP, store_history=False).success
    capsys.readouterr()
    for line in lines:
        result = shell.run_cell(line + "\n" + TRAINING_BODY, store_history=False)
        assert result.success, result.error_in_exec
        out = capsys.readouterr().out
        assert "[profile] rank 0:" in out and "[profile] rank 1:" in out, out
        assert "top ops by self time per step" in out
    assert sorted(p.name for p in (tmp_path / "profiles" / "run1").iterdir()) == [
        "rank0.pt.trace.json",
        "rank1.pt.trace.json",
    ]
    (default,) = (tmp_path / "ddp_profiles").iterdir()  # the first line's: ddp_profiles/DATE-TIME
    assert sorted(p.name for p in default.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]

    for line, says in (
        ("%%ddp --profile 0", "--profile takes the number of steps to record"),
        ("%%ddp --profile two", "--profile takes the number of steps to record"),
        ("%%ddp --profile --profile-dir /dev/null/profiles", "cannot write the profiles to /dev/null/profiles"),
        ("%%ddp --profile-dir somewhere", "--profile-dir goes with --profile"),
    ):
        result = shell.run_cell(line + "\nran = True", store_history=False)
        error = result.error_in_exec
        assert isinstance(error, UsageError) and says in str(error), (line, error)
        assert "\n" not in str(error), str(error)
    assert world_has_no(shell, "ran")


def world_has_no(shell: Any, name: str) -> bool:
    """No rank defines `name`: the refused cells ran nowhere."""
    world = shell.magics_manager.registry["DDPMagics"].world
    world.execute(f"_defined = {name!r} in dir()")
    return set(world.pull("_defined").values()) == {False}


# ---------------------------------------------------------------- GPU traces: our lanes, and HTA's breakdown


def gpu_trace(rank: int, late_us: float) -> dict[str, Any]:
    """A small trace of the shape torch.profiler writes on a GPU rank: 2 steps, each a launch of a
    compute kernel (with `late_us` more of Python before it) and an NCCL all-reduce that overlaps
    its last 100 us."""
    events: list[dict[str, Any]] = []
    pid, tid, correlation = 100 + rank, 100 + rank, 0
    for step in range(2):
        t0 = 1_000_000.0 + step * 2000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 2}", "pid": pid, "tid": tid,
                       "ts": t0, "dur": 1900.0, "args": {}})  # fmt: skip
        # torch also writes the step's span on the GPU's stream, from its first kernel to its last
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step + 2}", "pid": 0,
                       "tid": 7, "ts": t0 + 100 + late_us, "dur": 600.0, "args": {}})  # fmt: skip
        for name, start, dur, stream in (
            ("volta_sgemm_128x64_nn", t0 + 100 + late_us, 400.0, 7),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + 400 + late_us, 300.0, 20),
        ):
            correlation += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                           "ts": start - 50, "dur": 10.0, "args": {"correlation": correlation}})  # fmt: skip
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start, "dur": dur,
                           "args": {"stream": stream, "correlation": correlation, "device": 0}})  # fmt: skip
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
        "deviceProperties": [{"id": 0, "name": "GPU"}],
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        "traceEvents": events,
    }


def test_gpu_traces_get_a_kernel_lane_and_holistic_trace_analysis(tmp_path: Path) -> None:
    from ddp_notebook.live import hta_analysis
    from ddp_notebook.live.profile_analysis import analyse

    traces = {rank: gpu_trace(rank, late_us=300.0 if rank == 1 else 0.0) for rank in (0, 1)}
    analysis = analyse(traces)
    for rank in (0, 1):
        r = analysis.ranks[rank]
        assert [step.step for step in r.steps] == [2, 3], "the GPU's copy of each step's span is not a step"
        assert {s.category for s in r.gpu} == {"compute", "communication", "idle"}
        assert r.overlap == pytest.approx(100 / 300, rel=0.01)  # the all-reduce overlaps the GEMM's last 100 us
    files = {}
    for rank, trace in traces.items():
        files[rank] = tmp_path / f"rank{rank}.pt.trace.json"
        files[rank].write_text(json.dumps(trace))
    breakdown = hta_analysis.gpu_breakdown(files)
    if not hta_analysis.available():
        assert "pip install 'ddp_notebook[profile]'" in breakdown.note
        return
    assert breakdown.note == "", breakdown.note
    assert [row["rank"] for row in breakdown.overlap] == [0, 1]
    # 100 us of the all-reduce's 300 overlap the GEMM: as our own figure says
    assert [round(row["comp_comm_overlap_pctg"]) for row in breakdown.overlap] == [33, 33]
    assert {row["rank"] for row in breakdown.temporal} == {0, 1} and breakdown.idle
