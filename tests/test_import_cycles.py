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


#: The layers of the package, bottom first: a module imports only from its own
#: layer and the ones before it. A name stands for that module and every module
#: under it; the longest name that matches a module gives its layer. The
#: subpackages are the layers; the few modules named apart are the data a lower
#: layer shares (a turn, a group, a journal line), kept beside their owner.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "foundations: data, errors, settings and plumbing every layer uses",
        frozenset(
            {
                "_internal",
                "_lazy",
                "cli.options",  # what every command shares, the emulator's too
                "errors",
                "evaluation",  # pass@k and its statistics: the results alone
                "examples_mcp",
                "environments.mcp.leases",
                "policies.gate",
                "policies.turns",
                "pool.journal",
                "pool.preflight_cache",
                "results",
                "service.models",  # the HTTP API's wire format: the client's too
                "settings",
                "tasks",
                "telemetry.console",
                "telemetry.events",
                "training",
            }
        ),
    ),
    ("the emulator: a Fleet of its own, on the foundations alone", frozenset({"emulator"})),
    (
        "telemetry: the store, its queries and the dashboard",
        frozenset({"telemetry"}),
    ),
    (
        "policies, tools and the environment protocol",
        frozenset(
            {
                "environments.provider",
                "policies",
                "rollout.events",
                "rollout.progress",
                "rollout.routing",
                "rollout.mcp_common",
                "rollout.mcp_thin",
                "rollout.tools",
                "rollout.transcript",
                "scoring",  # reward components: checks and the judge (an HTTP adapter)
            }
        ),
    ),
    (
        "the rollout and the environment providers",
        frozenset({"environments", "rollout", "testing"}),
    ),
    (
        "the pool, its executors (local, Ray), and the client of a remote pool",
        frozenset(
            {
                "",  # the package: its public API
                "client",
                "pool",
                "testing.fake_executor",  # the pool's executor double
            }
        ),
    ),
    ("the HTTP service", frozenset({"service"})),
    ("the commands", frozenset({"bench", "cli"})),
    ("the entry point", frozenset({"cli.main", "__main__"})),
)


def _layer(module: str) -> int:
    """The index in LAYERS of ``module`` (a full name); KeyError when none holds it."""
    name = module.removeprefix("fleetroll").removeprefix(".")
    holding = [
        (len(held), index)
        for index, (_, names) in enumerate(LAYERS)
        for held in names
        if name == held or (held != "" and name.startswith(f"{held}."))
    ]
    if not holding:
        raise KeyError(module)
    return max(holding)[1]


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
