"""MCP tool sessions: one per endpoint per rollout, every call under a deadline.

* :func:`open_tool_session` connects with retries while a fresh instance's
  MCP service is still starting (502/503, refused connections): backoff
  inside ``mcp_connect_s``, never a fixed sleep. The session is then reused for
  every call (a fresh session per call costs ~10x a call).
* :meth:`ToolSession.call` runs each call under ``call_tool_s``; a timeout or
  a transport failure raises :class:`ToolCallFailed`, and the session stays
  usable.
* :class:`BoundedAnswers` counts the bytes of every answer while they are
  read (``pool.max_tool_answer_bytes``, ``pool.max_tool_listing_bytes``):
  past the cap it stops reading, closes the connection, and the caller gets
  a JSON-RPC error (:data:`ANSWER_TOO_LARGE`) instead of the answer.
* :func:`normalise` turns a ``CallToolResult`` into what a model consumes:
  text, parsed JSON, images as data URLs, errors flagged; malformed answers
  (``{"base64_image": null}``, empty images) become tool errors, not crashes.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx2
from mcp_types import (
    INVALID_REQUEST,
    REQUEST_TIMEOUT,
    CallToolResult,
    ErrorData,
    ImageContent,
    TextContent,
)

import fleetroll._internal.retrying as retrying
from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.retrying import Decision
from fleetroll._internal.wire import BodyTooLarge, ProxyError, Wire, WireError
from fleetroll.errors import FleetrollError, OperationTimeout, ToolCallFailed, ToolsError
from fleetroll.policies import ToolSpec
from fleetroll.tools.mcp_client import McpClient, SdkClient
from fleetroll.tools.mcp_common import (
    ANSWER_TOO_LARGE,
    AnswerLimits,
    HttpClients,
    http_opener,
    unfollowed,
)
from fleetroll.tools.mcp_thin import probe

_T = TypeVar("_T")

__all__ = [
    "ANSWER_TOO_LARGE",
    "AnswerLimits",
    "BoundedAnswers",
    "HttpClients",
    "McpClient",
    "RetryRefusedConnections",
    "ToolCallFailed",
    "ToolResult",
    "ToolSession",
    "normalise",
    "open_tool_session",
]


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool's answer, ready for a model."""

    text: str
    images: tuple[str, ...] = ()  # data URLs
    is_error: bool = False
    structured: Any = None


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def describe(exc: BaseException) -> str:
    """One line for an exception, with exception groups flattened."""
    leaves = _leaves(exc)
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves)


def _mcp_error(leaf: BaseException) -> ErrorData | None:
    """What an error the MCP client raised says; None for any other error."""
    from mcp.shared.exceptions import MCPError  # loaded already once a client has run

    return leaf.error if isinstance(leaf, MCPError) else None


#: How both clients say they left a redirect unfollowed (an ``INVALID_REQUEST``:
#: the SDK transport's ``_unfollowed_redirect``, and the thin client's copy of it).
_UNFOLLOWED = re.compile(r"Redirect to (\S+) not followed")


def _redirected_to(exc: BaseException) -> str | None:
    """Where a redirect the client did not follow pointed; None for any other error."""
    for leaf in _leaves(exc):
        error = _mcp_error(leaf)
        if error is not None and error.code == INVALID_REQUEST:
            found = _UNFOLLOWED.match(error.message)
            if found is not None:
                return found.group(1)
    return None


def _connect_transient(exc: BaseException) -> bool:
    """Worth another connect attempt: the service may still be starting."""
    for leaf in _leaves(exc):
        if isinstance(leaf, httpx2.TransportError | TimeoutError):
            continue
        if isinstance(leaf, ProxyError):
            if leaf.transient:  # the proxy could not reach the service (yet)
                continue
            return False  # the proxy said no (403, 407): trying again changes nothing
        if isinstance(leaf, WireError) and not isinstance(leaf, BodyTooLarge):
            continue
        if _redirected_to(leaf) is not None:
            return False  # the same request is redirected the same way again
        # The transport reports 5xx (and 404 from a router that has not seen
        # the instance yet) as MCP errors; whether the instance is really gone
        # is decided from the control plane, not from here.
        if _mcp_error(leaf) is not None:
            continue
        return False
    return True


