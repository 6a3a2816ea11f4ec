"""OpenAI's Responses API, translated to and from a chat completion: the gateway's
``/v1/responses`` dialect (:mod:`fleetroll.policies.gateway`).

A Codex-style agent (the ``openai`` SDK's ``client.responses.create``,
``OPENAI_BASE_URL``) asks with ``instructions`` (the system prompt), ``input``
(a string, or items: messages with ``input_text``/``input_image``/``output_text``
parts, ``function_call`` items with ``call_id``, ``name``, ``arguments``, their
``function_call_output`` items, ``reasoning`` items), function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
``top_p`` and ``text.format``. :func:`chat_request` turns that into the chat
completion the policy server is asked for (so the call is one of the rollout's
``turns``, its token ids and logprobs the server's, exactly as for
``/v1/chat/completions``); :func:`response_answer` turns the server's answer
into a ``response`` (``reasoning``, ``message`` with ``output_text`` and
``function_call`` output items, ``status`` and ``incomplete_details``,
``usage``), and :func:`response_events` into the events a streamed call gets
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``/``.done``,
``response.function_call_arguments.delta``/``.done``,
``response.output_item.done``, then ``response.completed`` or
``response.incomplete``); :class:`ResponseStream` gives those events as a
streamed answer's chunks come, token by token. :func:`error_body` is the API's error shape. A
request that cannot be translated (a built-in tool such as ``web_search``, an
item with no chat equivalent, ``previous_response_id`` or ``conversation``:
the gateway stores no responses, so the agent sends its whole ``input`` each
call, as with ``store=False``) raises :class:`Untranslatable`, which the
gateway answers with that shape and status 400. Pure functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = [
    "ResponseStream",
    "Untranslatable",
    "chat_request",
    "error_body",
    "response_answer",
    "response_events",
]

#: Fields of a request that change nothing here (the policy's model and its
#: training fields are used; nothing is stored).
_IGNORED: Final = frozenset(
    {
        "model",
        "metadata",
        "stream",
        "stream_options",
        "store",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "include",
        "reasoning",
        "truncation",
        "top_logprobs",
        "background",
        "previous_response_id",
        "conversation",
        "prompt",
    }
)
_KNOWN: Final = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        *_IGNORED,
    }
)
#: Fields refused when set (not null, not false): they need state this gateway does not keep.
_STATEFUL: Final = ("previous_response_id", "conversation", "prompt", "background")


class Untranslatable(ValueError):
    """A Responses request with no chat-completion equivalent; the message says why."""


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion request for a Responses request ``body``.

    Raises:
        Untranslatable: a field, an input item or a tool this gateway cannot
            translate, or one that is malformed.
    """
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise Untranslatable(f"the gateway cannot translate the field {unknown[0]!r}")
    for name in _STATEFUL:
        if body.get(name) not in (None, False):
            raise Untranslatable(
                f"{name}: the gateway stores no responses; send the whole conversation"
                " as 'input' (store=False)"
            )
    chat: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        chat.append({"role": "system", "content": _string(instructions, "instructions")})
    given = body.get("input")
    if isinstance(given, str):
        chat.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            _item(chat, item, f"input.{i}")
    else:
        raise Untranslatable("input: must be a string or a non-empty list of items")
    sent: dict[str, Any] = {"messages": chat}
    if body.get("max_output_tokens") is not None:
        sent["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(name) is not None:
            sent[name] = body[name]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise Untranslatable("tools: must be a list")
        sent["tools"] = [_tool(tool, f"tools.{i}") for i, tool in enumerate(tools)]
    if body.get("tool_choice") is not None:
        sent["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        sent |= _text_format(text)
    return sent


def _item(chat: list[dict[str, Any]], item: object, at: str) -> None:
    """One input item, appended to ``chat`` (a function call joins the assistant
    message before it, as a chat message holds all of a turn's tool calls)."""
    if not isinstance(item, Mapping):
        raise Untranslatable(f"{at}: must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        chat.append(_message(item, at))
    elif kind == "function_call":
        call = {
            "id": _string(item.get("call_id"), f"{at}.call_id"),
            "type": "function",
            "function": {
                "name": _string(item.get("name"), f"{at}.name"),
                "arguments": _string(item.get("arguments"), f"{at}.arguments"),
            },
        }
        last = chat[-1] if chat else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        text, images = _output(item.get("output"), f"{at}.output")
        call_id = _string(item.get("call_id"), f"{at}.call_id")
        chat.append({"role": "tool", "tool_call_id": call_id, "content": text})
        if images:  # a tool message holds text only: its images follow as the user's
            chat.append({"role": "user", "content": images})
    elif kind == "reasoning":
        return  # chat templates leave earlier reasoning out of the prompt too
    else:
        raise Untranslatable(f"{at}: the gateway cannot translate an item of type {kind!r}")


def _message(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise Untranslatable(
            f"{at}.role: must be 'user', 'assistant', 'system' or 'developer', not {role!r}"
        )
    role = "system" if role == "developer" else role
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise Untranslatable(f"{at}.content: must be a string or a list of content parts")
    parts = [_part(part, f"{at}.content.{j}") for j, part in enumerate(content)]
    if role != "user" or all(p["type"] == "text" for p in parts):
        if role != "user" and any(p["type"] != "text" for p in parts):
            raise Untranslatable(f"{at}.content: only a user's message may hold images")
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: object, at: str) -> dict[str, Any]:
    """A content part as a chat content part."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in ("input_text", "output_text", "text"):
        assert isinstance(part, Mapping)
        return {"type": "text", "text": _string(part.get("text"), f"{at}.text")}
    if kind == "refusal":
        assert isinstance(part, Mapping)
        return {"type": "text", "text": _string(part.get("refusal"), f"{at}.refusal")}
    if kind == "input_image":
        assert isinstance(part, Mapping)
        url = part.get("image_url")
        if not isinstance(url, str):
            raise Untranslatable(f"{at}: the gateway takes images by 'image_url', not file ids")
        image: dict[str, Any] = {"url": url}
        if part.get("detail") in ("low", "high", "auto"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    raise Untranslatable(f"{at}: the gateway cannot translate a {kind!r} content part")


def _output(output: object, at: str) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(output, str):
        return output, []
    if isinstance(output, list):
        parts = [_part(item, f"{at}.{k}") for k, item in enumerate(output)]
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")
        return text, [p for p in parts if p["type"] != "text"]
    raise Untranslatable(f"{at}: must be a string or a list of content parts")


def _tool(tool: object, at: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind != "function":
        raise Untranslatable(f"{at}: the gateway cannot translate a tool of type {kind!r}")
    assert isinstance(tool, Mapping)
    schema = tool.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(schema, Mapping):
        raise Untranslatable(f"{at}.parameters: must be an object")
    function: dict[str, Any] = {
        "name": _string(tool.get("name"), f"{at}.name"),
        "parameters": dict(schema),
    }
    if tool.get("description"):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: object) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "function":
        assert isinstance(choice, Mapping)
        name = _string(choice.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise Untranslatable(f"tool_choice: the gateway cannot translate {choice!r}")


def _text_format(text: object) -> dict[str, Any]:
    if not isinstance(text, Mapping):
        raise Untranslatable("text: must be an object")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise Untranslatable(f"text: the gateway cannot translate the field {unknown[0]!r}")
    form = text.get("format")
    kind = form.get("type") if isinstance(form, Mapping) else None
    if form is None or kind == "text":
        return {}
    assert isinstance(form, Mapping)
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise Untranslatable(f"text.format: the gateway cannot translate the type {kind!r}")


def _string(value: object, at: str) -> str:
    if not isinstance(value, str):
        raise Untranslatable(f"{at}: must be a string")
    return value


# -- the answer ----------------------------------------------------------------------

#: A chat completion's ``finish_reason`` that leaves a response ``incomplete``, and why.
_INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_answer(answer: Mapping[str, Any], asked: Mapping[str, Any]) -> dict[str, Any]:
    """The server's chat completion (its first choice) as a ``response`` to ``asked``.

    The request's settings (``instructions``, ``tools``, ``tool_choice``...) are
    echoed as the API does; ``status`` is ``incomplete`` (with its reason) when
    the server stopped at the token limit or a content filter.
    """
    choices = answer.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], Mapping) else {}
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    assert isinstance(message, Mapping)
    base = str(answer.get("id", "fleetroll"))
    finish = choice.get("finish_reason")
    reason = _INCOMPLETE.get(finish) if isinstance(finish, str) else None
    status = "incomplete" if reason else "completed"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{base}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": status,
            }
        )
    if isinstance(message.get("content"), str) and message["content"]:
        output.append(
            {
                "type": "message",
                "id": f"msg_{base}",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(function, Mapping)
        arguments = function.get("arguments")
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{base}_{i}",
                "call_id": call.get("id") or f"call_{base}_{i}",
                "name": function.get("name"),
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                "status": "completed",
            }
        )
    usage = answer.get("usage") if isinstance(answer.get("usage"), Mapping) else {}
    assert isinstance(usage, Mapping)
    given = int(usage.get("prompt_tokens") or 0)
    written = int(usage.get("completion_tokens") or 0)
    created = answer.get("created", 0)
    return {
        "id": f"resp_{base}",
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": created if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": reason} if reason else None,
        "instructions": asked.get("instructions"),
        "max_output_tokens": asked.get("max_output_tokens"),
        "metadata": asked.get("metadata") or {},
        "model": answer.get("model"),
        "output": output,
        "parallel_tool_calls": asked.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "store": False,
        "temperature": asked.get("temperature"),
        "text": asked.get("text") or {"format": {"type": "text"}},
        "tool_choice": asked.get("tool_choice", "auto"),
        "tools": asked.get("tools") or [],
        "top_p": asked.get("top_p"),
        "truncation": "disabled",
        "usage": {
            "input_tokens": given,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": written,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": given + written,
        },
    }


def response_events(response: Mapping[str, Any]) -> Iterator[str]:
    """``response`` (:func:`response_answer`'s) as the Server-Sent Events of a
    streamed call: each output item added, its text or arguments given whole in
    one delta, and done, in order, between ``response.created`` and
    ``response.completed`` (``response.incomplete``)."""
    number = iter(range(1 << 62))

    def event(kind: str, data: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": next(number), **data}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    started = {
        **response,
        "status": "in_progress",
        "completed_at": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
    }
    yield event("response.created", {"response": started})
    yield event("response.in_progress", {"response": started})
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        if kind == "function_call":
            yield event(
                "response.output_item.added",
                {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}},
            )
            args = item["arguments"]
            yield event("response.function_call_arguments.delta", {**at, "delta": args})
            yield event(
                "response.function_call_arguments.done",
                {**at, "name": item["name"], "arguments": args},
            )
        else:
            prefix = "response.output_text" if kind == "message" else "response.reasoning_text"
            yield event(
                "response.output_item.added",
                {"output_index": index, "item": {**item, "content": [], "status": "in_progress"}},
            )
            for j, part in enumerate(item["content"]):
                where = {**at, "content_index": j}
                text = part["text"]
                extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
                if kind == "message":
                    opened = {**part, "text": ""}
                    yield event("response.content_part.added", {**where, "part": opened})
                yield event(f"{prefix}.delta", {**where, "delta": text, **extra})
                yield event(f"{prefix}.done", {**where, "text": text, **extra})
                if kind == "message":
                    yield event("response.content_part.done", {**where, "part": part})
        yield event("response.output_item.done", {"output_index": index, "item": item})
    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(done, {"response": response})


class ResponseStream:
    """A streamed chat completion's chunks as a streamed call's events, as they
    come: ``response.created`` and ``response.in_progress`` at the first chunk,
    an output item added at its first delta (``reasoning``, the ``message``
    with its ``output_text`` part, a ``function_call`` per call) and its text
    or arguments as deltas, then, at :meth:`end`, each item's ``.done`` events
    and ``response.completed`` (``response.incomplete``) with the
    :func:`response_answer` of the whole answer. Only the first choice is
    shown, as :func:`response_answer` does."""

    def __init__(self, asked: Mapping[str, Any]) -> None:
        self._asked = asked
        self._base: str | None = None
        self._numbers = iter(range(1 << 62))
        #: The output items opened, in order: (kind, key) → their id.
        self._items: dict[tuple[str, int], str] = {}

    def _event(self, kind: str, data: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": next(self._numbers), **data}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunk(self, chunk: Mapping[str, Any]) -> list[str]:
        """The events of one chunk (``chat.completion.chunk``, parsed)."""
        out: list[str] = []
        if self._base is None:
            self._base = str(chunk.get("id", "fleetroll"))
            shell = {
                "id": self._base,
                "created": chunk.get("created", 0),
                "model": chunk.get("model"),
            }
            started = {
                **response_answer(shell, self._asked),
                "status": "in_progress",
                "completed_at": None,
                "usage": None,
            }
            out.append(self._event("response.created", {"response": started}))
            out.append(self._event("response.in_progress", {"response": started}))
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
        base = self._base
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            item: dict[str, Any] = {
                "type": "reasoning",
                "id": f"rs_{base}",
                "summary": [],
                "content": [],
            }
            at = self._item(out, ("reasoning", 0), item)
            out.append(
                self._event(
                    "response.reasoning_text.delta", {**at, "content_index": 0, "delta": reasoning}
                )
            )
        if isinstance(delta.get("content"), str) and delta["content"]:
            item = {"type": "message", "id": f"msg_{base}", "role": "assistant", "content": []}
            key = ("message", 0)
            fresh = key not in self._items
            at = self._item(out, key, item)
            where = {**at, "content_index": 0}
            if fresh:
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(self._event("response.content_part.added", {**where, "part": part}))
            text = {**where, "delta": delta["content"], "logprobs": []}
            out.append(self._event("response.output_text.delta", text))
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, Mapping):
                continue
            number = call.get("index", 0)
            function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
            assert isinstance(function, Mapping)
            item = {
                "type": "function_call",
                "id": f"fc_{base}_{number}",
                "call_id": call.get("id") or f"call_{base}_{number}",
                "name": function.get("name"),
                "arguments": "",
            }
            at = self._item(out, ("function_call", number), item)
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                out.append(
                    self._event(
                        "response.function_call_arguments.delta", {**at, "delta": arguments}
                    )
                )
        return out

    def _item(self, out: list[str], key: tuple[str, int], item: dict[str, Any]) -> dict[str, Any]:
        """Where ``key``'s item is (``item_id``, ``output_index``), added to ``out`` first."""
        if key not in self._items:
            self._items[key] = item["id"]
            added = {
                "output_index": len(self._items) - 1,
                "item": {**item, "status": "in_progress"},
            }
            out.append(self._event("response.output_item.added", added))
        index = list(self._items).index(key)
        return {"item_id": self._items[key], "output_index": index}

    def end(self, answer: Mapping[str, Any]) -> list[str]:
        """The last events, once the stream assembled into ``answer`` (a chat completion)."""
        response = response_answer(answer, self._asked)
        out: list[str] = []
        items = {item["id"]: item for item in response["output"]}
        for index, (key, item_id) in enumerate(self._items.items()):
            item = items.get(item_id)
            if item is None:
                continue
            at = {"item_id": item_id, "output_index": index}
            if key[0] == "function_call":
                done = {**at, "name": item["name"], "arguments": item["arguments"]}
                out.append(self._event("response.function_call_arguments.done", done))
            for j, part in enumerate(
                item.get("content") or () if key[0] != "function_call" else ()
            ):
                where = {**at, "content_index": j}
                if key[0] == "message":
                    text = {**where, "text": part["text"], "logprobs": []}
                    out.append(self._event("response.output_text.done", text))
                    out.append(self._event("response.content_part.done", {**where, "part": part}))
                else:
                    text = {**where, "text": part["text"]}
                    out.append(self._event("response.reasoning_text.done", text))
            out.append(
                self._event("response.output_item.done", {"output_index": index, "item": item})
            )
        ended = "response.completed" if response["status"] == "completed" else "response.incomplete"
        out.append(self._event(ended, {"response": response}))
        return out

    def error(self, status: int, message: str, kind: str) -> list[str]:
        """The event that ends a stream the server failed in (the SDK raises it);
        ``status`` is the HTTP status the failure would have had (unused)."""
        body = error_body(message, kind=kind)
        return [self._event("error", {**body["error"], "error": body["error"]})]


def error_body(message: str, *, kind: str = "invalid_request_error") -> dict[str, Any]:
    """The API's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
