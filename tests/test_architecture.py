"""The package's shape: no import circle (the package root's lazy edges included), a rank process
that loads no kernel-side module, the kernel's folders importing in one direction, and dependency
internals used in one adapter only."""

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


def import_graph(type_imports: bool = False) -> dict[str, set[str]]:
    """Runtime imports between the package's modules (lazy ones in functions included); with
    `type_imports`, those under `if TYPE_CHECKING:` too (a module that names another's types
    depends on them, though it never loads them).

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
            if not type_imports and _under_type_checking(node, parents):
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
    # it sees edges
    assert graph["ddp_notebook.world.cluster"] >= {"ddp_notebook.world.provisioning", "ddp_notebook.world.forming"}
    # the root's lazy names are edges too
    assert graph["ddp_notebook"] >= {"ddp_notebook.world.cluster", "ddp_notebook.rank.helpers", "ddp_notebook.magics"}
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph) or [])}"


def test_an_import_of_a_package_name_is_an_edge_to_the_package() -> None:
    graph = import_graph()
    # `from ddp_notebook.rank import group`: a module, not a name of ddp_notebook.rank
    assert "ddp_notebook.rank" not in graph["ddp_notebook.rank.calls"]
    assert "ddp_notebook.rank.membership" in graph["ddp_notebook.rank.calls"]
    # `from .provisioning import Provisioner`: a name of the package's __init__
    assert "ddp_notebook.world.provisioning" in graph["ddp_notebook.world.running"]


# A folder is where its code runs.
SIDES = {
    "wire": "the messages and calls between processes (standard library only)",
    "platform": "what the machine gives a process (standard library only)",
    "rank": "a rank process",
    "world": "the kernel: a world and its processes",
    "cell": "the kernel: a cell in flight",
    "live": "the kernel: what a running cell shows",
    "magics": "the kernel: the %ddp magics, a line read and one call on the world",
}
KERNEL_SIDE = ("magics", "world", "cell", "live")
STANDARD_LIBRARY_ONLY = ("wire", "platform")
# the package root holds its public face only: lazy names, the errors users catch, the datasets
ROOT_MODULES = {"ddp_notebook", "ddp_notebook._version", "ddp_notebook.errors", "ddp_notebook.datasets"}
ROOT_STANDARD_LIBRARY_ONLY = ("ddp_notebook._version", "ddp_notebook.errors")
# the datasets of the notebooks' cells: standard library at import, torch inside the functions that make tensors
ROOT_TORCH_WHEN_CALLED = ("ddp_notebook.datasets",)


def side_of(module: str) -> str:
    """The folder a module is in (`root` for the package root's own modules)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SIDES else "root"


def is_kernel_side(module: str) -> bool:
    return side_of(module) in KERNEL_SIDE


def test_the_side_rules_see_what_they_check() -> None:
    assert side_of("ddp_notebook.world.provisioning.local") == "world"
    assert side_of("ddp_notebook.rank") == "rank" and side_of("ddp_notebook.errors") == "root"
    assert is_kernel_side("ddp_notebook.magics.core") and is_kernel_side("ddp_notebook.live.feed")
    assert not is_kernel_side("ddp_notebook.rank.calls") and not is_kernel_side("ddp_notebook.wire.join")


def test_every_module_is_in_a_side_folder() -> None:
    """A new module goes in the folder of the process that runs it, not beside the root's public face."""
    stray = sorted(name for name in import_graph() if side_of(name) == "root" and name not in ROOT_MODULES)
    assert stray == [], f"modules outside the side folders {sorted(SIDES)}: {stray}"
    assert {side_of(name) for name in import_graph()} == {*SIDES, "root"}


def test_the_rank_side_never_imports_the_kernel_side() -> None:
    graph = import_graph()
    assert sum(side_of(name) == "rank" for name in graph) > 10, "the rank side, in its folder"
    crossing = [
        f"{name} -> {edge}"
        for name in sorted(graph)
        if side_of(name) == "rank"
        for edge in sorted(graph[name])
        if is_kernel_side(edge) or edge == "ddp_notebook"  # the root's lazy names reach every side
    ]
    assert crossing == []


# The kernel's folders, highest first: a folder imports the folders after it, never one before it.
# A world runs cells, a cell feeds what the notebook shows; what is shown knows no cell, a cell no world.
KERNEL_ORDER = ("world", "cell", "live")


def wrong_way_edges(graph: dict[str, set[str]]) -> list[str]:
    """The imports from a kernel folder to one before it in KERNEL_ORDER."""
    place = {folder: i for i, folder in enumerate(KERNEL_ORDER)}
    return [
        f"{name} -> {edge}"
        for name in sorted(graph)
        for edge in sorted(graph[name])
        if side_of(name) in place and side_of(edge) in place and place[side_of(edge)] < place[side_of(name)]
    ]


def test_the_folder_order_finds_the_wrong_way_edges() -> None:
    graph = {
        f"ddp_notebook.{name}": {f"ddp_notebook.{edge}" for edge in edges}
        for name, edges in {
            "world.cluster": ("cell.relay", "live.feed", "world.state"),
            "cell.relay": ("world.ipp_adapter", "live.feed", "wire.results"),
            "live.feed": ("cell.xray", "live.stragglers"),
            "magics": ("world.cluster",),
        }.items()
    }
    assert wrong_way_edges(graph) == [
        "ddp_notebook.cell.relay -> ddp_notebook.world.ipp_adapter",
        "ddp_notebook.live.feed -> ddp_notebook.cell.xray",
    ]


def test_the_kernel_folders_import_in_one_direction() -> None:
    """world -> cell -> live: a cell never imports a world, what the notebook shows never imports
    a cell or a world; the names a module reads only for its type hints count too."""
    graph = import_graph(type_imports=True)
    # it sees the edges the rule allows, and those under TYPE_CHECKING
    assert "ddp_notebook.cell.relay" in graph["ddp_notebook.world.cell_run"]
    assert "ddp_notebook.live.feed" in graph["ddp_notebook.world.cluster"]
    assert "ddp_notebook.world.cluster" in graph["ddp_notebook.world.report"]
    assert "ddp_notebook.world.cluster" not in import_graph()["ddp_notebook.world.report"]
    assert wrong_way_edges(graph) == []


@pytest.mark.parametrize("folder", [*STANDARD_LIBRARY_ONLY, "root"])
def test_the_wire_and_the_platform_import_only_the_standard_library(folder: str) -> None:
    """The messages between the processes are plain values either side can load; the platform's
    facts are read without torch; the root's errors and datasets load on either side."""
    graph = import_graph()
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    chosen = [*ROOT_STANDARD_LIBRARY_ONLY, *ROOT_TORCH_WHEN_CALLED] if folder == "root" else []
    chosen += [m for m in modules if side_of(m) == folder and folder != "root"]
    assert chosen
    for name in chosen:
        own = f"ddp_notebook.{folder}" if folder != "root" else None
        assert {edge for edge in graph[name] if own is None or not edge.startswith(own)} == set(), name
        tree = ast.parse(modules[name].read_text())
        for node in tree.body if name in ROOT_TORCH_WHEN_CALLED else ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            assert all(root in sys.stdlib_module_names for root in roots), f"{name} imports {roots}"


# what a rank process imports: its entry point, the rank side, the calls the notebook makes on it
RANK_ENTRY = (
    "ddp_notebook.rank.entrypoints",
    "ddp_notebook.rank.membership",
    "ddp_notebook.rank.calls",
    "ddp_notebook.rank.elastic",
)


def test_a_fresh_rank_process_loads_no_kernel_side_module() -> None:
    """Checked in a fresh process, through sys.modules: what a rank's imports really load, the
    package roots included. First a rank's own imports (counted), then every rank-side module."""
    every_rank_module = sorted(name for name in import_graph() if side_of(name) == "rank")
    code = (
        "import importlib, json, sys\n"
        "def loaded(): return sorted(m for m in sys.modules if m.startswith('ddp_notebook'))\n"
        f"for name in {RANK_ENTRY!r}:\n    importlib.import_module(name)\n"
        "first = loaded()\n"
        f"for name in {every_rank_module!r}:\n    importlib.import_module(name)\n"
        "print(json.dumps([first, loaded()]))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    first, everything = json.loads(run.stdout)
    kernel_side = [name for name in everything if is_kernel_side(name)]
    assert kernel_side == [], f"a rank loads kernel-side modules: {kernel_side}"
    # 23 with the entry points above, 4 of them package roots (40 before the package root loaded its
    # names lazily, all of them side by side, kernel side included)
    assert len(first) <= 24, first


def test_leaf_modules_import_nothing_of_the_package() -> None:
    graph = import_graph()
    leaves = (
        "wire.results",
        "world.state",
        "cell.output",
        "cell.ipp_adapter",
        "rank.torch_adapter",
        "rank.ipp_process_adapter",
        "errors",
    )
    for leaf in leaves:
        assert graph[f"ddp_notebook.{leaf}"] == set(), leaf


# each dependency's internals, in the folder of the side that uses that dependency
ADAPTERS = ("cell/ipp_adapter.py", "rank/torch_adapter.py", "rank/ipp_process_adapter.py", "live/plotly_adapter.py")
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
        if path.relative_to(PACKAGE).as_posix() not in ADAPTERS:
            reaches = private_reaches(ast.parse(path.read_text()))
            offenders += [f"{path.relative_to(PACKAGE)}: {reach}" for reach in reaches]
    assert offenders == []


# the private attributes of each dependency this package reaches for, each set in its adapter
_PRIVATE = {
    "cell/ipp_adapter.py": (
        "._children",
        "._io_loop",
        "._send(",
        "._query_stream",
        "._unwrap_exception",
        "stop_data",
        "._parse_date",
        "._update_engines",
        "_start_waiting",
        "._stop_waiting",
        "._wait_thread",
    ),
    "rank/ipp_process_adapter.py": ("._publish_execute_input",),
    "rank/torch_adapter.py": (
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
    "live/plotly_adapter.py": ("._widget_data", "._widget_layout", "figure._data", "._layout_obj"),
}


@pytest.mark.parametrize("adapter", list(_PRIVATE))
def test_a_dependencys_internals_only_in_its_adapter(adapter: str) -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == adapter:
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(PACKAGE)}: {private}" for private in _PRIVATE[adapter] if private in text]
    assert offenders == []
    assert all(private in (PACKAGE / adapter).read_text() for private in _PRIVATE[adapter]), "a stale entry"


# a kernel-side adapter sits in the lowest kernel folder that uses its dependency, so that every
# folder that uses it reaches it in the folder order
KERNEL_ADAPTERS = {"cell/ipp_adapter.py": "ipyparallel", "live/plotly_adapter.py": "plotly"}


def imported_roots(tree: ast.Module) -> set[str]:
    """The top-level packages a module imports (in functions too)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots.add((node.module or "").split(".")[0])
    return roots


@pytest.mark.parametrize(("adapter", "dependency"), list(KERNEL_ADAPTERS.items()))
def test_a_kernel_adapter_sits_in_the_lowest_folder_that_uses_its_dependency(adapter: str, dependency: str) -> None:
    folder = adapter.split("/")[0]
    users = {
        side_of(_module_name(path))
        for path in PACKAGE.rglob("*.py")
        if dependency in imported_roots(ast.parse(path.read_text()))
    }
    assert folder in users
    below = set(KERNEL_ORDER[KERNEL_ORDER.index(folder) + 1 :])
    assert users & below == set(), f"{dependency} is used below {adapter}: move the adapter down"


_MUTABLE_CALLS = {"dict", "set", "list", "deque", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "defaultdict"}


def module_level_state(tree: ast.Module) -> list[str]:
    """Names a module binds at its top level to a mutable container: state kept by the module."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        called = ast.unparse(value.func).split(".")[-1] if isinstance(value, ast.Call) else ""
        if isinstance(value, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp)) or (
            called in _MUTABLE_CALLS
        ):
            found += [ast.unparse(target) for target in targets]
    return found


def test_module_level_state_is_found() -> None:
    code = "A = (1, 2)\n_s: dict[str, int] = {}\n_q = deque(maxlen=2)\n_w = weakref.WeakSet()\nX = frozenset()"
    assert module_level_state(ast.parse(code)) == ["_s", "_q", "_w"]


def test_a_ranks_state_is_one_typed_object() -> None:
    """Everything a rank process keeps between cells is a field of `rank.state.RANK` (one typed
    object), not a dict of some module's that only a string key names."""
    offenders = []
    paths = sorted((PACKAGE / "rank").glob("*.py"))
    assert len(paths) > 10 and (PACKAGE / "rank" / "state.py").exists(), "the rank side and its state object"
    for path in paths:
        if path.name != "state.py":
            offenders += [f"rank/{path.name}: {name}" for name in module_level_state(ast.parse(path.read_text()))]
    assert offenders == []


def public_classes(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Each public class name (no leading underscore, defined at a module's top level) -> the
    modules defining it."""
    found: dict[str, list[str]] = {}
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(module)
    return found


def test_a_class_defined_twice_is_found() -> None:
    trees = {
        "a": ast.parse("class Report: ...\nclass _Own: ..."),
        "b": ast.parse("class Report(dict): ...\nclass _Own: ..."),
    }
    assert public_classes(trees) == {"Report": ["a", "b"]}


def test_every_public_class_name_means_one_thing() -> None:
    """A public class name is defined in one module only: a reader (or an import) never takes one
    `RankError` for another."""
    trees = {_module_name(path): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    classes = public_classes(trees)
    assert len(classes) > 50, "the package's classes"
    assert {name: modules for name, modules in classes.items() if len(modules) > 1} == {}
