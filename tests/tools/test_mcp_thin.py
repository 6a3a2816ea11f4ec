"""The thin MCP client against the mcp SDK's own streamable-HTTP server, side by side
with the SDK's client: the same tools, the same answers, the same errors.

Each case runs both clients on one server: ``open_tool_session`` with a
:class:`~fleetroll._internal.wire.Wire` (the thin client first) and without
(the SDK's client), and compares what a rollout sees: the listed
:class:`ToolSpec` s, the normalised :class:`ToolResult` s, or the
:class:`ToolCallFailed` (message and ``transient``). The server is
``MCPServer.streamable_http_app`` under uvicorn on a free loopback port; a thin
ASGI layer in front of it (:class:`Front`) records what arrives and, where a
case needs it, plays a server the SDK does not ship (a legacy-only one, one
that lies about its output schema, one that asks the client mid-stream).
"""

from __future__ import annotations

import gc
import json
import re
import socket
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import pytest
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from mcp_types import (
    CallToolResult,
    ElicitRequest,
    ElicitRequestFormParams,
    InputRequiredResult,
)
from mcp_types import methods as mcp_methods
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetroll._internal.retrying import Budget, Retry
from fleetroll._internal.serving import serve_asgi
from fleetroll._internal.wire import Response, Wire
from fleetroll.errors import OperationTimeout, ToolCallFailed, ToolsError
from fleetroll.tools import mcp_answers, mcp_results
from fleetroll.tools.mcp_client import SdkClient
from fleetroll.tools.mcp_thin import ThinClient
from fleetroll.tools.session import (
    AnswerLimits,
    BoundedAnswers,
    ToolResult,
    ToolSession,
    normalise,
    open_tool_session,
)

LIMITS = AnswerLimits(answer_bytes=64 * 1024, listing_bytes=32 * 1024)
DEADLINES: dict[str, Any] = {
    "connect_timeout_s": 10.0,
    "call_timeout_s": 10.0,
    "list_timeout_s": 10.0,
    "budget": Budget(3, 0.05, 0.5),
    "limits": LIMITS,
}
MODERN = "2026-07-28"


class Balance(BaseModel):
    account: str
    balance: float


def tools_server() -> MCPServer:
    """The SDK's server with one tool per case."""
    server = MCPServer("conformance", instructions="a server for the thin client's tests")

    @server.tool(description="Echo the text.")
    def echo(text: str) -> str:
        return text

    @server.tool(description="A structured answer with an output schema.")
    def balance() -> Balance:
        return Balance(account="Checking", balance=12.5)

    @server.tool(description="Its answer breaks its own output schema (see Front).")
    def liar() -> Balance:
        return Balance(account="Checking", balance=1.0)

    @server.tool()
    def broken() -> str:
        raise ValueError("the tool itself failed")

    @server.tool()
    def refused() -> str:
        raise MCPError(-32602, "the server refuses this call", {"why": "a test"})

    @server.tool()
    async def chatty(ctx: Context) -> str:
        with warnings.catch_warnings():  # 2026-07-28 deprecates logging, still sent on opt-in
            warnings.simplefilter("ignore", MCPDeprecationWarning)
            await ctx.info("working")
        await ctx.report_progress(1, 2, "half way")
        await ctx.report_progress(2, 2, "done")
        return "finished"

    @server.tool()
    def needs_input(ctx: Context) -> InputRequiredResult | str:
        if ctx.input_responses:
            return f"thanks: {sorted(ctx.input_responses)}"
        ask = ElicitRequestFormParams(
            message="Which account?",
            requested_schema={"type": "object", "properties": {"account": {"type": "string"}}},
        )
        return InputRequiredResult(input_requests={"account": ElicitRequest(params=ask)})

    @server.tool()
    def asks_mid_stream() -> str:
        return "answered after the question (see Front)"

    @server.tool()
    async def slow() -> str:
        await anyio.sleep(30)
        return "too late"

    @server.tool()
    def big() -> str:
        return "x" * (LIMITS.answer_bytes + 1024)

    return server


@dataclass
class Seen:
    """What reached the server."""

    methods: list[str] = field(default_factory=list)
    session_ids: list[str | None] = field(default_factory=list)  # of each tools/call
    issued_session_ids: list[str] = field(default_factory=list)
    event_streams: int = 0  # answers the SDK's server sent as text/event-stream


