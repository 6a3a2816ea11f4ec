"""A rollout's transcript: OpenAI chat messages, as the policy sees them.

What each event adds:

* the task's prompt: a ``user`` message;
* an assistant turn: an ``assistant`` message, with ``tool_calls`` carrying
  the model's own argument string when there is one (the transcript is
  training data);
* a tool's answer: a ``tool`` message, then, when the answer holds images,
  a ``user`` message with them (chat APIs take images only from users).

:meth:`Transcript.export` is what goes into a result: every string that came
from outside redacted, screenshots replaced by ``[image: N KB]`` unless kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fleetroll.policies import AssistantTurn, ToolCall
from fleetroll.tools import ToolResult

__all__ = ["Transcript", "assistant_message"]

Message = dict[str, Any]


class Transcript:
    """The messages of one rollout, in order; only its rollout appends."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def __len__(self) -> int:
        return len(self.messages)

    def since(self, start: int) -> tuple[Message, ...]:
        """The messages added after the first ``start``."""
        return tuple(self.messages[start:])

    def add_prompt(self, prompt: str) -> None:
        self.messages.append({"role": "user", "content": prompt})

    def add_turn(self, turn: AssistantTurn) -> None:
        self.messages.append(assistant_message(turn))

    def add_answer(self, call: ToolCall, result: ToolResult) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
        if result.images:
            parts: list[Message] = [
                {"type": "text", "text": f"Screenshot after {call.name} ({call.id}):"}
            ]
            parts += [{"type": "image_url", "image_url": {"url": url}} for url in result.images]
            self.messages.append({"role": "user", "content": parts})

    def export(self, redact: Callable[[str], str], *, keep_images: bool) -> list[Message]:
        """The messages for a result: redacted, images elided unless ``keep_images``."""
        return [_redacted(m if keep_images else _without_images(m), redact) for m in self.messages]


def assistant_message(turn: AssistantTurn) -> Message:
    """The chat message of an assistant turn."""
    message: Message = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": c.raw_arguments
                    if c.raw_arguments is not None
                    else json.dumps(dict(c.arguments)),
                },
            }
            for c in turn.tool_calls
        ]
    return message


def _redacted(message: Message, redact: Callable[[str], str]) -> Message:
    """``message`` with every string in it redacted, images (data URLs) left alone."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return value if value.startswith("data:") else redact(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return {k: clean(v) for k, v in message.items()}


def _without_images(message: Message) -> Message:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image_url":
            url = str(part.get("image_url", {}).get("url", ""))
            parts.append({"type": "text", "text": f"[image: {len(url) * 3 // 4 // 1024} KB]"})
        else:
            parts.append(part)
    return {**message, "content": parts}
