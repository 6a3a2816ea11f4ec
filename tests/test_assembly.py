"""Components take their own settings sections (issue 38).

The whole :class:`~fleetroll.settings.Settings` is split into sections only at
the assembly points: the commands, the bench, the service's assembly, the job
engine, the pool's public constructors (and the Ray actors that assemble a pool
on their side), the client, the integrations and the package's public API.
Everything else takes the section it reads (``ProvisioningSettings``,
``PolicySettings``, ...) or plain values, so a component says what it depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fleetroll

SRC = Path(fleetroll.__file__).resolve().parent

#: The modules that may take the whole Settings (a name covers the modules under it).
ASSEMBLY = (
    "fleetroll",  # the package's public API (its __init__ only)
    "fleetroll.bench",
    "fleetroll.cli",
    "fleetroll.client",
    "fleetroll.integrations",
    "fleetroll.jobs",
    "fleetroll.pool.assembly",
    "fleetroll.pool.assembly",
    "fleetroll.pool.assembly",
    "fleetroll.pool.batch_pool",
    "fleetroll.pool.executor",
    "fleetroll.pool.ray",
    "fleetroll.pool.rollout_pool",
    "fleetroll.service.app",
    "fleetroll.service.state",
    "fleetroll.settings",
)


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _assembles(module: str) -> bool:
    return any(
        module == name or (name != "fleetroll" and module.startswith(f"{name}."))
        for name in ASSEMBLY
    )


def _names_settings(annotation: ast.expr | None) -> bool:
    """Whether an annotation is, or holds, the whole ``Settings`` (``Settings | None`` too)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Settings":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Settings":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                quoted = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue
            if _names_settings(quoted):
                return True
    return False


def _takers(path: Path) -> list[str]:
    """Each parameter, field or attribute of ``path`` annotated with the whole Settings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            found += [
                f"{node.name}({a.arg}) line {node.lineno}"
                for a in every
                if _names_settings(a.annotation)
            ]
        elif isinstance(node, ast.AnnAssign) and _names_settings(node.annotation):
            found.append(f"{ast.unparse(node.target)} line {node.lineno}")
    return found


def test_only_the_assembly_points_take_the_whole_settings() -> None:
    taking = {
        module: takers
        for path in sorted(SRC.rglob("*.py"))
        if not _assembles(module := _module(path)) and (takers := _takers(path))
    }

    assert taking == {}


def test_the_check_sees_a_whole_settings_parameter_field_and_attribute(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def build(settings: Settings, other: int) -> None: ...\n"
        "class Thing:\n"
        "    settings: 'Settings | None'\n"
        "    def __init__(self, *, s: 'fleetroll.settings.Settings') -> None:\n"
        "        self.kept: Settings = s\n"
        "def fine(policy: PolicySettings, settings: 'PolicySettings') -> None: ...\n",
        encoding="utf-8",
    )

    assert _takers(probe) == [
        "build(settings) line 1",
        "settings line 3",
        "__init__(s) line 4",
        "self.kept line 5",
    ]


#: The client kinds chosen once, at construction, and the modules that construct
#: them (where asking which kind is held is the choice itself).
CLIENT_KINDS = frozenset(
    {"ThinClient", "SdkClient", "Client", "ClientSession", "McpClient", "AsyncClient"}
    | {"DirectEnv", "AsyncEnv", "DirectControl", "SdkControl", "ControlClient"}
)
CONSTRUCTION = frozenset(
    {
        "fleetroll.tools.mcp_client",  # the SDK's MCP client behind McpClient
        "fleetroll.tools.mcp_common",  # an HTTP client borrowed or opened (http_opener)
        "fleetroll.environments.fleet.control_client",  # direct or SDK, chosen once
        "fleetroll.environments.fleet.direct",  # the direct ControlClient's own handles
    }
)


def _kind_checks(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            named = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, ast.Name | ast.Attribute)
            }
            if named & CLIENT_KINDS:
                found.append(f"isinstance line {node.lineno}")
    return found


def test_no_caller_asks_which_client_kind_it_holds() -> None:
    """The MCP client (thin or the SDK's) and the control client (direct or the
    SDK's) are each one protocol, chosen once where it is built."""
    asking = {
        module: checks
        for path in sorted(SRC.rglob("*.py"))
        if (module := _module(path)) not in CONSTRUCTION
        and not module.startswith("fleetroll.emulator")
        and (checks := _kind_checks(path))
    }

    assert asking == {}
