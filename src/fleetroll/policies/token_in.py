"""Token-in: the conversation sent as the token ids the server returned.

From the second call of a rollout on, a policy with ``policy.token_in`` sends
the last call's prompt and completion ids exactly as the server returned
them, then the new messages as the server's ``/tokenize`` renders them, to
``/chat/completions/tokens`` (prime-rl's vLLM route), so a chat template that
re-renders history cannot drift. :func:`token_prompt` builds that prompt;
:func:`has_images` says when a conversation must go as messages instead.

With ``policy.token_in = "completions"`` the same holds on any server with
``/v1/completions``: :func:`local_prompt` renders the template on fleetroll's
side (:mod:`~fleetroll.policies.chat_template`), every call (the first too)
sends its prompt as ids, and :func:`read_completion` reads the answer into a
turn, its tool calls parsed here (:mod:`~fleetroll.policies.tool_parsers`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from fleetroll._internal.excerpts import shorten as _shorten
from fleetroll.errors import PolicyError
from fleetroll.policies.chat_http import OPERATION, ChatTransport, endpoint
from fleetroll.policies.chat_template import ChatTemplate
from fleetroll.policies.completions import (
    CompletionReader,
    ints,
    routed_experts,
    token_versions,
    training_problems,
)
from fleetroll.policies.servers import Affinity
from fleetroll.policies.tool_parsers import ToolParser
from fleetroll.policies.turns import AssistantTurn, Message, TokenTurn, TurnData

__all__ = ["LocalPrompt", "has_images", "local_prompt", "read_completion", "token_prompt"]


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
    return _continued(history, prefix, full[len(prefix) :])


def _continued(history: TokenTurn, prefix: list[int], new: list[int]) -> list[int]:
    """The last call's prompt and completion ids, what the template adds after
    the model's end of message, then ``new`` (the new messages' ids)."""
    completion = list(history.completion_token_ids)
    tail: list[int] = []
    if completion and history.finish_reason != "length" and completion[-1] in prefix:
        # What the template adds after the model's end-of-message token
        # (Qwen's newline after <|im_end|>): the model never generated it.
        last = len(prefix) - 1 - prefix[::-1].index(completion[-1])
        tail = prefix[last + 1 :]
    return [*history.prompt_token_ids, *completion, *tail, *new]


class LocalPrompt(NamedTuple):
    """A prompt rendered on fleetroll's side (``token_in = "completions"``)."""

    ids: list[int]
    #: The template renders the history differently once new messages follow
    #: it: the new messages' ids were rendered after a stand-in history, and
    #: the ids already sent kept.
    rerendered: bool = False


def local_prompt(
    template: ChatTemplate, body: Mapping[str, Any], history: TokenTurn | None, *, added: int
) -> LocalPrompt:
    """The prompt as token ids, rendered with the model's own template (blocking:
    call it in a worker thread).

    The first call's is the template's rendering of the conversation. Later
    ones are the last call's prompt and completion ids exactly as the server
    returned them, then the new messages' ids: the full rendering less the
    rendering up to the last assistant message, when the first starts with the
    second (the template leaves history alone). When it does not, the new
    messages are rendered after a stand-in history (the system prompt, a user
    and an assistant message) and ``rerendered`` says so: the ids already
    sent are never changed.

    Raises:
        PolicyError: the template fails, or renders even the stand-in
            differently once the new messages follow it (not transient).
    """
    messages = list(body["messages"])
    tools = body.get("tools")
    if history is None:
        return LocalPrompt(template.render(messages, tools, generation=True))
    end = history.index + added + 1
    prefix = template.render(messages[:end], tools, generation=False)
    full = template.render(messages, tools, generation=True)
    if full[: len(prefix)] == prefix:
        return LocalPrompt(_continued(history, prefix, full[len(prefix) :]))
    base: list[Message] = [m for m in messages[:1] if m.get("role") == "system"]
    base += [{"role": "user", "content": "-"}, {"role": "assistant", "content": "-"}]
    base_prefix = template.render(base, tools, generation=False)
    base_full = template.render([*base, *messages[end:]], tools, generation=True)
    if base_full[: len(base_prefix)] != base_prefix:
        raise PolicyError(
            f"the chat template of policy.tokenizer {template.name!r} renders earlier"
            " messages differently once new ones follow, so the new messages' token ids"
            ' cannot be told apart: policy.token_in = "completions" cannot continue'
            " this conversation (use policy.token_in = true on a server with its routes)",
            operation=OPERATION,
            transient=False,
        )
    return LocalPrompt(_continued(history, prefix, base_full[len(base_prefix) :]), True)


