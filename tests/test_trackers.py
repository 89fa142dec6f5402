"""Metrics of ddp_notebook.log() in experiment trackers, each read back with its own reader:
TensorBoard's event accumulator, MlflowClient on the SQLite store, the records of W&B's offline
run file. One world of 2 gloo ranks serves every tracker."""

from __future__ import annotations

import glob
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ddp_notebook import DDPCluster
from ddp_notebook.errors import DDPUsageError
from ddp_notebook.live.trackers import TrackerSettings
from tests.support.docs_pages import documented_magic_lines
from tests.support.kernel import Kernel, kernel_world_pids
from tests.support.processes import wait_gone

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

# each rank logs loss = 10 * rank + step at steps 0..4, and lr = 0.1 is defined on every rank
TRAINING = "lr = 0.1\nfor step in range(5):\n    ddp_notebook.log(loss=float(10 * rank + step), step=step)"
MORE = "for step in range(5, 8):\n    ddp_notebook.log(loss=float(10 * rank + step), step=step)"


def expected(rank: int, steps: range = range(5)) -> list[tuple[int, float]]:
    return [(step, float(10 * rank + step)) for step in steps]


def test_settings_are_checked_in_one_line() -> None:
    assert TrackerSettings.parse("mlflow") == TrackerSettings("mlflow", None, "0")
    assert TrackerSettings.parse("mlflow:sqlite:///x.db").where == "sqlite:///x.db"
    assert TrackerSettings.parse("tensorboard:runs", "all").tag("loss", 1) == "loss/rank1"
    assert TrackerSettings.parse("wandb").tag("loss", 1) is None  # rank 0's only, by default
    with pytest.raises(DDPUsageError, match="tracker must be one of tensorboard, mlflow, wandb"):
        TrackerSettings.parse("comet")
    with pytest.raises(DDPUsageError, match="tracker ranks must be 0 or all, got 'some'"):
        TrackerSettings.parse("mlflow", "some")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DDPCluster]:
    with DDPCluster(2, backend="gloo") as started:
        yield started


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


class RecordingBackend:
    """What the writer thread asked of its tracker, in order; the first write waits for a gate so that
    what is queued after it is there when the writer batches (the order a loaded machine gives)."""

    def __init__(self) -> None:
        import threading

        self.calls: list[str] = []
        self.gate = threading.Event()

    def begin(self, run_name: str, description: Any) -> None:
        self.calls.append("begin")

    def params(self, params: Any) -> None:
        self.calls.append(f"params {sorted(params)}")

    def write(self, points: Any) -> None:
        self.gate.wait(10)
        self.calls.append(f"write {len(points)}")

    def end(self) -> None:
        self.calls.append("end")


def test_hyperparameters_queued_before_a_flush_are_written_when_it_returns() -> None:
    from ddp_notebook.live.trackers import TrackerRun

    backend = RecordingBackend()
    run = TrackerRun(TrackerSettings.parse("tensorboard", "all"), backend, "cell-1", {})
    run.add(0, "loss", [0.0], [1.0])
    run.add(1, "loss", [0.0], [2.0])  # batched with the first: the writer looks past it
    run.params({"lr": 0.1})
    run.add(0, "loss", [1.0], [3.0])
    backend.gate.set()
    run.flush(10)
    assert "params ['lr']" in backend.calls, backend.calls  # it did not move behind the flush
    run.finish(10)
    assert backend.calls == ["begin", "write 2", "params ['lr']", "write 1", "end"], backend.calls


def test_tensorboard_holds_every_ranks_points(world: DDPCluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    world.track(f"tensorboard:{runs}", ranks="all", params=["lr"])
    try:
        world.execute(TRAINING)
        run = world.tracking.run
        assert run is not None and run.error is None
        [folder] = list(runs.iterdir())
        assert re.fullmatch(r".*cell-\d+", folder.name), folder.name  # named after the notebook and cell
        assert tensorboard_scalars(folder) == {"loss/rank0": expected(0), "loss/rank1": expected(1)}
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(folder))
        accumulator.Reload()
        texts = {
            tag: accumulator.Tensors(tag)[0].tensor_proto.string_val[0].decode()
            for tag in accumulator.Tags()["tensors"]
        }
        assert "| ranks | 2 |" in texts["world"] and "| backend | gloo |" in texts["world"], texts
        assert "| lr | 0.1 |" in texts["hyperparameters"], texts
    finally:
        world.track(None)


