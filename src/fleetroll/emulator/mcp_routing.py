"""The instances' MCP endpoints: real streamable-HTTP MCP servers.

Each sample environment gets two MCP servers, shared by all its instances:

* ``{root}mcp``: the per-env server, the environment's API tools;
* ``{root}api/v1/mcp``: the aggregator, the API tools plus ``computer``.

A request's path names its instance; the router checks that the instance is
alive and past its start-up (``mcp_warmup_s``: 503 before), rewrites the path
to the server's own and puts the instance id into the ASGI scope, where
:class:`~fleetroll.emulator.envs.base.ToolGate` finds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fleetroll.emulator.computer import register_computer_tool
from fleetroll.emulator.envs.base import INSTANCE_SCOPE_KEY, SampleEnv, ToolGate
from fleetroll.emulator.faults import FaultInjector
from fleetroll.emulator.instances import InstanceStore
from fleetroll.emulator.ledger import Ledger

__all__ = ["McpRouter"]

Endpoint = Literal["api", "aggregator"]
_MCP_PATH = "/mcp"


class McpRouter:
    """Routes ``/instances/{id}/mcp`` and ``/instances/{id}/api/v1/mcp``."""

    def __init__(
        self, envs: Sequence[SampleEnv], store: InstanceStore, faults: FaultInjector, ledger: Ledger
    ) -> None:
        self._store = store
        self._faults = faults
        self._ledger = ledger
        gate = ToolGate(store, faults, ledger)
        # Fleet's MCP servers sit behind its own routing; the Host header is ours.
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
        self._servers: list[MCPServer] = []
        self._apps: dict[tuple[str, Endpoint], ASGIApp] = {}
        for env in envs:
            api = MCPServer(f"{env.key}", instructions=env.description)
            env.register_tools(api, gate)
            aggregator = MCPServer(f"{env.key}-aggregator", instructions=env.description)
            env.register_tools(aggregator, gate)
            register_computer_tool(aggregator, gate, env.screen())
            pairs: tuple[tuple[Endpoint, MCPServer], ...] = (
                ("api", api),
                ("aggregator", aggregator),
            )
            for kind, server in pairs:
                app = server.streamable_http_app(
                    streamable_http_path=_MCP_PATH,
                    transport_security=security,
                    max_sessions=None,
                )
                self._servers.append(server)
                self._apps[(env.key, kind)] = app

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Run every server's session manager (the parent app's lifespan)."""
        async with AsyncExitStack() as stack:
            for server in self._servers:
                await stack.enter_async_context(server.session_manager.run())
            yield

    @staticmethod
    def match(path: str) -> tuple[str, Endpoint] | None:
        """``(instance_id, endpoint)`` when ``path`` is an instance MCP path."""
        if not path.startswith("/instances/"):
            return None
        instance_id, _, rest = path[len("/instances/") :].partition("/")
        rest = rest.rstrip("/")
        if rest == "mcp":
            return instance_id, "api"
        if rest == "api/v1/mcp":
            return instance_id, "aggregator"
        return None

    async def handle(
        self, instance_id: str, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
    ) -> None:
        inst = self._store.get(instance_id)
        if inst is None or not inst.alive:
            response = JSONResponse({"detail": f"Instance '{instance_id}' not found"}, 404)
            await response(scope, receive, send)
            return
        if self._faults.profile.broken(inst.env.key, inst.version):
            response = JSONResponse({"detail": "the environment's MCP service crashed"}, 502)
            await response(scope, receive, send)
            return
        warmup = self._faults.profile.mcp_warmup_s
        if warmup and inst.age() < warmup:
            self._ledger.mcp_rejected_warming += 1
            response = JSONResponse(
                {"detail": "MCP service is starting"}, 503, headers={"Retry-After": "1"}
            )
            await response(scope, receive, send)
            return
        app = self._apps[(inst.env.key, endpoint)]
        scope = dict(scope, path=_MCP_PATH, raw_path=_MCP_PATH.encode(), root_path="")
        scope[INSTANCE_SCOPE_KEY] = instance_id
        await app(scope, receive, send)
