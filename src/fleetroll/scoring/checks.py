"""What a reward component reads, and the checks computed from it alone.

A component reads one text of the rollout (:data:`~fleetroll.tasks.rewards.Target`):
the final answer, the last assistant message, or the transcript rendered as
text by :func:`render`. The inputs are those of the result as stored
(redacted, images elided as the result keeps them), so that ``fleetroll
rescore`` reads exactly what the rollout read. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from fleetroll.tasks.rewards import RewardSpec, Target

__all__ = ["ScoreInputs", "check", "render", "target_text"]


@dataclass(frozen=True, slots=True)
class ScoreInputs:
    """What the components of one rollout read (a result's fields, as stored)."""

    #: The task's prompt.
    prompt: str
    #: The result's ``transcript`` (OpenAI chat messages, redacted).
    transcript: Sequence[Mapping[str, Any]]
    #: The result's ``final_answer`` (redacted), or None when none was submitted.
    final_answer: str | None
    #: The result's ``steps``.
    steps: int


def render(messages: Sequence[Mapping[str, Any]]) -> str:
    """The transcript as plain text: one block per message, ``[role] text``.

    Tool calls are ``[assistant calls NAME] ARGUMENTS``, tool answers
    ``[tool CALL_ID] TEXT``, images ``[image]``. Deterministic: the same
    messages give the same text.
    """
    blocks = []
    for message in messages:
        role = str(message.get("role", "?"))
        text = _content(message.get("content"))
        if role == "tool":
            blocks.append(f"[tool {message.get('tool_call_id', '')}] {text}".rstrip())
            continue
        if text:
            blocks.append(f"[{role}] {text}")
        for call in message.get("tool_calls") or ():
            function = (call.get("function") or {}) if isinstance(call, Mapping) else {}
            blocks.append(f"[{role} calls {function.get('name')}] {function.get('arguments')}")
    return "\n\n".join(blocks)


def _content(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                parts.append("[image]")
            elif isinstance(part, Mapping):
                parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    return json.dumps(content, sort_keys=True, default=str)


def _last_message(messages: Sequence[Mapping[str, Any]]) -> str | None:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            text = _content(message.get("content"))
            if text:
                return text
    return None


def target_text(on: Target, inputs: ScoreInputs) -> str | None:
    """The text a component reads; None when there is none (no final answer, or
    no assistant message with text)."""
    if on == "final_answer":
        return inputs.final_answer
    if on == "last_message":
        return _last_message(inputs.transcript)
    return render(inputs.transcript)


def check(spec: RewardSpec, inputs: ScoreInputs) -> float:
    """A check's value: 1.0 when it holds, else 0.0.

    A check whose text is missing (no final answer was submitted) does not hold.
    Never raises for what the rollout produced.
    """
    if spec.kind == "max_turns":
        assert spec.max is not None
        return 1.0 if inputs.steps <= spec.max else 0.0
    text = target_text(spec.on, inputs)
    if text is None:
        return 0.0
    if spec.kind == "regex":
        assert spec.pattern is not None
        flags = re.IGNORECASE if spec.ignore_case else 0
        return 1.0 if re.search(spec.pattern, text, flags) else 0.0
    if spec.kind == "contains":
        assert spec.text is not None
        if spec.ignore_case:
            return 1.0 if spec.text.casefold() in text.casefold() else 0.0
        return 1.0 if spec.text in text else 0.0
    if spec.kind == "json_schema":
        assert spec.json_schema is not None
        try:
            document = json.loads(text)
        except ValueError:
            return 0.0
        validator = jsonschema.validators.validator_for(spec.json_schema)(spec.json_schema)
        return 1.0 if validator.is_valid(document) else 0.0
    raise ValueError(f"{spec.kind!r} is not a check")
