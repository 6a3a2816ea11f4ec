"""Reading a chat completion: the turn it answers, its tool calls, its training data.

:class:`CompletionReader` turns a ``/chat/completions`` answer (OpenAI's
shape, as vLLM and SGLang answer it too) into an
:class:`~fleetroll.policies.turns.AssistantTurn`: content, tool calls (bad
arguments become ``arguments_error``, never an exception), usage, and the
training data (token ids, logprobs) with what is missing or unusable warned
about once per policy. :class:`~fleetroll.policies.openai.OpenAIChatPolicy`
holds one.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetroll._internal.excerpts import shorten as _shorten
from fleetroll.errors import PolicyError
from fleetroll.policies.chat_http import OPERATION
from fleetroll.policies.turns import AssistantTurn, ToolCall, TurnData
from fleetroll.results import RoutedExperts

__all__ = [
    "CompletionReader",
    "ints",
    "routed_experts",
    "token_versions",
    "training_problems",
]

#: The policy's logger: its warnings are about the policy's server.
_log = logging.getLogger("fleetroll.policies.openai")


class CompletionReader:
    """Parses one policy's completions; warns once per kind of missing data.

    Args:
        url: the policy's endpoint, named in its warnings.
        asked: the training fields the policy asks for (``return_token_ids``,
            ``logprobs``, ``top_logprobs``): what is missing of them is warned about.
        redact: removes the policy's key from the text of an error.
    """

    def __init__(self, url: str, asked: Mapping[str, Any], redact: Callable[[str], str]) -> None:
        self.url = url
        self.asked = asked
        self.redact = redact
        #: Fields the server left out, already warned about (one warning each
        #: per policy, so per run, not per turn).
        self.warned: set[str] = set()

    def parse(self, payload: Any, *, url: str, choice: int = 0) -> AssistantTurn:
        """The turn of ``payload``'s choice number ``choice`` (the first: the one
        a policy acts on)."""

        def malformed(what: str) -> PolicyError:
            excerpt = _shorten(json.dumps(payload, ensure_ascii=False, default=str))
            return PolicyError(
                self.redact(f"{url} answered a malformed chat completion: {what}: {excerpt}"),
                operation=OPERATION,
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
        prompt_ids = ints(payload.get("prompt_token_ids", choice.get("prompt_token_ids")))
        completion_ids = ints(choice.get("token_ids"))
        logprobs, top = _logprobs(choice.get("logprobs"))
        problems = training_problems(prompt_ids, completion_ids, logprobs, top)
        experts, experts_problem = routed_experts(
            payload.get("prompt_routed_experts", choice.get("prompt_routed_experts")),
            choice.get("routed_experts"),
            prompt_ids,
            completion_ids,
        )
        if experts_problem:
            problems.append(experts_problem)
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
            token_versions=token_versions(choice, completion_ids),
            routed_experts=experts,
        )
        self.warn_once(
            [p for p in problems if p.split(":")[0] not in self.warned],
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
        if "return_token_ids" in self.asked:
            missing += [
                name
                for name, value in (
                    ("prompt_token_ids", prompt_ids),
                    ("completion_token_ids", completion_ids),
                )
                if value is None
            ]
        if "logprobs" in self.asked and logprobs is None:
            missing.append("logprobs")
        if "top_logprobs" in self.asked and top is None:
            missing.append("top_logprobs")
        self.warn_once(
            [name for name in missing if name not in self.warned],
            "%s answered without %s: recorded as null in the results' turns"
            " (said once, not per turn)",
        )
        return data

    def warn_once(self, new: list[str], message: str, sep: str = ", ") -> None:
        """One warning for what was not said yet (a problem's kind: before its colon)."""
        if new:
            self.warned.update(item.split(":")[0] for item in new)
            _log.warning(message, self.url, sep.join(new))


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


def ints(value: object) -> tuple[int, ...] | None:
    """``value`` as token ids, or None unless it is a list of ints."""
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        return None
    return tuple(value)


def token_versions(
    choice: Mapping[str, Any], completion_ids: tuple[int, ...] | None
) -> tuple[int | None, ...] | None:
    """A choice's ``token_versions`` (the weights' version per generated token, as a
    server that updates weights between tokens reports it), when it is a list of
    ints as long as ``token_ids``; None otherwise (never guessed)."""
    versions = ints(choice.get("token_versions"))
    if versions is None or completion_ids is None or len(versions) != len(completion_ids):
        return None
    return versions


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


def training_problems(
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


def routed_experts(
    prompt: object,
    completion: object,
    prompt_ids: Sequence[int] | None,
    completion_ids: Sequence[int] | None,
) -> tuple[RoutedExperts | None, str | None]:
    """The experts each token was routed to, compactly, and what is wrong with them.

    vLLM answers ``prompt_routed_experts`` (``[prompt_len][layers][top_k]``, at
    the top level) and each choice's ``routed_experts`` (``[gen_len][layers][top_k]``);
    (``/v1/completions``: the prompt's on each choice too); the result's rows are
    aligned with ``prompt_ids + completion_ids``, -1 for tokens the server gave
    no row (no prompt routes; the last token, which an engine may never feed
    back). (None, None) when the server returned none.
    """
    if completion is None and prompt is None:
        return None, None
    if prompt_ids is None or completion_ids is None:
        return None, "routed_experts without token ids: dropped (ask for return_token_ids)"
    shape = _expert_shape(completion if completion is not None else prompt)
    if shape is None:
        return None, "malformed routed_experts: not [tokens][layers][top_k] ints (dropped)"
    layers, top_k = shape
    missing = [[-1] * top_k for _ in range(layers)]
    prompt_rows = prompt if isinstance(prompt, list) else [missing] * len(prompt_ids)
    completion_rows = (
        completion if isinstance(completion, list) else [missing] * len(completion_ids)
    )
    if len(completion_rows) == len(completion_ids) - 1:  # the last token never fed back
        completion_rows = [*completion_rows, missing]
    if len(prompt_rows) != len(prompt_ids) or len(completion_rows) != len(completion_ids):
        return None, (
            "routed_experts not aligned with the token ids:"
            f" {len(prompt_rows)}+{len(completion_rows)} rows for"
            f" {len(prompt_ids)}+{len(completion_ids)} tokens (dropped)"
        )
    try:
        return RoutedExperts.from_rows(
            [*prompt_rows, *completion_rows], layers=layers, top_k=top_k
        ), None
    except ValueError as exc:
        return None, f"malformed routed_experts: {exc} (dropped)"


def _expert_shape(rows: object) -> tuple[int, int] | None:
    """``(layers, top_k)`` of the first row of ``[tokens][layers][top_k]``."""
    if not isinstance(rows, list) or not rows:
        return None
    first = rows[0]
    if not isinstance(first, list) or not first or not isinstance(first[0], list):
        return None
    return len(first), len(first[0])
