"""The package's shape: no import circle (the package root's lazy edges included), a rank process
that loads no kernel-side module, and dependency internals used in one adapter only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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

    `from package import submodule` is an edge to the submodule alone (its package is imported
    first whatever the module is); an edge to a package means a name its `__init__` holds.
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
                targets = [f"{base}.{alias.name}" for alias in node.names]
                if any(target not in modules for target in targets):
                    targets.append(base)  # a name of the package's own __init__
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module":
                # the package root's lazy names: import_module(f".{home}", __name__)
                targets = [f"{package}.{home}" for home in _lazy_homes(tree)] if name == "ddp_notebook" else []
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _lazy_homes(tree: ast.Module) -> set[str]:
    """The modules the package root's _HOMES table loads names from."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_HOMES" for t in node.targets):
            return {value.value for value in ast.walk(node.value) if isinstance(value, ast.Constant)} - {
                key.value for key in getattr(node.value, "keys", []) if isinstance(key, ast.Constant)
            }
    return set()


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
    # the root's lazy names are edges too
    assert graph["ddp_notebook"] >= {"ddp_notebook.cluster", "ddp_notebook.rank", "ddp_notebook.magics"}
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph) or [])}"


def test_an_import_of_a_package_name_is_an_edge_to_the_package() -> None:
    graph = import_graph()
    assert "ddp_notebook" not in graph["ddp_notebook.rank_calls"]  # `from ddp_notebook import rank`: a module
    assert "ddp_notebook.provisioning" in graph["ddp_notebook.running"]  # `from .provisioning import Provisioner`


# the modules that run in the kernel (or talk to ipyparallel from there); a rank process loads none
KERNEL_SIDE = {
    "cluster", "comeback", "config", "controller", "debugging", "export", "forming", "ipp_adapter",
    "launchers", "magics", "outcome", "output", "provisioning", "relay", "report", "running", "spare",
    "state", "supervision", "syntax", "template", "widgets", "xray",
}  # fmt: skip
# what a rank process imports: its entry point, the rank side, the calls the notebook makes on it
RANK_ENTRY = ("ddp_notebook.entrypoints", "ddp_notebook.rank", "ddp_notebook.rank_calls", "ddp_notebook.elastic")


def test_a_fresh_rank_process_loads_no_kernel_side_module() -> None:
    code = (
        f"import importlib, json, sys\nfor name in {RANK_ENTRY!r}:\n    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('ddp_notebook'))))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    kernel_side = [name for name in loaded if name.partition(".")[2].split(".")[0] in KERNEL_SIDE]
    assert kernel_side == [], f"a rank loads kernel-side modules: {kernel_side}"
    # 20 with the entry points above (40 before the package root loaded its names lazily)
    assert len(loaded) <= 22, loaded


def test_leaf_modules_import_nothing_of_the_package() -> None:
    graph = import_graph()
    for leaf in ("results", "state", "output", "ipp_adapter", "torch_adapter", "errors"):
        assert graph[f"ddp_notebook.{leaf}"] == set(), leaf


ADAPTERS = ("ipp_adapter.py", "torch_adapter.py", "plotly_adapter.py")
# the standard library's own functions spelled with an underscore (documented, public)
_STDLIB_UNDERSCORED = {"os._exit", "sys._getframe", "sys._current_frames"}


def private_reaches(tree: ast.Module) -> list[str]:
    """`x._name` (and getattr(x, "_name")) where x is not the object itself: another object's
    internals, a dependency's or another module's of ours. Attributes of our own that we set on
    objects we made are named `_ddp_notebook_*`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base, attr = ast.unparse(node.value), node.attr
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr", "setattr"):
            named = len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            if not named or not isinstance(node.args[1].value, str):
                continue
            base, attr = ast.unparse(node.args[0]), node.args[1].value
        else:
            continue
        if not attr.startswith("_") or attr.startswith("__") or attr.startswith("_ddp_notebook_"):
            continue
        if base in ("self", "cls") or f"{base}.{attr}" in _STDLIB_UNDERSCORED:
            continue
        found.append(f"{base}.{attr}")
    return found


def test_private_reaches_are_found() -> None:
    code = "mesh._pg_registry = {}\ngetattr(t, '_local_tensor', t)\nself._x\nos._exit(1)\nw._ddp_notebook_kwargs"
    assert private_reaches(ast.parse(code)) == ["mesh._pg_registry", "t._local_tensor"]


def test_no_private_internals_outside_the_adapters() -> None:
    """By rule: a dependency's internals (torch, ipyparallel, plotly, ipywidgets...) and the private
    names of our other modules are reached for in an adapter only."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ADAPTERS:
            reaches = private_reaches(ast.parse(path.read_text()))
            offenders += [f"{path.relative_to(PACKAGE)}: {reach}" for reach in reaches]
    assert offenders == []


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
        "._get_ddp_logging_data",
        "._compute_bucket_assignment_by_size",
        "tensor._version",
        "local._version",
        "_local_tensor",
        "._pg_registry",
        "._dim_group_names",
        "._execution_engine",
    ),
    "plotly_adapter.py": ("._widget_data", "._widget_layout", "figure._data", "._layout_obj"),
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


def test_the_wire_imports_only_the_standard_library_and_itself() -> None:
    """The messages between the processes are plain values either side can load."""
    graph = import_graph()
    for path in sorted((PACKAGE / "wire").rglob("*.py")):
        name = _module_name(path)
        assert {edge for edge in graph[name] if not edge.startswith("ddp_notebook.wire")} == set(), name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            assert all(root in sys.stdlib_module_names for root in roots), f"{name} imports {roots}"
