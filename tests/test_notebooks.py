"""Every notebook in notebooks/ runs top to bottom in a real kernel (nbclient)."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import nbformat
import pytest
import torch

from tests.support.notebooks import ExecutedNotebooks, check_dataparallel_vs_ddp, outputs_text, plotly_figures

pytestmark = pytest.mark.notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def widget_models(notebook: nbformat.NotebookNode) -> list[dict]:
    """The widget models the kernel created, in the state its comm messages left them."""
    saved = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return [{"_model_name": model["model_name"], **model["state"]} for model in saved.get("state", {}).values()]


def check_live_metrics(notebook: nbformat.NotebookNode, text: str) -> None:
    """The live view's widgets ended complete; a rank's own tqdm bar and figure came through."""
    models = widget_models(notebook)
    bars = [m for m in models if m["_model_name"] == "IntProgressModel"]
    assert len(bars) == 4 and all(m["value"] == m["max"] and m["bar_style"] == "success" for m in bars)
    html = " ".join(str(m.get("value", "")) for m in models if m["_model_name"] == "HTMLModel")
    assert html.count(">done<") == 2, "both ranks end 'done' in the status table"
    assert "rank 0 · epoch" in html and "rank 1 · batch" in html
    assert "<Metrics: 360 points; loss (rank 0: 160, rank 1: 160)" in text
    # rank 0's own widgets: a tqdm.auto bar that reached its end, and a plotly FigureWidget
    tqdm_bars = [m for m in models if m["_model_name"] == "FloatProgressModel"]
    assert [(m["value"], m["max"]) for m in tqdm_bars] == [(4.0, 4.0)]
    figures = [m for m in models if m.get("_anywidget_id", "").endswith("FigureWidget")]
    assert len(figures) == 2 and any("'type': 'bar'" in str(m.get("_widget_data")) for m in figures)


def check_notebook_to_script(text: str, directory: Path) -> None:
    """%%ddp cells, a DDPCluster script and a torchrun job end with the same loss and parameters."""
    text = text.replace("\r\n", "\n")  # `!command` output comes through a terminal
    losses = re.findall(r"^(\[rank 0\] |\[default0\]:)final training loss ([\d.]+)$", text, re.MULTILINE)
    assert [prefix for prefix, _ in losses] == ["[rank 0] ", "[rank 0] ", "[default0]:"], losses
    assert len({loss for _, loss in losses}) == 1, losses
    pulled = re.search(r"final_loss on each rank: \{0: ([\d.]+), 1: ([\d.]+)\}", text)
    assert pulled and pulled.group(1) == pulled.group(2) and f"{float(pulled.group(1)):.6f}" == losses[0][1]
    assert "[default1]:rank 1 of 2 on cpu, LOCAL_RANK=1" in text
    assert text.count("parameters identical to the notebook's: True") == 3
    assert {p.name for p in directory.glob("*_model.pt")} == {"notebook_model.pt", "api_model.pt", "torchrun_model.pt"}


def check_multi_node(text: str) -> None:
    """Ranks follow the MPI ranks (where Open MPI is installed), train in step; attaching leaves the engines."""
    launcher = "mpi" if shutil.which("mpiexec") else "local"
    assert f"starting the ranks with the {launcher} launcher" in text
    mpi_rank = "OMPI_COMM_WORLD_RANK=1" if launcher == "mpi" else "OMPI_COMM_WORLD_RANK=-"
    assert f"[rank 1] {mpi_rank}, RANK=1, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, WORLD_SIZE=2" in text
    weights = re.findall(r"\[rank (\d)\] accuracy ([\d.]+), weights sum (-?[\d.]+)", text)
    assert sorted(rank for rank, _, _ in weights) == ["0", "1"] and len({w for _, _, w in weights}) == 1
    assert float(weights[0][1]) >= 0.85
    assert re.search(r"attached to profile \S+, cluster demo", text)
    assert text.count("sum of ranks + 1: 3.0") == 2
    assert "its engines keep running in their cluster" in text and "engines still registered: 2" in text
    assert "skipped: no Slurm cluster answers here" in text or "world of 2 ranks (gloo)" in text


FRAMEWORKS = {  # what each framework says about the world it found, on each rank
    "Lightning": "world size 2, global rank {rank}, environment TorchElasticEnvironment",
    "Accelerate": None,
    "HF Trainer": "world size 2, process index {rank}, ParallelMode.DISTRIBUTED",
    "FSDP2": "this rank holds 64 of the 128 values of layers.0.weight",
}


def check_frameworks(text: str) -> None:
    """Each framework ran on 2 ranks as under torchrun: its world, its data split, equal parameters, one bar."""
    for rank in (0, 1):
        assert (
            f"[rank {rank}] RANK={rank}, LOCAL_RANK={rank}, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=1, "
            f"ROLE_RANK={rank} | started like torchrun: True" in text
        )
    assert "[rank 0] Accelerate: 2 processes, DistributedType.MULTI_CPU" in text
    assert "[rank 1] Accelerate: 2 processes" not in text, "accelerator.print prints on rank 0 only"
    sums = {}
    for framework, world in FRAMEWORKS.items():
        name = re.escape(framework)
        if world:
            for rank in (0, 1):
                assert f"[rank {rank}] {framework}: {world.format(rank=rank)}\n" in text, framework
        # computed on each rank: the parameters it ended with, summed
        lines = re.findall(
            rf"^\[rank (\d)\] {name}: (\d+) rows per epoch on this rank, parameter sum (-?[\d.]+)$", text, re.MULTILINE
        )
        assert sorted(rank for rank, _, _ in lines) == ["0", "1"], (framework, lines)
        assert len({total for _, _, total in lines}) == 1, f"{framework}: ranks ended with different parameters"
        sums[framework] = float(lines[0][2])
        # the first epoch, gathered on rank 0: each rank its half (Accelerate pads), together every row
        split = re.search(
            rf"^\[rank 0\] {name}: first epoch: rows per rank \[(\d+), (\d+)\], (\d+) of 120 rows "
            rf"covered, (\d+) shown twice \(padding\)$",
            text,
            re.MULTILINE,
        )
        assert split, framework
        first, second, covered, twice = map(int, split.groups())
        assert first == second == int(lines[0][1]) and covered == 120 and first + second - twice == 120
        assert first <= 64, f"{framework}: a rank saw more than its half of the rows"
        verdict = re.search(
            rf"^\[rank 0\] {name}: parameters equal on all 2 ranks: (\w+); test accuracy ([\d.]+)%$", text, re.MULTILINE
        )
        assert verdict and verdict.group(1) == "True", framework
        assert float(verdict.group(2)) >= 80.0, f"{framework} did not learn: {verdict.group(2)}%"
    # one progress bar per framework, rank 0's, redrawn in place: Lightning's rich bar (where rich is
    # installed) ends at its last epoch; its tqdm bar is a widget, shown once
    lightning_bars = re.findall(r"^Epoch (\d+)(/19)?", text, re.MULTILINE)
    assert len(lightning_bars) == 1 and lightning_bars[0] in (("19", "/19"), ("0", "")), lightning_bars
    assert text.count("Accelerate epochs:") == 1 and text.count("FSDP2 epochs:") == 1
    # the sharded checkpoint, with the optimizer's momentum, loaded in the notebook's own process
    momentum = set(re.findall(r"^\[rank \d\] FSDP2: sum of \|momentum\| ([\d.]+)$", text, re.MULTILINE))
    assert len(momentum) == 1
    loaded = re.search(
        r"^loaded in one process: parameter sum (-?[\d.]+), test accuracy ([\d.]+)%, momentum restored "
        r"for 4 tensors \(sum of \|momentum\| ([\d.]+)\)$",
        text,
        re.MULTILINE,
    )
    assert loaded and "shards written: 2" in text
    assert float(loaded.group(1)) == pytest.approx(sums["FSDP2"], abs=2e-5) and loaded.group(3) in momentum
    assert text.count("process group up: True, sum of ranks + 1: 3.0") == 2
    # each framework's own TensorBoard logger, written by rank 0 alone: one event file each, a point per
    # 10 steps (Lightning's log_every_n_steps), per epoch (accelerator.log), per 20 steps (logging_steps)
    assert "lightning: 1 event file(s), 'loss': 8 points" in text
    assert "accelerate: 1 event file(s), 'loss': 20 points" in text
    assert "hf_trainer: 1 event file(s), 'train/loss': 4 points" in text


RING_BYTES = re.compile(r"^N=(\d): each rank sent ([\d.]+)x to ([\d.]+)x the tensor; 2\(N-1\)/N = ([\d.]+)$", re.M)
RING_TIMES = re.compile(r"^ +([\d,]+) +[\d.]+ +([\d.]+) +([\d.]+) +([\d.]+)$", re.MULTILINE)


def check_ring_allreduce(notebook: nbformat.NotebookNode, text: str) -> None:
    """The hand-written ring sums like dist.all_reduce; the animation is what the ranks recorded;
    each rank sent 2(N-1)/N of the tensor; both all-reduces were timed at every size."""
    assert "[rank 0] ring equals dist.all_reduce on rings of 2, 3 and 4 ranks, 1 to 1001 elements: True" in text
    assert "every rank ends holding every rank's contribution in every chunk: True" in text
    assert "after the reduce-scatter, the fully summed chunks of each rank: {0: [1], 1: [2], 2: [3], 3: [0]}" in text
    animation, sent, timings = plotly_figures(notebook)
    # the start, 3 reduce-scatter and 3 all-gather steps; rank r's chunk c labelled with the ranks summed in it
    frames = animation["frames"]
    assert len(frames) == 7
    assert frames[0]["data"][0]["text"] == [[str(r)] * 4 for r in range(4)]
    assert frames[-1]["data"][0]["z"] == [[4] * 4] * 4 and frames[-1]["data"][0]["text"][0][0] == "0+1+2+3"
    # an arrow per rank from the chunk it sent to the next rank; none at the start
    shown = [[arrow["visible"] for arrow in frame["layout"]["annotations"]] for frame in frames]
    assert shown == [[False] * 4] + [[True] * 4] * 6
    ratios = {int(n): (float(low), float(high), float(formula)) for n, low, high, formula in RING_BYTES.findall(text)}
    assert sorted(ratios) == [2, 3, 4], ratios
    for n, (low, high, formula) in ratios.items():
        assert formula == pytest.approx(2 * (n - 1) / n, abs=0.001)
        assert low == pytest.approx(2 * (n - 1) / n, abs=0.002) and high == pytest.approx(2 * (n - 1) / n, abs=0.002)
    assert {trace["name"] for trace in sent["data"]} >= {"rank 0 (counted)", "rank 3 (counted)", "2(N-1)/N"}
    rows = RING_TIMES.findall(text)
    assert len(rows) >= 3 and all(float(ring) > 0 and float(gloo) > 0 for _, ring, gloo, _ in rows), rows
    for _, ring, gloo, ratio in rows:
        assert float(ratio) == pytest.approx(float(ring) / float(gloo), rel=0.05, abs=0.01)
    assert [trace["name"] for trace in timings["data"]] == ["ring (isend/irecv)", "gloo dist.all_reduce"]
    assert re.search(r"largest tensor \([\d.]+ MB\): the ring took [\d.]+x the time of gloo's all_reduce", text)


def check_mingpt(notebook: nbformat.NotebookNode, text: str, folder: Path) -> None:
    """The loss fell; after %ddp_restart training resumed at the snapshot's epoch; both runs drew every
    rank's curve; the model wrote text."""
    epochs = [(int(e), float(loss), m.start()) for m in EPOCH_LOSS.finditer(text) for e, loss in [m.groups()]]
    resumed = re.search(r"\[rank 0\] resuming from the snapshot gpt_snapshot\.pt: (\d+) epochs run", text)
    assert resumed and "[rank 0] no snapshot: starting at epoch 0 of" in text
    done = int(resumed.group(1))
    before = [epoch for epoch, _, at in epochs if at < resumed.start()]
    after = [epoch for epoch, _, at in epochs if at > resumed.start()]
    assert before == list(range(1, done + 1)) and after and after == list(range(done + 1, after[-1] + 1)), epochs
    assert epochs[-1][1] < epochs[0][1], f"the loss did not fall: {epochs}"
    assert text.count("'trainer' defined: False; snapshot on disk: True") == 2
    # the snapshot the last epoch left, read back here
    assert torch.load(folder / "gpt_snapshot.pt", map_location="cpu")["EPOCHS_RUN"] == after[-1]
    # each training cell's live view: a loss curve per rank, one point per step
    curves = [
        sorted((trace["name"], trace["y"]["shape"][0]) for trace in model["_widget_data"])
        for model in widget_models(notebook)
        if model.get("_anywidget_id", "").endswith("FigureWidget")
    ]
    points = sorted(steps for curve in curves for name, steps in curve if name == "rank 0")
    assert [[name for name, _ in curve] for curve in curves] == [["rank 0", "rank 1"]] * 2, curves
    # the same steps per epoch in both runs: first run done epochs, the resumed one the rest
    assert len(points) == 2 and any(a * (after[-1] - done) == b * done for a, b in (points, points[::-1])), (
        points,
        done,
    )
    sample = re.search(r"^\[rank 0\] sample:\n((?:\[rank 0\] .*\n?)+)", text, re.MULTILINE)
    assert sample and sample.group(1).startswith("[rank 0] The ")
    assert len(sample.group(1).replace("[rank 0] ", "")) > 100


