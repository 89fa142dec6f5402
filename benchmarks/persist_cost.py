"""What writing snapshots to disk costs a training loop: `track(..., persist=DIR)` against the same
`track(...)` without it, in alternating blocks of steps on the same world, side by side in one run.

    python benchmarks/persist_cost.py [--ranks 2] [--hidden 512] [--blocks 6] [--steps 400]

Each rank trains the training benchmark's MLP (64-HIDDEN-HIDDEN-10, SGD with momentum, batch 64
per rank, one torch thread) over a tracked `prepare_loader`, with the default cadence: a snapshot
every 20 batches (kept in memory either way), every 5th of them written (`persist_every`, default).
Blocks alternate without / with persisting (the order mirrored every other pair); the ratio is
steps/s with over steps/s without, per pair, and its median. It also prints what one written
snapshot takes on disk and how many were written and skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_notebook import DDPCluster

SETUP = """
import time, torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64 * {ranks} * 200, 64), torch.randint(0, 10, (64 * {ranks} * 200,)))
model = ddp_notebook.prepare_model(nn.Sequential(nn.Linear(64, {hidden}), nn.ReLU(), nn.Linear({hidden}, {hidden}),
                                                 nn.ReLU(), nn.Linear({hidden}, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = ddp_notebook.prepare_loader(data, batch_size=64, seed=0)
step = 0
ddp_notebook.track(model=model, opt=opt, loader=loader, step=step)

def block(steps):
    global step
    dist.barrier()
    began = time.perf_counter()
    done = 0
    while done < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            done += 1
            if done == steps:
                break
    dist.barrier()
    return steps / (time.perf_counter() - began)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6, help="pairs of blocks (without, with)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per block")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="persist-cost-")) / "ckpt"
    ratios, rates = [], {"without": [], "with": []}
    with DDPCluster(args.ranks, backend="gloo", collective_timeout=120) as world:
        world.execute(SETUP.format(ranks=args.ranks, hidden=args.hidden), setup=True, stream=False)
        world.execute(f"rate = block({args.steps})", stream=False)  # warm: first steps and buckets
        for pair in range(args.blocks):
            order = ("without", "with") if pair % 2 == 0 else ("with", "without")
            measured = {}
            for kind in order:
                persist = repr(str(folder)) if kind == "with" else "False"
                world.execute(
                    f"ddp_notebook.track(persist={persist})\nrate = block({args.steps})\n"
                    "from ddp_notebook.rank.calls import persist_wait\nwaited = persist_wait(120)",
                    stream=False,
                )
                measured[kind] = world.pull("rate", ranks=[0])[0]
                rates[kind].append(measured[kind])
            ratios.append(measured["with"] / measured["without"])
            print(
                f"pair {pair + 1}: without {measured['without']:.1f}, with {measured['with']:.1f} steps/s "
                f"({ratios[-1]:.3f}x)",
                flush=True,
            )
        writer = world.pull("waited", ranks=[0])[0]
    sizes = [
        sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in folder.glob("snapshot-*") if d.is_dir()
    ]
    result = {
        "ranks": args.ranks,
        "hidden": args.hidden,
        "steps_per_block": args.steps,
        "without_steps_per_s": statistics.median(rates["without"]),
        "with_steps_per_s": statistics.median(rates["with"]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "written": len(writer["written"]),
        "skipped": writer["skipped"],
        "snapshot_mb": (max(sizes) / 2**20) if sizes else 0.0,
    }
    print(
        f"persisting (every 5th snapshot, one every 100 steps): {result['ratio_median']:.3f}x the steps/s without "
        f"(pairs {result['ratio_min']:.3f}-{result['ratio_max']:.3f}); {result['written']} snapshots written by "
        f"rank 0, {result['skipped']} skipped, {result['snapshot_mb']:.1f} MB each"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
