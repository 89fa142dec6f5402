"""A world's settings: one frozen dataclass, checked when it is made.

Everything is validated before any process starts, so a bad request costs nothing and
leaves nothing behind (as accelerate's launchers do).
"""

from __future__ import annotations

import inspect
import ipaddress
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import DDPUsageError, name_ranks
from ..platform import devices, limits, network
from . import launchers, layout

Backend = Literal["gloo", "nccl"]
BACKEND_CHOICES = ("auto", "nccl", "gloo")

DEFAULT_COLLECTIVE_TIMEOUT = 120.0
DEFAULT_START_TIMEOUT = 90.0
# how long a detached world waits with no cell running and no kernel attached before it ends itself:
# long enough for a lunch break or a kernel restart, short enough that a forgotten world does not
# hold its GPUs overnight
DEFAULT_IDLE_LIMIT = 3600.0
# lost ranks a world goes on after by itself (replaced or shrunk around): enough for the odd crash
# or killed process, few enough that a cell which kills its rank every time (an out-of-memory
# step) stops after three tries
DEFAULT_MAX_RESTARTS = 3
# what a world does when ranks are lost (their processes or hosts gone): auto replaces local ranks
# and shrinks to the survivors elsewhere (replace there, where the launcher can: ssh, on a free slot)
ON_LOSS_CHOICES = ("auto", "replace", "shrink", "stop")
MAX_DEFAULT_CPU_RANKS = 4
# CPU ranks beyond this many per core are refused (unless forced): each one would get a small
# slice of a core and a few hundred MiB; on fewer cores, up to MAX_DEFAULT_CPU_RANKS still go
CPU_RANKS_PER_CORE = 2
# Memory of one rank before any data or model, as a floor for what a world needs. Measured with
# torch 2.13 (CPU build) on Linux: a world of 2 and of 4 gloo ranks, each after one cell, with
# psutil's memory_full_info() of every process (/tmp script: DDPCluster(n, backend="gloo",
# warm_start=...), then rss/pss/uss per pid): a rank started as a fresh interpreter has RSS
# 333-345 MiB (PSS 262, USS 250); a rank forked from the warm template RSS 270-289 MiB but
# PSS 137-159 MiB (it shares torch with the template, RSS 321 MiB), even after a DDP step and
# gc.collect(). Since the template freezes its objects out of the collector (gc.freeze), a forked
# rank's own memory (USS) after an all_reduce is 40 MiB instead of 108, and the controller (its
# schedulers threads, one heart-monitor process) 131 MiB PSS instead of 253 in 9 processes
# (/tmp script: warm_up(wait=60), DDPCluster(2), one all_reduce, memory_full_info()). The fresh rank's RSS
# covers a warm world too (the template's share included). GPU ranks hold more host memory
# (the CUDA libraries), not measured here: for them this is a lower bound.
RANK_MEMORY_BYTES = 340 * 2**20


