"""The policy that asks an OpenAI-compatible ``/chat/completions`` endpoint
(OpenAI, vLLM, SGLang, a proxy in front of a trainer) for each turn.

This module holds the policy (its requests, :meth:`~OpenAIChatPolicy.act` and
:meth:`~OpenAIChatPolicy.forward`), its configuration and the recipe it
travels as; the rest of its work is in modules of its own:
:mod:`~fleetroll.policies.chat_http` (the routes, POSTs and their retries),
:mod:`~fleetroll.policies.completions` (reading an answer into a turn and its
training data), :mod:`~fleetroll.policies.token_in` (the prompt as token ids).

Import it from :mod:`fleetroll.policies` or :mod:`fleetroll`.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType, TracebackType
from typing import Any, Literal, NamedTuple, Self

import anyio.to_thread
import httpx
from pydantic import SecretStr

import fleetroll._internal.retrying as retrying
from fleetroll._internal.deadlines import fail_after
from fleetroll.errors import ContextOverflowError, PolicyError
from fleetroll.policies.chat_http import OPERATION, ChatTransport, Endpoint, EventStream, endpoint
from fleetroll.policies.chat_template import ChatTemplate, load_template
from fleetroll.policies.completions import CompletionReader
from fleetroll.policies.gate import WeightUpdateMode, current_gate
from fleetroll.policies.images import PreparedImage, image_spans, prepare_messages
from fleetroll.policies.resumption import joined, part_versions
from fleetroll.policies.servers import (
    Affinity,
    PolicyServers,
    Server,
    ServerLimits,
    current_affinity,
)
from fleetroll.policies.streaming import ChunkAssembler
from fleetroll.policies.token_in import (
    completion_body,
    has_images,
    local_prompt,
    read_completion,
    token_prompt,
)
from fleetroll.policies.tool_parsers import PARSERS
from fleetroll.policies.turns import (
    AssistantTurn,
    EncodedMessages,
    Message,
    TokenHistory,
    TokenTurn,
    ToolSpec,
    TurnData,
)
from fleetroll.results import TurnImage
from fleetroll.settings import PolicySettings
from fleetroll.tasks import TaskSpec

__all__ = ["ChatPolicyConfig", "OpenAIChatPolicy", "PolicyRecipe", "Streamed", "shown"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})
#: What servers say when a prompt is longer than the model's context: vLLM ("This
#: model's maximum context length is N tokens"), SGLang ("... exceeds the maximum
#: allowed length", "longer than the model's context length"), OpenAI
#: (``context_length_exceeded``).
_CONTEXT_OVERFLOW = re.compile(
    r"(?i)maximum context length|context[_ ]length[_ ]exceeded"
    r"|longer than the model's context length|exceeds the maximum allowed length"
)


@dataclass(frozen=True, slots=True)
class ChatPolicyConfig:
    """What an :class:`OpenAIChatPolicy` made from configuration reads: the
    ``[policy]`` section, the key, and its deadlines and waits (from
    ``[timeouts]`` and ``[retries]``), built where things are assembled
    (:func:`fleetroll.pool.assembly.chat_policy_config`)."""

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
            ``"completions"``: the same on any server with ``/v1/completions``:
            every call's prompt rendered here with ``tokenizer``'s chat template
            and sent as ids, the generated ids kept exactly, tool calls parsed
            here by ``tool_parser`` (:mod:`~fleetroll.policies.token_in`).
        tokenizer: with ``token_in = "completions"``, the model's Hugging Face
            tokenizer (a directory or a hub name; None: ``model``), loaded once
            per process at the first call.
        tool_parser: with ``token_in = "completions"``, the parser of the
            model's tool calls (:data:`~fleetroll.policies.tool_parsers.PARSERS`).
        weight_update: ``policy.weight_update``. With ``"abort"``, an answer
            whose ``finish_reason`` is ``"abort"`` (a weight update aborted it on
            the server) is resumed: once the update is over (the rollout's gate,
            :func:`~fleetroll.policies.gate.current_gate`), the same call goes
            on from its partial output, its prompt being the old prompt plus the
            tokens kept (``/chat/completions/tokens``, or
            ``/v1/completions`` with ``token_in = "completions"``), and the turn is the
            parts joined, each token with the version that produced it
            (``TurnData.token_versions``). Implies ``return_token_ids``.
        max_token_staleness: a partial output more than this many versions behind
            the one it would resume on is sampled again rather than kept.
        image_max_pixels: a vision-language policy (``policy.image_max_pixels``):
            every image is resized by Qwen2-VL's rule to at most this many pixels
            before it is sent (:mod:`fleetroll.policies.images`), each turn keeps
            those images and their placeholder spans (``TurnData.images``), and
            token-in stays on with images (the images go in ``multi_modal_data``).

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
        token_in: bool | Literal["completions"] = False,
        tokenizer: str | None = None,
        tool_parser: str = "hermes",
        weight_update: WeightUpdateMode = "pause",
        max_token_staleness: int | None = None,
        image_max_pixels: int | None = None,
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
        self.url = endpoint(servers.servers[0], "chat")
        if token_in not in (True, False, "completions"):
            raise ValueError(f'token_in must be true, false or "completions", not {token_in!r}')
        if tool_parser not in PARSERS:
            raise ValueError(
                f"no tool parser {tool_parser!r} (policy.tool_parser: {', '.join(sorted(PARSERS))})"
            )
        if token_in == "completions" and max_tokens is None and "max_tokens" not in extra_body:
            raise ValueError(
                'policy.token_in = "completions" needs policy.max_tokens: /v1/completions'
                " generates only 16 tokens when a request sets none (vLLM's default)"
            )
        self.token_in = token_in
        self.tokenizer = tokenizer or model
        self._parser = PARSERS[tool_parser]
        self._template: ChatTemplate | None = None
        self.image_max_pixels = image_max_pixels
        self.weight_update = weight_update
        self.max_token_staleness = max_token_staleness
        return_token_ids = return_token_ids or bool(token_in) or weight_update == "abort"
        self.model = model
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
        self._extra_body = dict(extra_body)
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._owns_client = http_client is None
        self._client = http_client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, connect_timeout_s)),
            # The rollout pool bounds concurrency; a second, smaller limit here
            # would only queue turns behind each other.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._http = ChatTransport(
            servers,
            client=self._client,
            api_key=SecretStr(api_key) if isinstance(api_key, str) else api_key,
            budget=retrying.Budget(max_retries + 1, backoff_initial_s, backoff_max_s),
            max_answer_bytes=max_answer_bytes,
        )
        self._reader = CompletionReader(self.url, self._training, self._http.redact)
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
            tokenizer=policy.tokenizer,
            tool_parser=policy.tool_parser,
            weight_update=policy.weight_update,
            max_token_staleness=policy.max_token_staleness,
            image_max_pixels=policy.image_max_pixels,
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
        gate = current_gate()
        started = gate.version if gate is not None else None
        history = messages.last_token_turn() if isinstance(messages, TokenHistory) else None
        sent: list[int] | None = None
        kind: Endpoint
        images: list[PreparedImage] = []
        prepared: Sequence[Message] = messages
        if self.image_max_pixels is not None and has_images(messages):
            prepared, images = await self._prepare_images(messages)
        body = self._body(prepared, tools)
        multimodal = {"image": [image.url for image in images]} if images else None
        try:
            with fail_after(self.timeout_s) as scope:
                if self.token_in == "completions" and not self._has_images(messages):
                    kind = "completions"
                    template = await self.template()
                    added = len(body["messages"]) - len(messages)
                    prompt = await anyio.to_thread.run_sync(
                        lambda: local_prompt(template, body, history, added=added)
                    )
                    sent = prompt.ids
                    if prompt.rerendered:
                        self._reader.warn_once(
                            [] if "rerendered" in self._reader.warned else ["rerendered"],
                            "%s: the chat template renders earlier messages differently once"
                            " new ones follow (%s): the new messages' ids were rendered after a"
                            " stand-in history, the ids already sent kept; said once",
                        )
                    request = completion_body(
                        body,
                        sent,
                        template,
                        sampling=self._sampling,
                        training=self._training,
                        extra=self._extra_body,
                    )
                    content = self._http.encode(request, self.url)
                elif (
                    self.token_in is True
                    and history is not None
                    and (images or not self._has_images(messages))
                ):
                    added = len(body["messages"]) - len(messages)
                    body["tokens"] = sent = await token_prompt(
                        self._http,
                        body,
                        history,
                        added=added,
                        deadline=scope.deadline,
                        affinity=affinity,
                    )
                    if multimodal:  # vLLM's multimodal prompt: the ids and the images
                        body["multi_modal_data"] = multimodal
                    kind, content = "tokens", self._http.encode(body, self.url)
                elif images:  # resized: not the transcript's own encoding
                    kind, content = "chat", self._http.encode(body, self.url)
                else:
                    kind, content = "chat", self._encoded(body, messages)
                payload, server = await self._http.post(
                    content, deadline=scope.deadline, affinity=affinity, kind=kind
                )
                turn = await self._read(payload, server, kind, sent)
                if (
                    self.weight_update == "abort"
                    and turn.data is not None
                    and turn.data.finish_reason == "abort"
                ):
                    turn = await self._resume(
                        turn,
                        body,
                        kind,
                        started,
                        multimodal=multimodal,
                        deadline=scope.deadline,
                        affinity=affinity,
                    )
        except PolicyError as exc:
            if not exc.transient and _CONTEXT_OVERFLOW.search(str(exc)):
                raise ContextOverflowError(str(exc), operation=OPERATION, transient=False) from exc
            raise
        except TimeoutError:
            where = affinity.server if affinity is not None else None
            url = self.url if where is None else endpoint(where, "chat")
            raise PolicyError(
                f"no answer from {url} within the policy deadline of {self.timeout_s:g}s"
                " (retries included); raise timeouts.policy_s if the model is just slow",
                operation=OPERATION,
                transient=True,
            ) from None
        if turn.data is None:
            return turn
        data = _with_images(turn.data, images) if images else turn.data
        update: dict[str, Any] = shown(body)
        if len(self.servers.servers) > 1:  # with one server: nothing to say where it went
            update["server"] = server.name
        return replace(turn, data=replace(data, **update))

    async def forward(
        self,
        body: Mapping[str, Any],
        *,
        affinity: Affinity | None = None,
        history: TokenTurn | None = None,
    ) -> tuple[dict[str, Any], tuple[AssistantTurn, ...]]:
        """One chat completion for a request someone else wrote (an agent's,
        through :mod:`fleetroll.policies.gateway`): its messages, tools and sampling as
        sent (this policy's ``temperature``, ``top_p``, ``max_tokens`` where it
        sets none), but this policy's ``model``, its training fields
        (``return_token_ids``, ``logprobs``...) asked for as :meth:`act` asks,
        and its ``extra_body`` on top. The server is asked for one answer
        (:meth:`stream` asks for it chunk by chunk).

        Returns the server's answer (as it sent it) and a turn parsed from each
        of its choices (one unless the request asked for ``n`` > 1; the
        ``usage``, which is the call's, on the first only), with the same
        retries, servers and deadline as :meth:`act`.

        As :meth:`act` does: with ``image_max_pixels``, the request's images
        are resized before the server sees them and each turn keeps them with
        their placeholder spans; with ``weight_update = "abort"``, an answer the
        server aborted (a single choice) is resumed on the new weights once the
        :func:`~fleetroll.policies.gate.current_gate`'s pause ends, and the
        answer returned is the joined one (its text, tool calls, token ids and
        ``token_versions``; its ``logprobs`` left out: the turn holds them).
        With ``token_in = True`` and a ``history`` (the caller's last call, whose
        prompt and completion the request's messages continue: ``history.index``
        is its assistant message's), the request goes to the token route as
        :meth:`act`'s does, images included (their ids with the placeholders,
        plus the images).

        Raises:
            PolicyError: as :meth:`act`; ContextOverflowError included.
        """
        sent: dict[str, Any] = dict(self._sampling)
        sent.update((k, v) for k, v in body.items() if k not in ("stream", "stream_options"))
        sent["model"] = self.model
        sent.update(self._training)
        sent.update(self._extra_body)
        images: list[PreparedImage] = []
        messages = sent.get("messages")
        if (
            self.image_max_pixels is not None
            and isinstance(messages, list)
            and has_images(messages)
        ):
            prepared, images = await self._prepare_images(messages)
            sent["messages"] = prepared
        gate = current_gate()
        started = gate.version if gate is not None else None
        try:
            with fail_after(self.timeout_s) as scope:
                kind: Endpoint = "chat"
                ids: list[int] | None = None
                if self.token_in is True and history is not None:
                    sent["tokens"] = ids = await token_prompt(
                        self._http,
                        sent,
                        history,
                        added=0,
                        deadline=scope.deadline,
                        affinity=affinity,
                    )
                    if images:  # vLLM's multimodal prompt: the ids and the images
                        sent["multi_modal_data"] = {"image": [image.url for image in images]}
                    kind = "tokens"
                payload, server = await self._http.post(
                    self._http.encode(sent, self.url),
                    deadline=scope.deadline,
                    affinity=affinity,
                    kind=kind,
                )
                first = await self._read(payload, server, kind, ids)
                if (
                    self.weight_update == "abort"
                    and first.data is not None
                    and first.data.finish_reason == "abort"
                    and len(payload["choices"]) == 1
                ):
                    first = await self._resume(
                        first,
                        sent,
                        kind,
                        started,
                        multimodal={"image": [image.url for image in images]} if images else None,
                        deadline=scope.deadline,
                        affinity=affinity,
                    )
                    payload = _answer_of(payload, first)
        except PolicyError as exc:
            if not exc.transient and _CONTEXT_OVERFLOW.search(str(exc)):
                raise ContextOverflowError(str(exc), operation=OPERATION, transient=False) from exc
            raise
        except TimeoutError:
            raise PolicyError(
                f"no answer from {self.url} within the policy deadline of {self.timeout_s:g}s"
                " (retries included); raise timeouts.policy_s if the model is just slow",
                operation=OPERATION,
                transient=True,
            ) from None
        url = endpoint(server, "chat")
        turns = [first]
        turns += [
            replace(self._reader.parse(payload, url=url, choice=index), usage=None)
            for index in range(1, len(payload["choices"]))  # checked by the first parse
        ]
        update: dict[str, Any] = shown(sent)
        if len(self.servers.servers) > 1:
            update["server"] = server.name
        turns = [
            replace(turn, data=replace(_with_images(turn.data, images), **update))
            if turn.data is not None
            else turn
            for turn in turns
        ]
        return payload, tuple(turns)

    @property
    def streams_tokens(self) -> bool:
        """Whether :meth:`stream` relays the server's chunks as they come: not with
        ``weight_update = "abort"`` (an aborted answer is resumed, then joined),
        ``image_max_pixels`` (the images are prepared and their spans found
        in the prompt) or ``token_in = True`` (a call that continues the last
        goes to the token route), whose calls go whole through :meth:`forward`."""
        return (
            self.weight_update != "abort"
            and self.image_max_pixels is None
            and self.token_in is not True
        )

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, affinity: Affinity | None = None
    ) -> AsyncIterator[Streamed]:
        """:meth:`forward`, streamed: the server is asked with ``stream: true``
        (and ``stream_options.include_usage``) and the same request and training
        fields, and the block gets its chunks as they come
        (:meth:`Streamed.chunks`), then the answer and its turns
        (:meth:`Streamed.result`), assembled from the chunks into exactly what
        :meth:`forward` would have read (:mod:`~fleetroll.policies.streaming`).
        A server that answers one JSON body instead gives it as
        :attr:`Streamed.whole`. Retried (as :meth:`forward`) only until the
        first chunk; the deadline is the whole call's, the block's time included.
        Only when :attr:`streams_tokens`.

        Raises:
            PolicyError: as :meth:`forward` (on entering, or from the chunks: the
                stream broke, the server failed in it, the deadline passed).
        """
        if not self.streams_tokens:
            raise RuntimeError("this policy's settings need whole answers: use forward()")
        sent: dict[str, Any] = dict(self._sampling)
        sent.update((k, v) for k, v in body.items() if k not in ("stream", "stream_options"))
        sent["model"] = self.model
        sent.update(self._training)
        sent.update(self._extra_body)
        sent |= {"stream": True, "stream_options": {"include_usage": True}}
        try:
            with fail_after(self.timeout_s) as scope:
                async with self._http.stream(
                    self._http.encode(sent, self.url), deadline=scope.deadline, affinity=affinity
                ) as events:
                    yield Streamed(self, events, sent)
        except PolicyError as exc:
            if not exc.transient and _CONTEXT_OVERFLOW.search(str(exc)):
                raise ContextOverflowError(str(exc), operation=OPERATION, transient=False) from exc
            raise
        except TimeoutError:
            raise PolicyError(
                f"no whole answer from {self.url} within the policy deadline of"
                f" {self.timeout_s:g}s (retries and the streaming included); raise"
                " timeouts.policy_s if the model is just slow",
                operation=OPERATION,
                transient=True,
            ) from None

    def _forwarded_turns(
        self, payload: Any, server: Server, sent: Mapping[str, Any]
    ) -> tuple[AssistantTurn, ...]:
        """The turns of a forwarded call's answer (one per choice; the usage on the first)."""
        url = endpoint(server, "chat")
        turns = [self._reader.parse(payload, url=url)]
        turns += [
            replace(self._reader.parse(payload, url=url, choice=index), usage=None)
            for index in range(1, len(payload["choices"]))  # checked by the first parse
        ]
        update: dict[str, Any] = shown({k: v for k, v in sent.items() if k != "stream_options"})
        if len(self.servers.servers) > 1:
            update["server"] = server.name
        return tuple(
            replace(turn, data=replace(turn.data, **update)) if turn.data is not None else turn
            for turn in turns
        )

    async def template(self) -> ChatTemplate:
        """The model's chat template (``token_in = "completions"``), loaded once
        per process (:func:`~fleetroll.policies.chat_template.load_template`).

        Raises:
            PolicyError: it cannot be loaded (not transient).
        """
        if self._template is None:
            self._template = await load_template(self.tokenizer)
        return self._template

    async def _read(
        self, payload: Any, server: Server, kind: Endpoint, sent: list[int] | None
    ) -> AssistantTurn:
        """The turn of an answer from ``kind``'s route; its prompt is the ids
        ``sent``, whether or not the server echoed them."""
        if kind == "completions":
            assert sent is not None
            return read_completion(
                payload,
                url=endpoint(server, "completions"),
                sent=sent,
                template=await self.template(),
                parser=self._parser,
                reader=self._reader,
            )
        turn = self._reader.parse(payload, url=endpoint(server, "chat"))
        if sent is not None and turn.data is not None and not turn.data.prompt_token_ids:
            turn = replace(turn, data=replace(turn.data, prompt_token_ids=tuple(sent)))
        return turn

    async def _resume(
        self,
        turn: AssistantTurn,
        body: Mapping[str, Any],
        kind: Endpoint,
        started: int | None,
        *,
        multimodal: Mapping[str, Any] | None,
        deadline: float,
        affinity: Affinity | None,
    ) -> AssistantTurn:
        """Resume an aborted call from its partial output on the new weights, until
        an answer that was not aborted; the turn is the parts joined
        (:mod:`~fleetroll.policies.resumption`). ``body`` is the chat request
        the call was made of (``multimodal``: its images, for vLLM's
        ``multi_modal_data``); each resumption goes to the token route (with
        ``token_in = "completions"``: to ``/v1/completions``, and the joined
        text's tool calls are parsed once, here)."""
        data = turn.data
        assert data is not None  # the caller checked
        prompt = data.prompt_token_ids
        if prompt is None or data.completion_token_ids is None:
            raise PolicyError(
                f"{self.url} aborted a generation without its token ids: policy.weight_update"
                " = 'abort' resumes from them (the server must return return_token_ids)",
                operation=OPERATION,
                transient=False,
            )
        local = kind == "completions"
        parts = [turn]
        versions = [part_versions(data, started)]
        notes: list[str] = []
        ended: str | None = None
        while (last := parts[-1].data) is not None and last.finish_reason == "abort":
            gate = current_gate()
            version = (await gate.admit())[0] if gate is not None else None
            kept = [i for part in parts for i in (part.data.completion_token_ids or ())]  # type: ignore[union-attr]
            oldest = min((v for vs in versions for v in vs if v is not None), default=None)
            limit = self.max_token_staleness
            too_old = limit is not None and version is not None and oldest is not None
            if kept and too_old and version - oldest > limit:  # type: ignore[operator]
                notes.append(
                    f"{len(kept)} tokens of version {oldest} sampled again on version"
                    f" {version} (policy.max_token_staleness = {limit})"
                )
                parts, versions, kept = [], [], []
            ids = [*prompt, *kept]
            if local:
                request = completion_body(
                    body,
                    ids,
                    await self.template(),
                    sampling=self._sampling,
                    training=self._training,
                    extra=self._extra_body,
                )
            else:
                request = {**body, "tokens": ids}
                if multimodal:  # the prompt's image placeholders need their images
                    request["multi_modal_data"] = multimodal
            if kept:
                notes.append(f"aborted after {len(kept)} tokens, resumed on version {version}")
            left = request.get("max_tokens")
            if isinstance(left, int) and kept:
                if left - len(kept) < 1:  # nothing left to sample: the answer ran to its length
                    ended = "length"
                    break
                request["max_tokens"] = left - len(kept)
            payload, server = await self._http.post(
                self._http.encode(request, self.url),
                deadline=deadline,
                affinity=affinity,
                kind="completions" if local else "tokens",
            )
            part = await self._read(payload, server, "completions" if local else "tokens", ids)
            parts.append(part)
            if part.data is None:
                break
            versions.append(part_versions(part.data, version))
        whole = joined(parts, versions, prompt, "; ".join(notes) or None, ended)
        if not local or whole.data is None or whole.data.completion_token_ids is None:
            return whole
        # A tool call may straddle two parts: the joined text is parsed as one answer.
        content, calls = self._parser(
            (await self.template()).decode(whole.data.completion_token_ids)
        )
        finish = whole.data.finish_reason
        if finish in ("stop", "tool_calls"):
            finish = "tool_calls" if calls else "stop"
        return replace(
            whole,
            content=content,
            tool_calls=tuple(calls),
            data=replace(whole.data, finish_reason=finish),
        )

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
        return self._encoded(self._body(messages, tools), messages)

    def _encoded(self, body: Mapping[str, Any], messages: Sequence[Message]) -> bytes:
        """``body`` (made of ``messages``) as JSON, reusing each message's encoding
        when the transcript keeps it."""
        body = dict(body)
        if not isinstance(messages, EncodedMessages) or "messages" in self._extra_body:
            return self._http.encode(body, self.url)
        sent = body.pop("messages")
        added = len(sent) - len(messages)  # the system prompt, when we inserted it
        parts = [self._http.encode(message, self.url) for message in sent[:added]]
        parts += [messages.encoded(index) for index in range(len(messages))]
        rest = self._http.encode(body, self.url)  # never empty: it holds "model"
        # One join, so the transcript's bytes are copied once, not once per level.
        pieces = [b'{"messages":[']
        for index, part in enumerate(parts):
            if index:
                pieces.append(b",")
            pieces.append(part)
        pieces += [b"],", rest[1:]]
        return b"".join(pieces)

    async def _prepare_images(
        self, messages: Sequence[Message]
    ) -> tuple[list[Message], list[PreparedImage]]:
        """``messages`` with their images resized (``image_max_pixels``), off the loop.

        Raises:
            PolicyError: an image is not a base64 data URL of an image (not transient).
        """
        assert self.image_max_pixels is not None
        try:
            return await anyio.to_thread.run_sync(
                lambda: prepare_messages(messages, max_pixels=self.image_max_pixels or 0)
            )
        except ValueError as exc:
            raise PolicyError(
                f"an image could not be prepared for the model (policy.image_max_pixels): {exc}",
                operation=OPERATION,
                transient=False,
            ) from None

    def _has_images(self, messages: Sequence[Message]) -> bool:
        """Whether the conversation holds images (:func:`~.token_in.has_images`):
        those go by messages, not ids. Said once per policy."""
        images = has_images(messages)
        self._reader.warn_once(
            [] if not images or "token_in" in self._reader.warned else ["token_in"],
            "%s: a conversation with images is sent as messages, not token ids (policy.%s is"
            " set, but a text template does not expand image placeholders); said once",
        )
        return images


def shown(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a chat request ``body`` shows the model besides the conversation: its
    system message (its text; parts' texts joined by newlines, as vLLM renders
    them) and its ``tools`` as sent, as :class:`TurnData` fields."""
    messages = body.get("messages")
    system: str | None = None
    if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
        first = messages[0]
        if first.get("role") == "system":
            content = first.get("content")
            if isinstance(content, str):
                system = content
            elif isinstance(content, Sequence):
                system = "\n".join(
                    str(part.get("text", ""))
                    for part in content
                    if isinstance(part, Mapping) and part.get("type", "text") == "text"
                )
    tools = body.get("tools")
    listed = (
        tuple(tool for tool in tools if isinstance(tool, Mapping))
        if isinstance(tools, Sequence) and not isinstance(tools, str) and tools
        else None
    )
    return {"system_prompt": system, "tools": listed}


def _answer_of(payload: Mapping[str, Any], turn: AssistantTurn) -> dict[str, Any]:
    """``payload`` (an aborted answer's first part) as the whole answer ``turn``
    (the parts joined, :func:`~fleetroll.policies.resumption.joined`) says it:
    its message, ending, token ids, versions and usage; no ``logprobs``."""
    data = turn.data
    assert data is not None  # a resumed turn has its data
    choice = dict(payload["choices"][0])
    message = dict(choice.get("message") or {})
    message["content"] = turn.content
    message.pop("tool_calls", None)
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.raw_arguments
                    if call.raw_arguments is not None
                    else json.dumps(dict(call.arguments)),
                },
            }
            for call in turn.tool_calls
        ]
    choice.update(message=message, finish_reason=data.finish_reason, logprobs=None)
    if data.completion_token_ids is not None:
        choice["token_ids"] = list(data.completion_token_ids)
    if data.token_versions is not None:
        choice["token_versions"] = list(data.token_versions)
    answer = {**payload, "choices": [choice]}
    if data.prompt_token_ids is not None:
        answer["prompt_token_ids"] = list(data.prompt_token_ids)
    if turn.usage is not None:
        answer["usage"] = dict(turn.usage)
    return answer


def _with_images(data: TurnData, images: Sequence[PreparedImage]) -> TurnData:
    """``data`` with the prompt's images and their placeholder spans in its
    ``prompt_token_ids``; a ``training_data_error`` when they are not found.
    ``data`` itself without images."""
    if not images:
        return data
    spans = image_spans(data.prompt_token_ids or (), [image.placeholders for image in images])
    if spans is None:
        problem = (
            "image placeholders not found in prompt_token_ids: expected runs of"
            f" {[image.placeholders for image in images]} tokens (is the model a Qwen2-VL-style"
            " one, and policy.image_max_pixels within the server's max_pixels?)"
        )
        error = "; ".join(filter(None, (data.training_data_error, problem)))
        return replace(data, training_data_error=error)
    kept = tuple(
        TurnImage(
            start=start,
            end=end,
            width=image.width,
            height=image.height,
            sha256=image.sha256,
            data=base64.b64encode(image.png).decode("ascii"),
        )
        for image, (start, end) in zip(images, spans, strict=True)
    )
    return replace(data, images=kept)


class Streamed:
    """A call :meth:`OpenAIChatPolicy.stream` made: its chunks, then its answer.

    Attributes:
        whole: the server's one answer, when it answered the streamed request
            with a JSON body (then :meth:`chunks` yields nothing).
    """

    def __init__(self, policy: OpenAIChatPolicy, events: EventStream, sent: Mapping[str, Any]):
        self._policy = policy
        self._events = events
        self._sent = sent
        self._assembler = ChunkAssembler()
        self.whole: dict[str, Any] | None = events.whole
        self._done = events.whole is not None

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Each chunk the server sent, as it came (``chat.completion.chunk``).

        Raises:
            PolicyError: the stream broke or the server failed in it.
        """
        async for chunk in self._events.chunks():
            self._assembler.add(chunk)
            yield chunk
        self._done = True

    def result(self) -> tuple[dict[str, Any], tuple[AssistantTurn, ...]]:
        """The answer (the chunks assembled, or :attr:`whole`) and a turn per
        choice, as :meth:`OpenAIChatPolicy.forward` returns them; after
        :meth:`chunks` ran out.

        Raises:
            PolicyError: the answer is not a chat completion (not transient).
        """
        if not self._done:
            raise RuntimeError("the stream is not over: read its chunks first")
        answer = self.whole if self.whole is not None else self._assembler.answer()
        turns = self._policy._forwarded_turns(answer, self._events.server, self._sent)
        return answer, turns
