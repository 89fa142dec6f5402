"""Batch jobs from the notebook: the cells a world ran, submitted to Slurm as a torchrun job
(`%ddp_export train.py --submit slurm`), listed, followed and cancelled (`%ddp_jobs`).

Kernel side, no torch. The notebook keeps a record of the jobs it submitted in its folder
(`.ddp_jobs.json`), so `%ddp_jobs` still lists them after a kernel restart, and what became of
each (Slurm forgets a job minutes after it ends; accounting, `sacct`, is often off).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

from ..errors import DDPUsageError
from . import export, joblog, sbatch, slurm

if TYPE_CHECKING:
    from .cluster import DDPCluster

SCHEDULERS = ("slurm",)
RECORDS_FILE = ".ddp_jobs.json"
DEFAULT_FOLLOW_SECONDS = 600.0
LOG_POLL_SECONDS = 0.25
STATE_POLL_SECONDS = 2.0  # squeue at most this often: a cluster's controller is shared


@dataclass(frozen=True)
class JobRecord:
    """One job this notebook submitted, and how it ended once that is known."""

    job_id: str
    name: str
    script: str  # the exported torchrun script
    batch_script: str  # the sbatch script that runs it
    log: str  # the job's log (every node's lines)
    workdir: str
    nodes: int
    nproc_per_node: int
    backend: str
    submitted: float  # seconds since the epoch
    state: str | None = None  # the final state, once the job ended
    exit_code: int | None = None
    cancelled: bool = False  # cancelled from the notebook


@dataclass(frozen=True)
class JobStatus:
    """A job and its state now: Slurm's word while it knows the job, else the record's or the log's."""

    record: JobRecord
    state: str
    exit_code: int | None = None

    @property
    def ended(self) -> bool:
        return slurm.JobState(self.state).ended or self.state == "FINISHED"

    def describe(self) -> str:
        code = f" (exit code {self.exit_code})" if self.exit_code is not None else ""
        return f"job {self.record.job_id} {self.state}{code}"


# ---------------------------------------------------------------------------------- records


def records_path(folder: str | os.PathLike[str] | None = None) -> str:
    """Where this notebook's job records are: `.ddp_jobs.json` in its folder (the kernel's cwd)."""
    return os.path.join(os.path.abspath(os.fspath(folder or os.getcwd())), RECORDS_FILE)


def load_records(folder: str | os.PathLike[str] | None = None) -> list[JobRecord]:
    try:
        with open(records_path(folder), encoding="utf-8") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as problem:
        raise DDPUsageError(f"cannot read the job records {records_path(folder)}: {problem}") from None
    known = {f.name for f in fields(JobRecord)}
    return [JobRecord(**{k: v for k, v in item.items() if k in known}) for item in raw.get("jobs", [])]


def _save_records(records: Iterable[JobRecord], folder: str | os.PathLike[str] | None) -> None:
    path = records_path(folder)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump({"jobs": [asdict(record) for record in records]}, handle, indent=1)
    os.replace(temporary, path)  # a reader never sees half a file


def _update(record: JobRecord, folder: str | os.PathLike[str] | None) -> None:
    records = load_records(folder)
    _save_records([record if r.job_id == record.job_id else r for r in records], folder)


def find(job_id: str | int, folder: str | os.PathLike[str] | None = None) -> JobRecord:
    """This notebook's record of job `job_id`; one line if it has none."""
    wanted = str(job_id).strip()
    records = load_records(folder)
    for record in records:
        if record.job_id == wanted:
            return record
    known = ", ".join(r.job_id for r in records[-5:])
    raise DDPUsageError(
        f"no job {wanted} among this notebook's jobs"
        + (f" (the latest: {known}; %ddp_jobs lists them)" if known else "")
    )


# ---------------------------------------------------------------------------------- submit


