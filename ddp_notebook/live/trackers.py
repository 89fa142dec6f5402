"""The metrics of `ddp_notebook.log()` kept in an experiment tracker: TensorBoard, MLflow or W&B.

The ranks already stream every point to the notebook (the live view draws them); a tracker is one
more consumer of that stream, in the notebook's kernel: a rank's `log()` costs what it did, and
the writing happens on a thread of the kernel's, never on the cell's relay loop. One run per
training cell that logs (a cell with `--append` continues the previous run), named after the
notebook and the cell; the world's description (ranks, backend, devices) and the hyperparameters
the user names are logged once per run. Rank 0's metrics under their own names, or every rank's
under `NAME/rankN`.

Each tracker's package is optional and imported only when asked for: TensorBoard's event files
(the `tensorboard` package's writer, without torch in the kernel), MLflow (a local SQLite store by
default, or any tracking URI) and Weights & Biases (offline by default).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import DDPUsageError
from .notebook_session import notebook_path

KINDS = ("tensorboard", "mlflow", "wandb")
RANK_CHOICES = ("0", "all")
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny alembic sqlalchemy", "wandb": "wandb"}
FLUSH_SECONDS = 30.0  # how long finishing a run may wait for the writer thread

Point = tuple[str, float, float]  # (tag, step, value)


@dataclass(frozen=True)
class TrackerSettings:
    """Which tracker, where, and whose metrics: `mlflow`, `tensorboard:runs`, `wandb:my-project`."""

    kind: str
    where: str | None = None  # tensorboard: log folder; mlflow: tracking URI; wandb: project
    ranks: str = "0"  # "0": rank 0's metrics under their names; "all": every rank's as NAME/rankN

    @classmethod
    def parse(cls, text: str, ranks: str = "0") -> TrackerSettings:
        kind, _, where = text.strip().partition(":")
        if kind not in KINDS:
            raise DDPUsageError(f"tracker must be one of {', '.join(KINDS)} (optionally KIND:WHERE), got '{text}'")
        if ranks not in RANK_CHOICES:
            raise DDPUsageError(f"tracker ranks must be 0 or all, got '{ranks}'")
        return cls(kind, where or None, ranks)

    def tag(self, name: str, rank: int) -> str | None:
        """The name a point of `rank` is kept under; None: not kept."""
        if self.ranks == "all":
            return f"{name}/rank{rank}"
        return name if rank == 0 else None


class Backend(Protocol):
    def begin(self, run_name: str, description: Mapping[str, str]) -> None: ...
    def params(self, params: Mapping[str, Any]) -> None: ...
    def write(self, points: Sequence[Point]) -> None: ...
    def end(self) -> None: ...


def require(kind: str) -> None:
    """One line naming the package to install when `kind`'s is missing."""
    import importlib.util

    module = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}[kind]
    if importlib.util.find_spec(module) is None:
        raise DDPUsageError(f"the {kind} tracker needs its package: pip install {PACKAGES[kind]}")