class Front:
    """ASGI in front of the SDK's app: records requests, and plays what a case needs.

    * ``legacy_only``: a server of the handshake era only (modern requests are
      handed to the SDK's legacy transport, as an mcp 1.x server would get them);
    * ``discover_versions``: ``server/discover`` answers these supported versions;
    * ``reject_first_discover``: the first probe is answered ``-32022``, naming
      the modern version as supported;
    * ``warming``: the first this many requests get a bare 503 (a service starting);
    * ``chatty`` gets the log and progress opt-ins, so the SDK's server sends
      notifications before the answer (SSE);
    * ``liar``'s answer breaks its output schema; ``asks_mid_stream``'s stream
      carries a server request (elicitation) before the answer;
    * ``raw``: a ``tools/call`` of one of these names is answered with these
      bytes (``@ID@``: the request's id), as JSON or, with ``raw_events``, as
      one SSE event; with ``raw_kept_open`` too, a progress notification comes
      first and the stream stays open after the answer until the client
      leaves it (the spec allows it), which ``departures`` then tells.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        legacy_only: bool = False,
        discover_versions: list[str] | None = None,
        reject_first_discover: bool = False,
        warming: int = 0,
        raw: dict[str, bytes] | None = None,
        raw_events: bool = False,
        raw_kept_open: bool = False,
    ) -> None:
        self.app = app
        self.raw = raw or {}
        self.raw_events = raw_events
        self.raw_kept_open = raw_kept_open
        self._departed, self.departures = anyio.create_memory_object_stream[str](100)
        self.warming = warming
        self.legacy_only = legacy_only
        self.discover_versions = discover_versions
        self.reject_first_discover = reject_first_discover
        self.seen = Seen()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.warming > 0:
            self.warming -= 1
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"starting"})
            return
        request = json.loads(body)
        method = request.get("method", "")
        params = request.get("params") or {}
        headers = dict(scope["headers"])
        self.seen.methods.append(method)
        if method == "tools/call":
            sid = headers.get(b"mcp-session-id")
            self.seen.session_ids.append(sid.decode() if sid else None)
        modern = headers.get(b"mcp-protocol-version", b"").decode() == MODERN
        if method == "server/discover" and modern:
            if self.reject_first_discover and self.seen.methods.count("server/discover") == 1:
                error = {"code": -32022, "message": "Unsupported protocol version"}
                error["data"] = {"supported": [MODERN, "2025-11-25"], "requested": MODERN}
                await _json(send, 400, {"jsonrpc": "2.0", "id": request["id"], "error": error})
                return
            if self.discover_versions is not None:
                result = {"supportedVersions": self.discover_versions, "capabilities": {}}
                await _json(send, 200, {"jsonrpc": "2.0", "id": request["id"], "result": result})
                return
        if self.legacy_only and modern:
            scope = dict(
                scope, headers=[(k, v) for k, v in scope["headers"] if k != b"mcp-protocol-version"]
            )
        if method == "tools/call" and params.get("name") == "liar":
            result = {
                "content": [{"type": "text", "text": "{}"}],
                "structuredContent": {"account": "x"},
                "resultType": "complete",
            }
            await _json(send, 200, {"jsonrpc": "2.0", "id": request["id"], "result": result})
            return
        if method == "tools/call" and params.get("name") in self.raw:
            answer = self.raw[params["name"]].replace(b"@ID@", json.dumps(request["id"]).encode())
            if self.raw_kept_open:
                await _kept_open(receive, send, answer)
                await self._departed.send(params["name"])
                return
            await _raw(send, answer, events=self.raw_events)
            return
        if method == "tools/call" and params.get("name") == "asks_mid_stream":
            await _asking_stream(send, request["id"])
            return
        if method == "tools/call" and params.get("name") == "chatty":
            meta = params.setdefault("_meta", {})
            meta["io.modelcontextprotocol/logLevel"] = "debug"
            meta["progressToken"] = "p-1"
            body = json.dumps(request).encode()
        await self.app(scope, _replay(body), self._recording(send))

    def _recording(self, send: Send) -> Send:
        async def recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                for name, value in message.get("headers", []):
                    if name.lower() == b"mcp-session-id":
                        self.seen.issued_session_ids.append(value.decode())
                    if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                        self.seen.event_streams += 1
            await send(message)

        return recording


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


async def _json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _raw(send: Send, answer: bytes, *, events: bool) -> None:
    kind = b"application/json"
    if events:
        kind, answer = b"text/event-stream", b"event: message\ndata: " + answer + b"\n\n"
    headers = [(b"content-type", kind), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def _kept_open(receive: Receive, send: Send, answer: bytes) -> None:
    """A progress notification, the answer, then the stream held open (a comment
    on it) until the client leaves."""
    progress = b'{"jsonrpc":"2.0","method":"notifications/progress","params":'
    progress += b'{"progressToken":1,"progress":1}}'
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for data in (progress, answer):
        event = b"event: message\r\ndata: " + data + b"\r\n\r\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b": still here\n\n", "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass


async def _asking_stream(send: Send, request_id: Any) -> None:
    """A progress notification, a request to the client, then the answer."""
    events = [
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": 1, "progress": 1},
        },
        {
            "jsonrpc": "2.0",
            "id": "server-1",
            "method": "elicitation/create",
            "params": {
                "message": "Sure?",
                "mode": "form",
                "requestedSchema": {"type": "object", "properties": {}},
            },
        },
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "result": {
                "content": [{"type": "text", "text": "answered after the question"}],
                "structuredContent": {"result": "answered after the question"},
                "resultType": "complete",
            },
        },
    ]
    body = b"".join(
        b"event: message\r\ndata: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events
    )
    headers = [
        (b"content-type", b"text/event-stream"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving(
    *, json_response: bool, stateless: bool = False, **front: Any
) -> AsyncIterator[tuple[str, Front]]:
    server = tools_server()
    app = server.streamable_http_app(
        json_response=json_response,
        stateless_http=stateless,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    wrapped = Front(app, **front)
    with wrapped._departed, wrapped.departures:
        async with serve_asgi(wrapped) as base:
            yield f"{base}/mcp", wrapped


def _sdk_http() -> httpx2.AsyncClient:
    """The SDK client's HTTP client as the providers make it: answers capped."""
    return httpx2.AsyncClient(
        timeout=30, transport=BoundedAnswers(httpx2.AsyncHTTPTransport(), LIMITS)
    )


