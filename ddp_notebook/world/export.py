"""The %%ddp cells run so far, as one script for torchrun (`%ddp_export train.py`).

Notebook side (no torch). The script sets the process group up in plain torch, as torchrun
expects (`init_process_group` from the environment torchrun gives), and publishes the names a
cell sees (`rank`, `world_size`, `local_rank`, `device`, `torch`, `dist`, `ddp_notebook`). The
cells themselves are copied as they ran: their `ddp_notebook.prepare_model`, `prepare_loader`,
`log`, `progress`, `save_checkpoint`, ... calls stay, because those helpers run outside a world
too (they read torchrun's environment); rewriting them into plain torch would give the long
run other code than the one tried in the notebook. Failed cells are left out; a cell run on
some ranks only (`--ranks`) runs under `if rank in (...)`.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import DDPUsageError, rank_ranges


@dataclass(frozen=True)
class CellRecord:
    """One cell a world ran: its code, the ranks it ran on, and whether it succeeded."""

    number: int  # 1-based, in the order the world ran them
    code: str
    ranks: tuple[int, ...]
    ok: bool
    world_size: int


HEADER = '''\
#!/usr/bin/env python3
"""Exported from %%ddp cells. Run with: torchrun --nproc-per-node {world_size} {name}"""

import os

import torch
import torch.distributed as dist

import ddp_notebook
from ddp_notebook.rank.membership import context

# ---- the world, as %ddp_start set it up: torchrun gives RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*
local_rank = int(os.environ["LOCAL_RANK"])
backend = os.environ.get("DDP_BACKEND", {backend!r})
if backend == "nccl":
    torch.cuda.set_device(local_rank)  # cuda:LOCAL_RANK, before the group forms
    dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
else:
    dist.init_process_group(backend)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
rank = dist.get_rank()
world_size = dist.get_world_size()
device = context().device  # cuda:LOCAL_RANK on nccl, else the CPU
'''

FOOTER = """
# ---- leave the group cleanly (exiting without it can abort the process)
dist.destroy_process_group()
"""


def parse_selection(text: str | None) -> list[int] | None:
    """'1,3-5' -> [1, 3, 4, 5]; None or 'all' -> None (every successful cell)."""
    if text is None or text.strip() in ("", "all"):
        return None
    chosen: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise DDPUsageError(f"cells: expected numbers like 1,3-5, got {text!r}")
        chosen.extend(range(int(first), int(last or first) + 1))
    return chosen


def choose(history: Sequence[CellRecord], selection: Iterable[int] | None) -> list[CellRecord]:
    """The cells to export: the chosen numbers (in order), or every cell that succeeded."""
    if selection is None:
        return [cell for cell in history if cell.ok]
    by_number = {cell.number: cell for cell in history}
    chosen = []
    for number in selection:
        cell = by_number.get(number)
        if cell is None:
            raise DDPUsageError(f"no cell {number}: the world ran cells 1 to {len(history)} (%ddp_export --list)")
        if not cell.ok:
            raise DDPUsageError(f"cell {number} failed; fix it and run it again, then export the new one")
        chosen.append(cell)
    return chosen


def render(cells: Sequence[CellRecord], name: str = "train.py", backend: str = "gloo") -> str:
    """The script's text: the process group set-up, each cell in order, the teardown."""
    world_size = cells[-1].world_size if cells else 1
    parts = [HEADER.format(world_size=world_size, name=name, backend=backend)]
    for cell in cells:
        code = cell.code.rstrip() or "pass"
        everywhere = cell.ranks == tuple(range(cell.world_size))
        parts.append(f"\n# ---- cell {cell.number}" + ("" if everywhere else f" (ranks {list(cell.ranks)})") + "\n")
        if everywhere:
            parts.append(code + "\n")
        else:
            parts.append(f"if rank in {cell.ranks!r}:\n" + textwrap.indent(code, "    ") + "\n")
    parts.append(FOOTER)
    return "".join(parts)


def listing(history: Sequence[CellRecord]) -> str:
    """One line a cell: number, outcome, ranks, first line of code."""
    lines = []
    for cell in history:
        first = next((line for line in cell.code.splitlines() if line.strip()), "")
        state = "ok    " if cell.ok else "FAILED"
        lines.append(f"{cell.number:>3}  {state}  ranks {rank_ranges(cell.ranks):<8} {first[:70]}")
    return "\n".join(lines) or "no %%ddp cells ran in this world yet"


def check_plain_python(cell: CellRecord) -> None:
    """A cell with IPython-only syntax (%magic, !command) is refused here, not under torchrun."""
    try:
        compile(cell.code, f"cell {cell.number}", "exec")
    except SyntaxError as problem:
        where = f"line {problem.lineno}: {(problem.text or '').strip()}" if problem.lineno else str(problem.msg)
        raise DDPUsageError(
            f"cell {cell.number} is not plain Python ({where}): a torchrun script cannot run "
            "%magics or !commands; leave the cell out with --cells, or write it in Python"
        ) from None


def export_script(
    history: Sequence[CellRecord],
    path: str | os.PathLike[str],
    cells: Iterable[int] | None = None,
    *,
    backend: str = "gloo",
    overwrite: bool = False,
) -> str:
    """Write the chosen cells (default: every one that succeeded) as a torchrun script at `path`."""
    chosen = choose(history, cells)
    if not chosen:
        raise DDPUsageError("nothing to export: no %%ddp cell has succeeded in this world")
    target = os.path.abspath(os.fspath(path))
    if os.path.exists(target) and not overwrite:
        raise DDPUsageError(f"{target} exists; pass --force (overwrite=True) to replace it")
    for cell in chosen:
        check_plain_python(cell)
    text = render(chosen, os.path.basename(target), backend)
    compile(text, target, "exec")
    with open(target, "w", encoding="utf-8") as handle:
        handle.write(text)
    return target
