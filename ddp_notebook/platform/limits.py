"""What the platform lets this process use, read the way the platform sets it.

- Cores: the affinity mask (cpusets), and the CPU quota of the process's cgroup (v2 `cpu.max`,
  v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`). A quota is how Docker's `--cpus`, Kubernetes
  CPU limits and Binder cap a container, and the affinity mask does not show it.
- Memory: `/proc/meminfo`, and the limit, usage and out-of-memory kills of the process's cgroup
  and its ancestors (v2 `memory.max`, `memory.current`, `memory.events`; v1
  `memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.oom_control`): the out-of-memory
  killer strikes at the first of them to fill up.
- GPUs: `nvidia-smi` (the notebook side never imports torch).

Pure reading: every file is read under `root` (default "/"), so tests point it at sample trees.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page; anything this large is none
_V1_UNLIMITED = 1 << 60
MIB = 1 << 20
GIB = 1 << 30
# a running world warns when the memory its ranks share is this full (the killer acts at 100%) ...
MEMORY_WARN_FRACTION = 0.9
# ... once per crossing: the next warning needs the use to have dropped below this first
MEMORY_REARM_FRACTION = 0.85


@dataclass(frozen=True)
class Cgroup:
    """One cgroup directory of one hierarchy (v1: the hierarchy of one controller)."""

    directory: Path
    name: str  # its path inside the hierarchy, e.g. /kubepods/pod1/container
    version: int  # 1 or 2

    def read(self, file: str) -> str | None:
        try:
            return (self.directory / file).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None

    def _keyed(self, file: str) -> dict[str, int]:
        """A flat-keyed file ('key value' lines: memory.stat, memory.events, memory.oom_control)."""
        values: dict[str, int] = {}
        for line in (self.read(file) or "").splitlines():
            key, _, value = line.partition(" ")
            try:
                values[key] = int(value)
            except ValueError:
                continue
        return values

    def memory_limit(self) -> int | None:
        """Bytes this cgroup may use (its own setting, not its ancestors'); None: no limit."""
        text = self.read("memory.max" if self.version == 2 else "memory.limit_in_bytes")
        if text is None or text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return None if value >= _V1_UNLIMITED else value

    def memory_used(self) -> int | None:
        """Bytes in use, less the inactive page cache the kernel reclaims before any kill
        (the working set, as Kubernetes counts it)."""
        text = self.read("memory.current" if self.version == 2 else "memory.usage_in_bytes")
        try:
            usage = int(text or "")
        except ValueError:
            return None
        stat = self._keyed("memory.stat")
        inactive = stat.get("inactive_file" if self.version == 2 else "total_inactive_file", 0)
        return max(0, usage - inactive)

    def oom_kills(self) -> int | None:
        """Processes killed by the out-of-memory killer in this cgroup (v2: and below it)."""
        counters = self._keyed("memory.events" if self.version == 2 else "memory.oom_control")
        return counters.get("oom_kill")

    def cpu_quota(self) -> float | None:
        """Cores' worth of CPU time this cgroup may use per period; None: no quota."""
        if self.version == 2:
            quota, _, period = (self.read("cpu.max") or "max").partition(" ")
        else:
            quota, period = self.read("cpu.cfs_quota_us") or "-1", self.read("cpu.cfs_period_us") or ""
        try:
            cores = int(quota) / int(period)
        except (ValueError, ZeroDivisionError):
            return None  # "max", -1 or unreadable
        return cores if cores > 0 else None


@dataclass(frozen=True)
class _Mount:
    point: str  # where it is mounted
    root: str  # which cgroup of the hierarchy is seen there ("/" unless a container's view)
    version: int
    controllers: frozenset[str]  # v1: the controllers of this hierarchy; v2: empty


@dataclass(frozen=True)
class MemoryLimit:
    """The memory limit that is reached first, and how much of it is in use."""

    limit: int  # bytes
    used: int  # bytes
    source: str  # "cgroup memory limit" or "this machine"
    cgroup: Cgroup | None = None

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)

    @property
    def fraction(self) -> float:
        return self.used / self.limit if self.limit else 0.0

    def describe(self) -> str:
        """The limit in words: 'this machine's 23.5 GiB', 'the cgroup memory limit of 1.5 GiB'."""
        if self.cgroup is None:
            return f"{self.source}'s {format_bytes(self.limit)}"
        return f"the {self.source} of {format_bytes(self.limit)}"