class ToolSession:
    """An open MCP session on one endpoint, and the tools it lists.

    Its ``client`` is either kind of :class:`~fleetroll.tools.mcp_client.McpClient`
    (the thin one, or the SDK's in an :class:`~fleetroll.tools.mcp_client.SdkClient`),
    chosen where the session is opened; the session never asks which.
    """

    def __init__(
        self,
        client: McpClient,
        url: str,
        *,
        call_timeout_s: float,
        list_timeout_s: float,
        list_budget: retrying.Budget | None = None,
        report: retrying.Report | None = None,
    ) -> None:
        self._client = client
        self.url = url
        self._call_timeout_s = call_timeout_s
        self._list_timeout_s = list_timeout_s
        self._list_budget = list_budget or retrying.Budget(1, 0.0, 0.0)
        self._report = report

    async def list_tools(self) -> list[ToolSpec]:
        """Every tool of the endpoint.

        Listing is idempotent: a transient failure (an MCP error answer, a
        transport error) is tried again (operation ``list_tools``,
        ``retries.list_tools_attempts``) inside the one ``list_timeout_s``.

        Raises:
            ToolsError: listing failed or timed out.
        """
        try:
            with fail_after(self._list_timeout_s) as scope:
                async for attempt in retrying.attempts(
                    "list_tools",
                    self._list_budget,
                    deadline=scope.deadline,
                    classify=_list_transient,
                    report=self._report,
                ):
                    with attempt:
                        listed = await self._client.list_tools()
        except TimeoutError:
            raise OperationTimeout(
                f"list_tools at {self.url} took over {self._list_timeout_s:g} s",
                operation="list_tools",
                timeout_s=self._list_timeout_s,
            ) from None
        except Exception as exc:
            too_large = _too_large(exc)
            raise ToolsError(
                f"list_tools at {self.url} failed: {too_large or describe(exc)}",
                operation="list_tools",
                transient=too_large is None,
            ) from exc
        return list(listed.specs)

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Call a tool; an error *answer* is a result with ``is_error``.

        Raises:
            ToolCallFailed: the call raised or passed its deadline.
        """
        timeout = self._call_timeout_s
        try:
            # The client bounds the whole call by the timeout itself (one cancel
            # scope per call on the thin client, not two: it is the hot path).
            result = await self._client.call_tool(name, dict(arguments), timeout)
        except TimeoutError as exc:
            # Chained from the TimeoutError: `error_type` in telemetry says so.
            raise ToolCallFailed(
                f"{name} took over {timeout:g} s", operation="call_tool", transient=True
            ) from exc
        except Exception as exc:
            text = describe(exc)
            if _too_large(exc):
                # Not worth another try: the same call would answer the same bytes.
                text = f"{name}: {_too_large(exc)}"
                raise ToolCallFailed(text, operation="call_tool", transient=False) from exc
            if _timed_out(exc):
                text = f"{name} took over {timeout:g} s ({text})"
                cause: BaseException = TimeoutError(text)
            else:
                cause = exc
            raise ToolCallFailed(text, operation="call_tool", transient=True) from cause
        return normalise(result)


def _too_large(exc: BaseException) -> str | None:
    """What an answer over its cap (:data:`ANSWER_TOO_LARGE`) was told as, if it was one."""
    for leaf in _leaves(exc):
        error = _mcp_error(leaf)
        if error is not None and error.code == ANSWER_TOO_LARGE:
            return error.message
    return None


def _list_transient(exc: BaseException) -> Decision:
    """A failed listing worth another try: an error answer or a transport failure,
    not our own deadline (the attempts stop there)."""
    if isinstance(exc, TimeoutError) or _too_large(exc):
        return Decision(False)  # a listing over its cap would be as large again
    return Decision(_connect_transient(exc))


class RetryRefusedConnections(httpx2.AsyncBaseTransport):
    """An HTTP transport that sends a request again only when it provably never
    left: its connection could not be opened (``ConnectError``, ``ConnectTimeout``).

    Every MCP request of a session goes through it, a ``tools/call`` too, which is
    not idempotent: a failure after the connection was open (a read error, a
    reset) is never retried, as the server may have acted on it. Tries:
    ``retries.mcp_request_attempts`` (operation ``mcp_request``), inside the
    caller's deadline.
    """

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport,
        budget: retrying.Budget,
        report: retrying.Report | None = None,
    ) -> None:
        self._inner = inner
        self._budget = budget
        self._report = report

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        # The first attempt goes straight out: the retry machinery (a retry loop
        # per request) cost more CPU than the request when nothing failed.
        try:
            return await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            failed: BaseException | None = exc
        async for attempt in retrying.attempts(
            "mcp_request", self._budget, classify=_never_sent, report=self._report
        ):
            with attempt:
                if failed is not None:  # attempt 1: the one above, reported and counted
                    first, failed = failed, None
                    raise first
                return await self._inner.handle_async_request(request)
        raise AssertionError("unreachable: the last attempt's error propagates")

    async def aclose(self) -> None:
        await self._inner.aclose()


#: A JSON-RPC request's method, near the start of its body (the SDK writes
#: ``jsonrpc``, ``id``, ``method``, ``params`` in that order).
_METHOD = re.compile(rb'"method"\s*:\s*"([^"\\]{1,64})"')


class BoundedAnswers(httpx2.AsyncBaseTransport):
    """An HTTP transport that reads at most :class:`AnswerLimits` bytes of an answer.

    The cap of a POST's answer is chosen by the JSON-RPC method it carries
    (``tools/list``: the listing cap; anything else: the answer cap), and
    counted while the body is read:

    * a JSON answer (the mcp client reads it whole anyway) is read here; past
      the cap the rest is never read, the connection is closed, and the
      client gets a 502 whose body is a JSON-RPC error (:data:`ANSWER_TOO_LARGE`),
      which it hands to the caller as the request's error;
    * an SSE answer is passed on as it arrives, and ends with an ``SSEError``
      past the cap (the client answers the request with that error).

    The server's own GET stream (notifications) is not capped as a whole:
    the client bounds each of its events (``max_sse_event_size``).
    """

    def __init__(self, inner: httpx2.AsyncBaseTransport, limits: AnswerLimits) -> None:
        self._inner = inner
        self._limits = limits

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if request.method != "POST":
            return response
        try:
            found = _METHOD.search(request.content[:512])
        except httpx2.RequestNotRead:  # a streamed upload: not one of the mcp client's
            found = None
        method = found.group(1).decode("ascii", "replace") if found else None
        cap, _ = self._limits.cap(method)
        content_type = response.headers.get("content-type", "").lower()
        if content_type.startswith("text/event-stream"):
            stream = _CappedEvents(response.stream, cap, self._limits.too_large(method))
            return httpx2.Response(
                response.status_code,
                headers=response.headers,
                stream=stream,
                extensions=response.extensions,
            )
        chunks: list[bytes] = []
        size = 0
        inner = response.stream
        assert isinstance(inner, httpx2.AsyncByteStream)
        try:
            async for chunk in inner:
                size += len(chunk)
                if size > cap:
                    break
                chunks.append(chunk)
        finally:
            await inner.aclose()  # not read to its end: the connection is closed
        if size > cap:
            body = self._limits.error(method).model_dump_json(by_alias=True)
            return httpx2.Response(
                502, headers={"content-type": "application/json"}, content=body.encode()
            )
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=httpx2.ByteStream(b"".join(chunks)),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedEvents(httpx2.AsyncByteStream):
    """An SSE body that raises ``SSEError`` once it passes ``cap`` bytes in all."""

    def __init__(self, inner: Any, cap: int, too_large: str) -> None:
        self._inner = inner
        self._cap = cap
        self._too_large = too_large

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in self._inner:
            size += len(chunk)
            if size > self._cap:
                await self._inner.aclose()
                raise httpx2.SSEError(self._too_large)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _never_sent(exc: BaseException) -> Decision:
    return Decision(isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout))


def _timed_out(exc: BaseException) -> bool:
    """The MCP client's own read timeout (``REQUEST_TIMEOUT``), or a timeout leaf."""
    for leaf in _leaves(exc):
        if isinstance(leaf, TimeoutError | httpx2.TimeoutException):
            return True
        error = _mcp_error(leaf)
        if error is not None and error.code == REQUEST_TIMEOUT:
            return True
    return "timed out" in describe(exc).lower()


