"""Slurm's own commands, as the batch jobs use them: sbatch, squeue, scontrol, sacct, scancel.

Kernel side, standard library only. Every call has a time limit (a slow controller must not
freeze the notebook); a missing command or a refusal is one line (DDPUsageError).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from ..errors import DDPUsageError

COMMAND_SECONDS = 30.0
# states after which a job runs no more (squeue's and sacct's spelling)
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)


@dataclass(frozen=True)
class JobState:
    """What Slurm says of one job: its state (RUNNING, COMPLETED, ...) and exit code once ended."""

    state: str
    exit_code: int | None = None
    nodes: str = ""  # the nodes it runs on, while Slurm knows

    @property
    def ended(self) -> bool:
        return self.state.split()[0] in ENDED


def tool(name: str) -> str:
    """The path of Slurm's command `name`; one line if this machine has none."""
    path = shutil.which(name)
    if path is None:
        raise DDPUsageError(
            f"{name} not found: Slurm's commands are not on this machine's PATH; "
            "run the notebook where they are (a cluster's login node)"
        )
    return path


def _run(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            [tool(name), *args], capture_output=True, text=True, timeout=COMMAND_SECONDS, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise DDPUsageError(
            f"{name} did not answer within {COMMAND_SECONDS:.0f} s: is the Slurm controller up?"
        ) from None
    if check and result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        last = said[-1].removeprefix(f"{name}: error: ") if said else f"exit code {result.returncode}"
        raise DDPUsageError(f"{name} failed: {last}")
    return result


def submit(batch_script: str) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    out = _run("sbatch", "--parsable", batch_script).stdout.strip()
    job_id = out.splitlines()[-1].split(";")[0] if out else ""  # "ID" or "ID;CLUSTER"
    if not job_id.isdigit():
        raise DDPUsageError(f"sbatch answered {out!r}, not a job id")
    return job_id


def queued(job_ids: list[str]) -> dict[str, JobState]:
    """The jobs of `job_ids` still in the queue (pending, running, completing...)."""
    if not job_ids:
        return {}
    # the user's own jobs, filtered here: squeue refuses a list holding one id it forgot. A failed
    # squeue raises: a job it cannot see must not be taken for one that ended
    result = _run("squeue", "--me", "-h", "-o", "%i|%T|%N")
    found = {}
    for line in result.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        state, _, nodes = rest.partition("|")
        if job_id in job_ids:
            found[job_id] = JobState(state, None, nodes)
    return found


def shown(job_id: str) -> JobState | None:
    """`scontrol show job`: a job's state and exit code, while the controller still holds it
    (for MinJobAge seconds after it ended: 300 by default)."""
    result = _run("scontrol", "-o", "show", "job", job_id, check=False)
    if result.returncode != 0:
        return None
    fields = dict(word.partition("=")[::2] for word in result.stdout.split() if "=" in word)
    state = fields.get("JobState")
    if not state:
        return None
    return JobState(state, _exit_code(fields.get("ExitCode", "")), fields.get("NodeList", ""))


def accounted(job_id: str) -> JobState | None:
    """sacct's record of a job; None where accounting is off (or the job unknown)."""
    if shutil.which("sacct") is None:
        return None
    result = _run("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,NodeList", check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return None
    state, exit_code, nodes = [*lines[0].split("|"), "", ""][:3]
    return JobState(state, _exit_code(exit_code), nodes)


def cancel(job_id: str) -> None:
    _run("scancel", job_id)


def _exit_code(text: str) -> int | None:
    """Slurm's EXIT:SIGNAL -> the exit code (128 + signal when a signal ended it)."""
    code, _, signal = text.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(signal) if signal.isdigit() and int(signal) and not int(code) else int(code)
