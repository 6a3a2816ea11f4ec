"""Token-in: the conversation sent as the token ids the server returned.

From the second call of a rollout on, a policy with ``policy.token_in`` sends
the last call's prompt and completion ids exactly as the server returned
them, then the new messages as the server's ``/tokenize`` renders them, to
``/chat/completions/tokens`` (prime-rl's vLLM route), so a chat template that
re-renders history cannot drift. :func:`token_prompt` builds that prompt;
:func:`has_images` says when a conversation must go as messages instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fleetroll._internal.excerpts import shorten as _shorten
from fleetroll.errors import PolicyError
from fleetroll.policies.chat_http import OPERATION, ChatTransport, endpoint
from fleetroll.policies.completions import ints
from fleetroll.policies.servers import Affinity
from fleetroll.policies.turns import Message, TokenTurn

__all__ = ["has_images", "token_prompt"]


def has_images(messages: Sequence[Message]) -> bool:
    """Whether the conversation holds images: those go by messages, not ids
    (vLLM's ``/tokenize`` does not expand image placeholders; verifiers
    falls back the same way)."""
    return any(
        isinstance(part, Mapping) and part.get("type") == "image_url"
        for message in messages
        if isinstance(content := message.get("content"), list)
        for part in content
    )


async def token_prompt(
    transport: ChatTransport,
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
    prefix = await _tokenize(
        transport, body, messages[:end], False, deadline=deadline, affinity=affinity
    )
    full = await _tokenize(transport, body, messages, True, deadline=deadline, affinity=affinity)
    completion = list(history.completion_token_ids)
    tail: list[int] = []
    if completion and history.finish_reason != "length" and completion[-1] in prefix:
        # What the template adds after the model's end-of-message token
        # (Qwen's newline after <|im_end|>): the model never generated it.
        last = len(prefix) - 1 - prefix[::-1].index(completion[-1])
        tail = prefix[last + 1 :]
    return [*history.prompt_token_ids, *completion, *tail, *full[len(prefix) :]]


async def _tokenize(
    transport: ChatTransport,
    body: Mapping[str, Any],
    messages: list[Message],
    generation: bool,
    *,
    deadline: float,
    affinity: Affinity | None,
) -> list[int]:
    """vLLM's ``/tokenize`` of a chat: the ids the server's template renders."""
    request: dict[str, Any] = {"model": body["model"], "messages": messages}
    if "tools" in body:
        request["tools"] = body["tools"]
    request["add_generation_prompt"] = generation
    url = endpoint(transport.servers.servers[0], "chat")  # the policy's, as errors name it
    answer, server = await transport.post(
        transport.encode(request, url), deadline=deadline, affinity=affinity, kind="tokenize"
    )
    tokens = ints(answer.get("tokens")) if isinstance(answer, dict) else None
    if tokens is None:
        raise PolicyError(
            transport.redact(
                f"{endpoint(server, 'tokenize')} answered no 'tokens' list"
                " (policy.token_in needs vLLM's /tokenize):"
                f" {_shorten(json.dumps(answer, default=str))}"
            ),
            operation=OPERATION,
            transient=False,
        )
    return list(tokens)
