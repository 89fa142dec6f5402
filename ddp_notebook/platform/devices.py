"""Which GPUs, CPU cores and memory this process may use, found without importing torch.

The notebook kernel never imports torch: it only launches ranks, so it must not pay for
torch's import or initialize CUDA (a CUDA context in the kernel would pin memory on GPU 0).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from . import limits

_NVIDIA_PROC_DIR = Path("/proc/driver/nvidia/gpus")


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    listed = listed_gpus()
    if listed is not None:
        return listed
    return tuple(str(i) for i in range(_count_gpus()))


def listed_gpus() -> tuple[str, ...] | None:
    """The entries of CUDA_VISIBLE_DEVICES, in CUDA's order; None where it is unset.

    Reads the environment only (no driver, no subprocess): a rank checks its GPU with it
    before its first CUDA call.
    """
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return None
    valid = []
    for entry in (e.strip() for e in listed.split(",") if e.strip()):
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU
        if entry.startswith("-"):
            break
        valid.append(entry)
    return tuple(valid)


def _count_gpus() -> int:
    if _NVIDIA_PROC_DIR.is_dir():
        return sum(1 for _ in _NVIDIA_PROC_DIR.iterdir())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def usable_cpus() -> int:
    """CPU cores this process may use: its affinity mask (cpusets), capped by its cgroup's CPU
    quota (Docker --cpus, Kubernetes CPU limits, Binder), rounded up; at least 1."""
    return limits.Platform().usable_cpus()


def memory_limit() -> limits.MemoryLimit | None:
    """The memory limit this process (and the ranks it starts) reaches first, with its use;
    None where it cannot be read (not Linux)."""
    return limits.Platform().memory_limit()


def resident_memory_mb(pid: int) -> float | None:
    """Resident memory of a local process in MiB, from /proc (None where unavailable)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_memory_by_pid() -> dict[int, float]:
    """GPU memory in MiB used by each process, from nvidia-smi (empty where unavailable)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        listing = subprocess.run(
            [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    usage: dict[int, float] = {}
    for line in listing.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = usage.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return usage


# ---------------------------------------------------------------- a rank's device (torchrun's rule)


def rank_device(gpu: str | None, local_rank: int) -> str:
    """The device a rank computes on: `cuda:LOCAL_RANK` when it was given a GPU, else `cpu`.

    `gpu` is the CUDA_VISIBLE_DEVICES entry `place_ranks` chose for it, the host's GPU number
    `local_rank`; every rank on the host sees the same list, so that GPU is CUDA device
    LOCAL_RANK in the rank's process, whichever launcher started it.
    """
    return f"cuda:{local_rank}" if gpu is not None else "cpu"


def gpu_problem(gpu: str, local_rank: int, listed: Sequence[str] | None) -> str | None:
    """Why a rank cannot use GPU `gpu` as `cuda:LOCAL_RANK` (None: it can).

    `listed` is the rank's own CUDA_VISIBLE_DEVICES entries, None where the variable is unset
    (CUDA then shows every GPU of the host, and the set-up trusts its numbering). Checked
    before the rank's first CUDA call, so a wrong set-up fails with its cause, not with
    "invalid device ordinal" or, worse, a rank on its neighbour's GPU.
    """
    if listed is None:
        return None
    seen = f"CUDA_VISIBLE_DEVICES={','.join(listed)}" if listed else "CUDA_VISIBLE_DEVICES hides every GPU"
    if sum(entry.startswith("MIG-") for entry in listed) > 1:
        return f"its process is given several MIG instances ({seen}): {MIG_LIMIT}"
    if local_rank < len(listed) and listed[local_rank] == gpu:
        return None
    if local_rank >= len(listed):
        problem = f"its LOCAL_RANK is {local_rank} but its process sees {len(listed)} GPU(s) ({seen})"
    else:
        problem = f"CUDA device {local_rank} of its process is GPU {listed[local_rank]}, not GPU {gpu} ({seen})"
    hint = (
        "every rank on a host must see the same GPUs in the same order and use the one at its LOCAL_RANK, "
        "as under torchrun; do not mask each rank's CUDA_VISIBLE_DEVICES to its own GPU"
    )
    return f"{problem}: {hint}"


MIG_LIMIT = (
    "a CUDA process can use only one MIG instance and NCCL does not support MIG, so the ranks of one world "
    "cannot be MIG slices; give whole GPUs, or one MIG instance for a one-rank world"
)