@dataclass(frozen=True)
class WorldConfig:
    """Settings of one world of ranks: what `DDPCluster(config)` starts.

    Make one with `WorldConfig.build(n_ranks, **options)`, which fills in the defaults from
    this machine (GPUs, cores, addresses), or directly with every field given.
    `gpus[i]` is the GPU of rank i (a CUDA_VISIBLE_DEVICES entry); empty on CPU.
    `timeout` bounds every collective (torch's default of 30 minutes would freeze a notebook).
    """

    n_ranks: int | None  # None only when attaching: every engine the cluster has
    backend: Backend | Literal["auto"]  # "auto" only for ranks elsewhere: decided once they report
    gpus: tuple[str, ...] = ()
    timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    cell_timeout: float | None = None
    start_timeout: float = DEFAULT_START_TIMEOUT
    master_addr: str = "127.0.0.1"  # where the controller and the rendezvous listen
    curve: bool = False  # CurveZMQ encryption of ipyparallel's traffic
    threads_per_rank: int = 1
    env: dict[str, str] = field(default_factory=dict)
    launch: LaunchConfig = field(default_factory=lambda: LaunchConfig())
    # local ranks are forked from a template that imported torch once (where that is safe)
    warm_start: bool = True
    # how many lost ranks a world goes on after by itself (world.comeback) before a loss breaks it
    max_restarts: int = DEFAULT_MAX_RESTARTS
    # replace the lost ranks, shrink to the survivors, or stop (the world is broken); see ON_LOSS_CHOICES
    on_loss: str = "auto"
    # strict mode (ddp_notebook.strict): every rank checks each collective against its peers' first
    check_collectives: bool = False
    # reload edited user modules on every rank before each cell (%ddp_autoreload)
    autoreload: bool = True
    # a simulation for scale tests and benchmarks: the ranks join torch's fake process group (no
    # communication: every collective returns at once, with wrong values), so hundreds of ranks fit
    # one machine while the engines, channel, X-ray, live view and reports run for real
    simulated: bool = False
    # the controller and the ranks outlive this kernel (`%ddp_attach` from another finds them); the
    # world ends itself after `idle_limit` seconds with no cell running and no kernel attached
    detach: bool = False
    idle_limit: float = DEFAULT_IDLE_LIMIT

    def __post_init__(self) -> None:
        if self.n_ranks is not None or self.launch.attach is None:
            check_rank_count(self.n_ranks)
        if self.backend not in ("gloo", "nccl") and not (self.backend == "auto" and not self.launch.is_local):
            raise DDPUsageError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.backend == "nccl" and self.launch.is_local:
            if not self.gpus:
                raise DDPUsageError("backend 'nccl' needs GPUs and none are visible; use --backend gloo")
            if len(self.gpus) != self.n_ranks:
                raise DDPUsageError(
                    f"{self.n_ranks} ranks need {self.n_ranks} GPUs with nccl, "
                    f"{len(self.gpus)} given ({','.join(self.gpus)})"
                )
        if self.gpus and not self.launch.is_local:
            raise DDPUsageError(
                "--gpus chooses GPUs of this machine; ranks started elsewhere use their host's GPUs by LOCAL_RANK"
            )
        if self.gpus and len(self.gpus) != self.n_ranks:
            raise DDPUsageError(f"{len(self.gpus)} GPUs given for {self.n_ranks} ranks: give one GPU per rank")
        if len(set(self.gpus)) != len(self.gpus):
            raise DDPUsageError(f"each rank needs its own GPU, got {','.join(self.gpus)}")
        for name, value in (("timeout", self.timeout), ("start timeout", self.start_timeout)):
            check_seconds(name, value)
        if self.cell_timeout is not None:
            check_seconds("cell timeout", self.cell_timeout)
        if not is_loopback(self.master_addr) and not self.curve:
            raise DDPUsageError(
                f"listening on {self.master_addr} (beyond loopback) needs CurveZMQ encryption (curve=True)"
            )
        if self.threads_per_rank < 1:
            raise DDPUsageError(f"threads per rank must be >= 1, got {self.threads_per_rank}")
        if self.max_restarts < 0:
            raise DDPUsageError(f"max restarts must be >= 0 (0: a dead rank breaks the world), got {self.max_restarts}")
        if self.on_loss not in ON_LOSS_CHOICES:
            raise DDPUsageError(f"on loss must be one of {', '.join(ON_LOSS_CHOICES)}, got '{self.on_loss}'")
        check_seconds("idle limit", self.idle_limit)
        if self.detach:
            _check_detachable(self.launch)

    @classmethod
    def build(
        cls,
        n_ranks: int | None = None,
        *,
        backend: str = "auto",
        gpus: str | Iterable[int | str] | None = None,
        collective_timeout: float | None = None,
        cell_timeout: float | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        env: Mapping[str, str] | None = None,
        ip: str | None = None,
        curve: bool = False,
        launcher: str = launchers.LOCAL,
        ipp_profile: str | None = None,
        python: str | None = None,
        settings: Iterable[str] | Mapping[str, Mapping[str, Any]] = (),
        attach: AttachTarget | None = None,
        warm_start: bool = True,
        max_restarts: int | None = None,
        on_loss: str = "auto",
        check_collectives: bool = False,
        autoreload: bool = True,
        force: bool = False,
        simulated: bool = False,
        detach: bool = False,
        idle_limit: float = DEFAULT_IDLE_LIMIT,
        timeout: float | None = None,
        profile: str | None = None,
        **shortcuts: Any,
    ) -> WorldConfig:
        """Turn what a user asked for into a checked `WorldConfig`, filling in the defaults.

        - no `n_ranks`: one rank per visible GPU, or on CPU up to 4 ranks (never more than cores,
          counted as the container's CPU quota allows, nor more than the memory holds);
        - `backend="auto"`: nccl when the ranks have GPUs, gloo otherwise;
        - threads per rank: `OMP_NUM_THREADS` if the user set it; else 1 on GPU ranks (as torchrun
          does) and an equal share of the cores on CPU ranks, so ranks never oversubscribe cores;
        - `ip`: where the controller listens: loopback unless asked, or for launchers that start
          ranks on other hosts (ssh, slurm, ...) this machine's address on its default route;
          beyond loopback, CurveZMQ encryption is always on;
        - `collective_timeout`: seconds a collective may wait before it fails (default
          DEFAULT_COLLECTIVE_TIMEOUT; `timeout`, its old name, still works with a DeprecationWarning);
        - `launcher`: `local` or one of ipyparallel's launchers, with `ipp_profile`'s configuration
          (the ipyparallel profile; `profile`, its old name, still works with a DeprecationWarning),
          `settings` (`Class.trait=value` or {class: {trait: value}}) and the shortcut options
          of `launchers.SHORTCUTS` (`hosts`, `partition`, `account`, `time_limit`, `mpi_args`,
          `ssh_args`); ranks started elsewhere may get their number from the launch (ssh
          hosts, the attached cluster), their backend and GPUs from what their hosts have;
        - `attach`: use the engines of a cluster started elsewhere instead of starting ranks;
        - `warm_start`: fork local ranks from a template process that imported torch once
          (Linux; off where the ranks' own environment must be read by a fresh interpreter);
        - `max_restarts`: how many lost ranks (dead processes, lost hosts) the world goes on after
          by itself, bringing every rank back to the last snapshot of the tracked state (default
          DEFAULT_MAX_RESTARTS); past it a loss breaks the world (`restart()` then starts a full one);
        - `on_loss`: how it goes on: `replace` the lost ranks by new processes, `shrink` to the
          survivors (renumbered host by host; tracked loaders deal the rest of the epoch over
          them), `stop` (the world is broken), or `auto` (default): replace where the world can
          start processes (local ranks), shrink elsewhere (launchers, attached clusters);
        - `check_collectives`: strict mode: before each collective of the default group the ranks
          compare op, dtypes and shapes, and all raise the same error when they differ (one small
          all-gather per collective; `ddp_notebook.strict`), on every rank the world starts;
        - `autoreload`: before each cell, every rank reloads the user modules whose file changed
          (IPython's superreload; `DDPCluster.autoreload`, `%ddp_autoreload`);
        - `force`: start a local world that does not fit: more ranks than the memory available
          holds (about RANK_MEMORY_BYTES each before any data), or more CPU ranks than
          CPU_RANKS_PER_CORE per core (and more than 4). Without it such a world is refused.
        - `simulated`: a simulation for scale tests and benchmarks, never for training: CPU ranks of
          one thread join torch's fake process group (every collective returns at once, with wrong
          values, and no rank talks to another), so hundreds fit one machine while the engines,
          channel, X-ray, live view and reports run for real; the memory and cores check is off.
        - `detach`: the controller and the ranks (started here) outlive this kernel, killed or
          restarted: `DDPCluster.attach_detached()` (`%ddp_attach`) from a new kernel finds them with
          every variable; such a world ends itself after `idle_limit` seconds (default
          DEFAULT_IDLE_LIMIT, an hour) with no cell running and no kernel attached, or with `stop()`.
        """
        collective_timeout = renamed_keyword("timeout", timeout, "collective_timeout", collective_timeout)
        ipp_profile = renamed_keyword("profile", profile, "ipp_profile", ipp_profile)
        unknown = set(shortcuts) - set(launchers.SHORTCUTS)
        if unknown:
            raise TypeError(f"unknown world option(s): {', '.join(sorted(unknown))}")
        name = launchers.check(launcher)
        launch = LaunchConfig(
            launcher=name,
            profile=ipp_profile,
            settings=launchers.settings_for(name, _as_settings(settings), **shortcuts),
            python=python or sys.executable,
            attach=attach,
        )
        address = parse_ip(ip) if ip is not None else _default_address(launch)
        if not is_loopback(address) and network.interface_of(address) is None:
            raise DDPUsageError(f"--ip {address} is not an IPv4 address of this machine's network interfaces")
        if backend not in BACKEND_CHOICES:
            raise DDPUsageError(f"backend must be one of {', '.join(BACKEND_CHOICES)}; got {backend!r}")
        if simulated and (backend == "nccl" or gpus is not None):
            raise DDPUsageError("a simulated world runs CPU ranks: leave out backend='nccl' and gpus")
        placement = (
            _ranks_here(n_ranks, "gloo" if simulated else backend, gpus, force or simulated)
            if launch.is_local
            else _ranks_elsewhere(n_ranks, backend, gpus, launch)
        )
        if simulated:
            placement["threads_per_rank"] = 1  # a fake group computes nothing worth a core
        return cls(
            **placement,
            timeout=DEFAULT_COLLECTIVE_TIMEOUT if collective_timeout is None else collective_timeout,
            cell_timeout=cell_timeout,
            start_timeout=start_timeout,
            env=dict(env or {}),
            master_addr=address,
            curve=curve or not is_loopback(address),
            launch=launch,
            warm_start=warm_start,
            max_restarts=DEFAULT_MAX_RESTARTS if max_restarts is None else int(max_restarts),
            on_loss=str(on_loss),
            check_collectives=bool(check_collectives),
            autoreload=bool(autoreload),
            simulated=bool(simulated),
            detach=bool(detach),
            idle_limit=idle_limit,
        )