EPOCH_LOSS = re.compile(r"^\[rank 0\] epoch (\d+): mean training loss ([\d.]+); snapshot saved$", re.MULTILINE)


def check_seeing_inside(notebook: nbformat.NotebookNode, text: str) -> None:
    """A skipped and a mismatched collective named within seconds, state kept; the straggler (in the
    live view too); pdb on rank 1."""
    html = " ".join(str(m.get("value", "")) for m in widget_models(notebook) if m["_model_name"] == "HTMLModel")
    assert re.search(r"rank 1 is the straggler: [\d.]+x, compute", html), "the live view names the straggler"
    assert "rank 1 finished the cell without a collective that rank 0 waits in" in text
    assert "rank 0 waits in all_reduce #1 [3], cell line 4" in text
    assert "every rank is blocked, in collectives with different ops" in text
    assert re.search(r"rank 1 waits in broadcast #\d+ \[3\], cell line 2", text)
    assert "[rank 1] kept 10; all-reduce works again: 2.0" in text
    assert re.search(r"rank 1 is the straggler: .* mostly in compute", text)
    assert "[rank 1] (Pdb) p lr\n" in text and "[rank 1] 0.2\n" in text
    assert "[rank 1] -> total = torch.tensor([scaled])" in text and "[rank 1] 0.4\n" in text
    assert "[rank 0] after the breakpoint: scaled 0.2, sum over ranks 0.6" in text


