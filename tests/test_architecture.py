"""The package's shape: no import circle, and dependency internals used in one adapter only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_notebook"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            return True
    return False


def import_graph() -> dict[str, set[str]]:
    """Runtime imports between the package's modules (lazy ones in functions included).

    Imports of the top-level package itself are left out: it only re-exports.
    """
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if _under_type_checking(node, parents):
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in modules and target != "ddp_notebook" and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle() -> None:
    graph = import_graph()
    assert graph["ddp_notebook.cluster"] >= {"ddp_notebook.provisioning", "ddp_notebook.forming"}  # it sees edges
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph) or [])}"


def test_leaf_modules_import_nothing_of_the_package() -> None:
    graph = import_graph()
    for leaf in ("results", "state", "output", "ipp_adapter", "torch_adapter", "errors"):
        assert graph[f"ddp_notebook.{leaf}"] == set(), leaf


# the private attributes of each dependency this package reaches for, each set in its adapter
_PRIVATE = {
    "ipp_adapter.py": ("._children", "._io_loop", "._send(", "._query_stream", "._unwrap_exception", "stop_data"),
    "torch_adapter.py": (
        "torch._C",
        "_composable_state",
        "._get_fsdp_state",
        "._update_process_group",
        "._remove_autograd_hooks",
        "._register_backend",
        "._set_default_backend",
    ),
}


@pytest.mark.parametrize("adapter", list(_PRIVATE))
def test_a_dependencys_internals_only_in_its_adapter(adapter: str) -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == adapter:
            continue
        text = path.read_text()
        offenders += [f"{path.name}: {private}" for private in _PRIVATE[adapter] if private in text]
    assert offenders == []
    assert all(private in (PACKAGE / adapter).read_text() for private in _PRIVATE[adapter]), "a stale entry"
