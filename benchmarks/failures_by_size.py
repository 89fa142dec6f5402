"""Every failure path at several world sizes, as a new user meets it: `%ddp_start N` in a real
kernel, the other ranks waiting in a collective while one fails, then a next cell.

    python benchmarks/failures_by_size.py --ranks 2,3,4,8 [--json PATH]
    python benchmarks/failures_by_size.py --ranks 2,3,4,8,16 \
        --cases raise_first,raise_last,hang,interrupt,mismatch,death_middle

For each size and case it prints the seconds from the failure to the error under the cell, whether
the next cell (an all_reduce on every rank) works with every variable kept, and, for a death, how
long the rank took to come back; then the lines of the report under the cell (the error as the
notebook shows it: the root cause's traceback included), which should not grow with the world.
`resume` kills the last rank mid-epoch in a tracked training loop
(Adam, a scheduler, dropout), runs the loop again to the end and compares every rank's weights with
an uninterrupted run of the same loop in the same world, bit for bit. Sizes past this machine's
default (one rank per core, at least 4) start with --force. Exits non-zero where a case is not ok.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import RESULTS, exit_on_sigterm, fmt, machine_info, machine_line, print_table, write_json
from subjects import SETUP_TIMEOUT, Cell, Kernel

CASES = ("raise_first", "raise_last", "hang", "interrupt", "mismatch", "death_middle", "death_last", "resume")
CELL_TIMEOUT = 5.0  # the hang case's %%ddp --timeout
INTERRUPT_AT = 1.5  # seconds into the interrupt case's cell, the stop button
WAIT = 150.0  # the longest a case's cell may take before it counts as hung
SETUP = """%%ddp --setup
import os, time, torch, torch.distributed as dist
torch.manual_seed(0)
model = ddp_notebook.prepare_model(torch.nn.Linear(32, 4))
keep = 1000 + rank
"""
EVENT = "with open({event!r}, 'w') as f:\n    f.write(repr(time.time()))\n"
# @F@: the failing rank; @EVENT@: where it writes when it fails
FAILING = {
    "raise": "x = torch.ones(1)\nprobe = rank\nif rank == @F@:\n@EVENT@"
    "    raise ValueError('rank @F@ fails on purpose')\ndist.all_reduce(x)",
    "hang": "x = torch.ones(1)\nprobe = rank\nif rank == @F@:\n    time.sleep(600)\ndist.all_reduce(x)",
    "mismatch": "x = torch.ones(4)\nprobe = rank\nif rank == @F@:\n@EVENT@    dist.broadcast(x, 0)\n"
    "else:\n    dist.all_reduce(x)",
    "death": "x = torch.ones(1)\nprobe = rank\nif rank == @F@:\n    time.sleep(0.3)\n@EVENT@"
    "    os.kill(os.getpid(), 9)\ndist.all_reduce(x)",
}
FAILING["interrupt"] = FAILING["hang"]  # the stop button, INTERRUPT_AT s in
AFTER = (
    "%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    "print(f\"after rank={rank} sum={t.item():g} keep={keep} probe={globals().get('probe')}\", flush=True)"
)
AFTER_LINE = re.compile(r"after rank=(\d+) sum=(\d+) keep=(\d+) probe=(\S+)")
CAME_BACK = re.compile(r"came back in ([\d.]+) s")
# the tracked loop of `resume`: {p} prefixes the reference run's names
RESUME_BUILD = """
from torch.utils.data import TensorDataset
torch.manual_seed(0)
{p}data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
{p}net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1))
{p}model = ddp_notebook.prepare_model({p}net)
{p}opt = torch.optim.Adam({p}model.parameters(), lr=1e-3)
{p}sched = torch.optim.lr_scheduler.StepLR({p}opt, step_size=5, gamma=0.9)
{p}loader = ddp_notebook.prepare_loader({p}data, batch_size=8, seed=1)
{p}step = 0
"""
RESUME_TRACK = "ddp_notebook.track(model=model, opt=opt, sched=sched, loader=loader, step=step, snapshot_every=4)"
RESUME_TRAIN = """%%ddp
while {p}loader.epoch < 2:
    for x, y in {p}loader:
        if rank == {kill} and {p}step == {kill_at}:
{event}            os.kill(os.getpid(), 9)
        loss = torch.nn.functional.mse_loss({p}model(x), y)
        {p}opt.zero_grad()
        loss.backward()
        {p}opt.step()
        {p}sched.step()
        {p}step += 1
