"""What a snapshot point costs in a hand-written loop, tracked, in one run.

    python benchmarks/plain_loop_snapshots.py [--ranks 2] [--steps 400] [--every 20] [--repeats 3]

A world of `--ranks` gloo ranks trains the elastic scenario's MLP (64->512->512->10, SGD with
momentum, batch 64 per rank) in the tutorial's loop: the model wrapped in DDP by hand, a plain
DataLoader over a DistributedSampler. Two ways of tracking it, each `--repeats` times:

- `loader`: `track(model=, optimizer=, loader=, step=)`: every `--every` batches of the loader
  (and each epoch's end) is a snapshot point;
- `steps`: no loader tracked (the loop draws its batches from a tensor by the tracked step):
  every `--every` optimizer steps is a point, taken at the start of the next step.

Every snapshot the points take is timed on the rank itself (the copy of the weights, the momentum,
the loop's counters and the random generators). Printed per way: the median milliseconds of one
snapshot point on rank 0, the median step time of the same loop untracked (run in alternation with
the tracked one), the point's share of the `--every` steps it covers, and the memory the kept
snapshots take per rank.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from pathlib import Path

from harness import exit_on_sigterm, machine_info

sys.path.append(str(Path(__file__).resolve().parent.parent))

SETUP = """
import time, json, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
torch.manual_seed(0)
data = TensorDataset(torch.randn(16384, 64), torch.randint(0, 10, (16384,)))
def mlp():
    return DDP(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 10)))
model, plain_model = mlp(), mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=64, sampler=sampler)
plain_loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data))
step = 0
if WAY == "loader":
    ddp_notebook.track(model=model, optimizer=optimizer, loader=loader, step=step, snapshot_every=EVERY)
else:
    ddp_notebook.track(model=model, optimizer=optimizer, step=step, snapshot_every=EVERY)
"""
# every snapshot a point takes is timed where it is taken (elastic._take), on the rank
MEASURE = """
from ddp_notebook.rank import elastic
from ddp_notebook.rank.state import RANK
taken = []
untimed = elastic._take
def timed(*args, **kwargs):
    began = time.perf_counter()
    try:
        return untimed(*args, **kwargs)
    finally:
        taken.append(time.perf_counter() - began)
elastic._take = timed
def by_loader(net, opt, source, steps):
    global step
    done = 0
    for epoch in range(10**6):
        sampler.set_epoch(epoch)
        for x, y in source:
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            step += 1; done += 1
            if done == steps:
                return
def by_steps(net, opt, source, steps):
    global step
    xs, ys = data.tensors
    for _ in range(steps):
        at = (step * 64 * world_size + rank * 64) % (len(xs) - 64)
        loss = torch.nn.functional.cross_entropy(net(xs[at:at + 64]), ys[at:at + 64])
        opt.zero_grad(); loss.backward(); opt.step()
        step += 1
train = by_loader if WAY == "loader" else by_steps
def timed_block(tracked):
    dist.barrier()
    began = time.perf_counter()
    if tracked:
        train(model, optimizer, loader, STEPS)
    else:
        saved = step
        train(plain_model, plain_optimizer, plain_loader, STEPS)
        globals()["step"] = saved
    dist.barrier()
    return (time.perf_counter() - began) / STEPS
plain_s, tracked_s = [], []
for block in range(4):
    for tracked in ((True, False) if block % 2 == 0 else (False, True)):
        (tracked_s if tracked else plain_s).append(timed_block(tracked))
elastic._take = untimed
json.dumps({"point_ms": 1000 * statistics.median(taken), "points": len(taken),
            "step_ms": 1000 * statistics.median(plain_s), "tracked_step_ms": 1000 * statistics.median(tracked_s),
            "kept_mib": elastic.snapshot_bytes() / 2**20})
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="steps per timed block (4 blocks a repeat)")
    parser.add_argument("--every", type=int, default=20, help="track(snapshot_every=...)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    exit_on_sigterm()
    from ddp_notebook import DDPCluster

    print(json.dumps(machine_info()))
    results: dict[str, list[dict[str, float]]] = {"loader": [], "steps": []}
    for _ in range(args.repeats):
        for way in results:
            with DDPCluster(args.ranks, backend="gloo") as world:
                world.push({"WAY": way, "EVERY": args.every, "STEPS": args.steps})
                world.execute("import statistics\n" + SETUP, setup=True, stream=False)
                answer = world.execute(MEASURE, stream=False)
                results[way].append(json.loads(ast.literal_eval(answer.value_text(0))))
    print(
        f"{args.ranks} gloo ranks, snapshot_every={args.every}, median of {args.repeats} runs "
        f"({4 * args.steps} steps each, 2 of 4 blocks tracked)"
    )
    for way, runs in results.items():
        point = statistics.median(run["point_ms"] for run in runs)
        step = statistics.median(run["step_ms"] for run in runs)
        tracked = statistics.median(run["tracked_step_ms"] for run in runs)
        kept = statistics.median(run["kept_mib"] for run in runs)
        share = 100 * point / (args.every * step)
        print(
            f"{way:>6} points: one snapshot point {point:.2f} ms "
            f"(range {min(r['point_ms'] for r in runs):.2f}-{max(r['point_ms'] for r in runs):.2f}), "
            f"{share:.2f}% of the {args.every} steps it covers (step {step:.2f} ms untracked, "
            f"{tracked:.2f} ms tracked), {kept:.1f} MiB kept per rank"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
