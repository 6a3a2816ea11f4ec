"""Imports that read top-down (issues 14 and 28): no cycle among fleetroll's
modules outside the emulator, no import running back up a layer, the Fleet SDK
only behind the Fleet provider, and the pool without the web servers.

Every import counts: module level, under ``TYPE_CHECKING`` and inside
functions, since each of them ties two modules together.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


#: The layers of the package, bottom first: its folders (and top-level modules),
#: each in one layer. A module imports only from its own layer and the ones
#: before it; there are no exceptions, module by module: what a lower layer
#: needs lives in a lower folder. The README's map draws the same order.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "foundations: errors, settings and plumbing",
        frozenset({"errors", "_lazy", "settings", "_internal"}),
    ),
    (
        "data: tasks, results, turns, their statistics, and telemetry's events and store",
        frozenset({"tasks", "results", "evaluation", "training", "telemetry", "examples_mcp"}),
    ),
    ("the emulator: a Fleet of its own", frozenset({"emulator"})),
    ("policies and reward components", frozenset({"policies", "scoring"})),
    ("the agent's tools: sessions, MCP clients, routing", frozenset({"tools"})),
    ("the environment providers", frozenset({"environments"})),
    ("the rollout", frozenset({"rollout"})),
    ("the pool and its executors (local, Ray)", frozenset({"pool"})),
    ("the job engine: steps and drives that the CLI and the service call", frozenset({"jobs"})),
    ("test doubles", frozenset({"testing"})),
    ("the HTTP service", frozenset({"service"})),
    ("the client of a remote pool", frozenset({"client"})),
    ("the package's public API", frozenset({""})),
    ("the trainers' adapters: an assembly point", frozenset({"integrations"})),
    ("the commands and the bench", frozenset({"bench", "cli"})),
    ("the entry point", frozenset({"__main__"})),
)


def _layer(module: str) -> int:
    """The index in LAYERS of ``module``'s folder (a full name); KeyError when none holds it."""
    folder = module.removeprefix("fleetroll").removeprefix(".").partition(".")[0]
    for index, (_, names) in enumerate(LAYERS):
        if folder in names:
            return index
    raise KeyError(module)


def test_every_module_belongs_to_one_layer() -> None:
    unplaced = []
    for name in _modules():
        try:
            _layer(name)
        except KeyError:
            unplaced.append(name)

    assert unplaced == [], "add these modules to LAYERS"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    known = _modules()
    upward = sorted(
        f"{name} -> {imported} ({LAYERS[_layer(name)][0]} -> {LAYERS[_layer(imported)][0]})"
        for name, path in known.items()
        for imported in _imports(path, known)
        if _layer(imported) > _layer(name)
    )

    assert upward == []


def test_importing_the_pool_loads_neither_uvicorn_nor_starlette() -> None:
    """A library user or a Ray actor that only runs rollouts pays for no web server."""
    probe = (
        "import json, sys; import fleetroll.pool.rollout_pool; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.partition('.')[0] in ('uvicorn', 'starlette'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )

    assert json.loads(done.stdout) == []


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

    assert importers != []
    outside = [name for name in importers if not name.startswith("fleetroll.environments.fleet.")]
    assert outside == []
    rollout = _top_level(SRC / "rollout" / "machine.py")
    assert {"fleet", "httpx", "httpx2", "httpcore"}.isdisjoint(rollout)