@asynccontextmanager
async def open_tool_session(
    url: str,
    http: HttpClients,
    *,
    connect_timeout_s: float,
    call_timeout_s: float,
    list_timeout_s: float,
    budget: retrying.Budget,
    list_budget: retrying.Budget | None = None,
    report: retrying.Report | None = None,
    limits: AnswerLimits | None = None,
    wire: Wire | None = None,
    request_budget: retrying.Budget | None = None,
) -> AsyncIterator[ToolSession]:
    """Connect to an MCP endpoint, retrying while its service starts.

    With a ``wire`` (``pool.mcp_client = "thin"``), the thin client
    (:mod:`fleetroll.tools.mcp_thin`) is tried first: a server of the
    modern, stateless revision is spoken to with plain POSTs on that shared
    :class:`~fleetroll._internal.wire.Wire` (``request_budget``: the tries of
    a request whose connection was refused, ``retries.mcp_request_attempts``).
    Any other server (a legacy one, a session id, an error to the probe) gets
    the mcp SDK's client, on ``http``: a client, or a function making one
    (then made only when needed, and closed with the session).

    ``http`` should read answers through :class:`BoundedAnswers`; ``limits``
    (its caps) also bound each event of the server's SSE streams (the mcp
    client's own limit, 1 MiB by default, would otherwise refuse a larger
    answer sent as an event), and the thin client's answers.

    Retries (:func:`fleetroll._internal.retrying.attempts`, operation ``mcp_connect``,
    ``retries.mcp_connect_*``) wait full-jitter backoff inside
    ``connect_timeout_s``.

    Raises:
        OperationTimeout: no connection within ``connect_timeout_s``.
        ToolsError: a failure that retrying cannot fix, or (``transient``)
            the budget's attempts ran out first.
    """
    deadline = anyio.current_time() + connect_timeout_s
    open_http = http_opener(http)
    if wire is not None:
        opened = await _connect(
            url,
            lambda: probe(
                url,
                wire,
                open_http=open_http,
                read_timeout_s=call_timeout_s,
                limits=limits,
                budget=request_budget or retrying.Budget(1, 0.0, 0.0),
                report=report,
            ),
            connect_timeout_s=connect_timeout_s,
            deadline=deadline,
            budget=budget,
            report=report,
        )
        if opened is not None:  # a modern server: the thin client speaks to it
            yield ToolSession(
                opened,
                url,
                call_timeout_s=call_timeout_s,
                list_timeout_s=list_timeout_s,
                list_budget=list_budget,
                report=report,
            )
            return
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(open_http())
        yield await stack.enter_async_context(
            _sdk_session(
                url,
                client,
                deadline=deadline,
                connect_timeout_s=connect_timeout_s,
                call_timeout_s=call_timeout_s,
                list_timeout_s=list_timeout_s,
                budget=budget,
                list_budget=list_budget,
                report=report,
                limits=limits,
            )
        )


