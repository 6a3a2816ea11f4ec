"""Anthropic's Messages API, translated to and from a chat completion: the gateway's
``/v1/messages`` dialect (:mod:`fleetroll.policies.gateway`).

A Claude-style agent (the ``anthropic`` SDK, ``ANTHROPIC_BASE_URL``) asks with
``system``, ``messages`` of content blocks (``text``, ``image``, ``tool_use``,
``tool_result``), ``tools`` (``input_schema``), ``tool_choice``,
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``.
:func:`chat_request` turns that into the chat completion the policy server is
asked for (so the call is one of the rollout's ``turns``, its token ids and
logprobs the server's, exactly as for ``/v1/chat/completions``);
:func:`message_answer` turns the server's answer into a ``message``
(``text``, ``tool_use`` and ``thinking`` blocks, ``stop_reason``, ``usage``),
and :func:`message_events` into the events a streamed call gets
(``message_start``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``); :class:`MessageStream` gives those events
as a streamed answer's chunks come, token by token. :func:`error_body` is Anthropic's error
shape. A request that cannot be translated (a content block or a tool kind
with no chat equivalent, a malformed field) raises :class:`Untranslatable`,
which the gateway answers with that shape and status 400. Pure functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = [
    "MessageStream",
    "Untranslatable",
    "chat_request",
    "error_body",
    "error_type",
    "message_answer",
    "message_events",
]

#: Sampling fields passed to the chat request under the same name.
_SAME: Final = ("max_tokens", "temperature", "top_p", "top_k")
#: Fields of a request that change nothing here (the policy's model is used).
_IGNORED: Final = frozenset({"model", "metadata", "stream", "service_tier", "thinking"})
_KNOWN: Final = frozenset(
    {"messages", "system", "tools", "tool_choice", "stop_sequences", *_SAME, *_IGNORED}
)
#: A chat completion's ``finish_reason`` as a message's ``stop_reason``.
_STOP_REASONS: Final = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
#: Anthropic's error ``type`` for a status (the rest: ``api_error``).
_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class Untranslatable(ValueError):
    """A Messages request with no chat-completion equivalent; the message says why."""


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion request for a Messages request ``body``.

    Raises:
        Untranslatable: a field, a content block or a tool this gateway cannot
            translate, or one that is malformed.
    """
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise Untranslatable(f"the gateway cannot translate the field {unknown[0]!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Untranslatable("messages: must be a non-empty list")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text_of(system, "system")})
    for i, message in enumerate(messages):
        chat += _messages(message, f"messages.{i}")
    sent: dict[str, Any] = {"messages": chat}
    for name in _SAME:
        if body.get(name) is not None:
            sent[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Untranslatable("stop_sequences: must be a list of strings")
        sent["stop"] = stops
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise Untranslatable("tools: must be a list")
        sent["tools"] = [_tool(tool, f"tools.{i}") for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if choice is not None:
        sent |= _tool_choice(choice)
    return sent


def _messages(message: object, at: str) -> list[dict[str, Any]]:
    """One Messages message as chat messages (a user's tool results come first, as
    ``tool`` messages, then its other blocks as one user message)."""
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise Untranslatable(f"{at}: must be an object with role 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise Untranslatable(f"{at}.content: must be a string or a list of content blocks")
    if role == "assistant":
        return [_assistant(content, at)]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{at}.content.{j}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool_result":
            assert isinstance(block, Mapping)
            text, images = _tool_result(block, where)
            out.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id")), "content": text}
            )
            if images:  # a tool message holds text only: its images follow as the user's
                out.append({"role": "user", "content": images})
        else:
            parts.append(_part(block, where))
    if parts:
        # One text block is plain content, as a string message would be.
        single = len(parts) == 1 and parts[0]["type"] == "text"
        out.append({"role": "user", "content": parts[0]["text"] if single else parts})
    return out


def _assistant(content: list[Any], at: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{at}.content.{j}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_string(block.get("text"), f"{where}.text"))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, Mapping):
                raise Untranslatable(f"{where}.input: must be an object")
            name = _string(block.get("name"), f"{where}.name")
            calls.append(
                {
                    "id": _string(block.get("id"), f"{where}.id"),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # chat templates leave earlier reasoning out of the prompt too
        else:
            raise Untranslatable(f"{where}: the gateway cannot translate a {kind!r} block")
    joined: str | None = "".join(texts) or None
    message: dict[str, Any] = {"role": "assistant", "content": joined}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_result(block: Mapping[str, Any], at: str) -> tuple[str, list[dict[str, Any]]]:
    content = block.get("content", "")
    if isinstance(content, str):
        text, images = content, []
    elif isinstance(content, list):
        parts = [_part(item, f"{at}.content.{k}") for k, item in enumerate(content)]
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")
        images = [p for p in parts if p["type"] != "text"]
    else:
        raise Untranslatable(f"{at}.content: must be a string or a list of blocks")
    if block.get("is_error"):
        text = f"Error: {text}"
    return text, images


def _part(block: object, at: str) -> dict[str, Any]:
    """A user's ``text`` or ``image`` block as a chat content part."""
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind == "text":
        assert isinstance(block, Mapping)
        return {"type": "text", "text": _string(block.get("text"), f"{at}.text")}
    if kind == "image":
        assert isinstance(block, Mapping)
        source = block.get("source")
        if isinstance(source, Mapping) and source.get("type") == "base64":
            url = f"data:{source.get('media_type')};base64,{source.get('data')}"
        elif isinstance(source, Mapping) and source.get("type") == "url":
            url = _string(source.get("url"), f"{at}.source.url")
        else:
            raise Untranslatable(f"{at}.source: the gateway takes base64 or url images")
        return {"type": "image_url", "image_url": {"url": url}}
    raise Untranslatable(f"{at}: the gateway cannot translate a {kind!r} block")


def _tool(tool: object, at: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise Untranslatable(f"{at}: the gateway cannot translate a tool of type {kind!r}")
    schema = tool.get("input_schema", {"type": "object", "properties": {}})
    if not isinstance(schema, Mapping):
        raise Untranslatable(f"{at}.input_schema: must be an object")
    function = {"name": _string(tool.get("name"), f"{at}.name"), "parameters": dict(schema)}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: object) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "auto":
        picked: Any = "auto"
    elif kind == "any":
        picked = "required"
    elif kind == "none":
        picked = "none"
    elif kind == "tool":
        assert isinstance(choice, Mapping)
        name = _string(choice.get("name"), "tool_choice.name")
        picked = {"type": "function", "function": {"name": name}}
    else:
        raise Untranslatable(f"tool_choice: the gateway cannot translate the type {kind!r}")
    out: dict[str, Any] = {"tool_choice": picked}
    if isinstance(choice, Mapping) and choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _text_of(value: object, at: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_part(block, f"{at}.{k}").get("text", "") for k, block in enumerate(value))
    raise Untranslatable(f"{at}: must be a string or a list of text blocks")


def _string(value: object, at: str) -> str:
    if not isinstance(value, str):
        raise Untranslatable(f"{at}: must be a string")
    return value


# -- the answer ----------------------------------------------------------------------


def message_answer(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The server's chat completion (its first choice) as a Messages ``message``.

    A tool call's arguments that are not a JSON object are kept whole as
    ``{"arguments": "..."}`` (a ``tool_use`` input must be an object).
    """
    choices = answer.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], Mapping) else {}
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    assert isinstance(message, Mapping)
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(function, Mapping)
        raw = function.get("arguments") or "{}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = {"arguments": raw}
        call_id = call.get("id") or f"toolu_{answer.get('id', 'fleetroll')}_{i}"
        content.append(
            {"type": "tool_use", "id": call_id, "name": function.get("name"), "input": arguments}
        )
    finish = choice.get("finish_reason")
    stop_reason = _STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn"
    stop_sequence = choice.get("stop_reason")  # vLLM: the stop string that matched
    if stop_reason == "end_turn" and isinstance(stop_sequence, str):
        stop_reason = "stop_sequence"
    else:
        stop_sequence = None
    if calls and stop_reason == "end_turn":
        stop_reason = "tool_use"
    usage = answer.get("usage") if isinstance(answer.get("usage"), Mapping) else {}
    assert isinstance(usage, Mapping)
    return {
        "id": f"msg_{answer.get('id', 'fleetroll')}",
        "type": "message",
        "role": "assistant",
        "model": answer.get("model"),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
        },
    }


def message_events(message: Mapping[str, Any]) -> Iterator[str]:
    """``message`` (:func:`message_answer`'s) as the Server-Sent Events of a streamed
    call: each block opened, given whole in one delta, and closed, in order."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0},
    }
    yield _event("message_start", {"message": start})
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            opened: dict[str, Any] = {"type": "text", "text": ""}
            delta: dict[str, Any] = {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            opened = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield _event("content_block_start", {"index": index, "content_block": opened})
        yield _event("content_block_delta", {"index": index, "delta": delta})
        yield _event("content_block_stop", {"index": index})
    stopped = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield _event(
        "message_delta", {"delta": stopped, "usage": {"output_tokens": usage["output_tokens"]}}
    )
    yield _event("message_stop", {})


class MessageStream:
    """A streamed chat completion's chunks as a streamed call's events, as they
    come: ``message_start`` at the first chunk, a block opened at its first delta
    (``thinking``, ``text``, a ``tool_use`` per call, its arguments as
    ``input_json_delta`` pieces) and closed when another begins, then, at
    :meth:`end`, ``message_delta`` (the stop reason and usage
    :func:`message_answer` gives the whole answer) and ``message_stop``. Only
    the first choice is shown, as :func:`message_answer` does."""

    def __init__(self) -> None:
        self._base: str | None = None
        self._index = -1
        self._open: tuple[str, int] | None = None

    def chunk(self, chunk: Mapping[str, Any]) -> list[str]:
        """The events of one chunk (``chat.completion.chunk``, parsed)."""
        out: list[str] = []
        if self._base is None:
            self._base = str(chunk.get("id", "fleetroll"))
            start: dict[str, Any] = {
                "id": f"msg_{self._base}",
                "type": "message",
                "role": "assistant",
                "model": chunk.get("model"),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
            out.append(_event("message_start", {"message": start}))
        choice = next(
            (
                c
                for c in chunk.get("choices") or ()
                if isinstance(c, Mapping) and not c.get("index")
            ),
            None,
        )
        delta = choice.get("delta") if choice is not None else None
        if not isinstance(delta, Mapping):
            return out
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out += self._to(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""})
            piece = {"type": "thinking_delta", "thinking": reasoning}
            out.append(_event("content_block_delta", {"index": self._index, "delta": piece}))
        if isinstance(delta.get("content"), str) and delta["content"]:
            out += self._to(("text", 0), {"type": "text", "text": ""})
            piece = {"type": "text_delta", "text": delta["content"]}
            out.append(_event("content_block_delta", {"index": self._index, "delta": piece}))
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, Mapping):
                continue
            number = call.get("index", 0)
            function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
            assert isinstance(function, Mapping)
            if self._open != ("tool", number):
                call_id = call.get("id") or f"toolu_{self._base}_{number}"
                block = {"type": "tool_use", "id": call_id, "name": function.get("name")}
                out += self._to(("tool", number), {**block, "input": {}})
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                piece = {"type": "input_json_delta", "partial_json": arguments}
                out.append(_event("content_block_delta", {"index": self._index, "delta": piece}))
        return out

    def _to(self, block: tuple[str, int], opened: dict[str, Any]) -> list[str]:
        """Open ``block`` unless it is the open one (closing that first)."""
        if self._open == block:
            return []
        out = self._close()
        self._index += 1
        self._open = block
        out.append(_event("content_block_start", {"index": self._index, "content_block": opened}))
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._index})]

    def end(self, answer: Mapping[str, Any]) -> list[str]:
        """The last events, once the stream assembled into ``answer`` (a chat completion)."""
        message = message_answer(answer)
        usage = message["usage"]
        stopped = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        return [
            *self._close(),
            _event("message_delta", {"delta": stopped, "usage": usage}),
            _event("message_stop", {}),
        ]

    def error(self, status: int, message: str, kind: str) -> list[str]:
        """The event that ends a stream the server failed in (the SDK raises it);
        its type is ``status``'s (``kind`` is OpenAI's name for it, unused)."""
        return [_event("error", error_body(status, message))]


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