class TensorBoardBackend:
    """Event files under `folder/run_name`, written with TensorBoard's own writer."""

    def __init__(self, folder: str | None) -> None:
        self.folder = os.path.abspath(folder or "runs")
        self.writer: Any = None
        self.logdir = ""

    def begin(self, run_name: str, description: Mapping[str, str]) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = os.path.join(self.folder, _safe(run_name))
        self.writer = EventFileWriter(self.logdir)
        self._text("world", description)

    def params(self, params: Mapping[str, Any]) -> None:
        self._text("hyperparameters", {name: repr(value) for name, value in params.items()})
        self.writer.flush()  # text events wait for the writer's 2-minute flush otherwise

    def _text(self, tag: str, table: Mapping[str, str]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        markdown = "\n".join(f"| {key} | {value} |" for key, value in table.items())
        text = f"| name | value |\n|---|---|\n{markdown}".encode()
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(
                plugin_name="text", content=TextPluginData(version=0).SerializeToString()
            )
        )
        tensor = TensorProto(dtype=7, string_val=[text])  # DT_STRING
        value = summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)
        summary = summary_pb2.Summary(value=[value])
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary))

    def write(self, points: Sequence[Point]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        now = time.time()
        for tag, step, value in points:
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            self.writer.add_event(event_pb2.Event(wall_time=now, step=int(step), summary=summary))
        self.writer.flush()

    def end(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MLflowBackend:
    """A run in the experiment named after the notebook, in a local SQLite store by default."""

    def __init__(self, uri: str | None, experiment: str) -> None:
        self.uri = uri or f"sqlite:///{os.path.abspath('mlflow.db')}"
        self.experiment = experiment
        self.client: Any = None
        self.run_id = ""

    def begin(self, run_name: str, description: Mapping[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=run_name, tags={"ddp_notebook.world": "yes"})
        self.run_id = run.info.run_id
        self.params({f"world.{key}": value for key, value in description.items()})

    def params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(key, str(value)[:6000]) for key, value in params.items()])

    def write(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, int(step)) for tag, step, value in points]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def end(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id)
            self.client = None