async def _connect(
    url: str,
    attempt_once: Callable[[], Awaitable[_T]],
    *,
    connect_timeout_s: float,
    deadline: float,
    budget: retrying.Budget,
    report: retrying.Report | None,
) -> _T:
    """What ``attempt_once`` opens, tried again while the service starts (a refused
    connection, a bare 404 or 5xx) inside ``deadline``.

    Raises:
        OperationTimeout: ``deadline`` passed first.
        ToolsError: a failure that retrying cannot fix, or (``transient``)
            the budget's attempts ran out first.
    """
    tries = 0
    last: BaseException | None = None

    def decision(exc: BaseException) -> Decision:
        return Decision(_connect_transient(exc))

    try:
        async for attempt in retrying.attempts(
            "mcp_connect", budget, deadline=deadline, classify=decision, report=report
        ):
            with attempt:
                tries = attempt.num
                with anyio.CancelScope(deadline=deadline):
                    try:
                        return await attempt_once()
                    except Exception as exc:
                        last = exc
                        raise
                raise _connect_timeout(url, connect_timeout_s, tries, last)
    except OperationTimeout:
        raise
    except Exception as exc:
        raise _connect_failed(url, exc, connect_timeout_s, deadline, tries, budget) from exc
    raise AssertionError("unreachable: the last attempt's error propagates")


def _connect_failed(
    url: str,
    exc: BaseException,
    timeout_s: float,
    deadline: float,
    tries: int,
    budget: retrying.Budget,
) -> FleetrollError:
    """The error of a connect whose attempts ended with ``exc``."""
    if _connect_transient(exc):  # out of time, or of attempts, for another try
        if anyio.current_time() < deadline and budget.attempts is not None:
            return ToolsError(
                f"cannot open an MCP session at {url} in {tries} attempts"
                f" (retries.mcp_connect_attempts): {describe(exc)}",
                operation="connect",
                transient=True,
            )
        return _connect_timeout(url, timeout_s, tries, exc)
    location = _redirected_to(exc)
    if location is not None:
        why = unfollowed(url, location) or f"it redirects to {location}, which was not followed"
        return ToolsError(f"cannot open an MCP session at {url}: {why}", operation="connect")
    return ToolsError(f"cannot open an MCP session at {url}: {describe(exc)}", operation="connect")


