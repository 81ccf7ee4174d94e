"""The package's floors: every import, lazy and type-only ones included, runs down (or stays
on its floor), never up. The floors, bottom to top, are in :data:`FLOORS`; the side folders
(:data:`SIDE`) sit on no fixed floor: each of their modules floats just above the highest
floor it imports, so a floor may use a side module only when that module needs nothing
from the floor itself or above it."""

from __future__ import annotations

import ast
from pathlib import Path

import shmloader

PACKAGE = Path(shmloader.__file__).parent

# Bottom to top. A top-level module is its own unit; a folder is one unit with its modules.
FLOORS: list[tuple[str, ...]] = [
    ("errors", "context", "dataset", "_native", "_shared_read", "_jpeg"),  # import nothing of ours
    ("system",),
    ("memory",),
    ("transport",),
    ("batch",),
    ("workers", "tuning"),
    ("sampling",),
    ("config",),
    ("settings",),  # one epoch's frozen settings, read from the loader by loader.py
    ("runtime",),  # the working parts one loader holds (cursor, leases, tuner, stats)
    ("epoch",),  # the iterators, handed a runtime
    ("loader",),
    ("__init__",),  # the package's face
    ("cli", "doctor", "bench"),  # the tools, which use the package as a user does
]
SIDE = ("interop", "vision", "integrations")

# Imports that run up a floor on purpose, each with its reason. Empty: every arrow was moved.
ALLOWED: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("shmloader", *parts)).removesuffix(".__init__")


def _unit(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if parts else "__init__"


def _imports(modules: set[str]) -> dict[str, set[tuple[str, int]]]:
    """Package modules each module imports (with the line), at any depth of its code."""
    graph: dict[str, set[tuple[str, int]]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[tuple[str, int]] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level-1 packages
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base.split(".")[0] != "shmloader":
                    continue
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    found.add((target if target in modules else base, node.lineno))
            elif isinstance(node, ast.Import):
                found.update((a.name, node.lineno) for a in node.names if a.name.startswith("shmloader"))
        graph[name] = {(t, line) for t, line in found if t != name}
    return graph


def _ranks(graph: dict[str, set[tuple[str, int]]]) -> dict[str, float]:
    """Each module's floor: its unit's, or for a side module half a floor above the highest
    floor it imports."""
    floor = {unit: float(i) for i, units in enumerate(FLOORS) for unit in units}
    ranks: dict[str, float] = {}

    def rank(module: str, seen: tuple[str, ...] = ()) -> float:
        if module not in ranks:
            unit = _unit(module)
            if unit in floor:
                ranks[module] = floor[unit]
            else:
                assert unit in SIDE, f"{module}: its folder {unit!r} is on no floor; add it to FLOORS or SIDE"
                deps = [rank(t, (*seen, module)) for t, _ in graph.get(module, ()) if t not in seen]
                ranks[module] = max(deps, default=0.0) + 0.5
        return ranks[module]

    for module in graph:
        rank(module)
    return ranks


def _modules() -> set[str]:
    """The package's modules, its compiled extensions included (``shmloader._native``)."""
    python = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    native = {"shmloader." + p.name.split(".")[0] for p in PACKAGE.glob("*.so")}
    return python | native


def upward_imports() -> list[str]:
    """Every import from one unit into another on a higher floor, as 'a -> b (line n)'."""
    graph = _imports(_modules())
    ranks = _ranks(graph)
    arrows = []
    for module, targets in sorted(graph.items()):
        for target, line in sorted(targets):
            if target not in ranks or _unit(target) == _unit(module) or (module, target) in ALLOWED:
                continue
            if ranks[target] > ranks[module]:
                arrows.append(f"{module} -> {target} (line {line})")
    return arrows


def test_every_folder_has_a_floor():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    placed = {u for units in FLOORS for u in units} | set(SIDE)
    assert units <= placed, f"units on no floor: {sorted(units - placed)}"


def test_no_import_runs_up_a_floor():
    arrows = upward_imports()
    assert not arrows, f"{len(arrows)} imports run up a floor:\n" + "\n".join(arrows)