def job_spec(
    world: DDPCluster,
    script: str,
    *,
    nodes: int | None = None,
    nproc_per_node: int | None = None,
    gpus_per_node: int | None = None,
    time_limit: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    workdir: str | None = None,
    ranks_in_cells: int | None = None,
) -> sbatch.JobSpec:
    """The job `world`'s cells become: by default as many ranks as the cells ran on, spread
    evenly over as many nodes as the world's hosts, with the world's threads, environment,
    backend (nccl: one rank per GPU) and Python."""
    size = ranks_in_cells or world.world_size or 1
    nodes = nodes if nodes is not None else max(1, len(world.hosts))
    if gpus_per_node is None and world.backend == "nccl":
        gpus_per_node = nproc_per_node or max(1, size // max(nodes, 1))
    if nproc_per_node is None:
        if gpus_per_node:
            nproc_per_node = gpus_per_node
        elif nodes >= 1 and size % nodes == 0:
            nproc_per_node = size // nodes
        else:
            raise DDPUsageError(
                f"the cells ran on {size} ranks, which do not split evenly over {nodes} nodes: "
                "give --nodes N that divides them, or --nproc-per-node P"
            )
    folder, base = os.path.split(script)
    name = os.path.splitext(base)[0]
    return sbatch.JobSpec(
        script=script,
        log=os.path.join(folder, f"{name}-%j.log"),
        workdir=workdir or os.getcwd(),
        python=world.config.launch.python,
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        gpus_per_node=gpus_per_node,
        threads=world.config.threads_per_rank,
        env=dict(world.config.env),
        time_limit=time_limit,
        partition=partition,
        account=account,
        name=name,
    )


def submit_job(
    world: DDPCluster,
    path: str | os.PathLike[str],
    cells: Iterable[int] | None = None,
    *,
    scheduler: str = "slurm",
    nodes: int | None = None,
    nproc_per_node: int | None = None,
    gpus_per_node: int | None = None,
    time_limit: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    overwrite: bool = False,
    folder: str | os.PathLike[str] | None = None,
) -> JobRecord:
    """Export `world`'s cells (default: every one that succeeded) as the torchrun script `path`,
    write the sbatch script beside it (`train.sbatch` for `train.py`), submit it, and record the
    job in the notebook's folder (`folder`, default the current directory). `%ddp_export PATH
    --submit slurm`. Everything is checked before anything is written or submitted."""
    if scheduler not in SCHEDULERS:
        raise DDPUsageError(f"--submit takes {' or '.join(SCHEDULERS)}, got {scheduler!r}")
    slurm.tool("sbatch")  # no Slurm here: say so before writing anything
    script = os.path.abspath(os.fspath(path))
    batch_script = os.path.splitext(script)[0] + ".sbatch"
    if batch_script == script:
        raise DDPUsageError(f"name the script something other than {os.path.basename(script)}, e.g. train.py")
    if os.path.exists(batch_script) and not overwrite:
        raise DDPUsageError(f"{batch_script} exists; pass --force (overwrite=True) to replace it")
    chosen = export.choose(world.cell_history, cells)
    spec = job_spec(
        world,
        script,
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        gpus_per_node=gpus_per_node,
        time_limit=time_limit,
        partition=partition,
        account=account,
        workdir=os.fspath(folder) if folder is not None else None,
        ranks_in_cells=chosen[-1].world_size if chosen else None,
    )
    written = [p for p in (script, batch_script) if not os.path.exists(p)]
    export.export_script(world.cell_history, script, cells, backend=spec.backend, overwrite=overwrite)
    with open(batch_script, "w", encoding="utf-8") as handle:
        handle.write(sbatch.render(spec))
    try:
        job_id = slurm.submit(batch_script)
    except DDPUsageError:
        for made in written:  # refused (a bad partition, a time limit): the same line works again, fixed
            os.remove(made)
        raise
    record = JobRecord(
        job_id=job_id,
        name=spec.name,
        script=script,
        batch_script=batch_script,
        log=spec.log.replace("%j", job_id),
        workdir=spec.workdir,
        nodes=spec.nodes,
        nproc_per_node=spec.nproc_per_node,
        backend=spec.backend,
        submitted=time.time(),
    )
    _save_records([*load_records(folder), record], folder)
    return record


# ---------------------------------------------------------------------------------- state


def _ending_in_log(record: JobRecord) -> int | None:
    """The exit code the batch script wrote as its last line, if it got there."""
    try:
        with open(record.log, "rb") as handle:
            handle.seek(max(0, os.path.getsize(record.log) - 4096))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    marker = sbatch.END_MARKER.format(job=record.job_id, code="")
    for line in reversed(tail.splitlines()):
        if line.startswith(marker) and line[len(marker) :].strip().isdigit():
            return int(line[len(marker) :])
    return None


def job_status(
    record: JobRecord,
    folder: str | os.PathLike[str] | None = None,
    queue: dict[str, slurm.JobState] | None = None,
) -> JobStatus:
    """Where `record`'s job is now: squeue (or `queue`, its answer for several jobs), then
    `scontrol show job` while the controller holds it, then sacct where accounting is on, then
    the log's last line; the ending is kept in the record."""
    if record.state is not None:
        return JobStatus(record, record.state, record.exit_code)
    queued = (queue if queue is not None else slurm.queued([record.job_id])).get(record.job_id)
    if queued is not None and not queued.ended:
        return JobStatus(record, queued.state)
    known = slurm.shown(record.job_id) or slurm.accounted(record.job_id)
    if known is not None and not known.ended:
        return JobStatus(record, known.state)
    from_log = _ending_in_log(record)
    if known is not None:
        state, code = known.state.split()[0], known.exit_code if known.exit_code is not None else from_log
        if state == "CANCELLED" and not code:
            code = from_log  # Slurm says 0:0 of a job cancelled before its script ended
    elif record.cancelled:
        state, code = "CANCELLED", from_log
    elif from_log is not None:
        state, code = ("COMPLETED" if from_log == 0 else "FAILED"), from_log
    else:
        state, code = "FINISHED", None  # gone from the queue, how it ended unknown
    ended = replace(record, state=state, exit_code=code)
    _update(ended, folder)
    return JobStatus(ended, state, code)


def list_jobs(folder: str | os.PathLike[str] | None = None) -> list[JobStatus]:
    """Every job this notebook submitted, oldest first, with its state now (`%ddp_jobs`)."""
    records = load_records(folder)
    unfinished = [record.job_id for record in records if record.state is None]
    queue = slurm.queued(unfinished)  # one squeue for them all
    return [job_status(record, folder, queue) for record in records]


def listing(statuses: list[JobStatus]) -> str:
    """One line a job: id, state, shape, when, the log."""
    if not statuses:
        return "no batch jobs submitted from this notebook's folder yet (%ddp_export train.py --submit slurm)"
    lines = []
    for status in statuses:
        record = status.record
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.submitted))
        code = f" ({status.exit_code})" if status.exit_code is not None else ""
        shape = f"{record.nodes}x{record.nproc_per_node} {record.backend}"
        lines.append(f"{record.job_id:>8}  {(status.state + code):<16} {shape:<12} {when}  {record.name}  {record.log}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- log, cancel


def follow_log(
    job_id: str | int,
    *,
    follow: bool = False,
    timeout: float = DEFAULT_FOLLOW_SECONDS,
    everything: bool = False,
    show: Callable[[str], object] = print,
    folder: str | os.PathLike[str] | None = None,
) -> JobStatus:
    """Show job `job_id`'s log as `%%ddp` shows a cell (`[rank N] ...`): rank 0's lines and every
    rank's errors (`everything=True`: every line). `follow`: keep showing new lines until the job
    ends, or `timeout` seconds pass (the job goes on); returns the job's state at the end."""
    record = find(job_id, folder)
    reader, keep = joblog.LogReader(record.log), joblog.LogFilter(everything=everything)
    end_marker = sbatch.END_MARKER.format(job=record.job_id, code="")
    deadline = time.monotonic() + timeout
    status = job_status(record, folder)
    next_check = time.monotonic() + STATE_POLL_SECONDS
    while True:
        ended_in_log = False
        for raw in reader.new_lines() if not status.ended else reader.rest():
            ended_in_log = ended_in_log or raw.startswith(end_marker)
            shown = keep(raw)
            if shown is not None:
                show(shown)
        if status.ended or not follow:
            return status
        now = time.monotonic()
        if ended_in_log or now >= next_check:
            status = job_status(record, folder)
            next_check = now + STATE_POLL_SECONDS
            if status.ended:
                continue  # one last read: the lines written before it ended
        if now >= deadline:
            show(f"[ddp_notebook] job {record.job_id} is still {status.state} after {timeout:.0f} s; it goes on")
            return status
        time.sleep(LOG_POLL_SECONDS)


def cancel_job(job_id: str | int, folder: str | os.PathLike[str] | None = None) -> JobStatus:
    """Cancel job `job_id` (scancel), noted in the record; `%ddp_jobs --cancel ID`."""
    record = find(job_id, folder)
    status = job_status(record, folder)
    if status.ended:
        return status
    slurm.cancel(record.job_id)
    cancelled = replace(record, cancelled=True)
    _update(cancelled, folder)
    return JobStatus(cancelled, "CANCELLED")
