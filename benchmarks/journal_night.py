"""A night of progress bars: a detached world's cell that prints, logs and draws progress for a
simulated 72 hours with no kernel attached, its ranks' journals measured against their bounds as it
runs, then followed from a new kernel in the morning.

    python benchmarks/journal_night.py [--ranks 2] [--hours 72] [--tick 0.1]

A real kernel starts `%ddp_start N --detach` and sends the night's cell, then is SIGKILLed. The cell
runs HOURS simulated hours on a compressed clock: each step of its inner progress bar moves the
rank's live-view clock on by TICK seconds (0.1: the channel publishes a message every step, as a bar
stepping ten times a second does), logs a point, and prints a line every simulated 30 s. After each
simulated hour each rank prints what its journal holds against its bounds (entries, output bytes,
live-view messages, points), the journal's own size in memory (every object it holds, measured) and
the rank's resident memory. Once the ranks are idle, a new kernel's `%ddp_attach` and `%ddp_wait`
are timed, and the final bars its live view draws are printed. The user's registry goes to a
temporary folder.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from harness import exit_on_sigterm, machine_info

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.support.kernel; ddp_notebook as installed

NIGHT = """%%ddp
import sys, time
from array import array
from ddp_notebook.rank.channel import rank_channel
from ddp_notebook.rank.state import RANK
from ddp_notebook.wire import journal as bounds

channel = rank_channel()
clock = [time.monotonic()]
channel._clock = lambda: clock[0]  # the night on a compressed clock: TICK seconds of it per step
TICK, HOURS = {tick!r}, {hours!r}
per_hour = round(3600 / TICK)
print_every = max(1, round(30 / TICK))

def held_bytes(value, seen):
    # every object the journal holds, each counted once
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(held_bytes(k, seen) + held_bytes(v, seen) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        size += sum(held_bytes(item, seen) for item in value)
    return size

def rss_mb():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 1e6

print("[night] start", flush=True)
began = time.monotonic()
for hour in ddp_notebook.progress(range(HOURS), desc="hours"):
    for step in ddp_notebook.progress(range(per_hour), desc=f"hour {{hour}}"):
        clock[0] += TICK
        ddp_notebook.log(loss=1.0 / (1 + hour * per_hour + step))
        if step % print_every == 0:
            print(f"hour {{hour}} step {{step}} loss {{1.0 / (1 + hour * per_hour + step):.3e}}")
    held = RANK.journal.footprint()
    journal_mb = held_bytes(RANK.journal._cell.entries, set()) / 1e6
    print(
        f"[night] hour {{hour + 1}}: {{held['entries']}} entries, "
        f"output {{held['text_bytes']:,}} of {{bounds.TEXT_LIMIT_BYTES:,}} B, "
        f"messages {{held['messages']:,}} of {{bounds.MESSAGES_LIMIT:,}}, "
        f"points {{held['points']:,}} of {{bounds.POINTS_LIMIT:,}}; journal {{journal_mb:.1f}} MB, "
        f"rank {{rss_mb():.0f}} MB; {{time.monotonic() - began:.0f}} s real",
        flush=True,
    )
"""


def night(ranks: int, hours: int, tick: float) -> None:
    from ddp_notebook.wire import detached as wire
    from tests.support.kernel import Kernel

    evening = Kernel()
    try:
        out, error = evening.run(f"%load_ext ddp_notebook\n%ddp_start {ranks} --detach --idle-limit 3600")
        assert error is None, out
        evening.client.execute(NIGHT.format(tick=tick, hours=hours))
        evening.wait_for_output("[night] start", seconds=60)
        (path,) = wire.registry_dir().glob("*.json")
        entry = wire.read_entry(path)
        assert entry is not None
        os.kill(evening.manager.provisioner.process.pid, signal.SIGKILL)
        killed_at = time.time()
    finally:
        evening.close()
    began = time.monotonic()
    print(f"the evening's kernel is gone; the night runs ({hours} h on a compressed clock, a step every {tick} s)")
    status = wire.read_status(entry["private_dir"])
    # the morning: the ranks idle again, as the controller saw after the kernel was gone (a status it
    # wrote before the night's cell began says idle too)
    while status is None or status["busy"] or status["checked"] < killed_at + 3:
        if time.monotonic() - began > 6 * 3600:
            raise TimeoutError("the night's cell still runs after 6 real hours")
        time.sleep(5)
        status = wire.read_status(entry["private_dir"])
    print(f"the night's cell ended after {time.monotonic() - began:.0f} s of real time")
    morning = Kernel()
    try:
        out, error = morning.run("%load_ext ddp_notebook")
        assert error is None, out
        attach_began = time.perf_counter()
        out, error = morning.run("%ddp_attach")
        attached = time.perf_counter() - attach_began
        assert error is None and "attached again" in out, out
        wait_began = time.perf_counter()
        out, error = morning.run("%ddp_wait")
        waited = time.perf_counter() - wait_began
        assert error is None, out
        for line in out.splitlines():
            if "[night] hour" in line and (f"hour {hours}:" in line or " hour 1:" in line or "hour 24:" in line):
                print(line)
        kept = [line for line in out.splitlines() if "] hour " in line and " step " in line]
        print(
            f"%ddp_attach {attached:.2f} s, %ddp_wait {waited:.2f} s ({len(out):,} characters shown, "
            f"{len(kept):,} printed lines of the night kept, the oldest dropped first)"
        )
        out, error = morning.run(
            "feed = get_ipython().magics_manager.registry['DDPMagics'].world.recorder.latest\n"
            "for (rank, level), bar in sorted(feed.bars.items()):\n"
            "    print(f'final bar: rank {rank} level {level} {bar.desc!r} {bar.n}/{bar.total} {bar.state}')\n"
            "print('points per rank:', [len(feed.metrics.series('loss', r)[0]) for r in sorted(feed.ranks)])"
        )
        assert error is None, out
        print(out.strip())
        out, error = morning.run("%ddp_stop")
        assert error is None, out
    finally:
        morning.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hours", type=int, default=72)
    parser.add_argument("--tick", type=float, default=0.1)
    args = parser.parse_args()
    exit_on_sigterm()
    print(machine_info())
    with tempfile.TemporaryDirectory(prefix="journal-night-") as folder:
        os.environ["XDG_STATE_HOME"] = folder  # the kernels started next inherit it
        night(args.ranks, args.hours, args.tick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
