"""Which launchers a world can be started with, and what each needs, resolved in one place.

`local` is ours: one process per rank on this machine, each started with its own
environment. Every other name is one of ipyparallel's engine launchers, found the way
ipyparallel finds them, through the `ipyparallel.engine_launchers` entry points, so a
launcher a site installs as a plugin works here too. What a world needs from a launcher
beyond ipyparallel's defaults is read from the launcher's class (does it start ranks on
other hosts? does it write a batch script?); a launcher that needs more gets one entry in
`_WORLD_DEFAULTS`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..errors import DDPUsageError

LOCAL = "local"
ENGINE_LAUNCHER_GROUP = "ipyparallel.engine_launchers"
# the order users see them in; any other launcher ipyparallel has comes after these
_LISTED_FIRST = ("local", "mpi", "slurm", "ssh", "pbs", "sge", "lsf", "htcondor")


@cache
def _ipyparallel_launchers() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {entry.name.lower(): entry for entry in entry_points(group=ENGINE_LAUNCHER_GROUP)}


def names() -> tuple[str, ...]:
    """Every launcher name a world accepts, `local` first."""
    known = set(_ipyparallel_launchers()) | {LOCAL}
    return tuple(n for n in _LISTED_FIRST if n in known) + tuple(sorted(known - set(_LISTED_FIRST)))


def check(name: str) -> str:
    """`name` as a launcher name, or a usage error listing the ones there are."""
    if name != LOCAL and name.lower() not in _ipyparallel_launchers():
        raise DDPUsageError(f"launcher must be one of {', '.join(names())}; got {name!r}")
    return name if name == LOCAL else name.lower()


def engine_class(name: str) -> type:
    """ipyparallel's engine-set launcher class for `name` (not for `local`, which is ours)."""
    return _ipyparallel_launchers()[name.lower()].load()  # type: ignore[no-any-return]


def starts_ranks_elsewhere(name: str) -> bool:
    """Whether the launcher usually starts ranks on other hosts (the controller must then listen beyond loopback)."""
    if name in (LOCAL, "mpi"):  # mpiexec may well run on this machine only
        return False
    from ipyparallel.cluster.launcher import BatchSystemLauncher, SSHLauncher

    return issubclass(engine_class(name), (BatchSystemLauncher, SSHLauncher))


@dataclass(frozen=True)
class LaunchContext:
    """What world defaults may depend on."""

    python: str  # the interpreter the ranks run with
    private_dir: str  # a directory only this user reads, removed with the world


def _ssh_defaults(context: LaunchContext) -> dict[str, dict[str, Any]]:
    # every remote step runs this Python (ipyparallel's default is the remote PATH's python3);
    # no connection file is copied: the engines get the connection info through ssh's stdin,
    # never on a command line
    return {"SSHLauncher": {"remote_python": context.python}, "SSHEngineLauncher": {"to_send": []}}


# launchers whose world defaults cannot be read from their class
_WORLD_DEFAULTS: dict[str, Callable[[LaunchContext], dict[str, dict[str, Any]]]] = {
    "ssh": _ssh_defaults,
    "sshproxy": _ssh_defaults,
}


def world_defaults(name: str, context: LaunchContext) -> dict[str, dict[str, Any]]:
    """ipyparallel settings that suit a world started by `name`; the user's settings override them."""
    defaults = _WORLD_DEFAULTS.get(name)
    if defaults is not None:
        return defaults(context)
    from ipyparallel.cluster.launcher import BatchSystemLauncher

    launcher_class = engine_class(name)
    if issubclass(launcher_class, BatchSystemLauncher):
        # ipyparallel writes the batch script into the current (the notebook's) directory
        script = os.path.join(context.private_dir, f"{name}_engines.sh")
        return {launcher_class.__name__: {"batch_file_name": script}}
    return {}


# ---------------------------------------------------------------- shortcut options


@dataclass(frozen=True)
class Shortcut:
    """A `%ddp_start` option that sets one launcher trait."""

    option: str  # as the user types it
    launcher: str  # the launcher it belongs to
    class_name: str
    trait: str
    convert: Callable[[Any], Any] = lambda value: value


