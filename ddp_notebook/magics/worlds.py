"""`%ddp_worlds`: the user's detached worlds, each with its state, from any kernel."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class

from ..world import detached
from .arguments import no_arguments, usage_errors


@magics_class
class WorldsMagics(Magics):
    """Lists the detached worlds of this user (`%ddp_attach` attaches to one)."""

    @line_magic
    @usage_errors
    @no_arguments
    def ddp_worlds(self) -> None:
        """List your detached worlds (`%ddp_start N --detach`): id, ranks, state (idle, running a cell,
        attached), started, idle for how long, and the notebook that started each."""
        print(detached.describe(detached.worlds()))
