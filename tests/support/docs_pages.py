"""What the docs pages show, read for the tests that run it as written: the magic lines of a page's
python blocks (or of one of its sections)."""

from __future__ import annotations

import re
from pathlib import Path


def documented_magic_lines(page: Path, section: str | None = None) -> list[str]:
    """The magic lines (`%...`) of the python blocks of a docs page, or of its `## section`, as
    written there (a trailing comment left out): what a test must run as written."""
    text = page.read_text()
    if section is not None:
        text = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.startswith("%")]
