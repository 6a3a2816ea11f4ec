"""The OpenAI-compatible gateway an agent of its own talks to (``--agent-command``).

One loopback HTTP server per :class:`Gateway` (one per process in practice),
serving each rollout that acts through a command under its own root::

    POST /r/{token}/v1/chat/completions   (streaming and not)
    POST /r/{token}/v1/messages           (Anthropic's Messages API, streaming and not)
    POST /r/{token}/v1/responses          (OpenAI's Responses API, streaming and not)
    GET  /r/{token}/v1/models
    *    /r/{token}/mcp                   (the rollout's MCP relay)

``token`` is the rollout's: it is in the URL and is the only API key the
gateway accepts for it (``Authorization: Bearer {token}``, or ``x-api-key:
{token}`` as the ``anthropic`` SDK sends it); it is never the real server's key.
A Messages call is translated to a chat completion and back
(:mod:`fleetroll.policies.anthropic_messages`), so it is recorded exactly as one;
its errors, an untranslatable request included (400), have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``). A Responses call is
translated the same way (:mod:`fleetroll.policies.openai_responses`); its
errors have that API's shape (``{"error": {"message", "type", "param",
"code"}}``). The MCP relay is reached
by its URL alone (an MCP client
sends no key), and hands the request to the :class:`Link`, which forwards it to
the instance. What a call does is the link's business (the rollout's: hold
while the policy is paused, forward, record the turn); the gateway only
routes, checks the key and speaks HTTP. Every error, an unknown route
included, has OpenAI's shape (``{"error": {"message", "type", "code"}}``)
(Anthropic's under ``/v1/messages``, the Responses API's under ``/v1/responses``).

A call's turn is recorded only once its answer was sent whole to the agent
(:meth:`Pending.received`): an agent that disconnects before (it gave up, its
client timed out) gets no turn, and its call to the server is cancelled.

A streaming request (``stream: true``, in any dialect) is streamed from the
server (:meth:`Link.stream`) and relayed as it comes: each chunk, once it
arrives, as the dialect's events (the server's ``chat.completion.chunk``
as sent; Anthropic's ``message_start``, ``content_block_start``/``_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``)/``_stop``,
``message_delta``, ``message_stop``; the Responses API's ``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ... ``response.completed``). The
turn is recorded from the chunks assembled (:mod:`fleetroll.policies.streaming`),
so its token ids and logprobs are exactly the server's, as for a call not
streamed. A server failing in the stream ends it with the dialect's error event
(``data: {"error": ...}``; ``event: error``) and nothing is recorded. Where the
link answers whole (a server that answers the streamed request with one JSON
body, or a policy whose settings need whole answers:
:attr:`~fleetroll.policies.openai.OpenAIChatPolicy.streams_tokens`), the whole
answer goes as Server-Sent Events (per choice, one chunk with the whole message
and every field the server sent with it; the answer's own top-level fields,
``prompt_token_ids`` among them, on the first chunk; then a usage chunk when
asked, then ``[DONE]``; for the other dialects, their events with each block
whole in one delta).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from typing import Any, Final, NamedTuple, Protocol

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from fleetroll._internal.serving import serve_asgi
from fleetroll.policies import anthropic_messages as anthropic
from fleetroll.policies import openai_responses as responses

__all__ = ["Gateway", "GatewayRefusal", "Link", "Opened", "Pending", "Streaming"]


class GatewayRefusal(Exception):
    """A call the gateway answers with an error status (``status``) and ``message``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class Pending(Protocol):
    """A server's answer on its way to the agent."""

    #: The answer, as the server sent it.
    answer: dict[str, Any]

    def received(self) -> None:
        """The agent got the whole answer: record it (only then)."""
        ...


