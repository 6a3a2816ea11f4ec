"""The policy that asks an OpenAI-compatible ``/chat/completions`` endpoint
(OpenAI, vLLM, SGLang, a proxy in front of a trainer) for each turn: request
encoding, retries, response parsing and the training data a server returns.

Import it from :mod:`fleetroll.policies` or :mod:`fleetroll`; this module holds
its implementation.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType, TracebackType
from typing import Any, Literal, NamedTuple, Self

import httpx
from pydantic import SecretStr

import fleetroll._internal.retrying as retrying
from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.excerpts import error_excerpt as _excerpt
from fleetroll._internal.excerpts import shorten as _shorten
from fleetroll._internal.retrying import Decision, decide, retry_after_s, transient_status
from fleetroll.errors import ContextOverflowError, PolicyError
from fleetroll.policies.servers import (
    Affinity,
    PolicyServers,
    Server,
    ServerLimits,
    current_affinity,
)
from fleetroll.policies.turns import (
    AssistantTurn,
    EncodedMessages,
    Message,
    TokenHistory,
    TokenTurn,
    ToolCall,
    ToolSpec,
    TurnData,
)
from fleetroll.settings import PolicySettings
from fleetroll.tasks import TaskSpec

__all__ = ["ChatPolicyConfig", "OpenAIChatPolicy", "PolicyRecipe"]

_OPERATION = "policy"
_EMPTY: Mapping[str, Any] = MappingProxyType({})
#: Statuses worth trying again: rate limits, timeouts and server-side failures.
#: OpenAI-compatible servers answer 409 for a lock that timed out: worth another try.
_ALSO_TRANSIENT = frozenset({409})
#: What a server without token-in's routes answers them.
_NO_ROUTE = frozenset({404, 405})
#: What servers say when a prompt is longer than the model's context: vLLM ("This
#: model's maximum context length is N tokens"), SGLang ("... exceeds the maximum
#: allowed length", "longer than the model's context length"), OpenAI
#: (``context_length_exceeded``).
_CONTEXT_OVERFLOW = re.compile(
    r"(?i)maximum context length|context[_ ]length[_ ]exceeded"
    r"|longer than the model's context length|exceeds the maximum allowed length"
)
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatPolicyConfig:
    """What an :class:`OpenAIChatPolicy` made from configuration reads: the
    ``[policy]`` section, the key, and its deadlines and waits (from
    ``[timeouts]`` and ``[retries]``), built where things are assembled
    (:func:`fleetroll.pool.rollout_pool.chat_policy_config`)."""

    policy: PolicySettings
    #: ``OPENAI_API_KEY``, sent as ``Authorization: Bearer``.
    api_key: SecretStr | None = field(default=None, repr=False)
    #: ``timeouts.policy_s``: the deadline of one call, retries included.
    timeout_s: float = 300.0
    #: ``timeouts.policy_connect_s``.
    connect_timeout_s: float = 10.0
    #: ``retries.policy_backoff_initial_s`` and ``policy_backoff_max_s``.
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


class PolicyRecipe(NamedTuple):
    """What makes an :class:`OpenAIChatPolicy` in another process (a Ray actor):
    pickled in its place. ``key`` is the policy's own, so a process makes one
    policy per recipe (its HTTP client, its servers' health), not one per rollout.
    ``kind`` is the class that made it (a subclass travels as itself)."""

    key: str
    config: ChatPolicyConfig
    kind: type[OpenAIChatPolicy]

    def make(self) -> OpenAIChatPolicy:
        """The policy, made in this process from its configuration."""
        made = self.kind.from_config(self.config)
        made._recipe = self  # the same key in every process
        return made


class OpenAIChatPolicy:
    """Asks an OpenAI-compatible ``/chat/completions`` endpoint for each turn.

    Use it as an async context manager, or call :meth:`aclose` when done::

        async with OpenAIChatPolicy(base_url="http://127.0.0.1:8000/v1", model="m") as p:
            turn = await p.act(task, messages, tools)

    Args:
        base_url: the API root, e.g. ``https://api.openai.com/v1``.
        servers: many API roots instead of ``base_url`` (one of the two is
            needed; ``servers`` wins): each rollout's calls go to one of them
            as :mod:`fleetroll.policies.servers` says, and each turn records
            the server that answered it (``TurnData.server``).
        model: the ``model`` field of every request.
        api_key: sent as ``Authorization: Bearer``; None sends no header.
        temperature, top_p, max_tokens: sampling parameters, sent when set.
        extra_body: more body fields for every request (vLLM's ``top_k``...);
            they win over the fields above.
        system_prompt: prepended when the transcript does not start with a
            system message.
        timeout_s: the deadline of one :meth:`act`, retries included.
        connect_timeout_s: opening a connection (``timeouts.policy_connect_s``),
            at most ``timeout_s``.
        max_retries: how many times a 408/409/429/5xx answer, a connection error
            or a transport timeout is retried.
        backoff_initial_s, backoff_max_s: exponential backoff between retries
            (full jitter); a longer Retry-After from the server wins. A retry
            that could not start before the deadline is not made. Each retry
            is reported as :func:`fleetroll._internal.retrying.attempts` says (in a
            rollout: a ``fleet_retry`` event).
        http_client: a client to use (and leave open); by default the policy
            makes its own and closes it in :meth:`aclose`.
        return_token_ids: ask for the prompt's and the completion's token ids
            (vLLM's ``return_token_ids``).
        logprobs, top_logprobs: ask for each completion token's logprob and,
            with ``top_logprobs``, that many alternatives per token.
        max_answer_bytes: bytes of one answer (or error body) read, counted
            as they arrive (``policy.max_answer_bytes``); past it reading stops,
            the connection is closed and :meth:`act` raises a PolicyError.
        token_in: from the second call of a rollout on, send the conversation
            as token ids (``policy.token_in``): the last call's prompt and
            completion ids as the server returned them, then the new messages
            as the server's ``/tokenize`` renders them, to
            ``/chat/completions/tokens`` (prime-rl's vLLM route). Implies
            ``return_token_ids``; needs a transcript that keeps token ids
            (:class:`~fleetroll.policies.turns.TokenHistory`, as a rollout's does).

    Raises:
        ValueError: a number is out of range.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        model: str,
        api_key: SecretStr | str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] = _EMPTY,
        system_prompt: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 2,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        http_client: httpx.AsyncClient | None = None,
        return_token_ids: bool = False,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        max_answer_bytes: int = 64 * 1024 * 1024,
        servers: PolicyServers | None = None,
        token_in: bool = False,
    ) -> None:
        if servers is None:
            if base_url is None:
                raise ValueError("give base_url or servers")
            servers = PolicyServers([base_url])
        self.servers = servers
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s}")
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, not {connect_timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, not {max_retries}")
        if backoff_initial_s < 0 or backoff_max_s < 0:
            raise ValueError("backoff_initial_s and backoff_max_s must be >= 0")
        if max_answer_bytes < 1:
            raise ValueError(f"max_answer_bytes must be >= 1, not {max_answer_bytes}")
        self.max_answer_bytes = max_answer_bytes
        #: The first server's endpoint (each call's own is its server's).
        self.url = _endpoint(servers.servers[0], "chat")
        self.token_in = token_in
        return_token_ids = return_token_ids or token_in
        self.model = model
        self._api_key = SecretStr(api_key) if isinstance(api_key, str) else api_key
        self._sampling = {
            name: value
            for name, value in (
                ("temperature", temperature),
                ("top_p", top_p),
                ("max_tokens", max_tokens),
            )
            if value is not None
        }
        # Training data: vLLM answers these with top-level prompt_token_ids,
        # choices[0].token_ids and choices[0].logprobs.content (OpenAI's shape).
        self._training: dict[str, Any] = {}
        if return_token_ids:
            self._training["return_token_ids"] = True
        if logprobs or top_logprobs is not None:
            self._training["logprobs"] = True  # top_logprobs requires it
        if top_logprobs is not None:
            self._training["top_logprobs"] = top_logprobs
        #: Fields the server left out, already warned about (one warning each
        #: per policy, so per run, not per turn).
        self._warned: set[str] = set()
        self._extra_body = dict(extra_body)
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._owns_client = http_client is None
        self._client = http_client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, connect_timeout_s)),
            # The rollout pool bounds concurrency; a second, smaller limit here
            # would only queue turns behind each other.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        #: What makes this policy in another process (:class:`PolicyRecipe`): set
        #: by :meth:`from_config`.
        self._recipe: PolicyRecipe | None = None

    @classmethod
    def from_config(cls, config: ChatPolicyConfig) -> Self:
        """A policy configured by ``config.policy`` (its servers are
        ``policy.servers``: ``base_urls``, or else ``base_url``), with
        ``config``'s key, deadlines and backoffs.

        Pickled (to a Ray actor), it travels as its configuration (:class:`PolicyRecipe`)."""
        policy = config.policy
        limits = ServerLimits(
            max_calls=policy.max_calls_per_server,
            eject_after_failures=policy.eject_after_failures,
            eject_s=policy.eject_s,
        )
        made = cls(
            servers=PolicyServers(policy.servers, limits),
            model=policy.model,
            api_key=config.api_key,
            temperature=policy.temperature,
            top_p=policy.top_p,
            max_tokens=policy.max_tokens,
            extra_body=policy.extra_body,
            system_prompt=policy.system_prompt,
            timeout_s=config.timeout_s,
            connect_timeout_s=config.connect_timeout_s,
            max_retries=policy.max_retries,
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            return_token_ids=policy.return_token_ids or policy.trajectory,
            logprobs=policy.logprobs,
            top_logprobs=policy.top_logprobs,
            max_answer_bytes=policy.max_answer_bytes,
            token_in=policy.token_in,
        )
        made._recipe = PolicyRecipe(uuid.uuid4().hex, config, cls)
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to a Ray actor), a policy travels as its :class:`PolicyRecipe`:
        its HTTP client cannot, and each process needs its own.

        Raises:
            TypeError: the policy was not made with :meth:`from_config`.
        """
        if self._recipe is None:
            raise TypeError(
                "an OpenAIChatPolicy runs in another process (Ray) only when made with"
                " OpenAIChatPolicy.from_config: it is made again there from its configuration"
            )
        return (PolicyRecipe, tuple(self._recipe))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, model={self.model!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client, if the policy made it."""
        if self._owns_client:
            await self._client.aclose()

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """One chat completion, parsed into a turn.

        Tool-call arguments that are not a JSON object do not raise: the call
        comes back with ``arguments_error`` set.

        Raises:
            ContextOverflowError: the server answered that the prompt is longer
                than the model's context.
            PolicyError: the endpoint failed (transient for 408/409/429/5xx,
                connection errors and the deadline, once retries are spent;
                not transient for other statuses), or answered something that
                is not a chat completion (not transient).
        """
        affinity = current_affinity()  # the rollout's, bound by policy_servers.sticky()
        history = messages.last_token_turn() if isinstance(messages, TokenHistory) else None
        sent: list[int] | None = None
        kind: Endpoint
        try:
            with fail_after(self.timeout_s) as scope:
                if self.token_in and history is not None and not self._has_images(messages):
                    body = self._body(messages, tools)
                    added = len(body["messages"]) - len(messages)
                    body["tokens"] = sent = await self._token_prompt(
                        body, history, added=added, deadline=scope.deadline, affinity=affinity
                    )
                    kind, content = "tokens", self._encode(body)
                else:
                    kind, content = "chat", self._request(messages, tools)
                payload, server = await self._post(
                    content, deadline=scope.deadline, affinity=affinity, kind=kind
                )
        except PolicyError as exc:
            if not exc.transient and _CONTEXT_OVERFLOW.search(str(exc)):
                raise ContextOverflowError(str(exc), operation=_OPERATION, transient=False) from exc
            raise
        except TimeoutError:
            where = affinity.server if affinity is not None else None
            url = self.url if where is None else _endpoint(where, "chat")
            raise PolicyError(
                f"no answer from {url} within the policy deadline of {self.timeout_s:g}s"
                " (retries included); raise timeouts.policy_s if the model is just slow",
                operation=_OPERATION,
                transient=True,
            ) from None
        turn = self._parse(payload, url=_endpoint(server, "chat"))
        if sent is not None and turn.data is not None and turn.data.prompt_token_ids is None:
            # The prompt is the ids we sent, whether or not the server echoed them.
            turn = replace(turn, data=replace(turn.data, prompt_token_ids=tuple(sent)))
        if turn.data is None or len(self.servers.servers) == 1:
            return turn  # one server: nothing to say where the turn went
        return replace(turn, data=replace(turn.data, server=server.name))

    async def forward(
        self, body: Mapping[str, Any], *, affinity: Affinity | None = None
    ) -> tuple[dict[str, Any], tuple[AssistantTurn, ...]]:
        """One chat completion for a request someone else wrote (an agent's,
        through :mod:`fleetroll.policies.gateway`): its messages, tools and sampling as
        sent (this policy's ``temperature``, ``top_p``, ``max_tokens`` where it
        sets none), but this policy's ``model``, its training fields
        (``return_token_ids``, ``logprobs``...) asked for as :meth:`act` asks,
        and its ``extra_body`` on top. Streaming is the caller's business: the
        server is asked for one answer.

        Returns the server's answer (as it sent it) and a turn parsed from each
        of its choices (one unless the request asked for ``n`` > 1; the
        ``usage``, which is the call's, on the first only), with the same
        retries, servers and deadline as :meth:`act`.

        Raises:
            PolicyError: as :meth:`act`; ContextOverflowError included.
        """
        sent: dict[str, Any] = dict(self._sampling)
        sent.update((k, v) for k, v in body.items() if k not in ("stream", "stream_options"))
        sent["model"] = self.model
        sent.update(self._training)
        sent.update(self._extra_body)
        try:
            with fail_after(self.timeout_s) as scope:
                payload, server = await self._post(
                    self._encode(sent), deadline=scope.deadline, affinity=affinity
                )
        except PolicyError as exc:
            if not exc.transient and _CONTEXT_OVERFLOW.search(str(exc)):
                raise ContextOverflowError(str(exc), operation=_OPERATION, transient=False) from exc
            raise
        except TimeoutError:
            raise PolicyError(
                f"no answer from {self.url} within the policy deadline of {self.timeout_s:g}s"
                " (retries included); raise timeouts.policy_s if the model is just slow",
                operation=_OPERATION,
                transient=True,
            ) from None
        url = _endpoint(server, "chat")
        turns = [self._parse(payload, url=url)]
        turns += [
            replace(self._parse(payload, url=url, choice=index), usage=None)
            for index in range(1, len(payload["choices"]))  # checked by the first parse
        ]
        if len(self.servers.servers) > 1:
            turns = [
                replace(turn, data=replace(turn.data, server=server.name))
                if turn.data is not None
                else turn
                for turn in turns
            ]
        return payload, tuple(turns)

    # ------------------------------------------------------------- request

    def _body(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> dict[str, Any]:
        sent: list[Message] = list(messages)
        if self.system_prompt is not None and (not sent or sent[0].get("role") != "system"):
            sent.insert(0, {"role": "system", "content": self.system_prompt})
        body: dict[str, Any] = {"model": self.model, "messages": sent}
        if tools:
            # OpenAI rejects tool_choice without tools, so both or neither.
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                }
                for tool in tools
            ]
            body["tool_choice"] = "auto"
        body.update(self._sampling)
        body.update(self._training)
        body.update(self._extra_body)
        return body

    def _request(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> bytes:
        """The request body, reusing each message's encoding when the transcript keeps it."""
        body = self._body(messages, tools)
        if not isinstance(messages, EncodedMessages) or "messages" in self._extra_body:
            return self._encode(body)
        sent = body.pop("messages")
        added = len(sent) - len(messages)  # the system prompt, when we inserted it
        parts = [self._encode(message) for message in sent[:added]]
        parts += [messages.encoded(index) for index in range(len(messages))]
        rest = self._encode(body)  # never empty: it holds "model"
        # One join, so the transcript's bytes are copied once, not once per level.
        pieces = [b'{"messages":[']
        for index, part in enumerate(parts):
            if index:
                pieces.append(b",")
            pieces.append(part)
        pieces += [b"],", rest[1:]]
        return b"".join(pieces)

    def _has_images(self, messages: Sequence[Message]) -> bool:
        """Whether the conversation holds images: those go by messages, not ids
        (vLLM's ``/tokenize`` does not expand image placeholders; verifiers
        falls back the same way). Said once per policy."""
        images = any(
            isinstance(part, Mapping) and part.get("type") == "image_url"
            for message in messages
            if isinstance(content := message.get("content"), list)
            for part in content
        )
        self._warn_once(
            [] if not images or "token_in" in self._warned else ["token_in"],
            "%s: a conversation with images is sent as messages, not token ids (policy.%s is"
            " set, but /tokenize does not expand image placeholders); said once",
        )
        return images

    async def _token_prompt(
        self,
        body: dict[str, Any],
        history: TokenTurn,
        *,
        added: int,
        deadline: float,
        affinity: Affinity | None,
    ) -> list[int]:
        """The prompt as token ids: the last call's prompt and completion exactly
        as the server returned them, then what the template renders after them.

        The new messages' ids are the server's rendering of the whole
        conversation less its rendering up to the last assistant message (the
        delta, as SkyRL and verifiers take it), so a template that re-renders
        earlier turns differently changes nothing already sent.
        """
        messages = body["messages"]
        # ``added``: the system prompt we inserted shifts the transcript's indexes.
        end = history.index + added + 1
        prefix = await self._tokenize(
            body, messages[:end], False, deadline=deadline, affinity=affinity
        )
        full = await self._tokenize(body, messages, True, deadline=deadline, affinity=affinity)
        completion = list(history.completion_token_ids)
        tail: list[int] = []
        if completion and history.finish_reason != "length" and completion[-1] in prefix:
            # What the template adds after the model's end-of-message token
            # (Qwen's newline after <|im_end|>): the model never generated it.
            last = len(prefix) - 1 - prefix[::-1].index(completion[-1])
            tail = prefix[last + 1 :]
        return [*history.prompt_token_ids, *completion, *tail, *full[len(prefix) :]]

    async def _tokenize(
        self,
        body: Mapping[str, Any],
        messages: list[Message],
        generation: bool,
        *,
        deadline: float,
        affinity: Affinity | None,
    ) -> list[int]:
        """vLLM's ``/tokenize`` of a chat: the ids the server's template renders."""
        request: dict[str, Any] = {"model": self.model, "messages": messages}
        if "tools" in body:
            request["tools"] = body["tools"]
        request["add_generation_prompt"] = generation
        answer, server = await self._post(
            self._encode(request), deadline=deadline, affinity=affinity, kind="tokenize"
        )
        tokens = _ints(answer.get("tokens")) if isinstance(answer, dict) else None
        if tokens is None:
            raise PolicyError(
                self._redact(
                    f"{_endpoint(server, 'tokenize')} answered no 'tokens' list"
                    " (policy.token_in needs vLLM's /tokenize):"
                    f" {_shorten(json.dumps(answer, default=str))}"
                ),
                operation=_OPERATION,
                transient=False,
            )
        return list(tokens)

    def _encode(self, body: Mapping[str, Any]) -> bytes:
        def mapping_to_dict(value: object) -> object:
            if isinstance(value, Mapping):
                return dict(value)
            raise TypeError(f"{type(value).__name__} is not JSON serializable")

        try:
            return json.dumps(body, default=mapping_to_dict, ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:
            raise PolicyError(
                f"the request to {self.url} cannot be encoded as JSON: {exc}",
                operation=_OPERATION,
                transient=False,
            ) from None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.get_secret_value()}"
        return headers

    async def _post(
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
        """
        budget = retrying.Budget(self.max_retries + 1, self._backoff_initial_s, self._backoff_max_s)
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
                        url, shown = _endpoint(server, kind, shown=False), _endpoint(server, kind)
                        try:
                            async with self._client.stream(
                                "POST", url, content=content, headers=self._headers()
                            ) as response:
                                body = await self._read(response, shown)
                        except httpx.TransportError as exc:
                            self.servers.failed(server)
                            # Its text can hold the URL, never the headers; redact anyway.
                            problem = f"could not reach {shown}: {type(exc).__name__}: {exc}"
                            raise PolicyError(
                                self._redact(problem), operation=_OPERATION, transient=True
                            ) from exc
                        if response.status_code >= 500:
                            self.servers.failed(server)
                        else:  # it answered: a 4xx is the request's fault, not the server's
                            self.servers.succeeded(server)
                        if not response.is_success:
                            last = response
                            status = response.status_code
                            problem = f"{shown} answered HTTP {status}: {_excerpt(body)}"
                            if kind != "chat" and status in _NO_ROUTE:
                                problem += (
                                    "; policy.token_in needs a server with POST"
                                    f" {_endpoint(server, 'tokens')} and"
                                    f" {_endpoint(server, 'tokenize')} (prime-rl's vLLM"
                                    " server): serve one or set policy.token_in = false"
                                )
                            raise PolicyError(
                                self._redact(problem),
                                operation=_OPERATION,
                                transient=transient_status(status) or status in _ALSO_TRANSIENT,
                            )
            return self._decode(response.status_code, body, shown), server
        except PolicyError as exc:
            if not exc.transient:
                raise
            of = f"attempt {tries} of {budget.attempts}"
            if budget.attempts is not None and tries < budget.attempts:
                of += "; a retry would pass the policy deadline"
            raise PolicyError(f"{exc} ({of})", operation=_OPERATION, transient=True) from (
                exc.__cause__
            )

    # ------------------------------------------------------------ response

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
                    operation=_OPERATION,
                    transient=False,
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _decode(self, status: int, body: bytes, url: str) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise PolicyError(
                self._redact(
                    f"{url} answered HTTP {status} with a body that is not JSON: {_excerpt(body)}"
                ),
                operation=_OPERATION,
                transient=False,
            ) from None

    def _parse(self, payload: Any, *, url: str, choice: int = 0) -> AssistantTurn:
        """The turn of ``payload``'s choice number ``choice`` (the first: the one
        a policy acts on)."""

        def malformed(what: str) -> PolicyError:
            excerpt = _shorten(json.dumps(payload, ensure_ascii=False, default=str))
            return PolicyError(
                self._redact(f"{url} answered a malformed chat completion: {what}: {excerpt}"),
                operation=_OPERATION,
                transient=False,
            )

        if not isinstance(payload, dict):
            raise malformed("the body is not a JSON object")
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices:
            raise malformed("no 'choices'")
        chosen = choices[choice]
        message = chosen.get("message") if isinstance(chosen, dict) else None
        if not isinstance(message, dict):
            raise malformed(f"choices[{choice}] has no 'message' object")

        content = message.get("content")
        if isinstance(content, list):  # some servers answer content parts
            content = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        elif content is not None and not isinstance(content, str):
            raise malformed("message.content is neither a string, parts nor null")

        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise malformed("message.tool_calls is not a list")
        calls = []
        for index, raw in enumerate(raw_calls):
            function = raw.get("function") if isinstance(raw, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(function, dict) or not isinstance(name, str) or not name:
                raise malformed(f"tool_calls[{index}] has no function name")
            call_id = raw.get("id")
            if not isinstance(call_id, str) or not call_id:
                call_id = f"call_{secrets.token_hex(12)}"
            calls.append(_tool_call(call_id, name, function.get("arguments")))

        usage = payload.get("usage")
        return AssistantTurn(
            content=content,
            tool_calls=tuple(calls),
            usage=_int_fields(usage) if isinstance(usage, dict) else None,
            data=self._turn_data(payload, chosen, usage),
        )

    def _turn_data(
        self, payload: dict[str, Any], choice: dict[str, Any], usage: object
    ) -> TurnData:
        """The training data of a completion; what is missing is warned about once."""
        model = payload.get("model")
        finish_reason = choice.get("finish_reason")
        # vLLM: top-level prompt_token_ids, choices[0].token_ids. Some servers and
        # patches put the prompt's ids on the choice.
        prompt_ids = _ints(payload.get("prompt_token_ids", choice.get("prompt_token_ids")))
        completion_ids = _ints(choice.get("token_ids"))
        logprobs, top = _logprobs(choice.get("logprobs"))
        problems = _training_problems(prompt_ids, completion_ids, logprobs, top)
        # A NaN is no number to train on (nor valid JSON): such a list is dropped.
        finite = logprobs if logprobs is None or all(map(math.isfinite, logprobs)) else None
        top_finite = top
        if top is not None and not all(math.isfinite(n) for a in top for _, n in a):
            top_finite = None
        data = TurnData(
            model=model if isinstance(model, str) else None,
            finish_reason=finish_reason if isinstance(finish_reason, str) else None,
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion_ids,
            logprobs=finite,
            top_logprobs=top_finite,
            training_data_error="; ".join(problems) or None,
        )
        self._warn_once(
            [p for p in problems if p.split(":")[0] not in self._warned],
            "%s answered unusable training data (%s): the turn is flagged in the results'"
            " turns (training_data_error); said once per kind, not per turn",
            sep="; ",
        )
        missing = [
            name
            for name, value in (
                ("model", data.model),
                ("finish_reason", data.finish_reason),
                ("usage", usage if isinstance(usage, dict) else None),
            )
            if value is None
        ]
        if "return_token_ids" in self._training:
            missing += [
                name
                for name, value in (
                    ("prompt_token_ids", prompt_ids),
                    ("completion_token_ids", completion_ids),
                )
                if value is None
            ]
        if "logprobs" in self._training and logprobs is None:
            missing.append("logprobs")
        if "top_logprobs" in self._training and top is None:
            missing.append("top_logprobs")
        self._warn_once(
            [name for name in missing if name not in self._warned],
            "%s answered without %s: recorded as null in the results' turns"
            " (said once, not per turn)",
        )
        return data

    def _warn_once(self, new: list[str], message: str, sep: str = ", ") -> None:
        """One warning for what was not said yet (a problem's kind: before its colon)."""
        if new:
            self._warned.update(item.split(":")[0] for item in new)
            _log.warning(message, self.url, sep.join(new))

    def _redact(self, text: str) -> str:
        """Remove the API key (and any bearer token an error body echoed)."""
        if self._api_key is not None and (secret := self._api_key.get_secret_value()):
            text = text.replace(secret, "***")
        return _BEARER.sub("Bearer ***", text)


_BEARER = re.compile(r"(?i)bearer\s+[^\s\"',;]+")


#: The routes of a policy server: its chat completions, and token-in's
#: completion with a token prompt and vLLM's ``/tokenize`` (at the server's
#: root, not under ``/v1``).
Endpoint = Literal["chat", "tokens", "tokenize"]


def _endpoint(server: Server, kind: Endpoint, *, shown: bool = True) -> str:
    """``server``'s ``kind`` endpoint: as shown (no credentials), or as called."""
    base = server.name if shown else server.url
    if kind == "tokenize":
        return base.removesuffix("/v1") + "/tokenize"
    return base + ("/chat/completions/tokens" if kind == "tokens" else "/chat/completions")


def _tool_call(call_id: str, name: str, arguments: object) -> ToolCall:
    """A ToolCall, with ``arguments_error`` instead of an exception for bad arguments."""
    if isinstance(arguments, dict):  # a lenient server sent an object, not a string
        return ToolCall(id=call_id, name=name, arguments=arguments)
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        # No arguments at all: a call to a tool that takes none.
        return ToolCall(id=call_id, name=name, arguments={}, raw_arguments=arguments)
    raw = arguments if isinstance(arguments, str) else None
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as exc:
        reason = f"{exc.msg} at character {exc.pos}"
        return ToolCall(
            id=call_id,
            name=name,
            arguments={},
            arguments_error=f"arguments are not a JSON object: {reason} in {_shorten(raw or '')!r}",
            raw_arguments=raw,
        )
    if not isinstance(parsed, dict):
        return ToolCall(
            id=call_id,
            name=name,
            arguments={},
            arguments_error=(
                f"arguments are not a JSON object: got {type(parsed).__name__}"
                f" {_shorten(json.dumps(parsed, default=str))}"
            ),
            raw_arguments=raw,
        )
    return ToolCall(id=call_id, name=name, arguments=parsed, raw_arguments=raw)


def _ints(value: object) -> tuple[int, ...] | None:
    """``value`` as token ids, or None unless it is a list of ints."""
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        return None
    return tuple(value)


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _logprobs(
    value: object,
) -> tuple[tuple[float, ...] | None, tuple[tuple[tuple[str, float], ...], ...] | None]:
    """The sampled tokens' logprobs and their alternatives, from OpenAI's shape.

    ``choices[0].logprobs.content`` is a list of ``{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}`` (vLLM and SGLang answer the
    same); anything else is treated as not returned.
    """
    content = value.get("content") if isinstance(value, dict) else None
    if not isinstance(content, list):
        return None, None
    logprobs: list[float] = []
    top: list[tuple[tuple[str, float], ...]] | None = []
    for entry in content:
        logprob = _number(entry.get("logprob")) if isinstance(entry, dict) else None
        if logprob is None:
            return None, None
        logprobs.append(logprob)
        alternatives = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if top is not None and isinstance(alternatives, list) and alternatives:
            pairs = []
            for alternative in alternatives:
                number = (
                    _number(alternative.get("logprob")) if isinstance(alternative, dict) else None
                )
                token = alternative.get("token") if isinstance(alternative, dict) else None
                if number is None or not isinstance(token, str):
                    top = None
                    break
                pairs.append((token, number))
            else:
                top.append(tuple(pairs))
        else:
            top = None  # no alternatives were returned (or not for every token)
    return tuple(logprobs), (tuple(top) if top else None)


def _training_problems(
    prompt_ids: tuple[int, ...] | None,
    completion_ids: tuple[int, ...] | None,
    logprobs: tuple[float, ...] | None,
    top: tuple[tuple[tuple[str, float], ...], ...] | None,
) -> list[str]:
    """What makes a turn's training data unusable, each as ``kind: detail``."""
    problems = []
    for name, ids in (("prompt_token_ids", prompt_ids), ("completion_token_ids", completion_ids)):
        negative = next((i for i in ids or () if i < 0), None)
        if negative is not None:
            problems.append(f"negative {name}: {negative} is no token id")
    if logprobs is not None:
        bad = next((n for n in logprobs if not math.isfinite(n)), None)
        if bad is not None:
            problems.append(f"non-finite logprobs: {bad} (dropped)")
        if completion_ids is not None and len(logprobs) != len(completion_ids):
            problems.append(
                "logprobs and completion_token_ids of different lengths:"
                f" {len(logprobs)} and {len(completion_ids)}"
            )
    if top is not None:
        if any(not math.isfinite(n) for alternatives in top for _, n in alternatives):
            problems.append("non-finite top_logprobs: NaN or infinity (dropped)")
        if logprobs is not None and len(top) != len(logprobs):
            problems.append(
                f"top_logprobs and logprobs of different lengths: {len(top)} and {len(logprobs)}"
            )
    return problems


def _int_fields(usage: Mapping[str, Any]) -> dict[str, int]:
    """The token counts of ``usage``; nested details are dropped."""
    return {
        key: value
        for key, value in usage.items()
        if isinstance(value, int) and not isinstance(value, bool)
    }
