"""A rollout's transcript: OpenAI chat messages, as the policy sees them.

What each event adds:

* the task's prompt: a ``user`` message;
* an assistant turn: an ``assistant`` message, with ``tool_calls`` carrying
  the model's own argument string when there is one (the transcript is
  training data);
* a tool's answer: a ``tool`` message, then, when the answer holds images,
  a ``user`` message with them (chat APIs take images only from users),
  labelled ``Screenshot after computer (id):`` for the ``computer`` tool and
  ``Image from <tool> (id):`` for any other.

With ``max_images``, only the last that many screenshots stay: older image
parts are replaced by a text placeholder, in the transcript itself, which so
records what the model was sent. Each message's JSON is made once
(:meth:`Messages.encoded`), so building a request does not grow with the
transcript's age; an elided message is a new message, encoded once again.

:meth:`Transcript.export` is what goes into a result: every string that came
from outside redacted, screenshots replaced by ``[image: N KB]`` unless kept.
Redacting a large text takes seconds (16 MiB: 4 to 8 s), so
:meth:`Transcript.redact_ahead` redacts each large message once, as it is
added, in a worker thread and in pieces (:meth:`Redactor.in_pieces
<fleetroll.telemetry.events.Redactor.in_pieces>`, so that the event loop gets
the GIL between them); export reuses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from fleetroll.policies import AssistantTurn, ToolCall
from fleetroll.policies.turns import TokenTurn
from fleetroll.telemetry.events import Redactor
from fleetroll.tools.routing import COMPUTER_TOOL
from fleetroll.tools.session import ToolResult

__all__ = ["LARGE_TEXT", "Messages", "Transcript", "assistant_message"]

Message = dict[str, Any]

#: A message holding a string longer than this is redacted ahead, off the loop.
LARGE_TEXT = 64 * 1024
Redact = Callable[[str], str]

#: A rough count of characters per token, to estimate the size of what was
#: added to a prompt since the server last counted it (``max_context_tokens``).
CHARS_PER_TOKEN = 4


class Messages(list[Message]):
    """A transcript's messages, each keeping its JSON encoding, made once.

    Implements :class:`fleetroll.policies.EncodedMessages`. An entry replaced
    by another message is encoded again (the cache is checked by identity).
    Also :class:`fleetroll.policies.turns.ToolErrorFlags`: which tool answers were
    errors, a flag kept beside the messages (chat APIs have no field for it).
    """

    def __init__(self) -> None:
        super().__init__()
        self._encoded: dict[int, tuple[Message, bytes]] = {}
        self._error_answers: set[int] = set()
        self._token_turn: TokenTurn | None = None

    def last_token_turn(self) -> TokenTurn | None:
        """The last assistant message's token ids (a ``TokenHistory``)."""
        turn = self._token_turn
        return turn if turn is not None and turn.index < len(self) else None

    def record_tokens(self, turn: TokenTurn | None) -> None:
        """Keep (or, with None, forget) the token ids of the assistant message just added."""
        self._token_turn = turn

    def is_error_answer(self, index: int) -> bool:
        """Whether message ``index`` is a tool answer flagged as an error."""
        return index in self._error_answers

    def flag_error_answer(self, index: int) -> None:
        """Record that message ``index`` is a tool answer flagged as an error."""
        self._error_answers.add(index)

    def encoded(self, index: int) -> bytes:
        """The JSON (UTF-8) of message ``index``."""
        message = self[index]
        cached = self._encoded.get(index)
        if cached is not None and cached[0] is message:
            return cached[1]
        data = json.dumps(message, default=_mapping_to_dict, ensure_ascii=False).encode()
        self._encoded[index] = (message, data)
        return data