def completion_body(
    body: Mapping[str, Any],
    prompt: list[int],
    template: ChatTemplate,
    *,
    sampling: Mapping[str, Any],
    training: Mapping[str, Any],
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``/v1/completions`` request (vLLM's): the prompt as ids, the
    template's end-of-message tokens as stops, token ids and, when asked,
    logprobs (an int there: the alternatives per token, 0 for none)."""
    request: dict[str, Any] = {
        "model": body["model"],
        "prompt": prompt,
        "stop_token_ids": list(template.stop_ids),
        "return_token_ids": True,
    }
    request.update(sampling)
    if training.get("logprobs"):
        request["logprobs"] = int(training.get("top_logprobs") or 0)
    request.update(extra)
    return request


def read_completion(
    payload: Any,
    *,
    url: str,
    sent: list[int],
    template: ChatTemplate,
    parser: ToolParser,
    reader: CompletionReader,
) -> AssistantTurn:
    """The turn of a ``/v1/completions`` answer: its generated ids kept exactly,
    their text decoded here and its tool calls parsed by ``parser``.

    Raises:
        PolicyError: the answer is no completion or has no token ids (not transient).
    """

    def malformed(what: str) -> PolicyError:
        excerpt = _shorten(json.dumps(payload, ensure_ascii=False, default=str))
        return PolicyError(
            reader.redact(f"{url} answered a malformed completion: {what}: {excerpt}"),
            operation=OPERATION,
            transient=False,
        )

    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("no 'choices'")
    choice = choices[0]
    completion = ints(choice.get("token_ids"))
    if completion is None:
        raise malformed(
            "no 'token_ids' (policy.token_in = \"completions\" needs a server that"
            " returns the generated ids: vLLM's return_token_ids)"
        )
    prompt = ints(choice.get("prompt_token_ids")) or tuple(sent)
    finish = choice.get("finish_reason")
    finish = finish if isinstance(finish, str) else None
    content, calls = parser(template.decode(completion))
    if calls and finish == "stop":
        finish = "tool_calls"  # as a chat route answers it
    logprobs, top = _legacy_logprobs(choice.get("logprobs"))
    problems = training_problems(prompt, completion, logprobs, top)
    experts, experts_problem = routed_experts(
        payload.get("prompt_routed_experts", choice.get("prompt_routed_experts")),
        choice.get("routed_experts"),
        prompt,
        completion,
    )
    if experts_problem:
        problems.append(experts_problem)
    if logprobs is not None and not all(map(math.isfinite, logprobs)):
        logprobs = None
    if top is not None and not all(math.isfinite(n) for a in top for _, n in a):
        top = None
    asked = reader.asked
    missing = [] if logprobs is not None or "logprobs" not in asked else ["logprobs"]
    reader.warn_once([m for m in missing if m not in reader.warned], "%s answered without %s")
    reader.warn_once(
        [p for p in problems if p.split(":")[0] not in reader.warned],
        "%s answered unusable training data (%s): the turn is flagged in the results'"
        " turns (training_data_error); said once per kind, not per turn",
        sep="; ",
    )
    model = payload.get("model")
    usage = payload.get("usage")
    return AssistantTurn(
        content=content,
        tool_calls=calls,
        usage=(
            {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}
            if isinstance(usage, dict)
            else None
        ),
        data=TurnData(
            model=model if isinstance(model, str) else None,
            finish_reason=finish,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            logprobs=logprobs if "logprobs" in asked else None,
            top_logprobs=top if "top_logprobs" in asked else None,
            training_data_error="; ".join(problems) or None,
            token_versions=token_versions(choice, completion),
            routed_experts=experts,
        ),
    )


def _legacy_logprobs(
    value: object,
) -> tuple[tuple[float, ...] | None, tuple[tuple[tuple[str, float], ...], ...] | None]:
    """OpenAI's legacy completion logprobs (``token_logprobs``; ``top_logprobs``
    a dict per token) as the chat route's: each token's logprob, and its
    alternatives most likely first."""
    if not isinstance(value, dict):
        return None, None
    numbers = value.get("token_logprobs")
    if not isinstance(numbers, list) or not all(
        isinstance(n, int | float) and not isinstance(n, bool) for n in numbers
    ):
        return None, None
    logprobs = tuple(float(n) for n in numbers)
    tops = value.get("top_logprobs")
    if not isinstance(tops, list) or len(tops) != len(logprobs) or not tops:
        return logprobs, None
    top: list[tuple[tuple[str, float], ...]] = []
    for entry in tops:
        if not isinstance(entry, dict) or not entry:
            return logprobs, None
        pairs = [(str(k), float(v)) for k, v in entry.items() if isinstance(v, int | float)]
        top.append(tuple(sorted(pairs, key=lambda pair: -pair[1])))
    return logprobs, tuple(top)


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
