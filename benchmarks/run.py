"""Run a benchmark scenario on some subjects; `all` runs every scenario, `peers` every scenario
on every subject and writes results/peers.md.

    python benchmarks/run.py SCENARIO [--subjects a,b,...] [--ranks N] [--repeats K] [--json PATH] [options]
    python benchmarks/run.py all          # results/<scenario>.json for each
    python benchmarks/run.py scale [--sizes 2,8,...] [--browser N] [--hosts K]   # a simulated world as ranks grow
    bash benchmarks/peers_env.sh && benchmarks/.peers-venv/bin/python benchmarks/run.py peers

Exits non-zero if a subject failed, or if any process started by the run outlived it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from framework_scenario import NAMES as FRAMEWORK_NAMES
from framework_scenario import Frameworks
from harness import DATA_KINDS, RESULTS, exit_on_sigterm, machine_info, machine_line, warm_file_cache, write_json
from scenarios import SCENARIOS, Run, Scenario, drive
from subjects import SUBJECTS, world

CASES = ("raise", "hang", "interrupt", "death")
# opt-in failure cases (not in the default list, so `peers` does not run them on every tool)
EXTRA_CASES = ("mismatch", "skipped")
# run by name only (not by `all` or `peers`): frameworks needs the test extra and takes minutes
BY_NAME: dict[str, Scenario] = {"frameworks": Frameworks()}
CHOICES = SCENARIOS | BY_NAME
# settings whose default depends on the scenario (and on `peers`, shorter runs of more subjects)
DEFAULTS = {
    "warmup": {"roundtrip": 20, "training": 30, "logging": 30, "seeing": 30, "frameworks": 20},
    "steps": {"training": 500, "frameworks": 200},
    "peers": {"steps": 100},
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("scenario", choices=[*CHOICES, "all", "peers", "scale"])
    add("--subjects", help=f"comma-separated, of: {', '.join(SUBJECTS)} (default: the scenario's own)")
    add("--ranks", type=int, default=2, help="ranks per world (default: 2)")
    add("--repeats", type=int, help="rounds, each measuring every subject (default: the scenario's own)")
    add("--record", action="store_true", help="add the run's figures to results/by_date.md, under today's date")
    add(
        "--json",
        type=Path,
        metavar="PATH",
        help="write every sample here (a folder: SCENARIO.json in it; all: results/)",
    )
    add("--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: one GPU per rank (default: gloo)")
    add("--warmup", type=int, help="untimed cells (roundtrip: 20) or steps (training, logging: 30; frameworks: 20)")
    add("--cells", type=int, default=10, help="roundtrip: timed cells per subject per round (default: 10)")
    add("--steps", type=int, help="training: timed steps per run (default: 500; peers: 100; frameworks: 200)")
    add(
        "--data",
        choices=DATA_KINDS,
        default="tensors",
        help="training: batches made up front (tensors, the default), read through a DataLoader over a "
        "TensorDataset (loader), or so with ddp_notebook's subjects using prepare_loader and prepare_model (helpers)",
    )
    add("--threads", help="torch threads per rank, or 'default' for each tool's own (default: ddp_notebook's choice)")
    add("--cases", default=",".join(CASES), help=f"failures: which (default: {','.join(CASES)})")
    add("--hang-cap", type=float, default=35.0, help="seconds to wait for a failure report (default: 35)")
    add("--cell-timeout", type=float, default=5.0, help="failures: the hang case's cell timeout (default: 5)")
    add("--calls", type=int, default=200_000, help="logging: log() calls per timing (default: 200000)")
    add("--block", type=int, default=25, help="logging, seeing: training steps per block (default: 25)")
    add("--blocks", type=int, default=60, help="logging, seeing: blocks of each kind per cell (default: 60)")
    add("--frameworks", help="frameworks: which, comma-separated, in turn (default: all of them)")
    add("--sharded", action="store_true", help="elastic: the model sharded with FSDP2 (shard_model), not DDP")
    add("--markdown", type=Path, default=RESULTS / "peers.md", help="peers: the table (default: %(default)s)")
    return parser


def settings(args: argparse.Namespace, scenario: str, peers: bool) -> argparse.Namespace:
    s = argparse.Namespace(**vars(args))
    s.scenario, s.peers = scenario, peers
    picked = CHOICES[scenario]
    s.repeats = args.repeats or (picked.peers_repeats if peers else picked.repeats)
    for name in ("warmup", "steps"):
        if getattr(args, name) is None:
            fallback = DEFAULTS["peers"].get(name) if peers and scenario == "training" else None
            setattr(s, name, fallback or DEFAULTS[name].get(scenario, 0))
    s.cases = args.cases.split(",")
    s.frameworks = tuple(args.frameworks.split(",")) if args.frameworks else None
    return s


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate everything before starting anything."""
    for name in ("ranks", "repeats", "cells", "steps", "calls", "block", "blocks"):
        if (getattr(args, name) or 1) < 1:
            parser.error(f"--{name} must be >= 1")
    if unknown := set(args.cases.split(",")) - set(CASES) - set(EXTRA_CASES):
        known = ", ".join(CASES + EXTRA_CASES)
        parser.error(f"--cases: unknown {', '.join(sorted(unknown))} (choose from {known})")
    if args.frameworks and (unknown := set(args.frameworks.split(",")) - set(FRAMEWORK_NAMES)):
        parser.error(f"--frameworks: unknown {', '.join(sorted(unknown))} (choose from {', '.join(FRAMEWORK_NAMES)})")
    if args.subjects and (unknown := set(args.subjects.split(",")) - set(SUBJECTS)):
        parser.error(f"--subjects: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SUBJECTS)})")
    from ddp_notebook.platform import network

    try:  # the threads ddp_notebook gives a rank are torchrun's too, unless told otherwise
        chosen = world(args.ranks, args.backend, force=True).config.threads_per_rank
    except Exception as failure:  # noqa: BLE001  (any refusal is the user's to read)
        parser.error(f"ddp_notebook refuses {args.ranks} {args.backend} ranks here: {failure}")
    if args.threads == "default":
        args.threads = None
    elif args.threads is not None and not args.threads.isdigit():
        parser.error("--threads takes a number or 'default'")
    else:
        args.threads = int(args.threads or chosen)
    args.interface = network.loopback_interface()  # what DDPCluster gives its ranks on one machine


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["scale"]:  # its own table and options (benchmarks/scale.py)
        import scale

        return scale.main(arguments[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    check(parser, args)
    exit_on_sigterm()
    if args.json is not None:  # named from where the command was typed, before the move below
        args.json = args.json.resolve()
    # ranks start as `python -m ...`, which puts the working directory first on sys.path:
    # never a checkout's root, so `import ddp_notebook` there finds the same package as here
    os.chdir(Path(__file__).resolve().parent)
    peers = args.scenario == "peers"
    names = list(SCENARIOS) if args.scenario in ("all", "peers") else [args.scenario]
    info = machine_info()
    print(machine_line(info))
    print(f"   ddp_notebook from {info['ddp_notebook_path']} ({info['ddp_notebook_commit']})")
    warm_file_cache()
    status, reports = 0, {}
    for name in names:
        s = settings(args, name, peers)
        chosen = args.subjects.split(",") if args.subjects else None
        subjects = chosen or (list(SUBJECTS) if peers else list(CHOICES[name].default_subjects))
        run, began = Run(s), time.monotonic()
        try:
            results = drive(CHOICES[name], subjects, run)
            print()
            summary = CHOICES[name].report(results, s)
        finally:
            leaked = run.finish()
        print(f"   ({time.monotonic() - began:.0f} s)\n")
        reports[name] = {"subjects": results, "summary": summary}
        failed = [n for n, entry in results.items() if entry["error"]]
        status = status or (1 if leaked or failed else 0)
        payload = {"scenario": name, "command": shlex.join([sys.executable, *sys.argv]), "settings": vars(s)}
        payload |= {"machine": info, "subjects": results, "summary": summary, "leaked_pids": leaked}
        if args.record and not failed:
            import dated_table

            labels = {subject: entry.get("label", subject) for subject, entry in results.items()}
            command = shlex.join(["python", "benchmarks/run.py", *arguments])
            load = (float(info["load_average"][0]), os.getloadavg()[0])
            new_rows = dated_table.rows(name, summary, labels, str(info["ddp_notebook_commit"]), command, load)
            if new_rows:
                dated_table.record(RESULTS / "by_date.md", new_rows)
            else:
                print(f"--record: the {name} scenario has none of the figures results/by_date.md keeps; nothing added")
        if len(names) > 1:
            write_json((args.json or RESULTS) / f"{'peers-' if peers else ''}{name}.json", payload)
        elif args.json is not None and args.json.is_dir():  # a folder: the scenario's file in it, as `all` names it
            write_json(args.json / f"{name}.json", payload)
        else:
            write_json(args.json, payload)
    if peers:
        import peers_table

        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(peers_table.markdown(reports, args, info), encoding="utf8")
        print(f"wrote {args.markdown}")
    return status


if __name__ == "__main__":
    sys.exit(main())