"""
# the weights' bytes, hashed on each rank (the reference's are not on a rank that came back)
RESUME_CHECK = (
    "%%ddp\nimport hashlib\n"
    "digest = hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in {p}model.parameters())).hexdigest()\n"
    'print(f"weights rank={{rank}} sha256={{digest}}", flush=True)'
)
WEIGHTS_LINE = re.compile(r"weights rank=(\d+) sha256=([0-9a-f]+)")


class Size:
    """One kernel with one world of `ranks` ranks, and the cases run on it."""

    def __init__(self, ranks: int, scratch: Path) -> None:
        self.ranks, self.scratch = ranks, scratch
        self.kernel = Kernel(sys.executable, dict(os.environ))
        force = " --force" if ranks > max(4, os.cpu_count() or 1) else ""
        for code in ("%load_ext ddp_notebook", f"%ddp_start {ranks}{force}", SETUP):
            cell = self.kernel.run(code, SETUP_TIMEOUT)
            if cell.status != "ok":
                raise RuntimeError(f"{code.splitlines()[0]!r} failed: {cell.text[-1500:]}")

    def close(self) -> None:
        self.kernel.run("%ddp_stop", 60.0)
        self.kernel.shutdown()

    def event_file(self) -> Path:
        return self.scratch / f"event-{time.monotonic_ns()}"

    def case(self, name: str) -> dict[str, Any]:
        if name == "resume":
            return self.resume()
        kind = name.split("_")[0]
        failing = {"first": 0, "last": self.ranks - 1, "middle": self.ranks // 2}.get(name.partition("_")[2], 1)
        if kind == "mismatch":
            failing = self.ranks - 1
        event = self.event_file()
        body = FAILING[kind].replace("@F@", str(failing)).replace("@EVENT@", _indent(EVENT.format(event=str(event))))
        magic = f"%%ddp --timeout {CELL_TIMEOUT:g}" if kind == "hang" else "%%ddp"
        pressed: list[float] = []
        press = self.kernel.manager.interrupt_kernel
        timer = threading.Timer(INTERRUPT_AT, lambda: (pressed.append(time.time()), press()))
        if kind == "interrupt":
            timer.start()
        try:
            cell = self.kernel.run(f"{magic}\n{body}", WAIT)
        finally:
            timer.cancel()
        if kind in ("raise", "mismatch", "death"):
            began = float(event.read_text()) if event.exists() else None
        elif kind == "hang":
            began = cell.sent + CELL_TIMEOUT
        else:
            began = pressed[0] if pressed else None
        out: dict[str, Any] = {"failing_rank": failing, "said": _error_line(cell), "report_lines": _report_lines(cell)}
        out["report"] = _report(cell)
        errors = [o.wall for o in cell.outputs if o.error]
        out["message_s"] = errors[0] - began if errors and began is not None else None
        if kind == "death" and (back := CAME_BACK.search(cell.text)):
            out["back_s"] = float(back.group(1))
        out |= self.next_cell(survivors=[r for r in range(self.ranks) if not (kind == "death" and r == failing)])
        return out

    def next_cell(self, survivors: list[int]) -> dict[str, Any]:
        cell = self.kernel.run(AFTER, 60.0)
        found = {int(r): (int(total), int(keep), probe) for r, total, keep, probe in AFTER_LINE.findall(cell.text)}
        works = sorted(found) == list(range(self.ranks)) and all(t == self.ranks for t, _, _ in found.values())
        kept = works and all(found[r][1] == 1000 + r for r in found) and all(found[r][2] == str(r) for r in survivors)
        return {"next_cell": works, "state_kept": kept, "next_cell_s": cell.elapsed, "next_said": _error_line(cell)}

    def resume(self) -> dict[str, Any]:
        steps_per_epoch = -(-512 // self.ranks) // 8
        kill_at, last = steps_per_epoch + steps_per_epoch // 2, self.ranks - 1
        event = self.event_file()
        cells = [
            "%%ddp\n" + RESUME_BUILD.format(p="ref_"),
            RESUME_TRAIN.format(p="ref_", kill=-1, kill_at=-1, event=""),
            "%%ddp --setup\n" + RESUME_BUILD.format(p="") + RESUME_TRACK,
        ]
        for code in cells:
            cell = self.kernel.run(code, WAIT)
            if cell.status != "ok":
                raise RuntimeError(f"resume: {code.splitlines()[1]!r} failed: {cell.text[-1500:]}")
        reference = dict(WEIGHTS_LINE.findall(self.kernel.run(RESUME_CHECK.format(p="ref_"), 60.0).text))
        if len(set(reference.values())) != 1 or len(reference) != self.ranks:
            raise RuntimeError(f"resume: the uninterrupted run's ranks disagree: {reference}")
        kill = self.kernel.run(
            RESUME_TRAIN.format(p="", kill=last, kill_at=kill_at, event=_indent(EVENT.format(event=str(event)), 12)),
            WAIT,
        )
        out: dict[str, Any] = {"failing_rank": last, "killed_at_step": kill_at, "said": _error_line(kill)}
        out["report_lines"] = _report_lines(kill)
        errors = [o.wall for o in kill.outputs if o.error]
        began = float(event.read_text()) if event.exists() else None
        out["message_s"] = errors[0] - began if errors and began is not None else None
        if back := CAME_BACK.search(kill.text):
            out["back_s"] = float(back.group(1))
        again = self.kernel.run(RESUME_TRAIN.format(p="", kill=-1, kill_at=-1, event=""), WAIT)
        check = self.kernel.run(RESUME_CHECK.format(p=""), 60.0)
        found = {int(r): digest for r, digest in WEIGHTS_LINE.findall(check.text)}
        out["bitwise"] = sorted(found) == list(range(self.ranks)) and set(found.values()) == set(reference.values())
        out["next_cell"] = again.status == "ok" and sorted(found) == list(range(self.ranks))
        out["state_kept"] = out["next_cell"]
        return out


def _indent(code: str, spaces: int = 4) -> str:
    return "".join(" " * spaces + line + "\n" for line in code.splitlines())


def _error_line(cell: Cell) -> str:
    errors = [o.text for o in cell.outputs if o.error]
    return errors[0].splitlines()[0][:160] if errors else ("" if cell.returned else "(no answer)")


def _report(cell: Cell) -> str | None:
    """What the notebook shows under the cell for its error (its traceback, not the ename line before
    it), and the package's stderr notes beside it."""
    errors = [o.shown for o in cell.outputs if o.error]
    if not errors:
        return None
    shown = errors[0].rstrip("\n").splitlines()
    notes = [line for o in cell.outputs if not o.error for line in o.text.splitlines() if "ddp_notebook:" in line]
    return "\n".join(shown + notes)