class WandbBackend:
    """A W&B run, offline by default (WANDB_MODE=online to send it): every tag with its own step axis."""

    def __init__(self, project: str | None, default_project: str) -> None:
        self.project = project or default_project
        self.run: Any = None
        self.axes: set[str] = set()

    def begin(self, run_name: str, description: Mapping[str, str]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE", "offline")
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(
            project=_safe(self.project),
            name=run_name,
            mode=mode,
            dir=os.path.abspath("."),
            config={"world": dict(description)},
            settings=settings,
            reinit="create_new",
        )

    def params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update({"hyperparameters": {key: _plain(value) for key, value in params.items()}})

    def write(self, points: Sequence[Point]) -> None:
        for tag, step, value in points:
            # ranks log at their own steps, out of order between them: each tag has its own x axis
            axis = f"{tag}/step"
            if tag not in self.axes:
                self.run.define_metric(axis, hidden=True)
                self.run.define_metric(tag, step_metric=axis)
                self.axes.add(tag)
            self.run.log({tag: value, axis: step})

    def end(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            if wandb.run is None:
                # wandb's service process (wandb-core) outlives a finished run until the kernel
                # exits; nothing of ours may: it goes with our run, unless the user has one open
                wandb.teardown()


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name).strip("-") or "run"


def make_backend(settings: TrackerSettings, notebook: str) -> Backend:
    require(settings.kind)
    if settings.kind == "tensorboard":
        return TensorBoardBackend(settings.where)
    if settings.kind == "mlflow":
        return MLflowBackend(settings.where, f"ddp_notebook/{notebook}")
    return WandbBackend(settings.where, f"ddp_notebook-{notebook}")


class TrackerRun:
    """One tracker run fed from the notebook's side: points queue up and a thread writes them."""

    def __init__(self, settings: TrackerSettings, backend: Backend, name: str, description: Mapping[str, str]):
        self.settings = settings
        self.backend = backend
        self.name = name
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.error: str | None = None
        self.points = 0
        self._thread = threading.Thread(target=self._write, name="ddp-tracker", daemon=True)
        self._queue.put(("begin", (name, dict(description))))
        self._thread.start()

    def add(self, rank: int, name: str, steps: Sequence[float], values: Sequence[float]) -> None:
        tag = self.settings.tag(name, rank)
        if tag is not None and steps:
            self._queue.put(("write", [(tag, step, value) for step, value in zip(steps, values, strict=False)]))

    def params(self, params: Mapping[str, Any]) -> None:
        if params:
            self._queue.put(("params", dict(params)))

    def flush(self, seconds: float = FLUSH_SECONDS) -> None:
        """Wait until what was queued so far is written (at most `seconds`)."""
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait(seconds)

    def finish(self, seconds: float = FLUSH_SECONDS) -> None:
        self._queue.put(("end", None))
        self._thread.join(seconds)

    def _write(self) -> None:
        held: tuple[str, Any] | None = None  # taken while batching writes: it goes next, in order
        while True:
            what, payload = held if held is not None else self._queue.get()
            held = None
            try:
                if what == "flush":
                    payload.set()
                    continue
                if self.error is not None and what != "end":
                    continue  # a tracker that failed once drops the rest (said once, in `error`)
                if what == "begin":
                    self.backend.begin(*payload)
                elif what == "write":
                    # what queued up meanwhile goes in one batch
                    batch = list(payload)
                    while True:
                        try:
                            more = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if more[0] != "write":
                            held = more  # a flush or params must not move behind what came after it
                            break
                        batch.extend(more[1])
                    self.backend.write(batch)
                    self.points += len(batch)
                elif what == "params":
                    self.backend.params(payload)
                elif what == "end":
                    self.backend.end()
                    return
            except Exception as failure:  # noqa: BLE001  (a tracker's failure never breaks training)
                self.error = f"{type(failure).__name__}: {failure}"
                if what == "end":
                    return


def world_description(world: Any) -> dict[str, str]:
    """What the run's world was: ranks, backend, hosts and devices."""
    ranks = world.ranks
    devices = sorted({f"{info.device} {info.device_name}".strip() for info in ranks})
    return {
        "ranks": str(len(ranks)),
        "backend": str(world.backend),
        "hosts": ",".join(sorted({info.host for info in ranks})),
        "devices": "; ".join(devices),
        "launcher": world.config.launch.launcher,
    }


def notebook_name() -> str:
    """The notebook's file name without its suffix (the kernel's session path), else 'notebook'."""
    return os.path.splitext(os.path.basename(notebook_path()))[0] or "notebook"


class Tracking:
    """A world's tracker: its settings (from `track()`, or one cell's), and the run points go to."""

    def __init__(self) -> None:
        self.settings: TrackerSettings | None = None
        self.param_names: tuple[str, ...] = ()
        self.run: TrackerRun | None = None  # the open run: the next training cell starts another

    def configure(self, settings: TrackerSettings | None, params: Sequence[str] = ()) -> None:
        if settings is not None:
            require(settings.kind)
        self.close()  # the open run ends: cells from here on start runs of their own
        self.settings, self.param_names = settings, tuple(params)

    def attach(
        self,
        feed: Any,
        settings: TrackerSettings | None,
        run_name: str,
        describe: Any,
    ) -> None:
        """Send `feed`'s points to a tracker run: the previous cell's when it appends to it, else a
        new run, begun at the cell's first point (a cell that logs nothing makes no run)."""
        chosen = settings or self.settings
        if chosen is None:
            return
        require(chosen.kind)
        previous = getattr(feed.previous, "tracker_run", None)
        if previous is not None and previous.settings == chosen:
            feed.tracker_run = previous
            feed.on_points = previous.add
            return

        def first_point(rank: int, name: str, steps: list[float], values: list[float]) -> None:
            self.close()
            run = TrackerRun(chosen, make_backend(chosen, notebook_name()), run_name, describe())
            self.run = feed.tracker_run = run
            feed.on_points = run.add
            run.add(rank, name, steps, values)

        feed.on_points = first_point

    def after_cell(self, feed: Any, params: Mapping[str, Any], missing: Sequence[str]) -> str:
        """Log the cell's named hyperparameters, wait for the points to be written; a note to show, or ''."""
        run = getattr(feed, "tracker_run", None)
        if run is None:
            return ""
        run.params(params)
        run.flush()
        notes = []
        if missing:
            notes.append(f"not defined on rank 0, not logged: {', '.join(missing)}")
        if run.error is not None:
            notes.append(f"the {run.settings.kind} tracker failed ({run.error}); the metrics are kept (%ddp_metrics)")
        return "; ".join(notes)

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()
