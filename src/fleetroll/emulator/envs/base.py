"""What a sample environment provides, and the gate every tool call passes.

A sample environment is a :class:`SampleEnv`: it seeds an instance's SQLite
database for a ``data_key``, registers its API tools on an MCP server, and
owns a :class:`~fleetroll.emulator.computer.Screen` for the ``computer`` tool.
Tools look their instance up through a :class:`ToolGate`, which also applies
the fault profile (latency, hangs, injected errors) and counts calls in the
ledger, so every environment gets faults the same way.
"""

from __future__ import annotations

import abc
import sqlite3
from typing import TYPE_CHECKING, ClassVar, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from fleetroll.emulator.faults import hang

if TYPE_CHECKING:
    from fleetroll.emulator.computer import Screen
    from fleetroll.emulator.faults import FaultInjector
    from fleetroll.emulator.instances import Instance, InstanceStore
    from fleetroll.emulator.ledger import Ledger

__all__ = ["INSTANCE_SCOPE_KEY", "TOOL_SCOPE_KEY", "SampleEnv", "ToolGate", "create_schema"]

#: Key of the ASGI scope entry that carries the instance id to MCP tools.
INSTANCE_SCOPE_KEY = "fleetroll.instance_id"
#: The called tool's name, in the request scope when ``slow_tools`` needs it.
TOOL_SCOPE_KEY = "fleetroll.tool_name"


def create_schema(conn: sqlite3.Connection, schema: str) -> None:
    """Run a schema's statements inside the caller's transaction.

    (``executescript`` would commit first, splitting the seed into many
    transactions: a journal file each.)
    """
    for statement in schema.split(";"):
        if statement.strip():
            conn.execute(statement)


class SampleEnv(abc.ABC):
    """A sample environment served by the emulator."""

    key: ClassVar[str]
    name: ClassVar[str]
    description: ClassVar[str]
    modality: ClassVar[Literal["tool_use", "computer_use"]]
    versions: ClassVar[tuple[str, ...]] = ("v1",)
    data_keys: ClassVar[tuple[str, ...]] = ("seed",)
    default_data_key: ClassVar[str] = "seed"

    @abc.abstractmethod
    def seed(self, conn: sqlite3.Connection, data_key: str) -> None:
        """Create the schema and the rows of ``data_key`` in a new database."""

    @abc.abstractmethod
    def register_tools(self, server: MCPServer, gate: ToolGate) -> None:
        """Add this environment's API tools (never ``computer``) to ``server``."""

    @abc.abstractmethod
    def screen(self) -> Screen:
        """The simulated screen the ``computer`` tool acts on."""

    def describe(self) -> dict[str, object]:
        """The environment as Fleet's ``Environment`` JSON."""
        return {
            "env_key": self.key,
            "name": self.name,
            "description": self.description,
            "default_version": self.versions[-1],
            "versions": {v: v for v in self.versions},
        }


class ToolGate:
    """Resolves the instance behind a tool call and applies tool faults."""

    def __init__(self, store: InstanceStore, faults: FaultInjector, ledger: Ledger) -> None:
        self._store = store
        self._faults = faults
        self._ledger = ledger

    async def enter(self, ctx: Context) -> Instance:
        """Call first in every tool: the live instance, after any injected fault.

        Raises:
            ToolError: the instance is gone, or an error was injected.
        """
        request = ctx.request_context.request
        instance_id = request.scope.get(INSTANCE_SCOPE_KEY) if request is not None else None
        inst = self._store.get(instance_id) if isinstance(instance_id, str) else None
        if inst is None or not inst.alive:
            self._ledger.tool_called("instance_gone")
            raise ToolError(f"instance {instance_id} is not running")
        faults = self._faults
        latency = faults.tool_latency()
        slow = faults.profile.slow_tools
        if slow and request is not None:
            latency += slow.get(str(request.scope.get(TOOL_SCOPE_KEY)), 0.0)
        if latency:
            await anyio.sleep(latency)
        if faults.chance(faults.profile.p_tool_hang):
            self._ledger.tool_called("hang")
            if await hang(request, faults.profile.tool_hang_s):
                raise ToolError("the client went away")
        if faults.chance(faults.profile.p_tool_error):
            self._ledger.tool_called("injected_error")
            raise ToolError("internal error in the environment (injected fault)")
        if not inst.alive:  # died while we waited
            self._ledger.tool_called("instance_gone")
            raise ToolError(f"instance {inst.instance_id} is not running")
        self._ledger.tool_called("ok")
        return inst