class Transcript:
    """The messages of one rollout, in order; only its rollout appends.

    Args:
        max_images: keep only the last this many images (None: all).
    """

    def __init__(self, max_images: int | None = None) -> None:
        self.messages: Messages = Messages()
        self.max_images = max_images
        #: Large messages redacted ahead, by index: (the message, the redactor, the result).
        self._clean: dict[int, tuple[Message, Redact, Message]] = {}
        self._ahead = 0  # messages before this index were looked at by redact_ahead
        #: Messages whose images are still sent, oldest first, with their count
        #: (a list: an empty deque costs 13x an empty list, and this one is short).
        self._with_images: list[tuple[int, int]] = []
        self._images = 0

    def __len__(self) -> int:
        return len(self.messages)

    def since(self, start: int) -> tuple[Message, ...]:
        """The messages added after the first ``start``."""
        return tuple(self.messages[start:])

    def add_prompt(self, prompt: str, images: tuple[str, ...] = ()) -> None:
        """The task's prompt, then (the initial screenshot of a computer modality)
        ``images`` in a user message of their own: the first observation."""
        self.messages.append({"role": "user", "content": prompt})
        if images:
            intro = "Screenshot before your first action:"
            parts: list[Message] = [{"type": "text", "text": intro}]
            parts += [{"type": "image_url", "image_url": {"url": url}} for url in images]
            self.messages.append({"role": "user", "content": parts})
            self._with_images.append((len(self.messages) - 1, len(images)))
            self._images += len(images)
            self._elide_old_images()

    def add_turn(self, turn: AssistantTurn) -> None:
        self.messages.append(assistant_message(turn))
        data = turn.data
        ids = None if data is None else (data.prompt_token_ids, data.completion_token_ids)
        if data is None or ids is None or ids[0] is None or ids[1] is None:
            self.messages.record_tokens(None)
            return
        self.messages.record_tokens(
            TokenTurn(len(self.messages) - 1, ids[0], ids[1], data.finish_reason)
        )

    def add_answer(self, call: ToolCall, result: ToolResult) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
        if result.is_error:
            self.messages.flag_error_answer(len(self.messages) - 1)
        if result.images:
            parts: list[Message] = [{"type": "text", "text": image_label(call)}]
            parts += [{"type": "image_url", "image_url": {"url": url}} for url in result.images]
            self.messages.append({"role": "user", "content": parts})
            self._with_images.append((len(self.messages) - 1, len(result.images)))
            self._images += len(result.images)
            self._elide_old_images()

    def add_observations(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """What an agent of its own sent after its last assistant message (its tool
        answers, images in user messages), as it sent them: the chat fields only."""
        for message in messages:
            role = message.get("role")
            if role not in ("tool", "user"):
                continue
            kept: Message = {"role": role, "content": message.get("content")}
            if role == "tool" and "tool_call_id" in message:
                kept["tool_call_id"] = message["tool_call_id"]
            self.messages.append(kept)
            content = kept["content"]
            images = (
                sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url")
                if isinstance(content, list)
                else 0
            )
            if images:
                self._with_images.append((len(self.messages) - 1, images))
                self._images += images
                self._elide_old_images()

    def _elide_old_images(self) -> None:
        """Replace the images before the last ``max_images`` by a placeholder."""
        if self.max_images is None:
            return
        while self._images > self.max_images:
            index, count = self._with_images.pop(0)
            excess = min(count, self._images - self.max_images)
            message = self.messages[index]
            parts, dropped = [], 0
            for part in message["content"]:
                if dropped < excess and part.get("type") == "image_url":
                    dropped += 1
                    parts.append(
                        {
                            "type": "text",
                            "text": f"[screenshot omitted: only the last {self.max_images}"
                            " are sent]",
                        }
                    )
                else:
                    parts.append(part)
            self.messages[index] = {**message, "content": parts}
            self._images -= excess
            if count > excess:
                self._with_images.insert(0, (index, count - excess))

    def text_chars(self, start: int = 0) -> int:
        """Characters of text (not images) in the messages after the first ``start``."""
        return sum(_text_chars(message) for message in self.messages[start:])

    async def redact_ahead(self, redact: Redact) -> None:
        """Redact the large messages added since the last call, in a worker thread,
        for :meth:`export` to reuse (a redaction of MBs on the loop would stall it)."""
        while self._ahead < len(self.messages):
            index, message = self._ahead, self.messages[self._ahead]
            self._ahead += 1
            if _largest_text(message) > LARGE_TEXT:
                clean = await anyio.to_thread.run_sync(_redacted, message, redact)
                self._clean[index] = (message, redact, clean)

    def export(self, redact: Redact, *, keep_images: bool) -> list[Message]:
        """The messages for a result: redacted, images elided unless ``keep_images``."""
        out = []
        for index, message in enumerate(self.messages):
            ahead = self._clean.get(index)
            if ahead is not None and ahead[0] is message and ahead[1] is redact:
                clean = ahead[2]  # redaction leaves images alone: elided after, the same
            else:
                clean = _redacted(message, redact)
            out.append(clean if keep_images else _without_images(clean))
        return out


def image_label(call: ToolCall) -> str:
    """The text before the images a tool answered: only the ``computer`` tool's
    are screenshots taken after its action; any other tool's are its own."""
    if call.name == COMPUTER_TOOL:
        return f"Screenshot after {call.name} ({call.id}):"
    return f"Image from {call.name} ({call.id}):"


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


def _mapping_to_dict(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _text_chars(message: Message) -> int:
    """The characters of ``message``'s text and tool-call arguments."""
    content = message.get("content")
    chars = len(content) if isinstance(content, str) else 0
    if isinstance(content, list):
        chars += sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    for call in message.get("tool_calls") or ():
        chars += len(str(call.get("function", {}).get("arguments", "")))
    return chars


def _largest_text(message: Message) -> int:
    """The length of the longest string in ``message`` (its content, or a part's text)."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return max(
            (
                len(p["text"])
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            ),
            default=0,
        )
    return 0


def _redacted(message: Message, redact: Redact) -> Message:
    """``message`` with every string in it redacted, images (data URLs) left alone."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            if value.startswith("data:"):
                return value
            if len(value) > LARGE_TEXT and isinstance(redact, Redactor):
                return redact.in_pieces(value)
            return redact(value)
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
