"""Checks made on a cell in the notebook before it is sent to any rank."""

from __future__ import annotations

import ast
import functools
import traceback
from typing import Any

from ..errors import DDPError


class CellSyntaxError(DDPError):
    """The cell does not parse; nothing was sent to the ranks."""

    def __init__(self, original: SyntaxError) -> None:
        super().__init__(original.msg)
        self.original = original

    def _render_traceback_(self) -> list[str]:
        lines = traceback.format_exception_only(SyntaxError, self.original)
        return [line.rstrip("\n") for line in lines] + ["(nothing was sent to the ranks)"]

    def __str__(self) -> str:
        return f"{self.original.msg} (line {self.original.lineno}); nothing was sent to the ranks"


def check_syntax(code: str) -> None:
    """Raise CellSyntaxError if `code` would not compile on the ranks.

    The ranks run IPython, so magics and shell escapes are translated first, as they
    would be there; top-level `await` is allowed, as in a notebook.
    """
    try:
        _compiles(code)
    except SyntaxError as failure:
        raise CellSyntaxError(failure) from None


@functools.lru_cache(maxsize=64)
def _compiles(code: str) -> None:
    """Translate and compile `code`, raising its SyntaxError; a cell that compiled once is not
    compiled again (a notebook runs the same cells again and again; failures are not cached)."""
    source = _transformer().transform_cell(code)
    compile(source, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


@functools.cache
def _transformer() -> Any:
    """IPython's input transformer, made once (it keeps no state between cells)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()
