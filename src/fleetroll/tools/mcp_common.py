"""What both MCP clients share: answer caps, redirects, the SDK client's HTTP client,
and tool specs and validators made once.

The mcp SDK's client (:mod:`fleetroll.tools.session`) and the thin client
(:mod:`fleetroll.tools.mcp_thin`) read answers up to the same caps and fail
past them with the same error, follow the same redirects (:func:`unfollowed`
says which they do not, in one line), and every session of either kind hands
the agent the same :class:`~fleetroll.policies.ToolSpec` objects and checks
structured answers with the same compiled validators.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import httpx2
from jsonschema import SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from mcp_types import ErrorData, JSONRPCError, Tool
from referencing import Registry

from fleetroll.policies import ToolSpec

if TYPE_CHECKING:
    from fleetroll.settings import PoolSettings

__all__ = [
    "ANSWER_TOO_LARGE",
    "AnswerLimits",
    "HttpClients",
    "OpenHttp",
    "http_opener",
    "shared_spec",
    "shared_validator",
    "unfollowed",
]


#: The JSON-RPC error code of an answer fleetroll stopped reading at its cap
#: (in the range JSON-RPC leaves to implementations).
ANSWER_TOO_LARGE = -32099


@dataclass(frozen=True, slots=True)
class AnswerLimits:
    """How many bytes of an MCP answer are read (``pool.max_tool_*_bytes``)."""

    answer_bytes: int  # a tool call's (or any other request's) answer
    listing_bytes: int  # a tools/list answer

    @classmethod
    def from_pool(cls, pool: PoolSettings) -> AnswerLimits:
        """The caps ``pool`` sets."""
        return cls(pool.max_tool_answer_bytes, pool.max_tool_listing_bytes)

    def cap(self, method: str | None) -> tuple[int, str]:
        """The cap of the answer to ``method``, and the setting that sets it."""
        if method == "tools/list":
            return self.listing_bytes, "pool.max_tool_listing_bytes"
        return self.answer_bytes, "pool.max_tool_answer_bytes"

    def too_large(self, method: str | None) -> str:
        """What an answer over its cap is told as."""
        cap, setting = self.cap(method)
        return (
            f"the MCP server's answer to {method or 'a request'} is over {setting}"
            f" ({cap} bytes): reading stopped there and the connection was closed"
        )

    def error(self, method: str | None, request_id: Any = None) -> JSONRPCError:
        """The JSON-RPC error the session gets instead of an answer over its cap."""
        error = ErrorData(code=ANSWER_TOO_LARGE, message=self.too_large(method))
        return JSONRPCError(jsonrpc="2.0", id=request_id, error=error)


#: An HTTP client for the mcp SDK's client, or how to make one when needed.
HttpClients = httpx2.AsyncClient | Callable[[], httpx2.AsyncClient]

#: How an SDK client's HTTP client is had: entered for the client's life, and left
#: after it (a made client is closed then; a shared one is only borrowed).
OpenHttp = Callable[[], AbstractAsyncContextManager[httpx2.AsyncClient]]


def http_opener(http: HttpClients) -> OpenHttp:
    """How to have ``http`` for one SDK client: a function making a client is
    itself one (its client is closed after use); a client is borrowed, never closed."""
    if isinstance(http, httpx2.AsyncClient):
        return partial(_borrowed, http)
    return http


@asynccontextmanager
async def _borrowed(http: httpx2.AsyncClient) -> AsyncIterator[httpx2.AsyncClient]:
    yield http


#: Tools as the agent sees them, by what their listing says, shared by every
#: session that lists the same tool (rollouts of one environment list the same
#: tools: one copy of each schema, not one per rollout, for the collector to walk).
_SPECS: dict[tuple[str, str, str], ToolSpec] = {}
_SPECS_MAX = 4096


def shared_spec(tool: Tool) -> ToolSpec:
    """The :class:`ToolSpec` of a listed tool; the same object for the same listing."""
    description = tool.description or ""
    key = (tool.name, description, json.dumps(tool.input_schema))
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _SPECS_MAX:
            _SPECS.clear()
        spec = ToolSpec(name=tool.name, description=description, input_schema=tool.input_schema)
        _SPECS[key] = spec
    return spec


#: Compiled output-schema validators, by schema text, shared by every session.
_VALIDATORS: dict[str, Validator] = {}
_VALIDATORS_MAX = 1024


def shared_validator(schema: dict[str, Any]) -> Validator | None:
    """The compiled validator of an output schema, shared by every session; None
    when the schema is not one (the caller reports it, as the mcp client does)."""
    key = json.dumps(schema, sort_keys=True)
    validator = _VALIDATORS.get(key)
    if validator is None:
        cls = validator_for(schema)
        try:
            cls.check_schema(schema)
        except SchemaError:
            return None
        validator = cls(schema, registry=Registry())
        if len(_VALIDATORS) >= _VALIDATORS_MAX:
            _VALIDATORS.clear()
        _VALIDATORS[key] = validator
    return validator


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def _host_port(url: str) -> str:
    """``host:port`` of a URL, never its user or password."""
    _, host, port = _origin(url)
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}" if port is not None else shown


def unfollowed(url: str, location: str) -> str | None:
    """Why an MCP client does not follow a redirect of ``url`` to ``location``, in one
    line naming both hosts; None for a redirect it follows.

    Both clients follow a redirect only within the endpoint's origin (the mcp
    SDK's rule, ``stream_within_origin``): the same scheme, host and port, or
    the https upgrade of the same host on the default ports. Anything else
    would send the request's headers to a server it was not configured for;
    the same request is redirected the same way again, so it is not retried.
    """
    target = urljoin(url, location)
    here, there = _origin(url), _origin(target)
    if here == there or (
        here[0] == "http"
        and there[0] == "https"
        and here[1] == there[1]
        and here[2] == 80
        and there[2] == 443
    ):
        return None
    parts = urlsplit(target)
    shown = parts._replace(netloc=_host_port(target), query="", fragment="").geturl()
    where = "another host" if here[1] != there[1] else "another port or scheme"
    return (
        f"it redirects to {shown}, on {where} ({_host_port(url)} -> {_host_port(target)}),"
        " and an MCP client follows a redirect only within the URL's own origin:"
        " use that URL as the endpoint if it is the intended server"
    )