def _report_lines(cell: Cell) -> int | None:
    report = _report(cell)
    return None if report is None else len(report.splitlines())


def verdict(case: str, out: dict[str, Any], goal: float) -> tuple[bool, str]:
    """Whether a case is ok at the goal's seconds, and its cell of the table."""
    if "error" in out:
        return False, f"failed: {out['error'][:60]}"
    seconds = out.get("message_s")
    ok = bool(out.get("next_cell") and out.get("state_kept")) and seconds is not None and seconds <= goal
    if case == "resume":
        ok = ok and bool(out.get("bitwise"))
    text = f"{'ok' if ok else 'NOT ok'}, {seconds:.1f} s" if seconds is not None else "NOT ok, no message"
    if "back_s" in out:
        text += f" (back in {out['back_s']:.1f})"
    if case == "resume":
        text += ", bitwise" if out.get("bitwise") else ", NOT bitwise"
    if not out.get("next_cell"):
        text += f"; next cell fails: {out.get('next_said', '')[:50]}"
    elif not out.get("state_kept"):
        text += "; state lost"
    return ok, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,3,4", help="world sizes, comma-separated (default: 2,3,4)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"which (default: {','.join(CASES)})")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every case per size (default: 1)")
    parser.add_argument("--json", type=Path, help=f"write every sample here (default: {RESULTS}/failures_by_size.json)")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.ranks.split(",")]
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        parser.error(f"--cases: unknown {', '.join(sorted(unknown))} (choose from {', '.join(CASES)})")
    if any(n < 2 for n in sizes) or args.repeats < 1:
        parser.error("--ranks takes sizes of 2 or more, --repeats 1 or more")
    exit_on_sigterm()
    info = machine_info()
    print(machine_line(info))
    samples: dict[int, dict[str, list[dict[str, Any]]]] = {n: {c: [] for c in cases} for n in sizes}
    with tempfile.TemporaryDirectory(prefix="failures-by-size-") as scratch:
        for n in sizes:
            size = Size(n, Path(scratch))
            try:
                for round_ in range(args.repeats):
                    for case in cases:
                        began = time.monotonic()
                        try:
                            out = size.case(case)
                        except Exception as failure:  # noqa: BLE001  (one case failing must not lose the others)
                            out = {"error": f"{type(failure).__name__}: {failure}"}
                        samples[n][case].append(out)
                        print(f"  {n} ranks, {case} (round {round_ + 1}): {json.dumps(out)[:300]}", flush=True)
                        print(f"     ({time.monotonic() - began:.1f} s)", flush=True)
            finally:
                size.close()
    rows, all_ok, summary = [], True, {}
    for case in cases:
        row: list[Any] = [case]
        for n in sizes:
            goal = 2.0 if n <= 4 else 5.0
            outs = samples[n][case]
            verdicts = [verdict(case, out, goal) for out in outs]
            all_ok = all_ok and all(ok for ok, _ in verdicts)
            seconds = [s for o in outs if (s := o.get("message_s")) is not None]
            median = statistics.median(seconds) if seconds else None
            passed = sum(ok for ok, _ in verdicts)
            text = verdicts[0][1] if len(outs) == 1 else f"{passed}/{len(outs)} ok, median {fmt(median)} s"
            row.append(text)
            summary.setdefault(case, {})[n] = {"ok": all(ok for ok, _ in verdicts), "median_s": median}
        rows.append(row)
    print()
    print_table(["case", *(f"{n} ranks" for n in sizes)], rows)
    print("seconds: from the failure to the error under the cell (hang: from the end of its 5 s limit; death,")
    print("resume: the rank already back), then the comeback's own figure; goal <= 2 s up to 4 ranks, <= 5 s at 8")
    print()
    lines_rows = []
    for case in cases:
        counts = [[o.get("report_lines") for o in samples[n][case]] for n in sizes]
        lines_rows.append([case, *(" / ".join(fmt(c) for c in dict.fromkeys(found)) for found in counts)])
    print_table(["report lines", *(f"{n} ranks" for n in sizes)], lines_rows)
    print("report lines: the error under the cell as the notebook shows it (goal: <= 25 at 16 ranks, as at 2 at 8)")
    payload = {"command": " ".join([sys.executable, *sys.argv]), "machine": info}
    payload |= {"samples": samples, "summary": summary}
    write_json(args.json or RESULTS / "failures_by_size.json", payload)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
