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
from collections.abc import Mapping
from typing import Any, Literal

import httpx
from pydantic import SecretStr

import fleetroll._internal.retrying as retrying
from fleetroll._internal.excerpts import error_excerpt as _excerpt
from fleetroll._internal.retrying import Decision, decide, retry_after_s, transient_status
from fleetroll.errors import PolicyError
from fleetroll.policies.servers import Affinity, PolicyServers, Server

__all__ = ["ALSO_TRANSIENT", "NO_ROUTE", "OPERATION", "ChatTransport", "Endpoint", "endpoint"]

#: The operation a policy's errors and retries are reported as.
OPERATION = "policy"
#: Statuses worth trying again: rate limits, timeouts and server-side failures.
#: OpenAI-compatible servers answer 409 for a lock that timed out: worth another try.
ALSO_TRANSIENT = frozenset({409})
#: What a server without token-in's routes answers them.
NO_ROUTE = frozenset({404, 405})
_BEARER = re.compile(r"(?i)bearer\s+[^\s\"',;]+")

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
                            # Its text can hold the URL, never the headers; redact anyway.
                            problem = f"could not reach {shown}: {type(exc).__name__}: {exc}"
                            raise PolicyError(
                                self.redact(problem), operation=OPERATION, transient=True
                            ) from exc
                        if response.status_code >= 500:
                            self.servers.failed(server)
                        else:  # it answered: a 4xx is the request's fault, not the server's
                            self.servers.succeeded(server)
                        if not response.is_success:
                            last = response
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
                            raise PolicyError(
                                self.redact(problem),
                                operation=OPERATION,
                                transient=transient_status(status) or status in ALSO_TRANSIENT,
                            )
            return self._decode(response.status_code, body, shown), server
        except PolicyError as exc:
            if not exc.transient:
                raise
            of = f"attempt {tries} of {budget.attempts}"
            if budget.attempts is not None and tries < budget.attempts:
                of += "; a retry would pass the policy deadline"
            raise PolicyError(f"{exc} ({of})", operation=OPERATION, transient=True) from (
                exc.__cause__
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
