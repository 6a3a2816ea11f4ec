"""The HTTP side of a chat policy: its routes, and POSTs retried until an answer.

:class:`ChatTransport` sends a request body to the server a
:class:`~fleetroll.policies.servers.PolicyServers` chooses, reads the answer
up to a cap, and retries what is worth retrying (408/409/429/5xx, connection
errors) with full-jitter backoff inside the caller's deadline, telling the
servers how each call went. :func:`endpoint` names a server's routes: chat
completions, and token-in's completion with a token prompt and ``/tokenize``.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

import anyio
import httpx
from pydantic import SecretStr

import fleetroll._internal.retrying as retrying
from fleetroll._internal.excerpts import error_excerpt as _excerpt
from fleetroll._internal.retrying import Decision, decide, retry_after_s, transient_status
from fleetroll.errors import PolicyError
from fleetroll.policies.servers import Affinity, PolicyServers, Server
from fleetroll.policies.streaming import sse_data

__all__ = [
    "ALSO_TRANSIENT",
    "NO_ROUTE",
    "OPERATION",
    "ChatTransport",
    "Endpoint",
    "EventStream",
    "endpoint",
]

#: The operation a policy's errors and retries are reported as.
OPERATION = "policy"
#: Statuses worth trying again: rate limits, timeouts and server-side failures.
#: OpenAI-compatible servers answer 409 for a lock that timed out: worth another try.
ALSO_TRANSIENT = frozenset({409})
#: What a server without token-in's routes answers them.
NO_ROUTE = frozenset({404, 405})
_BEARER = re.compile(r"(?i)bearer\s+[^\s\"',;]+")
#: Closing a failed attempt's stream: bounded, shielded. Not a setting: closing a
#: response does no I/O worth waiting for longer.
_CLOSE_S = 5.0

#: The routes of a policy server: its chat completions, and token-in's
#: completion with a token prompt and vLLM's ``/tokenize`` (at the server's
#: root, not under ``/v1``), or (``token_in = "completions"``) its completions.
Endpoint = Literal["chat", "tokens", "tokenize", "completions"]


def endpoint(server: Server, kind: Endpoint, *, shown: bool = True) -> str:
    """``server``'s ``kind`` endpoint: as shown (no credentials), or as called."""
    base = server.name if shown else server.url
    if kind == "tokenize":
        return base.removesuffix("/v1") + "/tokenize"
    if kind == "completions":
        return base + "/completions"
    return base + ("/chat/completions/tokens" if kind == "tokens" else "/chat/completions")


