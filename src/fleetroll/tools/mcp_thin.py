"""A thin MCP tool client for the hot path: JSON-RPC over HTTP, 2026-07-28 only.

The mcp SDK's client runs a task group, memory streams, a dispatcher and a
post-writer task per session and a task per message, and turns every message
into pydantic models and back: per rollout the larger part of fleetroll's CPU
and ~550 objects the collector walks while the session lives. The modern
(2026-07-28, stateless) revision needs none of it: each request is one POST
carrying its own envelope. :class:`ThinClient` sends those POSTs on the
provider's shared :class:`~fleetroll._internal.wire.Wire` and holds a few
slots per session: no task, no stream, no closure.

It is the SDK client where it speaks at all (the SDK 2.3's wire behaviour,
``mcp.client.{session,streamable_http,_probe}``):

* open: ``server/discover`` at the newest modern version, once more at a
  mutual version on ``-32022`` (as ``negotiate_auto``); adopted only for a
  valid ``DiscoverResult`` naming a modern version we speak.
  :func:`probe` answers None for anything else (a legacy server,
  a session id, a JSON-RPC error, a 4xx), and the caller opens the SDK
  client instead; a bare 404, 5xx or a refused connection is the service
  still starting (retried by the caller, as for the SDK client);
* every request: the ``_meta`` envelope (protocol version, the SDK's client
  info and capabilities) and the ``mcp-protocol-version``, ``mcp-method``,
  ``mcp-name`` and ``Mcp-Param-*`` headers, as ``_make_modern_stamp``;
* answers: JSON or an SSE stream (notifications skipped, the first response
  taken, as the SDK's transport does), read as they arrive: a stream is left
  at its response's event, though its server may keep it open (the
  connection is then closed); each message parsed as strictly as the
  SDK parses it (pydantic-core's JSON parser: a lone surrogate escape, a BOM,
  trailing data are refused) and its envelope judged by the same models;
  HTTP statuses, 202, unknown content types and unparsable bodies become the
  same ``MCPError`` the SDK's transport synthesises, in its words; results
  are validated with the same models
  (version surface, then ``CallToolResult``) and structured answers against
  the tool's output schema with the SDK's messages; a ``HEADER_MISMATCH``
  is answered by listing again and sending once more, as ``Client.call_tool``;
* a ``tools/call`` that asks for client input (an ``input_required`` result,
  or a server request in its stream) is not guessed at: the call is made
  again by an SDK client on the same URL, whose answer is the answer;
* a redirect is not followed here: a probe that meets one opens the SDK
  client, which follows it within the URL's origin (a trailing slash) and
  fails at once on any other (:func:`fleetroll.tools.mcp_common.unfollowed`).

Answers are read up to :class:`~fleetroll.tools.mcp_common.AnswerLimits` (the
listing cap for ``tools/list``, the answer cap otherwise); past it the
request fails with :data:`~fleetroll.tools.mcp_common.ANSWER_TOO_LARGE`. A
request whose connection could not be opened is sent again
(``retries.mcp_request_attempts``); one whose connection broke after it may
have left never is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, TypeVar, cast
from urllib.parse import urlsplit

import anyio
from jsonschema import SchemaError
from jsonschema import exceptions as jsonschema_exceptions
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from mcp_types import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
    UNSUPPORTED_PROTOCOL_VERSION,
    CallToolResult,
    ClientCapabilities,
    ContentBlock,
    DiscoverResult,
    InputRequiredResult,
    ListToolsResult,
    TextContent,
    Tool,
)
from mcp_types import methods as _methods
from mcp_types.version import LATEST_MODERN_VERSION, MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json
from referencing import Registry
from referencing.exceptions import Unresolvable

import fleetroll._internal.retrying as retrying
from fleetroll._internal.retrying import Decision
from fleetroll._internal.wire import (
    BodyTooLarge,
    ConnectFailed,
    Response,
    StreamResponse,
    Wire,
    WireError,
)
from fleetroll.policies import ToolSpec
from fleetroll.tools.mcp_common import (
    ANSWER_TOO_LARGE,
    AnswerLimits,
    OpenHttp,
    shared_spec,
    shared_validator,
)

__all__ = ["ThinClient", "probe"]

_log = logging.getLogger("fleetroll.mcp_thin")
_T = TypeVar("_T")

_ACCEPT = "application/json, text/event-stream"
_CONTENT_TYPE = "application/json"

# The SDK client's envelope, read off the SDK itself (a client without
# sampling, elicitation or roots callbacks advertises no capability).
_CLIENT_INFO: Final = {"name": "mcp", "version": "0.1.0"}
_CAPABILITIES: Final = ClientCapabilities().model_dump(
    by_alias=True, mode="json", exclude_none=True
)

#: The ``_meta`` envelope of every request, encoded once per version.
_META: dict[str, bytes] = {}

_CALL_RESULT: TypeAdapter[CallToolResult | InputRequiredResult] = TypeAdapter(
    CallToolResult | InputRequiredResult
)
#: The caps when the caller sets none (the settings' defaults).
_NO_LIMITS: Final = AnswerLimits(16 * 1024 * 1024, 4 * 1024 * 1024)


def _meta(version: str) -> bytes:
    meta = _META.get(version)
    if meta is None:
        meta = _META[version] = json.dumps(
            {
                "io.modelcontextprotocol/protocolVersion": version,
                "io.modelcontextprotocol/clientInfo": _CLIENT_INFO,
                "io.modelcontextprotocol/clientCapabilities": _CAPABILITIES,
            },
            separators=(",", ":"),
        ).encode()
    return meta


def _mcp_error(code: int, message: str, data: Any = None) -> Exception:
    from mcp.shared.exceptions import MCPError  # loaded with mcp_types' server side

    return MCPError(code, message, data)


class _NeedsSdk(Exception):
    """The answer asks for something only the SDK client does (client input)."""


class _NotJsonRpc(Exception):
    """A message that is no JSON-RPC message (the SDK's adapter's refusal)."""


# ------------------------------------------------------------------ answers


def _answer(response: Response) -> dict[str, Any]:
    """The JSON-RPC result of one POST's answer, as the SDK's transport reads it.

    Raises:
        MCPError: an error answer, or the SDK transport's stand-in for an
            answer that is not one (a bare HTTP error, 202, another content type).
        _NeedsSdk: the server asked the client something in the stream.
    """
    status = response.status
    content_type = response.headers.get("content-type", "").lower()
    _check_status(status, content_type, response.headers, response.body)
    if content_type.startswith("application/json"):
        return _json_answer(response.body)
    if content_type.startswith("text/event-stream"):
        return _from_events(response.body)
    raise _mcp_error(INVALID_REQUEST, f"Unexpected content type: {content_type}")


async def _read(response: StreamResponse, expected: int | None = None) -> dict[str, Any]:
    """The JSON-RPC result of one POST's answer (to the request ``expected``), read
    as it arrives.

    An event stream is parsed as its bytes come, and left at the event that
    carries the response (the spec lets a server keep the stream open after
    it; the SDK's transport returns there too): leaving it closes the
    connection, which is reused only when an answer was read to its end.

    Raises:
        MCPError, _NeedsSdk: as :func:`_answer`.
        WireError: the answer broke off or passed its cap (``BodyTooLarge``).
    """
    status = response.status
    headers = response.headers
    content_type = headers.get("content-type", "").lower()
    if status == 202 or status >= 300:
        body = await response.aread() if status >= 400 else None
        _check_status(status, content_type, headers, body)
    if content_type.startswith("text/event-stream"):
        events = _Events(expected)
        async for chunk in response.aiter_bytes():
            found = events.feed(chunk)
            if found is not None:
                return found
        return events.end()
    body = await response.aread()
    if content_type.startswith("application/json"):
        return _json_answer(body, expected)
    raise _mcp_error(INVALID_REQUEST, f"Unexpected content type: {content_type}")


def _check_status(
    status: int, content_type: str, headers: Mapping[str, str], body: bytes | None
) -> None:
    """Raise what the SDK's transport makes of a status that carries no result
    (``body``: the answer's, read whole, for a JSON-RPC error at 4xx/5xx).

    Raises:
        MCPError: 202, an unfollowed redirect, or an error status.
    """
    if status == 202:
        raise _mcp_error(INVALID_REQUEST, "server answered a request with 202 Accepted")
    if 300 <= status < 400 and "location" in headers:
        # Shown as the SDK's transport shows it: without user info, query or fragment.
        parts = urlsplit(headers["location"])
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="")
        raise _mcp_error(
            INVALID_REQUEST,
            f"Redirect to {shown.geturl()} not followed;"
            " use that URL as the endpoint if it is the intended server",
        )
    if status >= 400:
        if body is not None and content_type.startswith("application/json"):
            error = _error_in(body)
            if error is not None:
                raise error
        if status == 404:
            raise _mcp_error(METHOD_NOT_FOUND, "Not Found")
        raise _mcp_error(INTERNAL_ERROR, "Server returned an error response")


# JSON-RPC messages are read as the SDK's transport reads them
# (``jsonrpc_message_adapter.validate_json``): pydantic-core's JSON parser, which
# refuses what Python's ``json`` lets through (a lone surrogate escape such as a
# file name that is not UTF-8, a BOM, nesting past its recursion limit; trailing
# data and invalid UTF-8 as ``json`` does) and keeps what it keeps (NaN and
# Infinity, the last of duplicate keys); then the envelope models. The usual
# envelopes are recognised here without building the models; anything else is
# decided by the SDK's own adapter, whose words its refusal carries.

_ABSENT: Final = object()


def _request_id(value: Any) -> bool:
    """A ``RequestId``: a str or (strictly) an int, never a bool or a float."""
    kind = type(value)
    return kind is int or kind is str


def _message(data: bytes | str, expected: int | None = None) -> dict[str, Any] | None:
    """One JSON-RPC message's result; None for a notification.

    ``expected``: the id of the request it answers. A response to another id
    is refused at once: read as this request's answer it would hand a rollout
    another call's result (a server off by one); the SDK's session drops it
    and waits out its read timeout, a failure of the call too.

    Raises:
        MCPError: an error response (its error), or a response to another id.
        _NotJsonRpc: not a JSON-RPC message (the SDK's adapter's words).
        _NeedsSdk: a request from the server.
    """
    try:
        message = from_json(data)
    except ValueError:
        message = None
    if type(message) is dict and message.get("jsonrpc") == "2.0":
        method = message.get("method", _ABSENT)
        rid = message.get("id", _ABSENT)
        if method is _ABSENT:
            result = message.get("result", _ABSENT)
            error = message.get("error", _ABSENT)
            if type(result) is dict and error is _ABSENT and _request_id(rid):
                if expected is not None and rid != expected:
                    raise _not_ours(expected, rid)
                return cast("dict[str, Any]", result)
            if type(error) is dict and result is _ABSENT and (rid is None or _request_id(rid)):
                code, text = error.get("code"), error.get("message")
                if type(code) is int and type(text) is str:
                    raise _mcp_error(code, text, error.get("data"))
        elif type(method) is str and rid is _ABSENT:
            params = message.get("params")
            if params is None or type(params) is dict:
                return None  # a notification (log messages, progress)
    return _by_adapter(data, expected)


def _not_ours(expected: int, rid: object) -> Exception:
    return _mcp_error(
        INTERNAL_ERROR,
        f"the server answered request {expected} with a response to request {rid!r}",
    )


def _by_adapter(data: bytes | str, expected: int | None = None) -> dict[str, Any] | None:
    """:func:`_message` of an envelope out of the usual, by the SDK's own adapter."""
    from mcp_types import JSONRPCError, JSONRPCRequest, JSONRPCResponse, jsonrpc_message_adapter

    try:
        parsed = jsonrpc_message_adapter.validate_json(data, by_name=False)
    except ValidationError as exc:
        raise _NotJsonRpc(str(exc)) from None
    if isinstance(parsed, JSONRPCResponse):
        if expected is not None and parsed.id != expected:
            raise _not_ours(expected, parsed.id)
        return parsed.result
    if isinstance(parsed, JSONRPCError):
        error = parsed.error
        raise _mcp_error(error.code, error.message, error.data)
    if isinstance(parsed, JSONRPCRequest):
        raise _NeedsSdk(f"the server sent a {parsed.method} request")
    return None


def _json_answer(body: bytes, expected: int | None = None) -> dict[str, Any]:
    """The result of a JSON answer (one message, which must be the response to
    ``expected``, when given).

    Raises:
        MCPError: an error response, a response to another id, or
            ``PARSE_ERROR``: not a response.
    """
    try:
        result = _message(body, expected)
    except _NotJsonRpc as exc:
        raise _mcp_error(PARSE_ERROR, f"Failed to parse JSON response: {exc}") from None
    except _NeedsSdk:
        result = None
    if result is None:  # a notification or a request where the response belongs
        raise _mcp_error(PARSE_ERROR, "Failed to parse JSON response: not a JSON-RPC response")
    return result


def _error_in(body: bytes) -> Exception | None:
    """The MCPError of a JSON-RPC error answer; None for any other body (the SDK's
    transport then answers from the status)."""
    try:
        _message(body)
    except (_NotJsonRpc, _NeedsSdk):
        return None
    except Exception as exc:  # the error response's MCPError
        return exc
    return None


class _Events:
    """A server-sent event stream, parsed as its bytes arrive, up to its response.

    The SDK's transport reads it so (httpx2's ``EventSource``): lines end at
    CR, LF or CRLF, a blank line dispatches the event gathered so far; only
    ``message`` events are read, those without data (priming events) skipped;
    a notification is skipped, the first response or error ends it, whatever
    its id (the SDK's transport answers the POST's request with it); a request
    from the server is client input, the SDK's. Event data is UTF-8, an invalid
    byte read as U+FFFD (as ``aiter_text`` decodes it).
    """

    __slots__ = ("_data", "_event", "_expected", "_line", "_pending_cr")

    def __init__(self, expected: int | None = None) -> None:
        self._expected = expected  # the request's id: a response to another is refused
        self._data: list[bytes] = []
        self._event = b""
        self._line: list[bytes] = []  # the start of a line not ended yet
        self._pending_cr = False  # a chunk ended in CR: the next may start with its LF

    def feed(self, chunk: bytes) -> dict[str, Any] | None:
        """The response's result once its event is complete; None while it is not.

        Raises:
            MCPError: an error response, or a message that is not JSON-RPC.
            _NeedsSdk: the server asked the client something.
        """
        if self._pending_cr:
            chunk = b"\r" + chunk
            self._pending_cr = False
        if chunk.endswith(b"\r"):
            self._pending_cr = True
            chunk = chunk[:-1]
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            if chunk:
                self._line.append(chunk)
            return None
        lines = chunk.split(b"\n")
        if self._line:
            self._line.append(lines[0])
            lines[0] = b"".join(self._line)
            self._line = []
        last = lines.pop()
        if last:
            self._line.append(last)
        for line in lines:
            found = self._line_of(line)
            if found is not None:
                return found
        return None

    def end(self) -> dict[str, Any]:
        """The stream ended: a last event it did not close with a blank line counts.

        Raises:
            MCPError: no response (``CONNECTION_CLOSED``), or as :meth:`feed`.
            _NeedsSdk: as :meth:`feed`.
        """
        self._pending_cr = False
        if self._line:
            line, self._line = b"".join(self._line), []
            found = self._line_of(line)
            if found is not None:
                return found
        found = self._line_of(b"")
        if found is not None:
            return found
        raise _mcp_error(CONNECTION_CLOSED, "SSE stream ended without a response")

    def _line_of(self, line: bytes) -> dict[str, Any] | None:
        if line:
            if line.startswith(b":"):
                return None
            name, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value
            return None
        # A blank line dispatches the event gathered so far.
        data, event = self._data, self._event
        self._data, self._event = [], b""
        if not data or event not in (b"", b"message"):
            return None
        joined = b"\n".join(data)
        if not joined:
            return None  # a priming event
        try:
            return _message(joined.decode("utf-8", "replace"), self._expected)
        except _NotJsonRpc as exc:
            raise _mcp_error(PARSE_ERROR, f"Failed to parse SSE message: {exc}") from None


def _from_events(body: bytes) -> dict[str, Any]:
    """The response among a whole server-sent event stream's messages (:class:`_Events`)."""
    events = _Events()
    found = events.feed(body)
    return found if found is not None else events.end()


def _clamp_ttl(raw: dict[str, Any]) -> None:
    """A negative ``ttlMs`` floored to 0 (the SDK's ``_clamp_inbound_ttl``)."""
    ttl = raw.get("ttlMs")
    if isinstance(ttl, int | float) and not isinstance(ttl, bool) and ttl < 0:
        raw["ttlMs"] = 0


# ------------------------------------------------------------------ listings


@dataclass(frozen=True, slots=True)
class Listing:
    """A ``tools/list`` answer, parsed once and shared by every session that got it.

    Rollouts of one environment list the same tools: one parse, one copy of
    each schema and one compiled validator for all of them.
    """

    tools: tuple[Tool, ...]  # without the tools a modern client must drop
    specs: tuple[ToolSpec, ...]
    output_schemas: Mapping[str, dict[str, Any] | None]
    param_headers: Mapping[str, dict[tuple[str, ...], str]]
    #: Each tool's compiled output-schema validator (None: not a schema), once looked up.
    validators: dict[str, Validator | None] = field(default_factory=dict)


_LISTINGS: dict[str, Listing] = {}
_LISTINGS_MAX = 256


def _listing(raw: dict[str, Any], version: str) -> Listing:
    """The shared :class:`Listing` of a ``tools/list`` result.

    Raises:
        pydantic.ValidationError: the result is not a listing at ``version``.
    """
    key = json.dumps(raw, sort_keys=True)
    found = _LISTINGS.get(key)
    if found is not None:
        return found
    from mcp.shared.inbound import find_invalid_x_mcp_header, x_mcp_header_map

    _clamp_ttl(raw)
    _check_surface("tools/list", version, raw)
    result = ListToolsResult.model_validate(raw, by_name=False)
    kept: list[Tool] = []
    headers: dict[str, dict[tuple[str, ...], str]] = {}
    for tool in result.tools:
        reason = find_invalid_x_mcp_header(tool.input_schema)
        if reason is not None:  # 2026-07-28: a client MUST drop it
            _log.warning("dropping tool %r: invalid x-mcp-header (%s)", tool.name, reason)
            continue
        header_map = x_mcp_header_map(tool.input_schema)
        if header_map:
            headers[tool.name] = header_map
        kept.append(tool)
    listing = Listing(
        tools=tuple(kept),
        specs=tuple(shared_spec(t) for t in kept),
        output_schemas={t.name: t.output_schema for t in kept},
        param_headers=headers,
    )
    if len(_LISTINGS) >= _LISTINGS_MAX:
        _LISTINGS.clear()
    _LISTINGS[key] = listing
    return listing


#: The version's wire type of each method's result, as a validator (None: no such pair).
_SURFACES: dict[tuple[str, str], TypeAdapter[Any] | None] = {}


def _check_surface(method: str, version: str, raw: dict[str, Any]) -> None:
    """The SDK's ``validate_server_result`` check (the SDK session skips a pair it
    does not know), without the dump of the result it then throws away.

    Raises:
        pydantic.ValidationError: the result is not of the version's shape.
    """
    key = (method, version)
    if key not in _SURFACES:
        target = _methods.SERVER_RESULTS.get(key)
        _SURFACES[key] = None if target is None else TypeAdapter(cast(Any, target))
    adapter = _SURFACES[key]
    if adapter is not None:
        adapter.validate_python(raw, by_name=False)


_PLAIN_KEYS: Final = frozenset({"content", "structuredContent", "isError", "resultType", "_meta"})
_TEXT_KEYS: Final = frozenset({"type", "text"})


def _plain_result(raw: dict[str, Any]) -> CallToolResult | None:
    """A tool result of the usual shape, built without the two validations it passes.

    The usual shape: ``resultType: "complete"`` (which the modern surface
    requires), ``content`` (a list of bare text blocks), and at most
    ``structuredContent`` (any JSON value), ``isError`` (a bool) and ``_meta``
    (an object: every surface takes any; the SDK's servers put their
    ``serverInfo`` in every result's) besides.
    Such a result passes the version's surface and the result model as it
    stands, so the model is made from it directly; any other shape (images,
    annotations, a ttl, no ``resultType``...) is None, and is
    validated as the SDK does.
    """
    if not raw.keys() <= _PLAIN_KEYS or raw.get("resultType") != "complete":
        return None
    is_error = raw.get("isError", False)
    content = raw.get("content")
    if type(is_error) is not bool or type(content) is not list:
        return None
    meta = raw.get("_meta", _ABSENT)
    if meta is not _ABSENT and type(meta) is not dict:
        return None
    blocks: list[ContentBlock] = []
    for block in content:
        if (
            type(block) is not dict
            or block.keys() != _TEXT_KEYS
            or block["type"] != "text"
            or type(block["text"]) is not str
        ):
            return None
        blocks.append(TextContent.model_construct(type="text", text=block["text"]))
    fields: dict[str, Any] = {"content": blocks}  # the fields set: those the answer has
    if "structuredContent" in raw:
        fields["structured_content"] = raw["structuredContent"]
    if "isError" in raw:
        fields["is_error"] = is_error
    if meta is not _ABSENT:
        fields["meta"] = meta
    fields["result_type"] = "complete"
    return CallToolResult.model_construct(**fields)


def _check_structured(
    name: str,
    schema: dict[str, Any],
    result: CallToolResult,
    validators: dict[str, Validator | None],
) -> None:
    """The SDK's ``validate_tool_result``, with its messages, on a shared validator
    (``validators``: the listing's, looked up once per tool).

    Raises:
        RuntimeError: no structured content, content that breaks the schema,
            or a schema that is not one.
    """
    if result.structured_content is None and "structured_content" not in result.model_fields_set:
        raise RuntimeError(
            f"Tool {name} has an output schema but did not return structured content"
        )
    if name in validators:
        validator = validators[name]
    else:
        validator = validators[name] = shared_validator(schema)
    if validator is None:
        cls = validator_for(schema)
        try:
            cls.check_schema(schema)
        except SchemaError as e:
            raise RuntimeError(f"Invalid schema for tool {name}: {e}") from None
        validator = cast(Validator, cls(schema, registry=Registry()))
    try:
        if validator.is_valid(result.structured_content):
            return  # the usual case, without best_match's walk of the errors
        errors = validator.iter_errors(result.structured_content)
        error = cast("Exception | None", jsonschema_exceptions.best_match(errors))
    except Unresolvable as e:
        raise RuntimeError(f"Invalid schema for tool {name}: {e}") from e
    if error is not None:
        raise RuntimeError(
            f"Invalid structured content returned by tool {name}: {error}"
        ) from error


# ------------------------------------------------------------------ the client


class ThinClient:
    """One endpoint's MCP tools over plain POSTs: ``list_tools`` and ``call_tool``
    as the SDK's ``Client`` has them (same results, same errors), an
    :class:`~fleetroll.tools.mcp_client.McpClient` as it stands (no adapter:
    it is the hot path)."""

    __slots__ = (
        "_budget",
        "_limits",
        "_listing",
        "_next_id",
        "_open_http",
        "_read_timeout_s",
        "_report",
        "_version",
        "_wire",
        "url",
    )

    def __init__(
        self,
        url: str,
        wire: Wire,
        *,
        version: str,
        open_http: OpenHttp,
        read_timeout_s: float,
        limits: AnswerLimits | None,
        budget: retrying.Budget,
        report: retrying.Report | None,
    ) -> None:
        self.url = url
        self._wire = wire
        self._version = version
        self._open_http = open_http
        self._read_timeout_s = read_timeout_s
        self._limits = limits
        self._budget = budget
        self._report = report
        self._listing: Listing | None = None
        self._next_id = 1  # 0 was the probe's

    @property
    def protocol_version(self) -> str:
        return self._version

    async def list_tools(self) -> Listing:
        """The endpoint's tools (the first page, as ``Client.list_tools()``).

        Raises:
            MCPError: an error answer, or the answer was not one.
            pydantic.ValidationError: the result is not a listing.
            WireError: the request failed on its way.
        """
        raw = await self._request("tools/list", b"", None, {}, self._read_timeout_s)
        listing = self._listing = _listing(raw, self._version)
        return listing

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
    ) -> CallToolResult:
        """Call a tool; its answer as the SDK client returns it.

        Raises:
            MCPError: an error answer (or the SDK transport's stand-in), or the
                read timeout (``REQUEST_TIMEOUT``).
            RuntimeError: a structured answer that breaks the tool's output schema.
            pydantic.ValidationError: the result is not a tool result.
            WireError: the request failed on its way.
        """
        timeout = self._read_timeout_s if read_timeout_seconds is None else read_timeout_seconds
        # One deadline for the whole call, whichever way it goes (a re-list and a
        # second send, the SDK's client for input): the read timeout, as the SDK's.
        with anyio.move_on_after(timeout):
            return await self._call_tool(name, arguments, sdk_wait_s=timeout)
        raise _mcp_error(REQUEST_TIMEOUT, "Request 'tools/call' timed out")

    async def _call_tool(
        self, name: str, arguments: dict[str, Any] | None, *, sdk_wait_s: float
    ) -> CallToolResult:
        # As the SDK dumps the request: no "arguments" when there are none.
        params = b'"name":%s,' % json.dumps(name).encode()
        if arguments is not None:
            params += b'"arguments":%s,' % json.dumps(arguments, separators=(",", ":")).encode()
        try:
            try:
                raw = await self._call(name, arguments, params)
            except Exception as exc:
                if getattr(exc, "code", None) != HEADER_MISMATCH:
                    raise
                # The spec's recovery (Client.call_tool): list again, send once more.
                try:
                    await self.list_tools()
                except Exception as relist:
                    raise exc from relist
                raw = await self._call(name, arguments, params)
        except _NeedsSdk:
            return await self._by_sdk(name, arguments, sdk_wait_s)
        if raw.get("resultType") == "input_required":
            return await self._by_sdk(name, arguments, sdk_wait_s)
        plain = _plain_result(raw)
        if plain is not None:
            result = plain
        else:
            _clamp_ttl(raw)
            _check_surface("tools/call", self._version, raw)
            parsed = _CALL_RESULT.validate_python(raw, by_name=False)
            if isinstance(parsed, InputRequiredResult):  # pragma: no cover - tagged above
                return await self._by_sdk(name, arguments, sdk_wait_s)
            result = parsed
        if not result.is_error:
            await self._validate(name, result)
        return result

    async def _call(
        self, name: str, arguments: dict[str, Any] | None, params: bytes
    ) -> dict[str, Any]:
        headers: dict[str, str] = {}
        listing = self._listing
        if listing is not None and name in listing.param_headers:
            from mcp.shared.inbound import mcp_param_headers

            headers = mcp_param_headers(listing.param_headers[name], arguments or {})
        return await self._request("tools/call", params, name, headers, None)

    async def _validate(self, name: str, result: CallToolResult) -> None:
        if self._listing is None or name not in self._listing.output_schemas:
            await self.list_tools()  # as the SDK: list, to know the tool's schema
        assert self._listing is not None
        if name not in self._listing.output_schemas:
            _log.warning(
                "Tool %s not listed by server, cannot validate any structured content", name
            )
            return
        schema = self._listing.output_schemas[name]
        if schema is not None:
            _check_structured(name, schema, result, self._listing.validators)

    async def _by_sdk(
        self, name: str, arguments: dict[str, Any] | None, wait_s: float
    ) -> CallToolResult:
        """The call, made again by the SDK's client on the same URL.

        A client of its own for this call: the SDK client's task group must
        nest inside the caller's cancel scopes, so it cannot outlive the call
        (a session-long one would need the per-session machinery this client
        leaves out). Only calls that ask for client input come here.
        """
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        limits = self._limits or _NO_LIMITS
        events = max(limits.answer_bytes, limits.listing_bytes)
        async with AsyncExitStack() as stack:
            http = await stack.enter_async_context(self._open_http())
            client = await stack.enter_async_context(
                Client(
                    streamable_http_client(self.url, http_client=http, max_sse_event_size=events),
                    read_timeout_seconds=self._read_timeout_s,
                )
            )
            return await client.call_tool(name, arguments, read_timeout_seconds=wait_s)

    async def _request(
        self,
        method: str,
        params: bytes,
        name: str | None,
        extra: dict[str, str],
        wait_s: float | None,
    ) -> dict[str, Any]:
        """One request's result, under the read timeout (``REQUEST_TIMEOUT`` past it;
        None: the caller's deadline bounds it)."""
        request_id = self._next_id
        self._next_id += 1
        body = b'{"jsonrpc":"2.0","id":%d,"method":"%s","params":{%s"_meta":%s}}' % (
            request_id,
            method.encode(),
            params,
            _meta(self._version),
        )
        headers = {
            "accept": _ACCEPT,
            "content-type": _CONTENT_TYPE,
            "mcp-protocol-version": self._version,
            "mcp-method": method,
        }
        if name is not None:
            from mcp.shared.inbound import encode_header_value

            headers["mcp-name"] = encode_header_value(name)
        if extra:
            headers.update(extra)
        if wait_s is None:
            return await self._post(method, body, headers, request_id)
        with anyio.move_on_after(wait_s):
            return await self._post(method, body, headers, request_id)
        raise _mcp_error(REQUEST_TIMEOUT, f"Request {method!r} timed out")

    async def _post(
        self, method: str, body: bytes, headers: dict[str, str], request_id: int
    ) -> dict[str, Any]:
        return await post(
            self._wire,
            self.url,
            method,
            body,
            headers,
            self._limits,
            self._budget,
            self._report,
            partial(_read, expected=request_id),
        )


async def post(
    wire: Wire,
    url: str,
    method: str,
    body: bytes,
    headers: dict[str, str],
    limits: AnswerLimits | None,
    budget: retrying.Budget,
    report: retrying.Report | None,
    read: Callable[[StreamResponse], Awaitable[_T]],
) -> _T:
    """What ``read`` makes of one POST's answer (handed over at its head); the POST
    is sent again only while its connection could not be opened.

    Raises:
        MCPError: ``ANSWER_TOO_LARGE``: the answer passed its cap; or ``read``'s.
        WireError: the request failed on its way.
    """
    limits = limits or _NO_LIMITS
    cap = limits.cap(method)[0]
    try:
        try:
            # The first attempt goes straight out: no retry machinery when nothing fails.
            async with wire.stream(
                "POST", url, body=body, headers=headers, max_bytes=cap
            ) as response:
                return await read(response)
        except ConnectFailed as exc:  # raised on entering only: nothing was sent
            failed: BaseException | None = exc
        async for attempt in retrying.attempts(
            "mcp_request", budget, classify=_never_sent, report=report
        ):
            with attempt:
                if failed is not None:  # attempt 1: the one above, reported and counted
                    first, failed = failed, None
                    raise first
                async with wire.stream(
                    "POST", url, body=body, headers=headers, max_bytes=cap
                ) as response:
                    return await read(response)
    except BodyTooLarge:
        too_large = limits.error(method).error
        raise _mcp_error(too_large.code, too_large.message) from None
    raise AssertionError("unreachable: the last attempt's error propagates")


def _never_sent(exc: BaseException) -> Decision:
    return Decision(isinstance(exc, ConnectFailed))


# ------------------------------------------------------------------ opening


async def probe(
    url: str,
    wire: Wire,
    *,
    open_http: OpenHttp,
    read_timeout_s: float,
    limits: AnswerLimits | None,
    budget: retrying.Budget,
    report: retrying.Report | None,
) -> ThinClient | None:
    """A :class:`ThinClient` when ``url`` speaks the modern revision; None when it
    needs the SDK's client.

    Raises:
        MCPError: a bare 404 or 5xx (the SDK transport's stand-in): the
            service may still be starting.
        WireError: no answer (a refused or broken connection).
    """
    version = LATEST_MODERN_VERSION
    for attempt in range(2):
        body = b'{"jsonrpc":"2.0","id":0,"method":"server/discover","params":{"_meta":%s}}' % (
            _meta(version),
        )
        headers = {
            "accept": _ACCEPT,
            "content-type": _CONTENT_TYPE,
            "mcp-protocol-version": version,
            "mcp-method": "server/discover",
        }
        heard = _Heard()
        try:
            raw = await post(
                wire, url, "server/discover", body, headers, limits, budget, report, heard.read
            )
        except _NeedsSdk:
            return None
        except _Stateful:
            return None  # a stateful server: the SDK client keeps its session
        except WireError:
            raise  # no answer (refused, broken, a proxy's refusal): the caller decides
        except Exception as exc:
            if heard.bare or getattr(exc, "code", None) == ANSWER_TOO_LARGE:
                raise  # the service is not up yet (try again), or an answer past its cap
            if getattr(exc, "code", None) == UNSUPPORTED_PROTOCOL_VERSION and attempt == 0:
                mutual = _mutual(getattr(exc, "data", None))
                if mutual is not None:
                    version = mutual
                    continue
            return None
        _clamp_ttl(raw)
        try:
            result = DiscoverResult.model_validate(raw)
        except ValidationError:
            return None
        mutual_versions = [v for v in MODERN_PROTOCOL_VERSIONS if v in result.supported_versions]
        if not mutual_versions:
            return None
        return ThinClient(
            url,
            wire,
            version=mutual_versions[-1],
            open_http=open_http,
            read_timeout_s=read_timeout_s,
            limits=limits,
            budget=budget,
            report=report,
        )
    return None


class _Stateful(Exception):
    """The probe's answer carries a session id: the SDK client keeps sessions."""


class _Heard:
    """The probe's reading of its answer: what :func:`_read` makes of it, and
    whether it was a bare 404 or 5xx (no JSON-RPC answer: a router's, or a
    service still starting)."""

    __slots__ = ("bare",)

    def __init__(self) -> None:
        self.bare = False

    async def read(self, response: StreamResponse) -> dict[str, Any]:
        if response.headers.get("mcp-session-id"):
            raise _Stateful
        status = response.status
        if status != 404 and status < 500:
            return await _read(response)
        body = await response.aread()
        content_type = response.headers.get("content-type", "").lower()
        if content_type.startswith("application/json"):
            self.bare = _error_in(body) is None
        else:
            self.bare = True
        return _answer(Response(status, response.headers, body))


def _mutual(data: Any) -> str | None:
    """The newest modern version a ``-32022``'s ``supported`` list shares with us."""
    supported = data.get("supported") if isinstance(data, dict) else None
    if not isinstance(supported, list):
        return None
    mutual = [v for v in MODERN_PROTOCOL_VERSIONS if v in supported]
    return mutual[-1] if mutual else None
