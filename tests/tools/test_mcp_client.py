"""Both MCP clients are one protocol, and a tool session never asks which it holds."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, cast

import anyio
from mcp import Client
from mcp.server.mcpserver import MCPServer

from fleetroll.tools import session as session_module
from fleetroll.tools.mcp_client import McpClient, SdkClient, ToolListing
from fleetroll.tools.mcp_thin import Listing, ThinClient
from fleetroll.tools.session import ToolSession


def test_the_thin_client_and_the_sdk_adapter_are_both_mcp_clients() -> None:
    assert issubclass(ThinClient, McpClient)
    assert issubclass(SdkClient, McpClient)
    assert isinstance(SdkClient(cast(Any, None)), McpClient)
    listing = Listing(tools=(), specs=(), output_schemas={}, param_headers={})
    assert isinstance(listing, ToolListing)


def test_the_tool_session_names_no_client_kind_and_asks_none() -> None:
    tree = ast.parse(textwrap.dedent(inspect.getsource(ToolSession)))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for kind in ("ThinClient", "SdkClient", "isinstance", "getattr", "hasattr"):
        assert kind not in names, kind
    # The module chooses the kind once, where a session is opened, and imports
    # no thin client to test against.
    assert not hasattr(session_module, "ThinClient")


async def test_a_session_on_the_sdk_adapter_lists_and_calls() -> None:
    server = MCPServer("bank")

    @server.tool()
    def balance(account: str) -> str:
        return f"{account}: 1.00"

    with anyio.fail_after(10):
        async with Client(server) as client:
            session = ToolSession(
                SdkClient(client), "memory://bank", call_timeout_s=5, list_timeout_s=5
            )
            assert [spec.name for spec in await session.list_tools()] == ["balance"]
            answer = await session.call("balance", {"account": "Checking"})
            assert answer.text == "Checking: 1.00" and not answer.is_error