@dataclass(frozen=True)
class AttachTarget:
    """An ipyparallel cluster started elsewhere, found by connection file or profile + cluster id."""

    url_file: str | None = None
    profile: str | None = None
    cluster_id: str | None = None
    world: str | None = None  # a detached world's id: its entry in the user's registry says where it is
    take_over: bool = False  # a detached world's: attach even while another live kernel is attached

    def describe(self) -> str:
        if self.world:
            return f"the detached world {self.world}"
        if self.url_file:
            return self.url_file
        return f"profile {self.profile or 'default'}" + (f", cluster {self.cluster_id}" if self.cluster_id else "")


@dataclass(frozen=True)
class LaunchConfig:
    """How the ranks are started: which ipyparallel launcher, with which of its settings.

    `settings` is ipyparallel (traitlets) configuration, {class name: {trait: value}}, merged
    over the profile's `ipcluster_config.py`; `python` is the interpreter ranks run with
    (the same path must exist on every host); `attach` connects to a running cluster instead.
    """

    launcher: str = "local"
    profile: str | None = None
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    python: str = sys.executable
    attach: AttachTarget | None = None

    def __post_init__(self) -> None:
        launchers.check(self.launcher)

    @property
    def is_local(self) -> bool:
        """Ranks started here, one process per rank (the rank's env and GPU set before it starts)."""
        return self.launcher == launchers.LOCAL and self.attach is None