class Streaming(Protocol):
    """A server's answer streaming to the agent (:meth:`Link.stream`)."""

    #: The server's one answer, when it sent it whole (then :meth:`chunks` is empty).
    whole: dict[str, Any] | None

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Each ``chat.completion.chunk`` as the server sends it.

        Raises:
            GatewayRefusal: the server failed in the stream (the call failed).
        """
        ...

    def answer(self) -> dict[str, Any]:
        """The chat completion the chunks made (or :attr:`whole`), once they ran out."""
        ...

    def received(self) -> None:
        """The agent got the whole answer: record it (only then)."""
        ...


class Link(Protocol):
    """What the gateway needs of the rollout that owns a token."""

    #: The model name ``/models`` lists.
    model: str

    def complete(self, body: dict[str, Any]) -> AbstractAsyncContextManager[Pending]:
        """One chat completion for ``body``: the server's answer, recorded only if
        :meth:`Pending.received` is called within the block (a block left without
        it, by a disconnect or a cancel, records nothing).

        Raises:
            GatewayRefusal: on entering, the call is refused (the rollout ended,
                the server failed).
        """
        ...

    def stream(self, body: dict[str, Any]) -> AbstractAsyncContextManager[Streaming]:
        """:meth:`complete`, streamed: the server's chunks as they come, recorded
        only if :meth:`Streaming.received` is called within the block.

        Raises:
            GatewayRefusal: on entering, as :meth:`complete`.
        """
        ...

    async def relay(
        self, scope: Scope, receive: Receive, send: Send, http: httpx.AsyncClient
    ) -> None:
        """Answer one HTTP request to the rollout's MCP relay (ASGI), forwarding
        it with ``http`` (the gateway's client, shared by its links)."""
        ...


class Opened(NamedTuple):
    """Where a link is served: its OpenAI root, its key and its MCP relay."""

    base_url: str
    key: str
    mcp_url: str

    @property
    def anthropic_base_url(self) -> str:
        """The root an ``anthropic`` client takes (``ANTHROPIC_BASE_URL``; the client
        adds ``/v1/messages``)."""
        return self.base_url.removesuffix("/v1")


class Gateway:
    """A loopback OpenAI-compatible server routing ``/r/{token}/...`` to links.

    Use it as an async context manager; :meth:`open` registers a link for
    the length of a block and gives its base URL, key and MCP relay URL.

    Args:
        max_request_bytes: the largest request body accepted (HTTP 413 past it).
    """

    def __init__(self, *, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes
        self._links: dict[str, Link] = {}
        self.url: str | None = None
        self._app = Starlette(
            routes=[
                Route("/r/{token}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/r/{token}/v1/messages", self._messages, methods=["POST"]),
                Route("/r/{token}/v1/responses", self._responses, methods=["POST"]),
                Route("/r/{token}/v1/models", self._models, methods=["GET"]),
                Route("/r/{token}/mcp", self._mcp, methods=["GET", "POST", "DELETE"]),
            ],
            exception_handlers={HTTPException: _http_error},
        )
        self._stack = AsyncExitStack()
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Gateway:
        # The relays' requests: no timeout of its own (each relayed request has its
        # deadline) and no cap on connections: every acting agent may hold one open
        # (its server's event stream), and a request queued behind them would be
        # charged to its own deadline (a tool call's call_tool_s).
        unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = await self._stack.enter_async_context(
            httpx.AsyncClient(timeout=None, limits=unbounded, follow_redirects=False)
        )
        self.url = await self._stack.enter_async_context(serve_asgi(self._app, lifespan="off"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.url = None
        await self._stack.aclose()

    @contextmanager
    def open(self, link: Link) -> Iterator[Opened]:
        """Serve ``link`` during the block: yields its base URL (``…/v1``), key
        and MCP relay URL.

        After the block its token is unknown: every call is refused (401).
        """
        if self.url is None:
            raise RuntimeError("the gateway is not serving: enter it first")
        token = secrets.token_urlsafe(24)
        self._links[token] = link
        root = f"{self.url.rstrip('/')}/r/{token}"
        try:
            yield Opened(f"{root}/v1", token, f"{root}/mcp")
        finally:
            del self._links[token]

    def _link(self, request: Request, *, key: bool = True) -> Link:
        """The link of the request's token; with ``key``, its key must be the token."""
        token = request.path_params["token"]
        link = self._links.get(token)
        # Compared as bytes: a header is latin-1, and compare_digest refuses
        # strings that are not ASCII (a 500 for a key with an accent).
        given = request.headers.get("authorization", "").encode("latin-1")
        bearer = secrets.compare_digest(given, f"Bearer {token}".encode())
        api_key = request.headers.get("x-api-key", "").encode("latin-1")
        anthropic_key = secrets.compare_digest(api_key, token.encode())
        if link is None or (key and not (bearer or anthropic_key)):
            raise GatewayRefusal(
                401,
                "unknown key or rollout: this gateway serves a rollout only while it acts,"
                " with the OPENAI_BASE_URL and OPENAI_API_KEY (or ANTHROPIC_BASE_URL and"
                " ANTHROPIC_API_KEY) it was given",
                kind="authentication_error",
            )
        return link

    async def _models(self, request: Request) -> Response:
        try:
            link = self._link(request)
        except GatewayRefusal as exc:
            return _error(exc)
        model = {"id": link.model, "object": "model", "created": 0, "owned_by": "fleetroll"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _mcp(self, request: Request) -> Response:
        try:
            link = self._link(request, key=False)
        except GatewayRefusal as exc:
            return _error(exc)
        assert self._http is not None, "serving, so entered"
        return _Relayed(link, self._http)

    async def _chat(self, request: Request) -> Response:
        try:
            link = self._link(request)
            body = await self._body(request)
            if not isinstance(body.get("messages"), list):
                raise GatewayRefusal(400, "the request body has no 'messages' list")
        except GatewayRefusal as exc:
            return _error(exc)
        return _Answer(link, body, body, _encoded, _error, lambda: _ChunkStream(body))

    async def _messages(self, request: Request) -> Response:
        """Anthropic's Messages API: translated to a chat completion and back."""
        try:
            link = self._link(request)
            asked = await self._body(request)
            try:
                body = anthropic.chat_request(asked)
            except anthropic.Untranslatable as exc:
                raise GatewayRefusal(400, str(exc)) from None
        except GatewayRefusal as exc:
            return _anthropic_error(exc)
        return _Answer(
            link, body, asked, _encoded_message, _anthropic_error, anthropic.MessageStream
        )

    async def _responses(self, request: Request) -> Response:
        """OpenAI's Responses API: translated to a chat completion and back."""
        try:
            link = self._link(request)
            asked = await self._body(request)
            try:
                body = responses.chat_request(asked)
            except responses.Untranslatable as exc:
                raise GatewayRefusal(400, str(exc)) from None
        except GatewayRefusal as exc:
            return _responses_error(exc)
        return _Answer(
            link,
            body,
            asked,
            _encoded_response,
            _responses_error,
            lambda: responses.ResponseStream(asked),
        )

    async def _body(self, request: Request) -> dict[str, Any]:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise GatewayRefusal(
                    413,
                    f"the request is over policy.agent_max_request_bytes"
                    f" ({self.max_request_bytes} bytes)",
                )
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            raise GatewayRefusal(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise GatewayRefusal(400, "the request body is not a JSON object")
        return body


class _Relayed(Response):
    """The link's MCP relay answers the request itself."""

    def __init__(self, link: Link, http: httpx.AsyncClient) -> None:
        self.link = link
        self.http = http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.link.relay(scope, receive, send, self.http)


#: How an answer goes out: the server's chat completion and what the agent asked
#: (in its dialect) → the status, headers and body parts.
_Encoder = Callable[
    [dict[str, Any], dict[str, Any]], tuple[int, list[tuple[bytes, bytes]], list[bytes]]
]


class _Incremental(Protocol):
    """A dialect's events for a stream's chunks, as they come."""

    def chunk(self, chunk: dict[str, Any]) -> list[str]: ...

    def end(self, answer: dict[str, Any]) -> list[str]: ...

    def error(self, status: int, message: str, kind: str) -> list[str]: ...


_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class _Answer(Response):
    """A chat completion, asked for while the agent waits and recorded once sent.

    ``body`` is what the server is asked (a chat completion request); ``asked``
    what the agent sent, in its dialect, which ``encode`` answers and ``refuse``
    turns a refusal into. A streamed call (``asked`` says ``stream``) is relayed
    chunk by chunk through ``incremental``'s encoder (:meth:`Link.stream`); a
    server failing in it ends the stream with the encoder's error event. The
    agent's disconnect (watched while the server answers and while the answer
    is sent) cancels the call: nothing is recorded.
    """

    def __init__(
        self,
        link: Link,
        body: dict[str, Any],
        asked: dict[str, Any],
        encode: _Encoder,
        refuse: Callable[[GatewayRefusal], Response],
        incremental: Callable[[], _Incremental],
    ) -> None:
        self.link = link
        self.sent = body
        self.asked = asked
        self.encode = encode
        self.refuse = refuse
        self.incremental = incremental

    async def _whole(self, send: Send, gone: anyio.Event) -> None:
        """Relay a call's answer once the server sent it whole."""
        async with self.link.complete(self.sent) as pending:
            status, headers, parts = self.encode(pending.answer, self.asked)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            for part in parts:
                await send(_more(part))
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b""})
                # uvicorn drops what is sent on a closed connection silently.
                if not gone.is_set():
                    pending.received()

    async def _streamed(self, send: Send, gone: anyio.Event) -> None:
        """Relay a streamed call's chunks as they come (or its whole answer)."""
        async with self.link.stream(self.sent) as pending:
            if pending.whole is not None:
                status, headers, parts = self.encode(pending.whole, self.asked)
                await send({"type": "http.response.start", "status": status, "headers": headers})
            else:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                encoder = self.incremental()
                try:
                    async for chunk in pending.chunks():
                        for part in encoder.chunk(chunk):
                            await send(_more(part.encode()))
                    parts = [part.encode() for part in encoder.end(pending.answer())]
                except GatewayRefusal as exc:  # after the first chunk: the stream's error
                    for part in encoder.error(exc.status, exc.message, exc.kind):
                        await send(_more(part.encode()))
                    await send({"type": "http.response.body", "body": b""})
                    return
            for body in parts:
                await send(_more(body))
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b""})
                if not gone.is_set():  # uvicorn drops what is sent on a closed connection
                    pending.received()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                if self.asked.get("stream"):
                    await self._streamed(send, gone)
                else:
                    await self._whole(send, gone)
            except GatewayRefusal as exc:
                await self.refuse(exc)(scope, receive, send)
            tg.cancel_scope.cancel()


def _more(body: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": body, "more_body": True}


class _ChunkStream:
    """Chat completion chunks relayed as the server sent them (the usage chunk
    only when the agent asked for it), then ``[DONE]``."""

    def __init__(self, asked: dict[str, Any]) -> None:
        opts = asked.get("stream_options")
        self.usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        if not self.usage and not chunk.get("choices") and chunk.get("usage") is not None:
            return []  # the policy asks for the usage (its turn's); the agent did not
        if not self.usage:
            chunk = {k: v for k, v in chunk.items() if k != "usage"}
        return [_sse(chunk)]

    def end(self, answer: dict[str, Any]) -> list[str]:
        return ["data: [DONE]\n\n"]

    def error(self, status: int, message: str, kind: str) -> list[str]:
        return [_sse({"error": {"message": message, "type": kind, "code": status}})]


def _encoded(
    answer: dict[str, Any], asked: dict[str, Any]
) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """The status, headers and body parts of ``answer`` as the agent asked for it."""
    if not asked.get("stream"):
        body = json.dumps(answer, ensure_ascii=False).encode()
        length = str(len(body)).encode()
        return 200, [(b"content-type", b"application/json"), (b"content-length", length)], [body]
    opts = asked.get("stream_options")
    usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    ]
    return 200, headers, [event.encode() for event in _events(answer, usage=usage)]


def _encoded_message(
    answer: dict[str, Any], asked: dict[str, Any]
) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """``answer`` as the Messages API's ``message`` (or its events, for a streamed call)."""
    message = anthropic.message_answer(answer)
    if not asked.get("stream"):
        body = json.dumps(message, ensure_ascii=False).encode()
        length = str(len(body)).encode()
        return 200, [(b"content-type", b"application/json"), (b"content-length", length)], [body]
    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    ]
    return 200, headers, [event.encode() for event in anthropic.message_events(message)]


def _encoded_response(
    answer: dict[str, Any], asked: dict[str, Any]
) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """``answer`` as the Responses API's ``response`` (or its events, for a streamed call)."""
    response = responses.response_answer(answer, asked)
    if not asked.get("stream"):
        body = json.dumps(response, ensure_ascii=False).encode()
        length = str(len(body)).encode()
        return 200, [(b"content-type", b"application/json"), (b"content-length", length)], [body]
    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    ]
    return 200, headers, [event.encode() for event in responses.response_events(response)]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown route, a method not allowed) in OpenAI's
    shape (Anthropic's under ``/v1/messages``, the Responses API's under ``/v1/responses``)."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    # Not the path: it holds the rollout's token.
    said = (
        f"{exc.detail}: this gateway serves POST {{OPENAI_BASE_URL}}/chat/completions,"
        " POST {OPENAI_BASE_URL}/responses, POST {ANTHROPIC_BASE_URL}/v1/messages"
        " and GET {OPENAI_BASE_URL}/models"
    )
    refusal = GatewayRefusal(exc.status_code, said, kind=kind)
    if "/v1/messages" in request.url.path:
        return _anthropic_error(refusal, headers=exc.headers)
    if "/v1/responses" in request.url.path:
        return _responses_error(refusal, headers=exc.headers)
    return _error(refusal, headers=exc.headers)


