"""No import cycle among fleetroll's modules outside the emulator (issue 14).

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


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in known}


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
