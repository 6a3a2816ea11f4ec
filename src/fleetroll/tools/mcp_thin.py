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

This module holds the client (the envelope, the requests, the probe); how an
answer is read is :mod:`fleetroll.tools.mcp_answers`, and what a result is
checked against, :mod:`fleetroll.tools.mcp_results`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Final, TypeVar

import anyio
from mcp_types import (
    HEADER_MISMATCH,
    REQUEST_TIMEOUT,
    UNSUPPORTED_PROTOCOL_VERSION,
    CallToolResult,
    ClientCapabilities,
    DiscoverResult,
    InputRequiredResult,
)
from mcp_types.version import LATEST_MODERN_VERSION, MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter, ValidationError

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
from fleetroll.tools.mcp_answers import NeedsSdk, answer, error_in, mcp_error, read_answer
from fleetroll.tools.mcp_common import (
    ANSWER_TOO_LARGE,
    AnswerLimits,
    OpenHttp,
)
from fleetroll.tools.mcp_results import (
    Listing,
    check_structured,
    check_surface,
    clamp_ttl,
    plain_result,
    shared_listing,
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
        listing = self._listing = shared_listing(raw, self._version)
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
        raise mcp_error(REQUEST_TIMEOUT, "Request 'tools/call' timed out")

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
        except NeedsSdk:
            return await self._by_sdk(name, arguments, sdk_wait_s)
        if raw.get("resultType") == "input_required":
            return await self._by_sdk(name, arguments, sdk_wait_s)
        plain = plain_result(raw)
        if plain is not None:
            result = plain
        else:
            clamp_ttl(raw)
            check_surface("tools/call", self._version, raw)
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
            check_structured(name, schema, result, self._listing.validators)

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
        raise mcp_error(REQUEST_TIMEOUT, f"Request {method!r} timed out")

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
            partial(read_answer, expected=request_id),
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
        raise mcp_error(too_large.code, too_large.message) from None
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
        except NeedsSdk:
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
        clamp_ttl(raw)
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
    """The probe's reading of its answer: what :func:`read_answer` makes of it, and
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
            return await read_answer(response)
        body = await response.aread()
        content_type = response.headers.get("content-type", "").lower()
        if content_type.startswith("application/json"):
            self.bare = error_in(body) is None
        else:
            self.bare = True
        return answer(Response(status, response.headers, body))


def _mutual(data: Any) -> str | None:
    """The newest modern version a ``-32022``'s ``supported`` list shares with us."""
    supported = data.get("supported") if isinstance(data, dict) else None
    if not isinstance(supported, list):
        return None
    mutual = [v for v in MODERN_PROTOCOL_VERSIONS if v in supported]
    return mutual[-1] if mutual else None