@asynccontextmanager
async def both(url: str, **deadlines: Any) -> AsyncIterator[tuple[ToolSession, ToolSession]]:
    """A thin-first session and an SDK session on one URL."""
    deadlines = {**DEADLINES, **deadlines}
    async with (
        Wire() as wire,
        open_tool_session(url, _sdk_http, wire=wire, **deadlines) as thin,
        _sdk_http() as http,
        open_tool_session(url, http, **deadlines) as sdk,
    ):
        yield thin, sdk


Outcome = ToolResult | tuple[str, str, bool]


async def outcome(session: ToolSession, name: str, arguments: dict[str, Any]) -> Outcome:
    """What a rollout sees of a call: its result, or its failure (type, message, transient)."""
    try:
        return await session.call(name, arguments)
    except ToolCallFailed as exc:
        return (type(exc).__name__, str(exc), exc.transient)


CALLS: list[tuple[str, dict[str, Any]]] = [
    ("echo", {"text": "héllo, wörld"}),
    ("balance", {}),
    ("liar", {}),  # invalid structured content: the SDK's RuntimeError
    ("broken", {}),  # an error answer (isError)
    ("refused", {}),  # a JSON-RPC error
    ("nope", {}),  # an unknown tool
    ("echo", {}),  # arguments the tool's schema refuses
    ("chatty", {}),  # notifications before the answer
    ("needs_input", {}),  # input_required: the SDK client's answer
    ("asks_mid_stream", {}),  # a server request in the stream
    ("big", {}),  # an answer over its cap
]


@pytest.mark.slow
@pytest.mark.parametrize("json_response", [True, False], ids=["json", "sse"])
async def test_the_thin_client_lists_and_answers_as_the_sdk_client_does(
    json_response: bool,
) -> None:
    with anyio.fail_after(60):
        async with serving(json_response=json_response) as (url, front), both(url) as (thin, sdk):
            assert isinstance(thin._client, ThinClient)
            assert isinstance(sdk._client, SdkClient)
            assert await thin.list_tools() == await sdk.list_tools()
            for name, arguments in CALLS:
                mine, theirs = (
                    await outcome(thin, name, arguments),
                    await outcome(sdk, name, arguments),
                )
                assert mine == theirs, name
    # SSE mode: chatty's notifications came first, on a stream (to each client).
    assert front.seen.event_streams == (0 if json_response else 2)
    # Neither client ever had a session id: the server spoke the stateless revision.
    assert front.seen.issued_session_ids == []
    assert set(front.seen.session_ids) == {None}


@pytest.mark.slow
async def test_a_call_past_its_timeout_fails_alike_on_time_and_the_session_goes_on() -> None:
    async with serving(json_response=True) as (url, _), both(url, call_timeout_s=0.5) as pair:
        for session in pair:
            began = anyio.current_time()
            with (
                anyio.fail_after(10),
                pytest.raises(ToolCallFailed, match=r"slow took over 0\.5 s") as late,
            ):
                await session.call("slow", {})
            assert late.value.transient and isinstance(late.value.__cause__, TimeoutError)
            assert anyio.current_time() - began < 2.0
            assert (await session.call("echo", {"text": "still here"})).text == "still here"


