"""The package's shape: no import circle between its modules, lazy imports included,
and the per-process context module stands alone (everything may import it)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import shmloader

PACKAGE = Path(shmloader.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("shmloader", *parts)).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """Package modules each module imports, at any depth of its code (lazy imports count:
    they close a circle as surely when they run)."""
    graph: dict[str, set[str]] = defaultdict(set)
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shmloader"):
                # `from shmloader import x` names module shmloader.x when x is a module
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("shmloader")]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_circle():
    graph = _imports()
    graph.pop("shmloader", None)  # the package's __init__ re-exports; nothing imports it back
    for deps in graph.values():
        deps.discard("shmloader")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep) :], dep] if dep in path else [module, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_context_imports_nothing_from_the_package():
    graph = _imports()
    assert "shmloader.context" in graph
    assert graph["shmloader.context"] == set()
