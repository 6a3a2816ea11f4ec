"""What a policy answers, and the transcript shape it reads: the values that pass
between a rollout and its policy.

Kept apart from the policies themselves so every policy (:mod:`fleetroll.policies`,
:mod:`fleetroll.policies.openai`) and every reader of turns (transcript, tools,
routing) can import them without importing one another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fleetroll.results import RoutedExperts, TurnImage

__all__ = [
    "AssistantTurn",
    "EncodedMessages",
    "Message",
    "TokenHistory",
    "TokenTurn",
    "ToolCall",
    "ToolErrorFlags",
    "ToolSpec",
    "TurnData",
]

Message = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the agent sees it."""

    name: str
    description: str
    input_schema: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the policy asks for.

    ``arguments_error`` is set (and ``arguments`` empty) when the model's
    arguments could not be parsed; the rollout answers it with a tool error
    instead of calling anything.

    ``raw_arguments`` is the arguments string exactly as the model produced it,
    when the policy got one (:class:`OpenAIChatPolicy`), so the transcript can
    record what the model said rather than a re-serialisation of it.
    """

    id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    arguments_error: str | None = None
    raw_arguments: str | None = None


@dataclass(frozen=True, slots=True)
class TurnData:
    """What a model server said about a turn besides the message: training data.

    Every field is None when the server did not return it (token ids and
    logprobs are only asked for when configured).
    """

    model: str | None = None
    finish_reason: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    completion_token_ids: tuple[int, ...] | None = None
    #: The sampled token's logprob, one per completion token.
    logprobs: tuple[float, ...] | None = None
    #: Per completion token, the ``(token, logprob)`` alternatives, most likely first.
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...] | None = None
    #: Why the token ids / logprobs are unusable for training (None: they are
    #: fine, or were not returned); a non-finite logprob's list is dropped.
    training_data_error: str | None = None
    #: The policy server that answered (its API root, without credentials),
    #: when there are many (``policy.base_urls``); None with one.
    server: str | None = None
    #: The weights' version that produced each completion token, as the server
    #: reported it (a ``token_versions`` list beside ``token_ids``) or as an
    #: aborted call's resumption knows it; None when not known.
    token_versions: tuple[int | None, ...] | None = None
    #: Why ``token_versions`` holds nulls, or what happened (an abort, a resumption).
    token_versions_note: str | None = None
    #: What the call showed the model besides the conversation's own
    #: messages: the system message it was sent (None: none), and the tools
    #: as sent (OpenAI's ``tools`` list; None: none). A result keeps its first
    #: call's, so turn 0 re-renders from the result alone. (The tools, dicts,
    #: are left out of the hash.)
    system_prompt: str | None = None
    tools: tuple[Mapping[str, Any], ...] | None = field(default=None, hash=False)
    #: The experts each token (prompt then completion) was routed to, when the
    #: server returned them (a mixture-of-experts model).
    routed_experts: RoutedExperts | None = None
    #: With ``policy.image_max_pixels``: the prompt's images as the model saw
    #: them, with their placeholder spans in ``prompt_token_ids``.
    images: tuple[TurnImage, ...] | None = None


@dataclass(frozen=True, slots=True)
class AssistantTurn:
    """The policy's answer: optional text and zero or more tool calls.

    ``data`` is set by policies backed by a model server (a result records a
    ``turn`` for each such answer) and None for the scripted policy.
    """

    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Mapping[str, int] | None = None
    data: TurnData | None = None


@runtime_checkable
class EncodedMessages(Protocol):
    """A transcript that keeps each message's JSON encoding, made once.

    :class:`OpenAIChatPolicy` builds its request body from these bytes instead
    of encoding the whole transcript again on every turn.
    """

    def __len__(self) -> int: ...

    def encoded(self, index: int) -> bytes:
        """The JSON (UTF-8) of message ``index``."""
        ...


@runtime_checkable
class ToolErrorFlags(Protocol):
    """A transcript that knows which tool answers were errors.

    The flag is the tool's own (MCP ``isError``, a failed call, bad
    arguments), not anything read off the answer's text: a tool may well
    answer ``"Errors: none"``, and an error may say nothing of the kind.
    """

    def is_error_answer(self, index: int) -> bool:
        """Whether message ``index`` is a tool answer flagged as an error."""
        ...


@dataclass(frozen=True, slots=True)
class TokenTurn:
    """The token ids of the transcript's last assistant message, as the server
    returned them (for token-in: ``policy.token_in``)."""

    #: The index of the assistant message in the transcript.
    index: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    finish_reason: str | None = None


@runtime_checkable
class TokenHistory(Protocol):
    """A transcript that keeps the token ids of its assistant messages."""

    def last_token_turn(self) -> TokenTurn | None:
        """The last assistant message's ids; None when it has none (or there is none)."""
        ...
