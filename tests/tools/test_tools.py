"""MCP tool sessions: output-schema validators compiled once for every session."""

from __future__ import annotations

import anyio
import httpx
import httpx2
import pytest
from fleet._async.client import AsyncFleet
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult
from pydantic import BaseModel

from fleetroll._internal.retrying import Budget
from fleetroll._internal.wire import Wire
from fleetroll.emulator import Emulator
from fleetroll.errors import ToolsError
from fleetroll.tools.mcp_client import SdkClient
from fleetroll.tools.session import ToolSession, open_tool_session

DEADLINES = {
    "connect_timeout_s": 10.0,
    "call_timeout_s": 10.0,
    "list_timeout_s": 10.0,
    "budget": Budget(None, 0.05, 2.0),
}


def _validators(session: ToolSession) -> dict[str, object]:
    client = session._client
    assert isinstance(client, SdkClient)
    return client.client.session._tool_output_validators  # type: ignore[no-any-return]


async def test_sessions_of_one_environment_share_compiled_output_validators() -> None:
    async with (
        Emulator() as emu,
        httpx2.AsyncClient(timeout=30) as http,
        httpx.AsyncClient(timeout=30) as control,
    ):
        fleet = AsyncFleet(
            api_key=emu.api_key, base_url=emu.base_url, max_retries=0, httpx_client=control
        )
        envs = [await fleet.make("ledger:v1", data_key="seed:v1") for _ in range(2)]
        sessions: list[ToolSession] = []
        tools: list[list[str]] = []
        with anyio.fail_after(30):
            async with (
                open_tool_session(envs[0].mcp.url, http, **DEADLINES) as first,
                open_tool_session(envs[1].mcp.url, http, **DEADLINES) as second,
            ):
                for session in (first, second):
                    tools.append([t.name for t in await session.list_tools()])
                    sessions.append(session)
                a, b = (_validators(s) for s in sessions)
                # Both sessions hold the very same compiled validator per tool.
                assert a and a.keys() == b.keys()
                assert all(a[name] is b[name] for name in a)
                # ...and answers are still checked against it.
                answer = await second.call("get_balance", {"account": "Checking"})
                assert not answer.is_error and answer.structured is not None
        for env in envs:
            await env.close()
    assert tools[0] == tools[1]
    assert emu.ledger.running == 0


class _Balance(BaseModel):
    account: str
    balance: float


async def test_an_answer_that_breaks_its_output_schema_is_still_rejected() -> None:
    server = MCPServer("bank")

    @server.tool()
    def balance() -> _Balance:
        return _Balance(account="Checking", balance=1.0)

    @server.tool()
    def savings() -> _Balance:
        return _Balance(account="Savings", balance=2.0)

    async with Client(server) as client:
        session = ToolSession(
            SdkClient(client), "memory://bank", call_timeout_s=5, list_timeout_s=5
        )
        await session.list_tools()
        validators = _validators(session)
        # Tools with the same schema share one compiled validator.
        assert validators["balance"] is validators["savings"]
        answer = await session.call("balance", {})
        assert answer.structured == {"account": "Checking", "balance": 1.0}
        # The mcp client checks each answer with the shared validator (an
        # MCPServer will not send a bad one, so the answer is made here).
        lie = CallToolResult(content=[], structured_content={"account": "Checking"})
        with pytest.raises(RuntimeError, match="Invalid structured content"):
            await client.session.validate_tool_result("balance", lie)


async def test_a_proxy_refusing_the_tunnel_fails_the_thin_client_s_connect_at_once() -> None:
    connects: list[bytes] = []

    async def refuse(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            connects.append(head)
            await stream.send(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, refuse)
        async with Wire(proxy=f"http://127.0.0.1:{port}") as wire:
            with anyio.fail_after(10), pytest.raises(ToolsError, match="refused the tunnel"):
                async with open_tool_session(
                    "https://127.0.0.1:9/mcp",
                    lambda: httpx2.AsyncClient(),
                    wire=wire,
                    **{**DEADLINES, "budget": Budget(5, 0.0, 0.0)},
                ):
                    pass
        tg.cancel_scope.cancel()
    assert len(connects) == 1  # a refusal is not a service still starting: not tried again
