"""Tool calls read off a model's text, on fleetroll's side (``policy.tool_parser``).

With ``policy.token_in = "completions"`` the server only generates tokens;
the tool calls in them are parsed here, as vLLM's parser of the same name
would parse them on its chat route, so a turn reads the same either way.

``hermes`` (Qwen2.5, Hermes, many others): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the last one may
be unclosed (the model stopped after it). The text before the first call is
the message's content. As vLLM's ``hermes`` parser: when any call is not a
JSON object with a ``name``, the whole text is the content and there are no
calls (the model's text, not an error; the rollout ends on a turn without
calls).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable

from fleetroll.policies.turns import ToolCall

__all__ = ["PARSERS", "ToolParser", "parse_hermes"]

#: A parser: the model's text → (content, calls).
ToolParser = Callable[[str], tuple[str | None, tuple[ToolCall, ...]]]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """The content (None when empty) and the calls of a hermes-style completion.

    Each call's ``raw_arguments`` is its arguments as JSON (what the chat
    route's ``arguments`` string would hold); ids are made here (``call_`` and
    24 hex digits), as a server makes them.
    """
    if "<tool_call>" not in text:
        return (text or None), ()
    calls: list[ToolCall] = []
    for closed, unclosed in _HERMES.findall(text):
        try:
            parsed = json.loads(closed or unclosed)
        except ValueError:
            return text, ()
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return text, ()
        arguments = parsed.get("arguments", {})
        if arguments is None:
            arguments = {}
        raw = json.dumps(arguments, ensure_ascii=False)
        call_id = f"call_{secrets.token_hex(12)}"
        if isinstance(arguments, dict):
            calls.append(
                ToolCall(id=call_id, name=parsed["name"], arguments=arguments, raw_arguments=raw)
            )
        else:  # as the chat route's reader: a call whose arguments are no object
            calls.append(
                ToolCall(
                    id=call_id,
                    name=parsed["name"],
                    arguments_error=(
                        f"arguments are not a JSON object: got {type(arguments).__name__} {raw}"
                    ),
                    raw_arguments=raw,
                )
            )
    content = text[: text.find("<tool_call>")]
    return (content or None), tuple(calls)


#: The parsers ``policy.tool_parser`` names.
PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes}