@pytest.mark.slow
async def test_answers_that_matter_are_what_each_case_says() -> None:
    """The side-by-side test compares; this pins what was compared."""
    async with (
        serving(json_response=False) as (url, front),
        Wire() as wire,
        open_tool_session(url, _sdk_http, wire=wire, **DEADLINES) as thin,
    ):
        await thin.list_tools()
        assert (await thin.call("echo", {"text": "hi"})).text == "hi"
        assert (await thin.call("balance", {})).structured == {
            "account": "Checking",
            "balance": 12.5,
        }
        assert (await thin.call("chatty", {})).text == "finished"
        assert (await thin.call("broken", {})).is_error
        assert (await thin.call("nope", {})).is_error
        with pytest.raises(
            ToolCallFailed, match="Invalid structured content returned by tool liar"
        ):
            await thin.call("liar", {})
        with pytest.raises(ToolCallFailed, match="the server refuses this call") as refused:
            await thin.call("refused", {})
        assert refused.value.transient
        with pytest.raises(ToolCallFailed, match="Elicitation not supported"):
            await thin.call("needs_input", {})
        asked = await thin.call("asks_mid_stream", {})
        assert asked.text == "answered after the question"
        with pytest.raises(ToolCallFailed, match=r"pool\.max_tool_answer_bytes") as big:
            await thin.call("big", {})
        assert not big.value.transient
    # The calls that asked for input were made again by an SDK client (its own probe),
    # which answered the server's question itself ("Elicitation not supported").
    assert front.seen.methods.count("server/discover") == 3
    assert front.seen.methods.count("tools/call") == 10 + 2
    assert front.seen.methods.count("") == 1  # its answer (an error) to the server's request


@pytest.mark.slow
@pytest.mark.parametrize("stateless", [False, True], ids=["stateful", "stateless"])
async def test_a_legacy_only_server_gets_the_sdk_client_and_its_session_id_back(
    stateless: bool,
) -> None:
    with anyio.fail_after(60):
        async with (
            serving(json_response=True, stateless=stateless, legacy_only=True) as (url, front),
            both(url) as (thin, sdk),
        ):
            assert isinstance(thin._client, SdkClient) and isinstance(sdk._client, SdkClient)
            assert thin._client.protocol_version == "2025-11-25"
            assert await thin.list_tools() == await sdk.list_tools()
            for name, arguments in CALLS[:7]:
                assert await outcome(thin, name, arguments) == await outcome(sdk, name, arguments)
    assert "initialize" in front.seen.methods
    if stateless:
        assert front.seen.issued_session_ids == [] and set(front.seen.session_ids) == {None}
    else:
        # Each session's calls carry the id the server gave that session.
        assert len(front.seen.issued_session_ids) >= 2
        assert set(front.seen.session_ids) <= set(front.seen.issued_session_ids)
        assert None not in front.seen.session_ids


@pytest.mark.slow
async def test_a_server_advertising_only_handshake_versions_gets_the_sdk_client() -> None:
    async with (
        serving(json_response=True, discover_versions=["2025-06-18", "2025-11-25"]) as (url, front),
        both(url) as (thin, sdk),
    ):
        assert isinstance(thin._client, SdkClient)
        assert thin._client.protocol_version == sdk._client.protocol_version == "2025-11-25"  # type: ignore[attr-defined]
        assert await thin.call("echo", {"text": "a"}) == await sdk.call("echo", {"text": "a"})
    assert front.seen.methods.count("initialize") == 2


@pytest.mark.slow
async def test_an_unsupported_version_answer_naming_a_mutual_version_is_probed_once_more() -> None:
    async with (
        serving(json_response=True, reject_first_discover=True) as (url, front),
        Wire() as wire,
        open_tool_session(url, _sdk_http, wire=wire, **DEADLINES) as thin,
    ):
        assert isinstance(thin._client, ThinClient) and thin._client.protocol_version == MODERN
        assert (await thin.call("echo", {"text": "again"})).text == "again"
    assert front.seen.methods[:2] == ["server/discover", "server/discover"]
    assert "initialize" not in front.seen.methods


@pytest.mark.slow
async def test_an_sdk_client_reprobes_the_same_way() -> None:
    """The other side of the test above: what the thin client copies."""
    async with (
        serving(json_response=True, reject_first_discover=True) as (url, front),
        _sdk_http() as http,
        open_tool_session(url, http, **DEADLINES) as sdk,
    ):
        assert sdk._client.protocol_version == MODERN  # type: ignore[attr-defined]
    assert front.seen.methods[:2] == ["server/discover", "server/discover"]


