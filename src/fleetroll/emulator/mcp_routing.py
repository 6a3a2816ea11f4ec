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

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import INTERNAL_ERROR
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetroll.emulator.computer import register_computer_tool
from fleetroll.emulator.envs.base import INSTANCE_SCOPE_KEY, TOOL_SCOPE_KEY, SampleEnv, ToolGate
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
        #: tools/list requests failed so far, per instance (``list_tools_failures``).
        self._listings_failed: dict[str, int] = {}
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
            for server in (api, aggregator):
                _without_tracing(server)
            pairs: tuple[tuple[Endpoint, MCPServer], ...] = (
                ("api", api),
                ("aggregator", aggregator),
            )
            for kind, server in pairs:
                app = server.streamable_http_app(
                    streamable_http_path=_MCP_PATH,
                    transport_security=security,
                    max_sessions=None,
                    # Answers as JSON, as the SDK's default mode does for any call
                    # that ends within its 15 s SSE deferral (all but injected
                    # hangs), without a task group, stream and disconnect watcher
                    # per request: ~5 ms of emulator CPU per realistic rollout.
                    # ToolGate ends a hang when its client leaves instead.
                    json_response=True,
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
        tool: str | None = None
        profile = self._faults.profile
        if (profile.list_tools_failures or profile.slow_tools) and scope.get("method") == "POST":
            body = await _body(receive)
            if await self._fail_listing(instance_id, body, scope, receive, send):
                return
            tool = _called_tool(body)
            receive = _replay(body, receive)
        app = self._apps[(inst.env.key, endpoint)]
        scope = dict(scope, path=_MCP_PATH, raw_path=_MCP_PATH.encode(), root_path="")
        scope[INSTANCE_SCOPE_KEY] = instance_id
        if tool is not None:
            scope[TOOL_SCOPE_KEY] = tool
        await app(scope, receive, send)

    async def _fail_listing(
        self, instance_id: str, body: bytes, scope: Scope, receive: Receive, send: Send
    ) -> bool:
        """Answer a ``tools/list`` with a JSON-RPC error while the fault lasts."""
        try:
            message = json.loads(body)
        except ValueError:
            return False
        if not isinstance(message, dict) or message.get("method") != "tools/list":
            return False
        failed = self._listings_failed.get(instance_id, 0)
        if failed >= self._faults.profile.list_tools_failures:
            return False
        self._listings_failed[instance_id] = failed + 1
        error = {"code": INTERNAL_ERROR, "message": "tools are still loading (injected fault)"}
        response = JSONResponse({"jsonrpc": "2.0", "id": message.get("id"), "error": error})
        await response(scope, receive, send)
        return True


def _called_tool(body: bytes) -> str | None:
    """The tool a ``tools/call`` request names (for ``slow_tools``), else None."""
    try:
        message = json.loads(body)
    except ValueError:
        return None
    if not isinstance(message, dict) or message.get("method") != "tools/call":
        return None
    params = message.get("params")
    name = params.get("name") if isinstance(params, dict) else None
    return name if isinstance(name, str) else None


def _without_tracing(server: MCPServer) -> None:
    """Drop the SDK's OpenTelemetry middleware: the emulator configures no
    tracer, so it opened and closed a no-op span around every request."""
    server.middleware[:] = [
        m for m in server.middleware if type(m).__name__ != "OpenTelemetryMiddleware"
    ]


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the already-read body to the app first, then
    passes on the server's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