def _check_detachable(launch: LaunchConfig) -> None:
    """A detached world is one whose processes this machine started (or one of those, attached again)."""
    if launch.attach is not None and launch.attach.world is None:
        raise DDPUsageError(
            "--detach starts a world that outlives the kernel; an attached cluster's engines outlive it "
            "already: leave out --detach"
        )
    if launch.attach is None and not launch.is_local:
        raise DDPUsageError(
            f"--detach keeps ranks started on this machine (--launcher local); ranks started with --launcher "
            f"{launch.launcher} belong to that launcher's job: leave out --detach"
        )


def check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise DDPUsageError(f"{name} must be a number of seconds > 0, got {value!r}")


def _ranks_here(
    n_ranks: int | None, backend: str, gpus: str | Iterable[int | str] | None, force: bool = False
) -> dict[str, Any]:
    """Rank count, backend, GPUs and threads of a world started on this machine."""
    chosen_gpus = _parse_gpus(gpus) if gpus is not None else None
    available = devices.visible_gpus()
    memory = devices.memory_limit()
    if chosen_gpus is None:
        use_gpus = backend != "gloo" and bool(available)
        if n_ranks is None:
            n_ranks = len(available) if use_gpus else _default_cpu_ranks(memory)
        check_rank_count(n_ranks)
        if use_gpus:
            if n_ranks > len(available):
                if backend == "nccl":
                    raise DDPUsageError(
                        f"{n_ranks} ranks asked for but only {len(available)} GPU(s) visible; "
                        f"use at most {len(available)} ranks with nccl, or --backend gloo"
                    )
                raise DDPUsageError(
                    f"{n_ranks} ranks asked for but only {len(available)} GPU(s) visible: one rank per GPU "
                    f"(use %ddp_start {len(available)}), or --backend gloo to run CPU ranks"
                )
            chosen_gpus = available[:n_ranks]
        else:
            chosen_gpus = ()
    else:
        if n_ranks is None:
            n_ranks = len(chosen_gpus)
        check_rank_count(n_ranks)
        if not available:
            raise DDPUsageError(
                f"--gpus {','.join(chosen_gpus)}: no GPU is visible on this machine; "
                "leave out --gpus to start CPU ranks (gloo)"
            )
        unknown = [g for g in chosen_gpus if g not in available]
        if unknown:
            raise DDPUsageError(f"GPU(s) {','.join(unknown)} not visible; visible: {','.join(available)}")
    layout.check_world_gpus(chosen_gpus)
    if not force:
        _check_fit(n_ranks, bool(chosen_gpus), memory)
    resolved = ("nccl" if chosen_gpus else "gloo") if backend == "auto" else backend
    if resolved == "nccl" and not chosen_gpus:
        raise DDPUsageError("backend 'nccl' needs GPUs and none are visible; use --backend gloo (or auto)")
    return {
        "n_ranks": n_ranks,
        "backend": resolved,
        "gpus": tuple(chosen_gpus),
        "threads_per_rank": _threads_per_rank(n_ranks, bool(chosen_gpus)),
    }