@dataclass(frozen=True)
class OomCounts:
    """The out-of-memory kill counters a process is subject to, read at one moment."""

    cgroups: tuple[tuple[Cgroup, int], ...]  # the process's memory cgroup and its ancestors
    system: int | None  # /proc/vmstat: every kill on the machine, cgroup kills included


@dataclass(frozen=True)
class OomVerdict:
    """Whether the out-of-memory killer struck since a reading: True/False, or None when unknown."""

    killed: bool | None
    cause: str = ""  # "cgroup memory limit 1.5 GiB reached", "the machine ran out of memory"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as nvidia-smi reports it."""

    index: str
    uuid: str
    name: str
    memory_total_mb: float
    memory_used_mb: float


class Platform:
    """Reads the limits of processes on this machine; every file under `root`."""

    def __init__(self, root: str | os.PathLike[str] = "/", affinity: int | None = None) -> None:
        self.root = Path(root)
        self._affinity = affinity  # tests set the mask's size; else the real one is asked for

    def _file(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def _read(self, absolute: str) -> str | None:
        try:
            return self._file(absolute).read_text(encoding="utf8", errors="replace")
        except OSError:
            return None

    # ------------------------------------------------------------------ cgroups

    def _mounts(self) -> list[_Mount]:
        mounts = []
        for line in (self._read("/proc/self/mountinfo") or "").splitlines():
            # ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
            fields = line.split()
            if "-" not in fields:
                continue
            dash = fields.index("-")
            if len(fields) < dash + 4 or len(fields) < 5:
                continue
            kind, super_options = fields[dash + 1], fields[dash + 3]
            root, point = _unescape(fields[3]), _unescape(fields[4])
            if kind == "cgroup2":
                mounts.append(_Mount(point, root, 2, frozenset()))
            elif kind == "cgroup":
                mounts.append(_Mount(point, root, 1, frozenset(super_options.split(","))))
        return mounts

    def cgroups(self, controller: str, pid: int | str = "self") -> list[Cgroup]:
        """The cgroup of `pid` that `controller` ('memory' or 'cpu') acts through, then its
        ancestors up to the root visible here; innermost first. Empty where none is mounted."""
        membership = self._read(f"/proc/{pid}/cgroup")
        if membership is None:
            return []
        v1: dict[str, str] = {}
        v2: str | None = None
        for line in membership.splitlines():
            hierarchy, _, rest = line.partition(":")
            names, _, path = rest.partition(":")
            if hierarchy == "0" and names == "":
                v2 = path
            else:
                for name in names.split(","):
                    v1[name] = path
        mounts = self._mounts()
        # a controller bound to a v1 hierarchy is not available in the unified one (hybrid set-ups)
        for mount in mounts:
            if mount.version == 1 and controller in mount.controllers and controller in v1:
                return self._chain(mount, v1[controller])
        for mount in mounts:
            if mount.version == 2 and v2 is not None:
                return self._chain(mount, v2)
        return []

    def _chain(self, mount: _Mount, path: str) -> list[Cgroup]:
        root = mount.root.rstrip("/")
        if root and (path == root or path.startswith(root + "/")):
            path = path[len(root) :] or "/"
        elif root:
            path = "/"  # a container's view whose cgroup path lies outside it: its own root is it
        parts = [p for p in path.split("/") if p]
        chain = []
        for depth in range(len(parts), -1, -1):
            inside = "/" + "/".join(parts[:depth])
            directory = self._file(mount.point) / "/".join(parts[:depth])
            if directory.is_dir():
                chain.append(Cgroup(directory, (root + inside).rstrip("/") or "/", mount.version))
        return chain

    # ------------------------------------------------------------------ cores

    def affinity_cpus(self) -> int:
        if self._affinity is not None:
            return self._affinity
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)

    def cpu_quota(self, pid: int | str = "self") -> float | None:
        """The tightest CPU quota over the process's cgroup and its ancestors, in cores."""
        quotas = [q for q in (c.cpu_quota() for c in self.cgroups("cpu", pid)) if q is not None]
        return min(quotas) if quotas else None

    def usable_cpus(self, pid: int | str = "self") -> int:
        """Cores' worth of CPU this process may use: the affinity mask, capped by the quota
        (rounded up: a quota of 1.5 cores still runs 2 threads at once), at least 1."""
        cpus = self.affinity_cpus()
        quota = self.cpu_quota(pid)
        return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus

    # ------------------------------------------------------------------ memory

    def meminfo(self) -> dict[str, int]:
        """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); empty where unreadable."""
        values = {}
        for line in (self._read("/proc/meminfo") or "").splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        return values

    def memory_limit(self, pid: int | str = "self", chain: Sequence[Cgroup] | None = None) -> MemoryLimit | None:
        """The limit `pid` reaches first: the cgroup (along its path) or the machine with the
        least memory left. None where not even /proc/meminfo can be read."""
        info = self.meminfo()
        found: MemoryLimit | None = None
        if "MemTotal" in info and "MemAvailable" in info:
            found = MemoryLimit(info["MemTotal"], info["MemTotal"] - info["MemAvailable"], "this machine")
        for cgroup in self.cgroups("memory", pid) if chain is None else chain:
            limit = cgroup.memory_limit()
            if limit is None:
                continue
            used = cgroup.memory_used()
            candidate = MemoryLimit(limit, used or 0, "cgroup memory limit", cgroup)
            if found is None or candidate.available < found.available:
                found = candidate
        return found

    def resident_bytes(self, pid: int) -> int | None:
        """A process's resident memory (VmRSS), None once it is gone."""
        for line in (self._read(f"/proc/{pid}/status") or "").splitlines():
            if line.startswith("VmRSS:"):
                try:
                    return int(line.split()[1]) * 1024
                except (IndexError, ValueError):
                    return None
        return None

    # ------------------------------------------------------------------ out-of-memory kills

    def oom_counts(self, pid: int | str = "self") -> OomCounts:
        cgroups = tuple((c, n) for c in self.cgroups("memory", pid) if (n := c.oom_kills()) is not None)
        return OomCounts(cgroups, self._system_oom_kills())

    def _system_oom_kills(self) -> int | None:
        for line in (self._read("/proc/vmstat") or "").splitlines():
            if line.startswith("oom_kill "):
                try:
                    return int(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None

    def oom_since(self, before: OomCounts) -> OomVerdict:
        """Whether the out-of-memory killer struck among the counters of `before` since it was read.

        A kill counts in the victim's cgroup (v2: and every ancestor): where the innermost went
        up, the tightest limit among those that did was reached (or, with no limit on the path,
        the machine's memory ran out). That counter counts kills of every kind, the machine-wide
        ones too (Linux 4.13 added both together): where it stayed, the killer struck someone
        else's process, in a sibling cgroup (an ancestor's v2 counter moves) or anywhere on the
        machine (its counter moves). Without cgroup counters, the machine's is all there is.
        """
        increased = [c for c, count in before.cgroups if (c.oom_kills() or 0) > count]
        if increased and increased[0] is before.cgroups[0][0]:
            limits = [limit for c in increased if (limit := c.memory_limit()) is not None]
            if limits:
                return OomVerdict(True, f"cgroup memory limit {format_bytes(min(limits))} reached")
            return OomVerdict(True, "the machine ran out of memory")
        if before.cgroups:
            return OomVerdict(False)
        now_system = self._system_oom_kills() if before.system is not None else None
        if now_system is None or before.system is None:
            return OomVerdict(None)
        if now_system > before.system:
            return OomVerdict(True, "the machine ran out of memory")
        return OomVerdict(False)


# ---------------------------------------------------------------------- GPUs

GPU_QUERY = "index,uuid,name,memory.total,memory.used"


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits output, one GPU a line."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            found.append(GpuInfo(parts[0], parts[1], parts[2], float(parts[3]), float(parts[4])))
        except ValueError:
            continue  # "[N/A]" on some MIG set-ups
    return found


def gpus(visible: Iterable[str] | None = None) -> tuple[GpuInfo, ...]:
    """The GPUs nvidia-smi reports with their memory, those of `visible` only (CUDA_VISIBLE_DEVICES
    entries: indices or UUIDs) in that order; empty without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        listing = subprocess.run(
            [smi, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return select_gpus(parse_gpu_query(listing.stdout), visible)


def select_gpus(found: Sequence[GpuInfo], visible: Iterable[str] | None) -> tuple[GpuInfo, ...]:
    if visible is None:
        return tuple(found)
    chosen = []
    for entry in visible:
        match = [g for g in found if entry in (g.index, g.uuid) or (len(entry) > 4 and g.uuid.startswith(entry))]
        chosen.extend(match[:1])
    return tuple(chosen)


# ---------------------------------------------------------------------- words


def format_bytes(value: float | None) -> str:
    """'340 MiB', '1.5 GiB'."""
    if value is None:
        return "-"
    if value >= GIB:
        return f"{value / GIB:.1f} GiB"
    return f"{value / MIB:,.0f} MiB"


def _unescape(text: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(escaped, plain)
    return text
