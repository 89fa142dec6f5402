"""results/peers.md from `run.py peers`: every scenario's figures for every subject, side by side."""

from __future__ import annotations

import time
from typing import Any

from subjects import SUBJECTS

COMMAND = "bash benchmarks/peers_env.sh && benchmarks/.peers-venv/bin/python benchmarks/run.py peers"


def seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def cell_of(report: dict[str, Any], name: str, text: Any) -> str:
    """`text(summary)` for a subject that ran; else why not."""
    entry = report["subjects"].get(name)
    if entry is None:
        return "not run"
    if entry["na"]:
        return f"n/a ({entry['na']})"
    if entry["error"]:
        return f"failed: {entry['error'][:80]}"
    return text(report["summary"][name])


def case_text(out: dict[str, Any] | None, cap: float) -> str:
    if out is None:
        return "-"
    if "error" in out:
        return f"failed ({out['failed']} of {out['of']}): {out['error'][:80]}"
    message = "none" if out["message_s"] is None else seconds(out["message_s"])
    returned = f"hang (> {cap:g} s)" if out["returned_s"] is None else seconds(out["returned_s"])
    then = out["recovery"]
    if out["recovery"] == "next cell works":
        then = "next cell works, state kept" if out["state_kept"] else "next cell works, on fresh ranks"
    elif out["recovery"] == "restart":
        then = f"restart {seconds(out['recover_s'])}"
    return f"{message} / {returned}; {then}"


def markdown(reports: dict[str, dict[str, Any]], args: Any, info: dict[str, Any]) -> str:
    names = list(SUBJECTS) if not args.subjects else args.subjects.split(",")
    start, trip, train, fail = (reports.get(k) for k in ("start", "roundtrip", "training", "failures"))
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    out = [
        "# ddp_notebook and its peers, measured",
        "",
        f"Produced by `{COMMAND}` on {time.strftime('%Y-%m-%d')}: {args.ranks} {args.backend} ranks, "
        f"{info['usable_cpus']} CPU cores ({info['cpu']}), {info['platform']}, Python {info['python']}; {versions};"
        f" ddp_notebook at {info['ddp_notebook_commit']}. Load average at the start:"
        f" {', '.join(f'{x:.2f}' for x in info['load_average'])}. The machine was shared with other work: single"
        " figures move by tens of percent; the paired ratios (each run next to its partner's) move less.",
        "",
        "| | start → ready to train | trivial cell round trip, median (× the same path by hand, per round)"
        " | training steps/s (× torchrun: median of the pairs; their range)"
        " | torch threads per rank (tool's default) |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        label = SUBJECTS[name].label
        row = [
            cell_of(start, name, lambda x: seconds(x["ready_s"]["median"]) + (" ¹" if x["lost"] else "")),
            cell_of(
                trip,
                name,
                lambda x: (
                    f"{x['ms']['median']:.3g} ms"
                    + (f" (× {x['reference']}: {x['ratio']['median']:.2f})" if x["ratio"] else "")
                ),
            ),
            cell_of(
                train,
                name,
                lambda x: (
                    f"{x['steps_per_s']['median']:.0f}"
                    + (
                        f" ({x['ratio']['median']:.2f}; {x['ratio']['min']:.2f}–{x['ratio']['max']:.2f})"
                        if x["ratio"]
                        else ""
                    )
                ),
            ),
            cell_of(start, name, lambda x: str(x["threads"])),
        ]
        out.append(f"| {label} | " + " | ".join(row) + " |")
    cap = args.hang_cap
    out += [
        "",
        f"Failures: seconds to the first message / to the cell returning, capped at {cap:g} s; then what the next"
        " cell with a collective found (its ranks' variables from earlier cells: state kept).",
        "",
        "| | rank 1 raises in a collective | hung collective, cell timeout"
        f" {args.cell_timeout:g} s (from its end) | stop button in a hung collective | rank 1's process dies"
        " | state kept across cells | output tagged by rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        row = [
            cell_of(fail, name, lambda x, case=case: case_text(x.get(case), cap))
            for case in ("raise", "hang", "interrupt", "death")
        ]
        probes = trip["subjects"].get(name, {}).get("notes", {}) if trip else {}
        row += [probes.get("state") or cell_of(trip, name, str), probes.get("tagging") or cell_of(trip, name, str)]
        out.append(f"| {SUBJECTS[name].label} | " + " | ".join(row) + " |")
    out += ["", *notes(reports, names), "", "How each figure is taken: [benchmarks/README.md](../README.md)."]
    return "\n".join(out) + "\n"


def notes(reports: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    lines = []
    start, fail = reports.get("start"), reports.get("failures")
    for name in names:
        entry = start and start["subjects"].get(name)
        if entry and entry["samples"] and any(x.get("lost_cells") for x in entry["samples"]):
            setup = max(x.get("setup_s", 0) for x in entry["samples"])
            lines.append(
                f"¹ {SUBJECTS[name].label}: the setup cells return in {setup:.1f} s, but the first cell sent after them"
                " got no answer and had to be sent again."
            )
    for name in names:
        for case, out in ((fail or {}).get("summary", {}).get(name) or {}).items():
            if "error" in out:
                continue
            said = f"`{out['said']}`" if out["said"] else "(nothing)"
            extra = f"; the next cell showed `{out['recovery_said']}`" if out.get("recovery_said") else ""
            lines.append(f"- {SUBJECTS[name].label}, {case}: first message {said}{extra}.")
    return lines