@pytest.mark.slow
async def test_the_thin_client_waits_for_a_starting_service_as_the_sdk_client_does() -> None:
    retries: list[Retry] = []
    async with (
        serving(json_response=True, warming=2) as (url, front),
        Wire() as wire,
        open_tool_session(url, _sdk_http, wire=wire, report=retries.append, **DEADLINES) as thin,
    ):
        assert isinstance(thin._client, ThinClient)
        assert (await thin.call("echo", {"text": "up"})).text == "up"
    # Two bare 503s: two connect attempts failed, each told as the SDK client tells it.
    assert [r.operation for r in retries] == ["mcp_connect"] * 2
    assert {str(r.cause) for r in retries} == {"Server returned an error response"}
    assert front.seen.methods[0] == "server/discover"


@pytest.mark.slow
async def test_a_service_that_never_answers_is_a_connect_timeout_naming_its_attempts() -> None:
    with anyio.fail_after(30):
        async with Wire() as wire:
            # Nothing listens on the port: every connection is refused.
            url = f"http://127.0.0.1:{_free_port()}/mcp"
            deadlines = dict(DEADLINES, connect_timeout_s=1.0, budget=Budget(None, 0.05, 0.2))
            with pytest.raises(OperationTimeout, match=r"timed out after 1 s \(\d+ attempts; last"):
                async with open_tool_session(url, _sdk_http, wire=wire, **deadlines):
                    raise AssertionError("connected to nothing")


@pytest.mark.slow
@pytest.mark.parametrize("client", ["thin", "sdk"])
async def test_a_stream_kept_open_after_its_response_is_answered_at_the_response(
    client: str,
) -> None:
    """The spec lets a server keep a POST's event stream open after the response;
    the thin client read every stream to its end, so each call waited out
    ``call_tool_s``. Both clients return at the response event and leave the
    stream (which the server sees), and the session goes on."""
    answer = _text_answer(b"here already")
    deadlines = dict(DEADLINES, call_timeout_s=600.0)  # never what ends a call here
    async with (
        serving(
            json_response=False, raw={"lingering": answer}, raw_events=True, raw_kept_open=True
        ) as (url, front),
        Wire() as wire,
    ):
        with anyio.fail_after(60):
            async with open_tool_session(
                url, _sdk_http, wire=wire if client == "thin" else None, **deadlines
            ) as session:
                assert isinstance(session._client, ThinClient if client == "thin" else SdkClient)
                for _ in range(2):
                    assert (await session.call("lingering", {})).text == "here already"
                    assert await front.departures.receive() == "lingering"  # it left
                assert (await session.call("echo", {"text": "next"})).text == "next"


