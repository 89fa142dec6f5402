"""Where the suite's CPU goes, by kind of process (the wall-clock tables of suite_time.py say where a
test waited; on 2 cores kept about 90% busy, what decides the wall time is the CPU every process used).

    python benchmarks/suite_cpu.py record cpu.json &   # samples every process twice a second
    python3 -m pytest -q -p no:cacheprovider -n 3      # the suite (or any run)
    kill %1                                            # SIGTERM: writes cpu.json
    python benchmarks/suite_cpu.py table cpu.json [--biggest 20]

Each process's CPU time (user + system) is read from /proc/PID/stat until it ends, keyed by PID and
start time (less what it had used when the record began); a process that lived under half a
second between two samples is missed. A rank forked
from a template has the template's command line, so forked ranks count with their template.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import time
from collections import defaultdict
from pathlib import Path

from harness import proc_stat

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_SECONDS = 0.5

# first match wins: the kinds of process the suite starts, by their command line
KINDS = [
    ("torchrun agents", r"torch\.distributed\.run|torchrun"),
    ("ranks forked from the tests' template source", r"tests\.support\.template_source"),
    ("templates and the ranks forked from them", r"ddp_notebook\.rank\.template_process"),
    ("ranks started fresh (ssh, MPI, Slurm, detached)", r"ddp_notebook\.rank\.entrypoints engine"),
    ("controllers", r"ddp_notebook\.rank\.entrypoints controller|ipyparallel\.controller"),
    ("kernels", r"ipykernel_launcher"),
    ("pytest and its workers", r"pytest|exec\(eval\(sys\.stdin"),
    ("pip", r"\bpip\b"),
    ("Sphinx", r"sphinx"),
    ("chromium", r"chromium"),
    ("JupyterHub, JupyterLab, Playwright", r"jupyterhub|jupyterlab|jupyter-lab|singleuser|playwright|node\b"),
    ("sshd, Slurm, MPI", r"sshd|\bssh\b|slurm|mpiexec|prte"),
    ("other Python", r"python"),
]


def _read(pid: int) -> tuple[int, float, str] | None:
    """(start time in ticks, CPU seconds, command line) of `pid`, None once it is gone."""
    fields = proc_stat(pid)
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        if not command:  # a kernel thread: its name
            command = f"[{Path(f'/proc/{pid}/comm').read_text(errors='replace').strip()}]"
    except OSError:
        return None
    if fields is None:
        return None
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICK, command[:300]


def record(out: Path) -> None:
    seen: dict[tuple[int, int], list] = {}  # (pid, start) -> [command, cpu seconds, cpu before the record]
    stopped: list[bool] = []
    first_sweep = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.append(True))
    me = os.getpid()
    while not stopped:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            read = _read(int(entry.name))
            if read is None:
                continue
            start, cpu, command = read
            # what ran before the record began is not counted
            known = seen.setdefault((int(entry.name), start), [command, cpu, cpu if first_sweep else 0.0])
            known[1] = cpu
            if known[0].startswith("[") and not command.startswith("["):
                known[0] = command  # read between fork and exec first
        first_sweep = False
        time.sleep(SAMPLE_SECONDS)
    counted = [[pid, start, command, cpu - before] for (pid, start), (command, cpu, before) in seen.items()]
    out.write_text(json.dumps(counted))


def table(path: Path, biggest: int) -> None:
    rows = json.loads(path.read_text())
    cpu: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for row in rows:  # [pid, start, command, cpu seconds]
        command, seconds = row[2], row[3]
        kind = next((kind for kind, pattern in KINDS if re.search(pattern, command)), "the system and the rest")
        cpu[kind] += seconds
        count[kind] += 1
    total = sum(cpu.values()) or 1.0
    print("| kind of process | CPU | share | processes |\n|---|---|---|---|")
    for kind, seconds in sorted(cpu.items(), key=lambda item: -item[1]):
        print(f"| {kind} | {seconds / 60:.1f} min | {100 * seconds / total:.0f}% | {count[kind]} |")
    print(f"| **all** | {total / 60:.1f} min | 100% | {len(rows)} |")
    if biggest:
        print(f"\nthe {biggest} processes of most CPU:")
        for row in sorted(rows, key=lambda row: -row[3])[:biggest]:
            print(f"  {row[3]:7.1f} s  {row[0]:>7}  {row[2][:140]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("record", help="sample every process until SIGTERM or SIGINT").add_argument("out", type=Path)
    shown = commands.add_parser("table", help="the CPU by kind of process")
    shown.add_argument("path", type=Path)
    shown.add_argument("--biggest", type=int, default=0, help="also list this many processes of most CPU")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out)
    else:
        table(args.path, args.biggest)


if __name__ == "__main__":
    main()
