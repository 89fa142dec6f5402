"""Every magic line the README, the docs and the notebooks show, and every option they name, goes
through the magic's own parser: an option documented for a magic that does not take it (as
`%%ddp --tracker-ranks` was) fails here, not in a user's notebook.

Whole lines (in code blocks and notebook cells) are parsed as written; a magic named in prose
(`` `%ddp_start --tracker-ranks 0|all` ``) has each of its options looked up in the parser. Magics that
read their line by hand have their shape checked instead (`%ddp_run SCRIPT ARGS` passes its args
to the script, so anything goes after the script).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_notebook.magics import magic as find_magic
from ddp_notebook.magics import parse_line

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]
MAGIC = re.compile(r"(?<![\w%])%%?(ddp(?:_[a-z]+)?)(?![\w*])(.*)")
SPAN = re.compile(r"`([^`\n]*%%?ddp[^`\n]*)`")
# the magics that read their line by hand: how many words each takes (None: any, after one)
BY_HAND: dict[str, tuple[int, int | None]] = {
    "ddp_stop": (0, 0),
    "ddp_restart": (0, 0),
    "ddp_rollback": (0, 0),
    "ddp_status": (0, 0),
    "ddp_worlds": (0, 0),
    "ddp_metrics": (0, 0),
    "ddp_resize": (1, 1),
    "ddp_output": (1, 1),
    "ddp_debug": (0, 1),
    "ddp_run": (1, None),
}


@dataclass(frozen=True)
class Mention:
    where: str  # file and line
    magic: str  # ddp_start, ddp (the cell magic), ...
    rest: str  # what follows the magic's name
    whole: bool  # a line as a user runs it (in a code block or a notebook cell), not a mention in prose

    def __str__(self) -> str:
        return f"{self.where}: %{'%' if self.magic == 'ddp' else ''}{self.magic} {self.rest}".rstrip()


def _code_lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, in code) of a page: a notebook's code cells are code, its markdown prose."""
    if path.suffix == ".ipynb":
        found = []
        for number, cell in enumerate(json.loads(path.read_text())["cells"]):
            for line in "".join(cell["source"]).splitlines():
                found.append((number, line, cell["cell_type"] == "code"))
        return found
    found, fence, code = [], False, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            code = fence and line.strip() in ("```python", "```ipython")  # a shell block's lines are not magics
            continue
        found.append((number, line, code))
    return found


def mentions() -> list[Mention]:
    found = []
    for path in SOURCES:
        name = path.relative_to(ROOT)
        for number, line, code in _code_lines(path):
            where = f"{name}:{number}"
            if code:
                text = line.split(" #", 1)[0]
                match = MAGIC.search(text)
                if match and text.lstrip().startswith(("%", "m = %", "metrics = %")):
                    found.append(Mention(where, match.group(1), match.group(2).strip(), True))
                continue
            for span in SPAN.findall(line):
                for part in re.split(r"(?=%%?ddp)", span):
                    match = MAGIC.match(part.strip())
                    if match:
                        found.append(Mention(where, match.group(1), match.group(2).strip().rstrip(",;)"), False))
    return found


MENTIONS = mentions()


def _method(name: str) -> object:
    try:
        return find_magic(name)
    except KeyError:
        raise AssertionError(f"%{name} is documented but is no magic of ddp_notebook") from None


def _options(method: object) -> set[str]:
    """The option strings the magic's parser takes, as its help lists them."""
    parser = method.parser  # type: ignore[attr-defined]
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", parser.format_help()))


def test_the_documents_show_the_magics() -> None:
    whole = [m for m in MENTIONS if m.whole]
    assert len(whole) > 50 and len(MENTIONS) > 150, (len(whole), len(MENTIONS))
    assert {m.magic for m in whole} >= {"ddp_start", "ddp", "ddp_stop", "ddp_run", "ddp_export", "ddp_interrupt"}


@pytest.mark.parametrize("mention", [m for m in MENTIONS if m.whole], ids=str)
def test_every_documented_magic_line_parses(mention: Mention) -> None:
    method = _method(mention.magic)
    words = _expanded(shlex.split(mention.rest))
    if hasattr(method, "parser"):
        old = sorted({word.split("=")[0] for word in words} & set(getattr(method, "renamed_options", {})))
        assert old == [], f"old spellings (the docs show the new ones): {old}"
        parse_line(method, shlex.join(words))  # a mistake raises (IPython's UsageError, or argparse's exit)
        return
    low, high = BY_HAND[mention.magic]
    assert len(words) >= low and (high is None or len(words) <= high), f"%{mention.magic} takes {low}-{high} words"


def _expanded(words: list[str]) -> list[str]:
    """A line's words after IPython's `$name` expansion, as far as a test can tell: an option's `$value`
    is a value; a `$options` on its own expands to options of the notebook's choosing, left out here."""
    kept: list[str] = []
    for word in words:
        if word.startswith("$") and not (kept and kept[-1].startswith("-")):
            continue
        kept.append("X" if word.startswith("$") else word)
    return kept


@pytest.mark.parametrize("mention", [m for m in MENTIONS if not m.whole], ids=str)
def test_every_option_named_in_the_prose_is_the_magics(mention: Mention) -> None:
    method = _method(mention.magic)
    if mention.magic == "ddp_run":
        return  # its words after the script are the script's
    # a synopsis's brackets and alternatives aside: `[--tracker-ranks 0|all]`
    named = {word.split("=")[0] for word in re.split(r"[\s\[\]|]+", mention.rest) if re.match(r"--?[a-zA-Z]", word)}
    known = _options(method) if hasattr(method, "parser") else set()
    assert named <= known, f"not options of %{mention.magic}: {sorted(named - known)}"


def test_the_options_the_magics_share_read_the_same_on_each() -> None:
    line = "--tracker tensorboard:tb --tracker-ranks all --params lr,batch_size"
    start, cell = (vars(parse_line(_method(magic), line)) for magic in ("ddp_start", "ddp"))
    shared = ("tracker", "tracker_ranks", "params")
    assert (
        [start[name] for name in shared]
        == [cell[name] for name in shared]
        == ["tensorboard:tb", "all", "lr,batch_size"]
    )
    assert "--ranks" in _options(_method("ddp")) and "--ranks" in _options(_method("ddp_interrupt"))
