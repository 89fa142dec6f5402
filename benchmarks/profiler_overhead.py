"""What `%%ddp --profile` costs a training step: ms/step off vs on, paired rounds in one world.

    python benchmarks/profiler_overhead.py [--ranks 2] [--rounds 6] [--steps 10]

One DDPCluster of gloo CPU ranks (one thread each). Each round runs the same training cell twice,
in alternating order: plain, and with `profile=ProfileSettings(steps=STEPS)` (1 step skipped, 1 warm-up,
STEPS recorded, memory on). The ranks time every step of a DDP MLP (64-512-512-10, batch 64); the
figures are rank 0's steps that the profiler records (the same step numbers in the plain run):

- `median`: the median step, what recording costs per step;
- `mean`: their mean, which also carries the last recorded step's trace export (written in the
  optimizer hook that ends the profile);
- `cell`: the whole cell's wall time in the notebook, the profiler's start, the trace's transfer and
  the analysis included.

Profiling off runs no code of the profiler at all (no profiler object, no hook): the plain cell is
the cell as it runs without `--profile`.
"""

from __future__ import annotations

import argparse
import statistics
import time

CELL = """
import time
torch.manual_seed(0)
torch.set_num_threads(1)
_net = ddp_notebook.prepare_model(torch.nn.Sequential(
    torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
_opt = torch.optim.SGD(_net.parameters(), lr=0.01)
_x, _y = torch.randn(64, 64), torch.randint(0, 10, (64,))
_times = []
for _ in range(TOTAL):
    _began = time.perf_counter()
    _opt.zero_grad()
    torch.nn.functional.cross_entropy(_net(_x), _y).backward()
    _opt.step()
    _times.append(time.perf_counter() - _began)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps recorded per profiled cell")
    args = parser.parse_args()

    import tempfile

    from ddp_notebook import DDPCluster, ProfileSettings

    skipped = 2  # the schedule's wait and warm-up steps
    window = slice(skipped, skipped + args.steps)
    rows: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    with tempfile.TemporaryDirectory() as folder, DDPCluster(args.ranks, backend="gloo") as world:
        world.push({"TOTAL": skipped + args.steps + 3})
        world.execute(CELL, stream=False)  # warm: imports, first allocations
        for round_ in range(args.rounds):
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            for mode in order:
                profile = ProfileSettings(steps=args.steps, folder=folder) if mode == "on" else None
                began = time.perf_counter()
                world.execute(CELL, profile=profile, stream=False)
                cell = time.perf_counter() - began
                steps = world.pull("_times", ranks=[0])[0][window]
                for key, value in (
                    ("median", statistics.median(steps)),
                    ("mean", statistics.fmean(steps)),
                    ("cell", cell),
                ):
                    rows[mode].setdefault(key, []).append(value)
            ratio = rows["on"]["median"][-1] / rows["off"]["median"][-1]
            print(
                f"round {round_ + 1}: median ms/step off {rows['off']['median'][-1] * 1e3:.3f}, "
                f"on {rows['on']['median'][-1] * 1e3:.3f} ({ratio:.3f}x)",
                flush=True,
            )
    print(f"{args.ranks} gloo ranks, {args.rounds} paired rounds, {args.steps} recorded steps each (round medians):")
    for key, label in (
        ("median", "median step"),
        ("mean", "mean step (trace export included)"),
        ("cell", "whole cell, s"),
    ):
        off, on = statistics.median(rows["off"][key]), statistics.median(rows["on"][key])
        scale, unit = (1.0, "s") if key == "cell" else (1e3, "ms")
        print(f"  {label:36s} off {off * scale:8.3f} {unit}   on {on * scale:8.3f} {unit}   {on / off:6.3f}x")
    per_round = [on / off for on, off in zip(rows["on"]["median"], rows["off"]["median"])]
    print(f"  per-round ratio of median steps: {', '.join(f'{r:.3f}' for r in per_round)}")


if __name__ == "__main__":
    main()
