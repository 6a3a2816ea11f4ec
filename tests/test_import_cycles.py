"""Imports that read top-down (issue 14): no cycle among fleetroll's modules
outside the emulator, and the Fleet SDK only behind the Fleet provider.

Every import counts: module level, under ``TYPE_CHECKING`` and inside
functions, since each of them ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fleetroll

SRC = Path(fleetroll.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(path: Path) -> set[str]:
    """Every absolute name a module imports, and each ``from`` import's members."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    return {name for name in _imported(path) if name in known}


def _top_level(path: Path) -> set[str]:
    return {name.partition(".")[0] for name in _imported(path)}


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def test_no_module_outside_the_emulator_imports_itself_back() -> None:
    known = _modules()
    graph = {name: _imports(path, known) - {name} for name, path in known.items()}
    in_cycles = sorted(
        name
        for name in graph
        if not name.startswith("fleetroll.emulator") and name in _reachable(name, graph)
    )

    assert in_cycles == []


def test_only_the_fleet_provider_s_modules_import_the_fleet_sdk() -> None:
    """Another provider plugs in at ``environments.Provider``; the SDK stays behind it."""
    importers = sorted(
        name
        for name, path in _modules().items()
        if "fleet" in _top_level(path)
        and not name.startswith(("fleetroll.emulator", "fleetroll.bench"))
    )

    assert importers == [
        "fleetroll.fleet_control",
        "fleetroll.fleet_traces",
        "fleetroll.provisioning",
        "fleetroll.verification",
    ]
    assert {"fleet", "httpx", "httpx2", "httpcore"}.isdisjoint(_top_level(SRC / "rollout.py"))
