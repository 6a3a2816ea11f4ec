"""A streamed chat completion: its Server-Sent Events read, and its chunks assembled.

A policy server asked with ``stream: true`` answers ``chat.completion.chunk``
events (OpenAI's shape, as vLLM and SGLang stream them): each choice's
``delta`` (``content``, ``reasoning_content``, ``tool_calls`` numbered by
``index``, their ``arguments`` in pieces), and beside it, per chunk, the
tokens that delta came from (vLLM's ``token_ids`` with ``return_token_ids``,
``logprobs.content`` with ``logprobs``, ``token_versions`` from a server
that updates weights between tokens), ``finish_reason`` on the last; the
answer's own fields (``prompt_token_ids``...) on the first chunk, ``usage``
on a last chunk without choices (``stream_options.include_usage``), then
``data: [DONE]``.

:func:`sse_data` reads the events' data from a byte stream; :class:`ChunkAssembler`
joins the chunks into exactly the chat completion the server would have
answered without ``stream`` (the same message, token ids, logprobs, finish
reason and usage), which the policy then reads as any answer
(:class:`~fleetroll.policies.completions.CompletionReader`): a streamed call's
turn is the non-streamed call's. Pure, but for :func:`sse_data`'s reading.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

__all__ = ["ChunkAssembler", "sse_data"]

#: A chunk's top-level fields that are the chunk's own, not the answer's.
_CHUNK_OWN = frozenset({"object", "choices", "usage"})
#: A choice's fields that are joined across chunks (the rest: the last value sent).
_JOINED = frozenset({"index", "delta", "token_ids", "token_versions", "logprobs"})


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data`` of each Server-Sent Event in ``chunks`` (its lines joined by
    newlines), as each event completes; an event without data is skipped."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk.replace(b"\r\n", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = [
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                yield b"\n".join(data)


class _Choice:
    """One choice's deltas so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.content: list[str] | None = None
        self.reasoning: list[str] | None = None
        self.reasoning_name = "reasoning_content"
        self.calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] | None = None
        self.token_versions: list[int] | None = None
        self.logprobs: list[Any] | None = None
        self.other: dict[str, Any] = {}
        self.message_other: dict[str, Any] = {}

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self._delta(delta)
        for name in ("token_ids", "token_versions"):
            given = choice.get(name)
            if isinstance(given, list):
                kept = getattr(self, name)
                setattr(self, name, (kept or []) + given)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs = (self.logprobs or []) + logprobs["content"]
        for name, value in choice.items():
            if name not in _JOINED and (value is not None or name not in self.other):
                self.other[name] = value

    def _delta(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("role"), str):
            self.role = delta["role"]
        if isinstance(delta.get("content"), str):
            self.content = (self.content or []) + [delta["content"]]
        for name in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(name), str):
                self.reasoning_name = name
                self.reasoning = (self.reasoning or []) + [delta[name]]
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            number = call.get("index", len(self.calls))
            kept = self.calls.setdefault(number, {"function": {"name": None, "arguments": ""}})
            for name in ("id", "type"):
                if call.get(name) is not None:
                    kept[name] = call[name]
            function = call.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    kept["function"]["name"] = (kept["function"]["name"] or "") + function["name"]
                if isinstance(function.get("arguments"), str):
                    kept["function"]["arguments"] += function["arguments"]
        for name, value in delta.items():
            if name not in ("role", "content", "reasoning_content", "reasoning", "tool_calls"):
                self.message_other[name] = value

    def choice(self) -> dict[str, Any]:
        calls = [
            {"id": call.get("id"), "type": call.get("type", "function"), **call}
            for _, call in sorted(self.calls.items())
        ]
        content = "".join(self.content) if self.content is not None else None
        if content == "" and calls:
            content = None  # a server answers a message of tool calls alone with null content
        message: dict[str, Any] = {"role": self.role, "content": content, **self.message_other}
        if self.reasoning is not None:
            message[self.reasoning_name] = "".join(self.reasoning)
        message["tool_calls"] = calls
        out: dict[str, Any] = {"index": self.index, "message": message}
        out["logprobs"] = {"content": self.logprobs} if self.logprobs is not None else None
        out.setdefault("finish_reason", None)
        out |= self.other
        out["token_ids"] = self.token_ids
        if self.token_versions is not None:
            out["token_versions"] = self.token_versions
        return out


class ChunkAssembler:
    """Joins a streamed chat completion's chunks into the completion (see the module).

    Feed it each chunk with :meth:`add`; :meth:`answer` is the completion so far.
    """

    def __init__(self) -> None:
        self._top: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None
        #: Chunks added so far.
        self.chunks = 0

    def add(self, chunk: dict[str, Any]) -> None:
        """One chunk (a ``chat.completion.chunk``, parsed)."""
        self.chunks += 1
        for name, value in chunk.items():
            if name not in _CHUNK_OWN and self._top.get(name) is None:
                self._top[name] = value  # the first value sent (the first chunk's)
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict):
                index = choice.get("index", 0)
                index = index if isinstance(index, int) else 0
                self._choices.setdefault(index, _Choice(index)).add(choice)

    def answer(self) -> dict[str, Any]:
        """The chat completion the chunks make (``object``: ``chat.completion``)."""
        answer = {
            **self._top,
            "object": "chat.completion",
            "choices": [c.choice() for _, c in sorted(self._choices.items())],
        }
        if self._usage is not None:
            answer["usage"] = self._usage
        return answer