class ChatTransport:
    """POSTs a policy's requests to its servers, with its key, budget and cap.

    Args:
        servers: where each call goes (:mod:`fleetroll.policies.servers`).
        client: the HTTP client (its owner closes it).
        api_key: sent as ``Authorization: Bearer``; None sends no header.
        budget: tries in all and the backoff between them (a longer
            Retry-After from the server wins; a retry that could not start
            before the deadline is not made). Each retry is reported as
            :func:`fleetroll._internal.retrying.attempts` says (in a rollout: a
            ``fleet_retry`` event).
        max_answer_bytes: bytes of one answer (or error body) read, counted
            as they arrive.
    """

    def __init__(
        self,
        servers: PolicyServers,
        *,
        client: httpx.AsyncClient,
        api_key: SecretStr | None,
        budget: retrying.Budget,
        max_answer_bytes: int,
    ) -> None:
        self.servers = servers
        self.client = client
        self.budget = budget
        self.max_answer_bytes = max_answer_bytes
        self._api_key = api_key

    def encode(self, body: Mapping[str, Any], url: str) -> bytes:
        """``body`` as JSON (a request to ``url``, named in the error).

        Raises:
            PolicyError: the body cannot be encoded (not transient).
        """

        def mapping_to_dict(value: object) -> object:
            if isinstance(value, Mapping):
                return dict(value)
            raise TypeError(f"{type(value).__name__} is not JSON serializable")

        try:
            return json.dumps(body, default=mapping_to_dict, ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:
            raise PolicyError(
                f"the request to {url} cannot be encoded as JSON: {exc}",
                operation=OPERATION,
                transient=False,
            ) from None

    def redact(self, text: str) -> str:
        """Remove the API key (and any bearer token an error body echoed)."""
        if self._api_key is not None and (secret := self._api_key.get_secret_value()):
            text = text.replace(secret, "***")
        return _BEARER.sub("Bearer ***", text)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.get_secret_value()}"
        return headers

    async def post(
        self,
        content: bytes,
        *,
        deadline: float,
        affinity: Affinity | None,
        kind: Endpoint = "chat",
    ) -> tuple[Any, Server]:
        """POST to the ``kind`` endpoint until an answer, a permanent failure, or
        no retries or time left.

        Each attempt goes to the server :attr:`servers` chooses for ``affinity``
        (the rollout's own, unless it was ejected) and tells it how it went.
        Returns the decoded answer and the server that gave it.

        Raises:
            PolicyError: transient for 408/409/429/5xx, connection errors and
                the deadline once the budget is spent (the message says which
                attempt it was); not transient for other statuses, an answer
                over ``max_answer_bytes`` or one that is not JSON.
        """
        budget = self.budget
        tries = 0
        last: httpx.Response | None = None

        def decision(exc: BaseException) -> Decision:
            if not isinstance(exc, PolicyError):
                return decide(exc)
            if last is None:  # no answer: a transport failure
                return Decision(exc.transient)
            return Decision(exc.transient, last.status_code, retry_after_s(last.headers))

        try:
            async for attempt in retrying.attempts(
                "policy", budget, deadline=deadline, classify=decision
            ):
                with attempt:
                    tries, last = attempt.num, None
                    async with self.servers.call(affinity) as server:
                        url, shown = endpoint(server, kind, shown=False), endpoint(server, kind)
                        try:
                            async with self.client.stream(
                                "POST", url, content=content, headers=self._headers()
                            ) as response:
                                body = await self._read(response, shown)
                        except httpx.TransportError as exc:
                            self.servers.failed(server)
                            raise self._unreachable(shown, exc) from exc
                        if response.status_code >= 500:
                            self.servers.failed(server)
                        else:  # it answered: a 4xx is the request's fault, not the server's
                            self.servers.succeeded(server)
                        if not response.is_success:
                            last = response
                            raise self._refused(response, body, server, kind)
            return self._decode(response.status_code, body, shown), server
        except PolicyError as exc:
            raise _counted(exc, tries, budget) from exc.__cause__

    @asynccontextmanager
    async def stream(
        self, content: bytes, *, deadline: float, affinity: Affinity | None
    ) -> AsyncIterator[EventStream]:
        """POST a streamed chat completion (``content`` says ``stream: true``): the
        events as they come, once the first has come.

        Retried as :meth:`post` is until the server's first event (or its whole
        answer: a server that answers one JSON body to a streamed request is
        :attr:`EventStream.whole`); a failure after it is the call's, never a
        silent re-send. The server is held (its call cap) for the block.

        Raises:
            PolicyError: as :meth:`post`, on entering; from the events, the
                stream broke (transient), or passed ``max_answer_bytes`` or
                sent something that is not a chunk (not transient).
        """
        budget = self.budget
        tries = 0
        last: httpx.Response | None = None

        def decision(exc: BaseException) -> Decision:
            if not isinstance(exc, PolicyError):
                return decide(exc)
            if last is None:  # no answer, or a stream that broke before its first chunk
                return Decision(exc.transient)
            return Decision(exc.transient, last.status_code, retry_after_s(last.headers))

        opened: EventStream | None = None
        stack = AsyncExitStack()
        try:
            async for attempt in retrying.attempts(
                "policy", budget, deadline=deadline, classify=decision
            ):
                with attempt:
                    tries, last, opened = attempt.num, None, None
                    stack = AsyncExitStack()
                    try:
                        server = await stack.enter_async_context(self.servers.call(affinity))
                        url, shown = endpoint(server, "chat", shown=False), endpoint(server, "chat")
                        headers = self._headers() | {"Accept": "text/event-stream"}
                        try:
                            response = await stack.enter_async_context(
                                self.client.stream("POST", url, content=content, headers=headers)
                            )
                            if not response.is_success:
                                body = await self._read(response, shown)
                            elif response.headers.get("content-type", "").startswith(
                                "text/event-stream"
                            ):
                                events = EventStream(self, response, server, shown)
                                await events.first()  # retried until it comes
                                opened = events
                            else:  # one whole answer: relayed as such
                                body = await self._read(response, shown)
                                whole = self._decode(response.status_code, body, shown)
                                opened = EventStream(self, response, server, shown, whole=whole)
                        except httpx.TransportError as exc:
                            self.servers.failed(server)
                            raise self._unreachable(shown, exc) from exc
                        if response.status_code >= 500:
                            self.servers.failed(server)
                        else:
                            self.servers.succeeded(server)
                        if not response.is_success:
                            last = response
                            raise self._refused(response, body, server, "chat")
                    finally:
                        if opened is None:  # this attempt failed: its server and stream go
                            with anyio.move_on_after(_CLOSE_S, shield=True):
                                await stack.aclose()
        except PolicyError as exc:
            raise _counted(exc, tries, budget) from exc.__cause__
        assert opened is not None, "the attempts ended with an answer"
        async with stack:
            yield opened

    def _unreachable(self, shown: str, exc: httpx.TransportError) -> PolicyError:
        """A server that could not be reached (transient): its text can hold the
        URL, never the headers; redacted anyway."""
        problem = f"could not reach {shown}: {type(exc).__name__}: {exc}"
        return PolicyError(self.redact(problem), operation=OPERATION, transient=True)

    def _refused(
        self, response: httpx.Response, body: bytes, server: Server, kind: Endpoint
    ) -> PolicyError:
        """The error of a ``kind`` call ``server`` refused (its status, an excerpt)."""
        shown = endpoint(server, kind)
        status = response.status_code
        problem = f"{shown} answered HTTP {status}: {_excerpt(body)}"
        if kind == "completions" and status in NO_ROUTE:
            problem += (
                '; policy.token_in = "completions" needs a server with'
                f" POST {shown}: serve one or set policy.token_in = false"
            )
        elif kind != "chat" and status in NO_ROUTE:
            problem += (
                "; policy.token_in needs a server with POST"
                f" {endpoint(server, 'tokens')} and"
                f" {endpoint(server, 'tokenize')} (prime-rl's vLLM"
                " server): serve one or set policy.token_in = false"
            )
        return PolicyError(
            self.redact(problem),
            operation=OPERATION,
            transient=transient_status(status) or status in ALSO_TRANSIENT,
        )

    async def _read(self, response: httpx.Response, url: str) -> bytes:
        """The answer's body, counted as it arrives, up to ``max_answer_bytes``.

        Raises:
            PolicyError: the body passed the cap (not transient: the same
                request would answer as much again); the connection is closed
                with the response, the rest never read.
        """
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():  # decoded: a compressed bomb counts whole
            size += len(chunk)
            if size > self.max_answer_bytes:
                raise PolicyError(
                    f"{url} answered HTTP {response.status_code} with a body over"
                    f" policy.max_answer_bytes ({self.max_answer_bytes} bytes): reading"
                    " stopped there and the connection was closed",
                    operation=OPERATION,
                    transient=False,
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _decode(self, status: int, body: bytes, url: str) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise PolicyError(
                self.redact(
                    f"{url} answered HTTP {status} with a body that is not JSON: {_excerpt(body)}"
                ),
                operation=OPERATION,
                transient=False,
            ) from None


def _counted(exc: PolicyError, tries: int, budget: retrying.Budget) -> PolicyError:
    """``exc`` as the call's last word: a transient one says which attempt it was."""
    if not exc.transient:
        return exc
    of = f"attempt {tries} of {budget.attempts}"
    if budget.attempts is not None and tries < budget.attempts:
        of += "; a retry would pass the policy deadline"
    return PolicyError(f"{exc} ({of})", operation=OPERATION, transient=True)


class EventStream:
    """A streamed chat completion's events, once the first came
    (:meth:`ChatTransport.stream`).

    Attributes:
        server: the server answering.
        whole: the server's one answer, when it answered the streamed request
            with a JSON body (no events then).
    """

    def __init__(
        self,
        transport: ChatTransport,
        response: httpx.Response,
        server: Server,
        shown: str,
        *,
        whole: Any = None,
    ) -> None:
        self.server = server
        self.whole = whole
        self._transport = transport
        self._response = response
        self._shown = shown
        self._size = 0
        self._events = sse_data(self._counted()) if whole is None else None
        self._first: dict[str, Any] | None = None

    async def _counted(self) -> AsyncIterator[bytes]:
        cap = self._transport.max_answer_bytes
        async for chunk in self._response.aiter_bytes():
            self._size += len(chunk)
            if self._size > cap:
                raise PolicyError(
                    f"{self._shown} streamed an answer over policy.max_answer_bytes ({cap}"
                    " bytes): reading stopped there and the connection was closed",
                    operation=OPERATION,
                    transient=False,
                )
            yield chunk

    async def _next(self) -> dict[str, Any] | None:
        """The next chunk; None at ``[DONE]``.

        Raises:
            PolicyError: the stream broke, or ended before ``[DONE]`` (transient).
        """
        assert self._events is not None
        try:
            data = await anext(self._events, None)
        except httpx.TransportError as exc:
            problem = f"the stream from {self._shown} broke: {type(exc).__name__}: {exc}"
            raise PolicyError(
                self._transport.redact(problem), operation=OPERATION, transient=True
            ) from exc
        if data is None:
            raise PolicyError(
                f"the stream from {self._shown} ended before its 'data: [DONE]'",
                operation=OPERATION,
                transient=True,
            )
        if data.strip() == b"[DONE]":
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if isinstance(chunk, dict) and "error" in chunk:
            problem = f"{self._shown} failed while streaming: {_excerpt(data)}"
            raise PolicyError(self._transport.redact(problem), operation=OPERATION, transient=True)
        if not isinstance(chunk, dict):
            problem = f"{self._shown} streamed an event that is not a chunk: {_excerpt(data)}"
            raise PolicyError(self._transport.redact(problem), operation=OPERATION, transient=False)
        return chunk

    async def first(self) -> None:
        """Wait for the first chunk (a stream that ends before it is a broken one)."""
        self._first = await self._next()
        if self._first is None:
            raise PolicyError(
                f"{self._shown} ended its stream ('data: [DONE]') before its first chunk",
                operation=OPERATION,
                transient=True,
            )

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Each chunk, as it comes, until ``[DONE]``.

        Raises:
            PolicyError: as :meth:`ChatTransport.stream` says.
        """
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while self._events is not None and (chunk := await self._next()) is not None:
            yield chunk