def _anthropic_error(exc: GatewayRefusal, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        anthropic.error_body(exc.status, exc.message), status_code=exc.status, headers=headers
    )


def _responses_error(exc: GatewayRefusal, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = responses.error_body(exc.message, kind=exc.kind)
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _error(exc: GatewayRefusal, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}},
        status_code=exc.status,
        headers=headers,
    )


#: A completion's top-level fields a chunk has its own value for.
_CHUNK_OWN = frozenset({"id", "object", "created", "model", "choices", "usage"})


def _events(answer: dict[str, Any], *, usage: bool) -> Iterator[str]:
    """A chat completion as the chunks of a stream (OpenAI's ``chat.completion.chunk``).

    Nothing the server sent is dropped: each choice's message fields are its
    chunk's ``delta`` (``reasoning_content`` included; tool calls numbered by
    ``index``), its other fields (``logprobs``, ``token_ids``, ``stop_reason``...)
    are on its chunk, and the answer's own fields (``prompt_token_ids``,
    ``system_fingerprint``...) are on the first chunk, as vLLM streams them.
    """
    base = {
        "id": answer.get("id", "chatcmpl-fleetroll"),
        "object": "chat.completion.chunk",
        "created": answer.get("created", 0),
        "model": answer.get("model"),
    }
    extra = {k: v for k, v in answer.items() if k not in _CHUNK_OWN}
    for index, choice in enumerate(answer.get("choices") or []):
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        delta.update(message if isinstance(message, dict) else {})
        calls = delta.get("tool_calls")
        if calls:
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(calls) if isinstance(call, dict)
            ]
        else:
            delta.pop("tool_calls", None)  # none (null, []): OpenAI's chunks leave it out
        chunk = {k: v for k, v in choice.items() if k != "message"}
        chunk |= {"index": choice.get("index", index), "delta": delta}
        chunk.setdefault("finish_reason", None)
        yield _sse({**base, **extra, "choices": [chunk]})
        extra = {}
    if usage and "usage" in answer:
        yield _sse({**base, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