@asynccontextmanager
async def _sdk_session(
    url: str,
    http: httpx2.AsyncClient,
    *,
    deadline: float,
    connect_timeout_s: float,
    call_timeout_s: float,
    list_timeout_s: float,
    budget: retrying.Budget,
    list_budget: retrying.Budget | None,
    report: retrying.Report | None,
    limits: AnswerLimits | None,
) -> AsyncIterator[ToolSession]:
    """A session of the mcp SDK's client, connected with retries inside ``deadline``."""
    # The SDK's client, imported when first used: ``mcp`` loads starlette and
    # uvicorn (its server side), which importing the pool does not.
    from mcp import Client
    from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE, streamable_http_client

    event_bytes = None if limits is None else max(limits.answer_bytes, limits.listing_bytes)
    if event_bytes is None:
        event_bytes = DEFAULT_MAX_SSE_EVENT_SIZE
    connected = False
    tries = 0
    last: BaseException | None = None

    def decision(exc: BaseException) -> Decision:
        # Once connected, a failure belongs to the caller's block: never retried.
        return Decision(not connected and _connect_transient(exc))

    try:
        async for attempt in retrying.attempts(
            "mcp_connect", budget, deadline=deadline, classify=decision, report=report
        ):
            with attempt:
                tries = attempt.num
                # The connect deadline must wrap the whole `async with Client` so
                # that cancel scopes nest; it is lifted once the handshake is done.
                with anyio.CancelScope(deadline=deadline) as scope:
                    try:
                        async with Client(
                            streamable_http_client(
                                url, http_client=http, max_sse_event_size=event_bytes
                            ),
                            read_timeout_seconds=call_timeout_s,
                        ) as client:
                            connected = True
                            scope.deadline = math.inf
                            yield ToolSession(
                                SdkClient(client),
                                url,
                                call_timeout_s=call_timeout_s,
                                list_timeout_s=list_timeout_s,
                                list_budget=list_budget,
                                report=report,
                            )
                    except Exception as exc:
                        if not connected:
                            last = exc
                        raise
                if not connected:  # the deadline passed while connecting
                    raise _connect_timeout(url, connect_timeout_s, tries, last)
                return  # in the block: a failed attempt leaves it too, its error held
    except Exception as exc:
        if connected or isinstance(exc, OperationTimeout):
            raise
        raise _connect_failed(url, exc, connect_timeout_s, deadline, tries, budget) from exc


def _connect_timeout(
    url: str, timeout_s: float, attempts: int, last: BaseException | None
) -> OperationTimeout:
    s = "" if attempts == 1 else "s"
    why = describe(last) if last else "no answer"
    return OperationTimeout(
        f"connecting to the MCP endpoint {url} timed out after {timeout_s:g} s "
        f"({attempts} attempt{s}; last: {why})",
        operation="connect",
        timeout_s=timeout_s,
    )


def _image(data: str | None, mime: str | None) -> str | None:
    """A data URL for base64 image data, or None when the data is unusable."""
    if not data or not isinstance(data, str):
        return None
    try:
        base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return f"data:{mime or 'image/png'};base64,{data}"


def normalise(result: CallToolResult) -> ToolResult:
    """What a model should see of a tool's answer."""
    texts: list[str] = []
    images: list[str] = []
    problems: list[str] = []
    for block in result.content or ():
        if isinstance(block, TextContent):
            parsed = _maybe_json(block.text)
            if isinstance(parsed, dict) and "base64_image" in parsed:
                url = _image(parsed.get("base64_image"), parsed.get("mime_type"))
                if url is None:
                    problems.append("the screenshot came back empty")
                else:
                    images.append(url)
                rest = {k: v for k, v in parsed.items() if k not in ("base64_image", "mime_type")}
                if rest:
                    texts.append(json.dumps(rest))
            else:
                texts.append(block.text)
        elif isinstance(block, ImageContent):
            url = _image(block.data, block.mime_type)
            if url is None:
                problems.append("the image came back empty or not base64")
            else:
                images.append(url)
        else:
            texts.append(f"[{block.type} content]")
    structured = result.structured_content
    if not texts and structured is not None:
        texts.append(json.dumps(structured))
    if problems:
        texts.append("Malformed tool answer: " + "; ".join(problems))
    # An answer that says it failed (a truthy "error", or "status": "failed")
    # is a tool error even when MCP's isError is not set, as the reference counts it.
    failed = _says_failed(structured) or any(_says_failed(_maybe_json(t)) for t in texts)
    return ToolResult(
        text="\n".join(texts),
        images=tuple(images),
        is_error=bool(result.is_error) or bool(problems) or failed,
        structured=structured,
    )


def _says_failed(answer: Any) -> bool:
    """A JSON object answer that reports a failure of its own."""
    return isinstance(answer, dict) and (
        bool(answer.get("error")) or answer.get("status") == "failed"
    )


def _maybe_json(text: str) -> Any:
    stripped = text.lstrip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        return json.loads(stripped)
    except ValueError:
        return None