PROFILE_TRACE = re.compile(r"^rank(\d)\.pt\.trace\.json: rank (\d) of 2, (\d+) spans, steps (.+)$", re.MULTILINE)


def check_profiling(notebook: nbformat.NotebookNode, text: str, folder: Path) -> None:
    """The slow rank named from its trace with its phase, then none after the fix; a timeline with
    every rank's lanes; a trace per rank read back; the tracker's run read back; no profiler chatter."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddp_notebook.live.profile_analysis import CATEGORIES

    shown = [
        html.unescape(re.sub(r"<[^>]+>", " ", o["data"]["text/html"]))
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if "text/html" in o.get("data", {}) and "traces in" in o["data"]["text/html"]
    ]
    assert len(shown) == 2, "a report under each profiled cell"
    assert re.search(
        r"rank 1 is the straggler: [\d.]+ ms per step outside communication vs [\d.]+ ms on the others .*"
        r"mostly data: waiting for the next batch",
        shown[0],
    ), shown[0]
    # fixed: no rank waits for its data (on a busy machine a rank a few ms slower in compute may be named)
    assert "mostly data" not in shown[1] and "straggler" in shown[1], shown[1]
    timelines = [f for f in plotly_figures(notebook) if [t.get("name") for t in f["data"]] == list(CATEGORIES)]
    assert len(timelines) == 2
    for timeline in timelines:
        lanes = {y for trace in timeline["data"] for y in trace.get("y", [])}
        assert {"rank 0", "rank 1", "rank 0 comm", "rank 1 comm"} <= lanes, lanes
    traces = PROFILE_TRACE.findall(text)
    assert [(name, rank) for name, rank, _, _ in traces] == [("0", "0"), ("1", "1")], traces
    assert all(int(spans) > 100 and steps.count("ProfilerStep#") == 3 for _, _, spans, steps in traces)
    for run in ("slow_disk", "fixed"):
        assert sorted(p.name for p in (folder / "profiles" / run).iterdir()) == [
            "rank0.pt.trace.json",
            "rank1.pt.trace.json",
        ]
    assert "profiler_st" not in text and "unknown size" not in text, "the native profiler's chatter got through"
    # the tracker's run: rank 0's 20 losses, as the notebook printed them
    (run,) = [p for p in (folder / "runs").iterdir() if p.is_dir()]
    events = EventAccumulator(str(run), size_guidance={"scalars": 0}).Reload()
    losses = [point.value for point in events.Scalars("loss")]
    assert len(losses) == 20
    assert f"run '{run.name}': 20 losses, first {losses[0]:.3f}, last {losses[-1]:.3f}" in text


# in the core subset (benchmarks/compat.py): the quick start, the live view, the failures tour
CORE_NOTEBOOKS = {"01_quickstart.ipynb", "02_live_metrics.ipynb", "03_failures_and_recovery.ipynb"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=p.name, marks=[pytest.mark.core] if p.name in CORE_NOTEBOOKS else []) for p in NOTEBOOKS],
)
def test_notebook_runs(path: Path, executed_notebooks: ExecutedNotebooks) -> None:
    # executed once per session, shared with the docs site's build (tests/conftest.py)
    run = executed_notebooks.get(path)
    notebook, tmp_path = run.notebook, run.folder
    assert executed_notebooks.runner.failed_cells(notebook) == []
    text = outputs_text(notebook)
    assert "stopped the world" in text, "every notebook ends by stopping its world"
    if path.name == "01_quickstart.ipynb":
        accuracy = float(re.search(r"\[rank 0\] test accuracy: ([\d.]+)%", text).group(1))
        assert accuracy >= 85.0
        assert "[rank 1] test accuracy" in text
        assert (tmp_path / "iris_model.pt").exists()
        assert re.search(r"reloaded model, test accuracy: ([\d.]+)%", text)
    if path.name == "03_failures_and_recovery.ipynb":
        assert "rank 1 failed first (root cause)" in text or "bad batch at step 15" in text
        assert "weights identical on all ranks: True" in text
        assert "rank 0: waiting in torch.distributed.all_reduce" in text
        assert "all-reduce works again: 2.0 - step is still 20" in text
        assert "broken (rank 1 gone): %ddp_restart" in text
        assert "fresh process, 'model' defined: False" in text
    if path.name == "02_live_metrics.ipynb":
        check_live_metrics(notebook, text)
    if path.name == "04_dataparallel_vs_ddp.ipynb":
        check_dataparallel_vs_ddp(notebook, text)
    if path.name == "05_notebook_to_script.ipynb":
        check_notebook_to_script(text, tmp_path)
    if path.name == "06_multi_node.ipynb":
        check_multi_node(text)
    if path.name == "07_elastic.ipynb":
        assert re.search(r"rank 1 was killed by SIGKILL\. Rank 1 came back in [\d.]+ s", text)
        assert "every rank is back at the snapshot taken at epoch 1, batch 3" in text
        assert "step 16; weights identical on all ranks: True" in text
        assert "each sample once per epoch: True" in text
        assert "the world has 3 ranks now" in text and "the world has 2 ranks now" in text
        assert "3 ranks, step 22; weights identical on all ranks: True" in text
        assert "third epoch used every sample: True" in text
        assert "2 ranks, step 30; weights identical on all ranks: True" in text
    if path.name == "08_seeing_inside.ipynb":
        check_seeing_inside(notebook, text)
    if path.name == "09_frameworks.ipynb":
        check_frameworks(text)
    if path.name == "10_ring_allreduce.ipynb":
        check_ring_allreduce(notebook, text)
    if path.name == "11_mingpt.ipynb":
        check_mingpt(notebook, text, tmp_path)
    if path.name == "12_profiling.ipynb":
        check_profiling(notebook, text, tmp_path)


def test_there_are_notebooks() -> None:
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
