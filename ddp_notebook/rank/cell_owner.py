"""Runs on the ranks of a detached world: the one kernel whose cells they run.

Two live kernels attached to one world (the notebook open in two tabs, a colleague's session on the
same account) would send their cells in different orders to different ranks, which then wait in
different collectives. A kernel attaching tells every rank, over its X-ray line (answered at once,
even while a cell runs), which ipyparallel session is the world's now (`wire.detached.OwnerRequest`);
from then on a cell any other session sends is refused before it runs (IPython's `InputRejected`,
raised from an AST transformer: the cell never starts, its kernel gets one error naming the kernel
that took the world). The kernels check the world's registry entry first and say it in one line
(`world.ownership`); this is what holds when two of them race.
"""

from __future__ import annotations

import ast
from typing import Any

from ..wire import detached as wire
from ..wire.xray_messages import XRAY_VERSION, error_answer
from .state import RANK


class _OnlyTheOwnersCells(ast.NodeTransformer):
    """Looks at each cell once before it runs (IPython's `ast_transformers`), changes nothing."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    def visit(self, node: ast.AST) -> ast.AST:
        owner = RANK.cell_owner
        if owner is not None:
            from . import ipp_process_adapter as adapter

            _, session = adapter.current_request(self.shell)
            if session and session != owner["session"]:
                from IPython.core.error import InputRejected

                raise InputRejected(owner["refusal"])
        return node


def guard(shell: Any) -> None:
    """From now on, this rank runs the cells of its owner's session only, once one is named."""
    if not any(isinstance(transformer, _OnlyTheOwnersCells) for transformer in shell.ast_transformers):
        shell.ast_transformers.append(_OnlyTheOwnersCells(shell))


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The X-ray's `owner` request: the session whose cells this rank runs from now on."""
    session, refusal = request.get("session"), request.get("refusal")
    if not isinstance(session, str) or not session or not isinstance(refusal, str):
        return dict(error_answer("an owner request names a session and what other sessions are told"))
    RANK.cell_owner = {"session": session, "refusal": refusal}
    answered: wire.OwnerAnswer = {"v": XRAY_VERSION, "owner": session}
    return dict(answered)
