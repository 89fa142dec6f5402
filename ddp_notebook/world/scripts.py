"""A script run on every rank as torchrun runs it: `%ddp_run train.py ARGS` is IPython's `%run` in a
`%%ddp` cell (the script's `sys.argv`, `__name__ == "__main__"`, the notebook's folder for relative
paths, its prints tagged by rank). Checked here, in the kernel, before any rank runs it: a missing
script would otherwise be one "File not found" line per rank, and no error."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path

from ..errors import DDPUsageError


def script_cell(line: str, folder: Path) -> str:
    """The cell that runs `line` (`SCRIPT [ARGS...]`, or IPython %run's own options first) on a rank
    working in `folder`."""
    try:
        words = shlex.split(line)
    except ValueError as problem:  # an unbalanced quote
        raise DDPUsageError(f"cannot read this line ({problem}): close every quote you open") from None
    options = list(itertools.takewhile(lambda word: word.startswith("-"), words))
    if "-m" in options:
        return f"%run {line.strip()}"  # a module (-m NAME): each rank finds it on its own path
    if len(words) == len(options):
        raise DDPUsageError("%ddp_run needs a script and its arguments, e.g. %ddp_run train.py 4 2")
    script = Path(words[len(options)]).expanduser()
    if not (folder / script).is_file():  # an absolute path stays itself under `/`
        raise DDPUsageError(f"no script {script} in {folder}: the ranks run it from the notebook's folder")
    return f"%run {line.strip()}"