class Lingering:
    """ASGI in front of the SDK's app (JSON answers): each POST's answer is sent as
    an event stream instead (a comment, the answer's event), which then stays open
    until the client leaves it, as the spec allows. ``served`` counts those
    streams, ``open`` those not left yet; :meth:`all_left` waits until none is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.served = 0
        self.open = 0
        self._left = anyio.Event()

    async def all_left(self) -> None:
        while self.open:
            await self._left.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        start: Message = {}
        body = b""

        async def kept(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start":
                start = message
            else:
                body += message.get("body", b"")

        await self.app(scope, receive, kept)
        headers = dict(start.get("headers", []))
        if start.get("status") != 200 or headers.get(b"content-type") != b"application/json":
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        self.served += 1
        self.open += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            event = b": an answer follows\n\nevent: message\ndata: " + body + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            self.open -= 1
            self._left.set()
            self._left = anyio.Event()


@pytest.mark.slow
@pytest.mark.parametrize("client", ["thin", "sdk"])
async def test_a_server_keeping_every_stream_open_serves_a_whole_session(client: str) -> None:
    """The probe, the listing and each call return at their answer's event, the
    streams they leave are closed (the server sees each client leave)."""
    app = tools_server().streamable_http_app(
        json_response=True,
        stateless_http=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    front = Lingering(app)
    deadlines = dict(DEADLINES, connect_timeout_s=600.0, call_timeout_s=600.0)
    deadlines["list_timeout_s"] = 600.0  # never what ends a request here
    async with serve_asgi(front) as base, Wire() as wire:
        with anyio.fail_after(60):
            async with open_tool_session(
                f"{base}/mcp", _sdk_http, wire=wire if client == "thin" else None, **deadlines
            ) as session:
                assert isinstance(session._client, ThinClient if client == "thin" else SdkClient)
                assert "echo" in {spec.name for spec in await session.list_tools()}
                for text in ("one", "two"):
                    assert (await session.call("echo", {"text": text})).text == text
                assert (await session.call("broken", {})).is_error
            await front.all_left()
    assert front.served >= 5  # discover, list, three calls: each left at its answer


class Redirecting:
    """ASGI in front of an app: ``/elsewhere`` is redirected (307) to the same
    server under another host name (``localhost`` for ``127.0.0.1``), ``/moved``
    to ``/mcp`` on its own origin; the rest goes to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.base = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in ("/elsewhere", "/moved"):
            await self.app(scope, receive, send)
            return
        target = self.base.replace("127.0.0.1", "localhost") if path == "/elsewhere" else ""
        headers = [(b"location", f"{target}/mcp".encode()), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 307, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


@pytest.mark.slow
@pytest.mark.parametrize("client", ["thin", "sdk"])
async def test_a_redirect_to_another_host_fails_the_connect_at_once_naming_both_hosts(
    client: str,
) -> None:
    """Neither client follows it (the SDK's rule: within the URL's origin only), and
    the same request is redirected again: it was retried for all of
    ``mcp_connect_s``. A redirect within the origin still leads to the server."""
    app = tools_server().streamable_http_app(
        json_response=True,
        stateless_http=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    front = Redirecting(app)
    retries: list[Retry] = []
    deadlines = dict(DEADLINES, connect_timeout_s=5.0, budget=Budget(None, 0.05, 0.2))
    async with serve_asgi(front) as base, Wire() as wire:
        front.base = base
        mine = wire if client == "thin" else None
        with anyio.fail_after(30), pytest.raises(ToolsError) as failed:
            async with open_tool_session(
                f"{base}/elsewhere", _sdk_http, wire=mine, report=retries.append, **deadlines
            ):
                raise AssertionError("followed a redirect to another host")
        with anyio.fail_after(30):
            async with open_tool_session(f"{base}/moved", _sdk_http, wire=mine, **deadlines) as s:
                assert (await s.call("echo", {"text": "moved"})).text == "moved"
    here = base.removeprefix("http://")
    there = here.replace("127.0.0.1", "localhost")
    assert retries == [] and not failed.value.transient
    assert str(failed.value) == (
        f"cannot open an MCP session at {base}/elsewhere: it redirects to http://{there}/mcp,"
        f" on another host ({here} -> {there}), and an MCP client follows a redirect only"
        " within the URL's own origin: use that URL as the endpoint if it is the intended"
        " server"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
async def test_one_open_thin_session_holds_far_fewer_tracked_objects_than_an_sdk_session() -> None:
    async with serving(json_response=True) as (url, _), Wire() as wire, _sdk_http() as http:
        # Warm both paths (imports, caches, the Wire's connection, the first
        # call's validators), then count: the fewest of two, since the server
        # runs in this process and its own objects come and go in the count.
        for client in (wire, None):
            async with open_tool_session(url, http, wire=client, **DEADLINES) as warm:
                await warm.list_tools()
                await warm.call("echo", {"text": "x"})

        async def held(client: Wire | None) -> int:
            gc.collect()
            before = len(gc.get_objects())
            async with open_tool_session(url, http, wire=client, **DEADLINES) as session:
                await session.list_tools()
                await session.call("echo", {"text": "x"})
                gc.collect()
                during = len(gc.get_objects())
            return during - before

        thin = min([await held(wire) for _ in range(2)])
        sdk = min([await held(None) for _ in range(2)])
    print(f"GC-tracked objects held by one open session: thin {thin}, SDK {sdk}")
    assert thin * 10 < sdk


#: Whole answers to a ``tools/call`` that Python's json module reads one way and
#: the SDK's parser (pydantic-core's) another, or that both read alike.
def _text_answer(text: bytes, after: bytes = b"") -> bytes:
    head = b'{"jsonrpc":"2.0","id":@ID@,"result":{"resultType":"complete",'
    return head + b'"content":[{"type":"text","text":"' + text + b'"}]}}' + after


ODD_ANSWERS: dict[str, bytes] = {
    # A file name that is not UTF-8, as a server that escapes surrogates writes it.
    "lone_low_surrogate": _text_answer(rb"report-\udc80.txt"),
    "lone_high_surrogate": _text_answer(rb"report-\ud83d.txt"),
    "surrogate_in_a_key": (
        b'{"jsonrpc":"2.0","id":@ID@,"result":{"content":[],"structuredContent":{"\\udcff":1}}}'
    ),
    "a_surrogate_pair": _text_answer(rb"smile \ud83d\ude00"),  # valid: both read it
    "trailing_data": _text_answer(b"ok", after=b' {"jsonrpc":"2.0"}'),
    "trailing_whitespace": _text_answer(b"ok", after=b" \r\n\t"),
    "byte_order_mark": b"\xef\xbb\xbf" + _text_answer(b"ok"),
    "invalid_utf8": _text_answer(b"caf\xe9"),
    "a_float_id": _text_answer(b"ok").replace(b"@ID@", b"@ID@.0"),
    "duplicate_keys": (
        b'{"jsonrpc":"2.0","id":@ID@,"result":{"resultType":"complete",'
        b'"content":[{"type":"text","text":"first"}],'
        b'"content":[{"type":"text","text":"second"}]}}'
    ),
    "infinity": (
        b'{"jsonrpc":"2.0","id":@ID@,"result":{"content":[],"structuredContent":{"x":Infinity}}}'
    ),
    "deep_nesting": (
        b'{"jsonrpc":"2.0","id":@ID@,"result":{"resultType":"complete","content":[],'
        b'"structuredContent":' + b"[" * 300 + b"]" * 300 + b"}}"
    ),
    # The modern surface wants a resultType: the SDK's client refuses a result without.
    "no_result_type": b'{"jsonrpc":"2.0","id":@ID@,"result":{"content":[]}}',
    "an_error_with_a_surrogate": (
        b'{"jsonrpc":"2.0","id":@ID@,"error":{"code":-32000,"message":"no \\udc80"}}'
    ),
}


def _idless(seen: Outcome) -> Outcome:
    """An outcome without the numbers its message quotes: the clients number their
    requests apart, and an id's digits move the columns a parse error names."""
    if isinstance(seen, tuple):
        return (seen[0], re.sub(r"\d+", "N", seen[1]), seen[2])
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("events", [False, True], ids=["json", "sse"])
async def test_answers_the_sdk_s_json_parser_refuses_are_refused_alike(events: bool) -> None:
    """A lone surrogate escape (a file name that is not UTF-8) was a result on the thin
    client, whose text then crashed the run's journal; the SDK client refuses the
    message as not JSON (a ``tool_failure``). Every odd answer is read alike."""
    with anyio.fail_after(60):
        async with (
            serving(json_response=True, raw=ODD_ANSWERS, raw_events=events) as (url, _),
            both(url) as (thin, sdk),
        ):
            assert isinstance(thin._client, ThinClient)
            seen = {}
            for name in ODD_ANSWERS:
                mine, theirs = await outcome(thin, name, {}), await outcome(sdk, name, {})
                assert _idless(mine) == _idless(theirs), name
                seen[name] = mine
    where = "SSE message" if events else "JSON response"
    for name in ("lone_low_surrogate", "lone_high_surrogate", "surrogate_in_a_key"):
        failed = seen[name]
        assert isinstance(failed, tuple), name
        assert failed[0] == "ToolCallFailed" and failed[2], name
        assert f"Failed to parse {where}" in failed[1] and "Invalid JSON" in failed[1], name
    assert isinstance(seen["a_surrogate_pair"], ToolResult)
    assert seen["a_surrogate_pair"].text == "smile \U0001f600"
    assert isinstance(seen["duplicate_keys"], ToolResult)
    assert seen["duplicate_keys"].text == "second"
    assert isinstance(seen["trailing_data"], tuple) and isinstance(seen["deep_nesting"], tuple)


# -- the thin client's reading of answers, without a server -----------------------


def _response(status: int, kind: str, body: bytes, **headers: str) -> Response:
    return Response(status, {"content-type": kind, **headers}, body)


def test_an_event_stream_answer_skips_notifications_comments_and_pings() -> None:
    events = (
        b": ping\r\n\r\n"
        b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/message",\r\n'
        b'data: "params":{"level":"info","data":"x"}}\r\n\r\n'
        b"id: 7\nevent: message\ndata:\n\n"
        b'event: other\ndata: {"jsonrpc":"2.0","id":1,"result":{"wrong":true}}\n\n'
        b'data: {"jsonrpc":"2.0","id":1,"result":{"ok":1}}'
    )
    assert mcp_answers.answer(_response(200, "text/event-stream", events)) == {"ok": 1}


def test_an_event_stream_is_parsed_as_it_arrives_and_ends_at_its_response() -> None:
    """Fed in any pieces (one byte at a time: a CRLF split between two), the parser
    gives the response as soon as its event is complete, whatever follows."""
    before = (
        b": ping\r\n\r\n"
        b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/progress",\r\n'
        b'data: "params":{"progressToken":1,"progress":1}}\r\n\r\n'
        b"id: 7\revent: message\rdata:\r\r"
        b'data: {"jsonrpc":"2.0","id":1,"result":{"ok":"caf\xc3\xa9"}}\r\n'
    )
    for size in (1, 2, 3, 7, len(before)):
        events = mcp_answers.Events()
        pieces = [before[i : i + size] for i in range(0, len(before), size)]
        assert all(events.feed(piece) is None for piece in pieces), size
        # The blank line that ends the response's event; the stream may go on.
        assert events.feed(b"\r") is None  # a CR that may be the start of a CRLF
        assert events.feed(b"\ndata: never read\n\n") == {"ok": "café"}, size


def test_answers_that_are_not_responses_get_the_sdk_transport_s_errors() -> None:
    cases = [
        (_response(202, "", b""), -32600, "server answered a request with 202 Accepted"),
        (_response(404, "text/plain", b"no"), -32601, "Not Found"),
        (
            _response(503, "application/json", b'{"detail":"starting"}'),
            -32603,
            "Server returned an error response",
        ),
        (_response(200, "text/html", b"<html>"), -32600, "Unexpected content type: text/html"),
        (
            _response(200, "text/event-stream", b'data: {"jsonrpc":"2.0","method":"x"}\n\n'),
            -32000,
            "SSE stream ended without a response",
        ),
        (
            _response(
                400,
                "application/json",
                b'{"jsonrpc":"2.0","id":null,"error":{"code":-32602,"message":"bad"}}',
            ),
            -32602,
            "bad",
        ),
    ]
    for response, code, message in cases:
        with pytest.raises(MCPError) as caught:
            mcp_answers.answer(response)
        assert (caught.value.code, caught.value.message) == (code, message)


def test_a_result_of_the_usual_shape_is_the_model_the_sdk_s_validation_makes() -> None:
    """The fast path builds exactly what validation builds, fields set included; any
    other shape is left to validation (the version's surface first, which wants a
    ``resultType``: the SDK client refuses a result without one)."""
    plain = [
        {"content": [{"type": "text", "text": "ok"}], "resultType": "complete"},
        {"content": [], "isError": True, "resultType": "complete"},
        {
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "structuredContent": {"n": 1, "xs": [1, 2]},
            "isError": False,
            "resultType": "complete",
        },
        {
            "content": [{"type": "text", "text": "x"}],
            "structuredContent": None,
            "resultType": "complete",
        },
        {  # what the SDK's own servers send: their serverInfo in every result
            "content": [{"type": "text", "text": "x"}],
            "isError": False,
            "resultType": "complete",
            "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "s", "version": ""}},
        },
        {"content": [], "resultType": "complete", "_meta": {"k": [1, {"n": None}]}},
    ]
    for raw in plain:
        built = mcp_results.plain_result(raw)
        assert built is not None, raw
        validated = CallToolResult.model_validate(raw, by_name=False)
        assert built == validated and built.model_fields_set == validated.model_fields_set
        assert normalise(built) == normalise(validated)
    others = [
        {"content": [{"type": "image", "data": "aGk=", "mimeType": "image/png"}]},
        {"content": [{"type": "text", "text": "x", "annotations": {"priority": 1}}]},
        {"content": [{"type": "text", "text": 3}]},
        {"content": "ok"},
        {"content": [], "isError": "no"},
        {"content": [], "_meta": {"k": 1}},  # no resultType
        {"content": [], "resultType": "complete", "_meta": 5},
        {"content": [], "ttlMs": -5},
        {"content": [], "resultType": "input_required"},
        {"structuredContent": {}},
        {"content": [{"type": "text", "text": "ok"}]},  # no resultType
    ]
    for raw in others:
        assert mcp_results.plain_result(raw) is None, raw
    # Every version's surface takes what the fast path builds without it.
    for (method, version), _ in mcp_methods.SERVER_RESULTS.items():
        if method == "tools/call":
            for raw in plain:
                mcp_results.check_surface(method, version, raw)


@pytest.mark.slow
@pytest.mark.parametrize("events", [False, True], ids=["json", "sse"])
async def test_a_response_to_another_request_s_id_is_never_this_call_s_result(
    events: bool,
) -> None:
    """A server off by one (OpenEnv's timed-out receive) answers a call with another
    request's response: read as this call's result, a rollout scores on another call's
    answer. The thin client took the first response whatever its id; now it refuses
    one to another id at once. The SDK client fails a JSON one too (its session drops
    the stray response and waits out its read timeout), but takes one on the POST's
    own event stream as the answer whatever its id: there the thin client is the
    stricter of the two, on purpose."""
    stray = {"stray": _text_answer(b"someone else's answer").replace(b"@ID@", b"@ID@0")}
    with anyio.fail_after(60):
        async with (
            serving(json_response=True, raw=stray, raw_events=events) as (url, _),
            both(url, call_timeout_s=1.0) as (thin, sdk),
        ):
            assert isinstance(thin._client, ThinClient)
            mine, theirs = await outcome(thin, "stray", {}), await outcome(sdk, "stray", {})
    assert isinstance(mine, tuple) and mine[0] == "ToolCallFailed", mine
    assert "with a response to request" in mine[1]
    if events:
        assert isinstance(theirs, ToolResult) and theirs.text == "someone else's answer"
    else:
        assert isinstance(theirs, tuple) and theirs[0] == "ToolCallFailed", theirs
