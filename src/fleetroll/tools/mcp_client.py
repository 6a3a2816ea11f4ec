"""The one protocol a tool session asks of its MCP client, and the SDK's client behind it.

A :class:`~fleetroll.tools.session.ToolSession` holds an :class:`McpClient`
and never asks which kind: the thin client
(:class:`fleetroll.tools.mcp_thin.ThinClient`, the hot path, which satisfies
the protocol as it is) or the mcp SDK's ``Client`` in an :class:`SdkClient`.
The kind is chosen once, where the session is opened
(:func:`fleetroll.tools.session.open_tool_session`, from ``pool.mcp_client``
and what the endpoint speaks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mcp_types import CallToolResult, Tool

from fleetroll._internal.deadlines import fail_after
from fleetroll.policies import ToolSpec
from fleetroll.tools.mcp_common import shared_spec, shared_validator

if TYPE_CHECKING:
    from mcp import Client

__all__ = ["McpClient", "SdkClient", "ToolListing"]


@runtime_checkable
class ToolListing(Protocol):
    """A ``tools/list`` answer, as a session hands it on: the agent's tool specs."""

    @property
    def specs(self) -> Sequence[ToolSpec]: ...


@runtime_checkable
class McpClient(Protocol):
    """What a :class:`~fleetroll.tools.session.ToolSession` asks of its MCP client."""

    async def list_tools(self) -> ToolListing:
        """The endpoint's tools.

        Raises:
            Exception: as the client raises it (the session translates it).
        """
        ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None, read_timeout_seconds: float
    ) -> CallToolResult:
        """A tool's answer, the whole call bounded by ``read_timeout_seconds``
        (an MCP ``REQUEST_TIMEOUT`` error, or ``TimeoutError``, past it).

        Raises:
            Exception: as the client raises it (the session translates it).
        """
        ...


@dataclass(frozen=True, slots=True)
class _Specs:
    specs: tuple[ToolSpec, ...]


class SdkClient:
    """The mcp SDK's ``Client`` as an :class:`McpClient`."""

    __slots__ = ("client",)

    def __init__(self, client: Client) -> None:
        #: The SDK's client; its owner opens and closes it.
        self.client = client

    @property
    def protocol_version(self) -> str:
        return self.client.protocol_version

    async def list_tools(self) -> ToolListing:
        listed = await self.client.list_tools()
        _share_output_validators(self.client, listed.tools)
        return _Specs(tuple(shared_spec(t) for t in listed.tools))

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None, read_timeout_seconds: float
    ) -> CallToolResult:
        # The MCP read timeout ends the request cleanly; the outer deadline (a
        # little later) is the hard bound if anything else hangs.
        with fail_after(read_timeout_seconds + 1.0):
            result = await self.client.call_tool(
                name, arguments, read_timeout_seconds=read_timeout_seconds
            )
        return result


def _share_output_validators(client: Client, tools: Sequence[Tool]) -> None:
    """Give a session the compiled validators of its tools' output schemas.

    The mcp client validates every structured tool answer against the tool's
    output schema, compiling a validator once per tool *per session*: a
    compile costs ~60x a validation, and with one session per rollout it was
    ~5 % of fleetroll's CPU at 1,000 concurrent rollouts. Sessions of the
    same environment list the same schemas, so one compiled validator serves
    them all (validators are immutable). This fills the session's own cache
    (``ClientSession._tool_output_validators``, mcp 2.x), which it keys by
    tool name and clears when a listing changes a schema; if a later mcp
    drops that attribute, sessions simply compile their own again. (The thin
    client has no such cache: it asks :func:`shared_validator` itself.)
    """
    cache = getattr(client.session, "_tool_output_validators", None)
    if not isinstance(cache, dict):
        return
    for tool in tools:
        schema = tool.output_schema
        if schema is None or tool.name in cache:
            continue
        validator = shared_validator(schema)
        if validator is not None:  # else the session reports it, on the call, as it always has
            cache[tool.name] = validator