def _split(value: str | Sequence[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def _hosts(value: str | Mapping[str, int]) -> dict[str, int]:
    return dict(parse_hosts(value) if isinstance(value, str) else value)


SHORTCUTS: dict[str, Shortcut] = {
    "hosts": Shortcut("--hosts", "ssh", "SSHEngineSetLauncher", "engines", _hosts),
    "partition": Shortcut("--partition", "slurm", "SlurmEngineSetLauncher", "queue"),
    "account": Shortcut("--account", "slurm", "SlurmEngineSetLauncher", "account"),
    "time_limit": Shortcut("--time", "slurm", "SlurmEngineSetLauncher", "timelimit"),
    "mpi_args": Shortcut("--mpi-args", "mpi", "MPIEngineSetLauncher", "mpi_args", _split),
    "ssh_args": Shortcut("--ssh-args", "ssh", "SSHLauncher", "ssh_args", _split),
}


def settings_for(
    launcher: str,
    settings: Sequence[str] | Mapping[str, Mapping[str, Any]] = (),
    **shortcuts: Any,
) -> dict[str, dict[str, Any]]:
    """The ipyparallel configuration for the shortcut options given, plus any `Class.trait=value`."""
    merged: dict[str, dict[str, Any]] = {}

    def put(class_name: str, trait: str, value: Any) -> None:
        merged.setdefault(class_name, {})[trait] = value

    for name, value in shortcuts.items():
        if value is None:
            continue
        shortcut = SHORTCUTS[name]
        if launcher != shortcut.launcher:
            raise DDPUsageError(
                f"{shortcut.option} is for the {shortcut.launcher} launcher; this world uses --launcher {launcher}"
            )
        converted = shortcut.convert(value)
        put(shortcut.class_name, shortcut.trait, converted)
        if name == "ssh_args" and "-p" not in converted:
            put("SSHLauncher", "scp_args", converted)  # scp spells the port -P; the rest (-F, -i, -o, -J) is shared
    if isinstance(settings, Mapping):
        for class_name, traits in settings.items():
            for trait, value in traits.items():
                put(class_name, trait, value)
    else:
        for text in settings:
            put(*parse_setting(text))
    return merged


def parse_hosts(text: str) -> dict[str, int]:
    """'node1,node2:2' -> {'node1': 1, 'node2': 2} (engines per host, for the SSH launcher)."""
    hosts: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        host, colon, count_text = part.rpartition(":") if ":" in part else (part, "", "1")
        if not colon:
            host = part
        try:
            count = int(count_text)
        except ValueError:
            raise DDPUsageError(f"cannot read host '{part}': write HOST or HOST:RANKS, e.g. node1:2,node2:2") from None
        if not host or count < 1:
            raise DDPUsageError(f"cannot read host '{part}': write HOST or HOST:RANKS with RANKS >= 1")
        hosts[host] = hosts.get(host, 0) + count
    if not hosts:
        raise DDPUsageError("--hosts needs at least one host, e.g. --hosts node1:2,node2:2")
    return hosts


def parse_setting(text: str) -> tuple[str, str, Any]:
    """'Class.trait=value' (ipyparallel configuration) -> (class, trait, value).

    The value is read as a Python literal where it is one (numbers, lists, dicts, quoted
    strings), else taken as a plain string, as on ipcluster's command line.
    """
    import ast

    name, equals, value_text = text.partition("=")
    class_name, dot, trait = name.strip().lstrip("-").rpartition(".")
    if not equals or not dot or not class_name.isidentifier() or not trait.isidentifier():
        raise DDPUsageError(
            f"cannot read setting '{text}': write Class.trait=value, e.g. SlurmEngineSetLauncher.qos=high"
        )
    try:
        value: Any = ast.literal_eval(value_text.strip())
    except (ValueError, SyntaxError):
        value = value_text.strip()
    return class_name, trait, value


def slurm_submit_command(settings: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The command the world's Slurm jobs are submitted with (ipyparallel's default: sbatch)."""
    for name in ("SlurmEngineSetLauncher", "SlurmLauncher"):
        command = settings.get(name, {}).get("submit_command")
        if command:
            return [str(part) for part in command]
    return ["sbatch"]


def ssh_slots(settings: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """{host as listed: ranks it may run} of the SSH launcher's hosts list (empty: none)."""
    engines = settings.get("SSHEngineSetLauncher", {}).get("engines") or {}
    slots = {}
    for host, count in engines.items():
        if isinstance(count, Mapping):  # ipyparallel's {"n": N, trait: value} form
            count = count.get("n", 1)
        slots[str(host)] = int(count[0] if isinstance(count, (tuple, list)) else count)
    return slots


def hosts_for_new_ranks(
    ranks: Sequence[int],
    slots: Mapping[str, int],
    running: Mapping[str, int],
    lost: Collection[str] = (),
    former: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """rank -> the host of the list its new process starts on.

    `running` counts the ranks each listed host runs now; a `lost` host takes none. A rank
    whose process died on a host that is still there starts there again (`former`); the others
    take the free slots of the list in its order (the slots a world smaller than its list left:
    its spare hosts). One line, with what to do, when there is no free slot.
    """
    used = {host: running.get(host, 0) for host in slots}
    plan: dict[int, str] = {}
    for rank in ranks:
        before = (former or {}).get(rank)
        candidates = ([before] if before in slots else []) + list(slots)
        host = next((h for h in candidates if h not in lost and used[h] < slots[h]), None)
        if host is None:
            listed = ", ".join(f"{h}:{slots[h]} ({'lost' if h in lost else f'runs {used[h]}'})" for h in slots)
            raise DDPUsageError(
                f"no host of the list has a free slot for rank {rank} ({listed}): list a spare host in --hosts "
                "(%ddp_start N starts N ranks and keeps the other slots spare), or go on with the survivors "
                "(--on-loss shrink)"
            )
        used[host] += 1
        plan[rank] = host
    return plan


def ssh_host_total(settings: Mapping[str, Mapping[str, Any]]) -> int | None:
    """How many ranks the SSH launcher's hosts list has slots for (None: no host list)."""
    return sum(ssh_slots(settings).values()) or None