def _default_cpu_ranks(memory: limits.MemoryLimit | None) -> int:
    """Up to 4 CPU ranks, no more than cores, nor than the memory available holds (at least 1)."""
    most = min(MAX_DEFAULT_CPU_RANKS, devices.usable_cpus())
    if memory is not None:
        most = min(most, max(1, memory.available // RANK_MEMORY_BYTES))
    return most


def max_cpu_ranks(cpus: int) -> int:
    """The most CPU ranks a machine with `cpus` cores takes without --force."""
    return max(MAX_DEFAULT_CPU_RANKS, CPU_RANKS_PER_CORE * cpus)


def _check_fit(n_ranks: int, on_gpu: bool, memory: limits.MemoryLimit | None) -> None:
    """Refuse a local world that cannot fit this machine: one line, what fits, how to override."""
    kind = "GPU" if on_gpu else "CPU"
    fits = n_ranks
    reasons = []
    if not on_gpu:
        cpus = devices.usable_cpus()
        most = max_cpu_ranks(cpus)
        if n_ranks > most:
            fits = min(fits, most)
            reasons.append(f"{cpus} core{'s' if cpus != 1 else ''} take at most {most} CPU ranks")
    if memory is not None and n_ranks * RANK_MEMORY_BYTES > memory.available:
        held = int(memory.available // RANK_MEMORY_BYTES)
        fits = min(fits, held)
        reasons.append(
            f"{n_ranks} ranks need about {limits.format_bytes(n_ranks * RANK_MEMORY_BYTES)} "
            f"({limits.format_bytes(RANK_MEMORY_BYTES)} each before any data) and "
            f"{limits.format_bytes(memory.available)} is free of {memory.describe()}"
        )
    if not reasons:
        return
    advice = f"start at most {fits} (%ddp_start {fits})" if fits >= 1 else "free some memory first"
    raise DDPUsageError(
        f"{n_ranks} {kind} ranks do not fit here: {'; '.join(reasons)}; "
        f"{advice}, or add --force (force=True) to start {n_ranks} anyway"
    )


def _ranks_elsewhere(n_ranks: int | None, backend: str, gpus: object, launch: LaunchConfig) -> dict[str, Any]:
    """Rank count and threads of a world started by a launcher or attached; backend decided later."""
    if gpus is not None:
        raise DDPUsageError(
            "--gpus chooses GPUs of this machine; ranks started elsewhere use their host's GPUs by LOCAL_RANK"
        )
    host_total = launchers.ssh_host_total(launch.settings)
    if n_ranks is None:
        n_ranks = host_total
    if n_ranks is None and launch.attach is None:
        raise DDPUsageError(f"say how many ranks to start with the {launch.launcher} launcher, e.g. %ddp_start 4")
    if n_ranks is not None and host_total is not None and n_ranks > host_total:
        # fewer is fine: the first N slots start, the others are spare (replacements, %ddp_resize)
        raise DDPUsageError(f"{n_ranks} ranks asked for but the ssh hosts list has slots for {host_total}")
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    # ranks elsewhere share their host's cores with unknown neighbours: torchrun's default
    return {
        "n_ranks": n_ranks,
        "backend": backend,
        "threads_per_rank": int(threads) if threads.isdigit() and int(threads) > 0 else 1,
    }


def _as_settings(
    settings: Iterable[str] | Mapping[str, Mapping[str, Any]],
) -> list[str] | Mapping[str, Mapping[str, Any]]:
    return settings if isinstance(settings, Mapping) else list(settings)


def _default_address(launch: LaunchConfig) -> str:
    if launch.attach is not None or not launchers.starts_ranks_elsewhere(launch.launcher):
        return "127.0.0.1"
    address = network.primary_address()
    if address is None:
        raise DDPUsageError(
            f"the {launch.launcher} launcher starts ranks on other hosts, and this machine has no address "
            "they could reach it at; give one with --ip ADDRESS"
        )
    return address


def parse_ip(text: str) -> str:
    """An IP address of this machine to listen on, checked (no hostnames: say which interface)."""
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        raise DDPUsageError(f"--ip needs an IP address of this machine such as 127.0.0.1, got '{text}'") from None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def check_rank_count(n_ranks: object) -> None:
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
        raise DDPUsageError(f"number of ranks must be a whole number >= 1, got {n_ranks!r}")


def _parse_gpus(gpus: str | Iterable[int | str]) -> tuple[str, ...]:
    items = gpus.split(",") if isinstance(gpus, str) else [str(g) for g in gpus]
    parsed = tuple(item.strip() for item in items if item.strip())
    if not parsed:
        raise DDPUsageError("--gpus needs a list of GPU indices such as 0,1")
    return parsed


def _threads_per_rank(n_ranks: int, on_gpu: bool) -> int:
    user_setting = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user_setting.isdigit() and int(user_setting) > 0:
        return int(user_setting)
    if on_gpu:
        return 1
    return max(1, devices.usable_cpus() // n_ranks)


def parse_rank_count(text: str) -> int:
    """Parse the N of `%ddp_start N`, with a message that says what to type instead."""
    try:
        value = int(text)
    except ValueError:
        raise DDPUsageError(f"'{text}' is not a number of ranks; give a whole number >= 1, e.g. %ddp_start 2") from None
    if value < 1:
        raise DDPUsageError(f"number of ranks must be >= 1, got {value}; e.g. %ddp_start 2")
    return value


def select_ranks(ranks: Iterable[int] | str | None, world_size: int) -> tuple[int, ...]:
    """Ranks chosen by a caller, sorted, against a world's size: None is every rank, a string is
    read by `parse_ranks`, numbers are checked to exist."""
    if ranks is None:
        return tuple(range(world_size))
    if isinstance(ranks, str):
        return parse_ranks(ranks, world_size)
    chosen = tuple(sorted(set(ranks)))
    outside = [r for r in chosen if not (isinstance(r, int) and 0 <= r < world_size)]
    if outside:
        raise _no_such_ranks(outside, world_size)
    if not chosen:
        raise DDPUsageError("no ranks selected")
    return chosen


def _no_such_ranks(outside: list[int], world_size: int) -> DDPUsageError:
    exist = "do not exist" if len(set(outside)) > 1 else "does not exist"
    return DDPUsageError(f"{name_ranks(outside)} {exist}: this world has ranks 0-{world_size - 1}")


def parse_ranks(spec: str, world_size: int) -> tuple[int, ...]:
    """Parse a rank selection such as '0', '0,2', '1-3' or 'all' against a world's size."""
    text = spec.strip()
    if text in ("all", "*", ""):
        return tuple(range(world_size))
    chosen: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low_text, dash, high_text = part[1:].partition("-") if part.startswith("-") else part.partition("-")
        if part.startswith("-"):
            low_text = "-" + low_text
        try:
            low = int(low_text)
            high = int(high_text) if dash else low
        except ValueError:
            raise DDPUsageError(f"cannot read ranks '{spec}': use numbers like 0, 0,2 or 1-3 (or 'all')") from None
        if low > high:
            raise DDPUsageError(f"rank range '{part}' runs backwards; write {high}-{low}")
        chosen.extend(range(low, high + 1))
    outside = [r for r in chosen if not 0 <= r < world_size]
    if outside:
        raise _no_such_ranks(outside, world_size)
    return tuple(sorted(set(chosen)))


def renamed_keyword(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of keyword `new`, or of its old name `old` with a DeprecationWarning (as the
    magics' old flags are read, with a note); both given is a TypeError."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"give {new}= (the new name of {old}=), not both")
    said = f"{old}= is now {new}= (as the magics' --{new.replace('_', '-')})"
    warnings.warn(said, DeprecationWarning, stacklevel=_outside_the_package())
    return old_value


def _outside_the_package() -> int:
    """The stack level of the first caller outside this package (the user's line that gave the
    old keyword, through DDPCluster(...) or WorldConfig.build alike), for warnings.warn."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = inspect.currentframe()
    frame, level = (here.f_back if here is not None else None), 1  # renamed_keyword's: warn's level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level
