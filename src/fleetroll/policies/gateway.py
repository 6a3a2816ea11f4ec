"""The OpenAI-compatible gateway an agent of its own talks to (``--agent-command``).

One loopback HTTP server per :class:`Gateway` (one per process in practice),
serving each rollout that acts through a command under its own root::

    POST /r/{token}/v1/chat/completions   (streaming and not)
    GET  /r/{token}/v1/models

``token`` is the rollout's: it is in the URL and is the only API key the
gateway accepts for it (``Authorization: Bearer {token}``); it is never the
real server's key. What a call does is the :class:`Link`'s business (the
rollout's: hold while the policy is paused, forward, record the turn); the
gateway only routes, checks the key and speaks HTTP. A streaming request gets
the server's one answer as Server-Sent Events (one chunk with the whole
message, then a usage chunk when asked, then ``[DONE]``): the turn is recorded
from that answer, so its token ids and logprobs are exactly the server's.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetroll._internal.serving import serve_asgi

__all__ = ["Gateway", "GatewayRefusal", "Link"]


class GatewayRefusal(Exception):
    """A call the gateway answers with an error status (``status``) and ``message``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class Link(Protocol):
    """What the gateway needs of the rollout that owns a token."""

    #: The model name ``/models`` lists.
    model: str

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion for ``body``: the server's answer, recorded.

        Raises:
            GatewayRefusal: the call is refused (the rollout ended, the server failed).
        """
        ...


class Gateway:
    """A loopback OpenAI-compatible server routing ``/r/{token}/v1/...`` to links.

    Use it as an async context manager; :meth:`open` registers a link for
    the length of a block and gives its base URL and key.

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
                Route("/r/{token}/v1/models", self._models, methods=["GET"]),
            ]
        )
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> Gateway:
        self.url = await self._stack.enter_async_context(serve_asgi(self._app, lifespan="off"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.url = None
        await self._stack.aclose()

    @contextmanager
    def open(self, link: Link) -> Iterator[tuple[str, str]]:
        """Serve ``link`` during the block: yields its base URL (``…/v1``) and key.

        After the block its token is unknown: every call is refused (401).
        """
        if self.url is None:
            raise RuntimeError("the gateway is not serving: enter it first")
        token = secrets.token_urlsafe(24)
        self._links[token] = link
        try:
            yield f"{self.url.rstrip('/')}/r/{token}/v1", token
        finally:
            del self._links[token]

    def _link(self, request: Request) -> Link:
        token = request.path_params["token"]
        link = self._links.get(token)
        given = request.headers.get("authorization", "")
        if link is None or not secrets.compare_digest(given, f"Bearer {token}"):
            raise GatewayRefusal(
                401,
                "unknown key or rollout: this gateway serves a rollout only while it acts,"
                " with the OPENAI_BASE_URL and OPENAI_API_KEY it was given",
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

    async def _chat(self, request: Request) -> Response:
        try:
            link = self._link(request)
            body = await self._body(request)
            answer = await link.complete(body)
        except GatewayRefusal as exc:
            return _error(exc)
        if body.get("stream"):
            usage = isinstance(opts := body.get("stream_options"), dict) and opts.get(
                "include_usage"
            )
            return StreamingResponse(
                _events(answer, usage=bool(usage)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(answer)

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
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise GatewayRefusal(400, "the request body has no 'messages' list")
        return body


def _error(exc: GatewayRefusal) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}},
        status_code=exc.status,
    )


async def _events(answer: dict[str, Any], *, usage: bool) -> AsyncIterator[str]:
    """A chat completion as the chunks of a stream (OpenAI's ``chat.completion.chunk``)."""
    base = {
        "id": answer.get("id", "chatcmpl-fleetroll"),
        "object": "chat.completion.chunk",
        "created": answer.get("created", 0),
        "model": answer.get("model"),
    }
    for index, choice in enumerate(answer.get("choices") or []):
        message = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        calls = message.get("tool_calls")
        if calls:
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(calls) if isinstance(call, dict)
            ]
        chunk = {
            "index": choice.get("index", index),
            "delta": delta,
            "finish_reason": choice.get("finish_reason"),
        }
        if "logprobs" in choice:
            chunk["logprobs"] = choice["logprobs"]
        if "token_ids" in choice:
            chunk["token_ids"] = choice["token_ids"]
        yield _sse({**base, "choices": [chunk]})
    if usage and "usage" in answer:
        yield _sse({**base, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