def test_mlflow_holds_rank_0s_points_and_an_appended_cell_continues_the_run(world: DDPCluster, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    world.execute(TRAINING, tracker=f"mlflow:{uri}", params=["lr", "nothere"])
    run = world.tracking.run
    assert run is not None
    world.execute(MORE, on_data=world.recorder.feed(ranks=range(2), append=True), tracker=f"mlflow:{uri}")
    assert world.tracking.run is run  # the appended cell went on in the same run
    world.track(None)  # ends it
    client = MlflowClient(tracking_uri=uri)
    [found] = client.search_runs([client.get_experiment_by_name("ddp_notebook/notebook").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "loss"))
    assert history == expected(0, range(8)), history  # rank 0's, exactly; nothing of rank 1's
    assert set(found.data.metrics) == {"loss"}
    assert found.data.params["lr"] == "0.1" and "nothere" not in found.data.params
    assert found.data.params["world.ranks"] == "2" and found.data.params["world.backend"] == "gloo"
    assert found.info.status == "FINISHED" and found.info.run_name.startswith("notebook cell ")


def wandb_records(path: str) -> Iterator[Any]:
    """The protobuf records of a W&B run file: a 7-byte header (':W&B', magic, version), then
    LevelDB's log format (32 KiB blocks of records: crc32c, length, type, data)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left_in_block = block - position % block
        if left_in_block < 7:
            position += left_in_block  # the block's tail is padding
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, position)
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_holds_every_ranks_points(
    world: DDPCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the run's files go under the notebook's folder
    monkeypatch.delenv("WANDB_MODE", raising=False)
    world.track("wandb:curves", ranks="all", params=["lr"])
    world.execute(TRAINING)
    assert [p.name() for p in psutil.Process().children(recursive=True) if p.name() == "wandb-core"]
    world.track(None)
    # wandb's service process went with the run
    assert [p.pid for p in psutil.Process().children(recursive=True) if p.name() == "wandb-core"] == []
    [path] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    points: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, Any] = {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for tag in ("loss/rank0", "loss/rank1"):
                if tag in row:
                    points.setdefault(tag, []).append((int(row[f"{tag}/step"]), float(row[tag])))
        elif kind in ("config", "run"):  # the run's first record holds the config given at its start
            for item in (record.config if kind == "config" else record.run.config).update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    assert points == {"loss/rank0": expected(0), "loss/rank1": expected(1)}, points
    assert "world" in config, config
    assert config["world"]["ranks"] == "2" and config["hyperparameters"] == {"lr": 0.1}, (config, points)


def test_a_missing_tracker_package_is_one_line_before_the_cell_runs(
    world: DDPCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(DDPUsageError, match=r"the mlflow tracker needs its package: pip install mlflow-skinny"):
        world.execute("ran = True", tracker="mlflow")
    assert world.execute("'ran' in dir()").value_text(0) == "False"


DOCS = Path(__file__).resolve().parent.parent / "docs" / "live.md"


def documented_lines() -> list[str]:
    """The magic lines of docs/live.md's trackers section, as written there."""
    return documented_magic_lines(DOCS, "Experiment trackers")


@pytest.mark.integration  # a kernel and a world of its own
def test_the_tracker_magics_in_a_kernel(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    kernel = Kernel()
    ran: list[str] = []

    def cell(first_line: str, body: str = "") -> tuple[str, str | None]:
        ran.append(first_line)
        return kernel.run(f"{first_line}\n{body}" if body else first_line)

    try:
        out, error = kernel.run(f"import os\nos.chdir({str(tmp_path)!r})\n%load_ext ddp_notebook")
        assert error is None, out
        out, error = cell("%ddp_start 2 --tracker mlflow --tracker-ranks all")
        assert error is None, out
        pids = kernel_world_pids(kernel)
        out, error = cell("%%ddp --params lr", TRAINING)
        assert error is None, out
        out, error = cell("%%ddp --tracker tensorboard:runs", TRAINING)
        assert error is None, out
        # --tracker-ranks on a cell's line, as on %ddp_start
        out, error = cell("%%ddp --tracker tensorboard:every_rank --tracker-ranks all", TRAINING)
        assert error is None, out
        out, error = kernel.run("%%ddp --tracker tensorboard:runs --tracker-ranks some\nx = 1")
        assert "UsageError: argument --tracker-ranks: invalid choice: 'some'" in out, out
        out, error = kernel.run("%%ddp --tracker comet\nx = 1")
        assert "UsageError: tracker must be one of tensorboard, mlflow, wandb" in out, out
        out, error = kernel.run("%ddp_stop")
        assert error is None and "stopped the world" in out, out
        assert wait_gone(pids) == []
    finally:
        kernel.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("ddp_notebook/notebook").experiment_id])
    assert sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "loss/rank1")) == expected(1)
    assert found.data.params["lr"] == "0.1"
    [folder] = list((tmp_path / "runs").iterdir())
    assert tensorboard_scalars(folder) == {"loss": expected(0)}  # a cell's own tracker: rank 0's only
    [folder] = list((tmp_path / "every_rank").iterdir())
    assert tensorboard_scalars(folder) == {"loss/rank0": expected(0), "loss/rank1": expected(1)}
    missing = [line for line in documented_lines() if line not in ran]
    assert documented_lines() and missing == [], f"documented in {DOCS.name} but not run as written: {missing}"
