"""Anthropic's Messages API to a chat completion and back
(fleetroll.policies.anthropic_messages), checked against the ``anthropic`` SDK's own types."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from anthropic import Anthropic
from anthropic.types import Message

from fleetroll.policies.anthropic_messages import (
    Untranslatable,
    chat_request,
    error_body,
    message_answer,
    message_events,
)
from fleetroll.testing.fake_openai import completion, tool_call

SCHEMA = {"type": "object", "properties": {"account": {"type": "string"}}}


def test_a_conversation_with_a_system_prompt_tools_and_tool_results_becomes_chat_messages() -> None:
    body = {
        "model": "claude-anything",
        "max_tokens": 256,
        "system": [{"type": "text", "text": "You keep books."}],
        "messages": [
            {"role": "user", "content": "What is in Checking?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_balance",
                     "input": {"account": "Checking"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "12500.0"},
                                 {"type": "image", "source": {"type": "base64",
                                  "media_type": "image/png", "data": "AAAA"}}]},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        "tools": [{"name": "get_balance", "description": "A balance.", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 5,
        "metadata": {"user_id": "u"},
        "stream": True,
    }  # fmt: skip

    assert chat_request(body) == {
        "messages": [
            {"role": "system", "content": "You keep books."},
            {"role": "user", "content": "What is in Checking?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"id": "toolu_1", "type": "function",
                     "function": {"name": "get_balance", "arguments": '{"account": "Checking"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "12500.0"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "user", "content": "Thanks."},
        ],
        "max_tokens": 256,
        "temperature": 0.5,
        "top_k": 5,
        "stop": ["END"],
        "tools": [{"type": "function", "function": {
            "name": "get_balance", "parameters": SCHEMA, "description": "A balance."}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"messages": []}, "messages: must be a non-empty list"),
        ({"betas": ["x"]}, "cannot translate the field 'betas'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0: the gateway cannot translate a 'document' block",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools.0: the gateway cannot translate a tool of type 'web_search_20250305'",
        ),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice: the gateway cannot translate"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role 'user' or 'assistant'"),
    ],
)
def test_a_request_with_no_chat_equivalent_is_refused_naming_what(
    change: dict[str, Any], said: str
) -> None:
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(Untranslatable, match=said.replace("(", r"\(").replace(")", r"\)")):
        chat_request(body)


def answer_with_everything() -> dict[str, Any]:
    reply = completion(
        "I'll check.", [tool_call("get_balance", {"account": "Checking"}, id="call_7")]
    )
    reply["choices"][0]["message"]["reasoning_content"] = "the user wants a balance"
    reply["choices"][0]["finish_reason"] = "tool_calls"
    reply["usage"] = {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}
    return reply


def test_a_chat_completion_becomes_a_message_the_anthropic_sdk_reads() -> None:
    message = message_answer(answer_with_everything())

    parsed = Message.model_validate(message)
    assert [block.type for block in parsed.content] == ["thinking", "text", "tool_use"]
    tool_use = parsed.content[2]
    assert tool_use.type == "tool_use"
    assert (tool_use.id, tool_use.name, tool_use.input) == (
        "call_7",
        "get_balance",
        {"account": "Checking"},
    )
    assert parsed.stop_reason == "tool_use" and parsed.stop_sequence is None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (31, 9)


@pytest.mark.parametrize(
    ("finish", "stop_reason", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("stop", "END", ("stop_sequence", "END")),
        ("length", None, ("max_tokens", None)),
        ("content_filter", None, ("refusal", None)),
    ],
)
def test_a_finish_reason_becomes_its_stop_reason(
    finish: str, stop_reason: str | None, expected: tuple[str, str | None]
) -> None:
    reply = completion("text")
    reply["choices"][0] |= {"finish_reason": finish, "stop_reason": stop_reason}
    message = message_answer(reply)
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_arguments_that_are_not_a_json_object_are_kept_whole() -> None:
    message = message_answer(completion(tool_calls=[tool_call("note", "{not json", id="c")]))
    assert message["content"] == [
        {"type": "tool_use", "id": "c", "name": "note", "input": {"arguments": "{not json"}}
    ]


def test_the_streamed_events_give_the_same_message_to_the_anthropic_sdk() -> None:
    message = message_answer(answer_with_everything())
    body = "".join(message_events(message)).encode()
    events = [
        json.loads(part.split("data: ", 1)[1]) for part in body.decode().split("\n\n") if part
    ]
    assert [e["type"] for e in events] == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_stop"] * 3,
        "message_delta",
        "message_stop",
    ]

    def serve(request: httpx2.Request) -> httpx2.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx2.Response(200, headers=headers, content=body)

    http = httpx2.Client(transport=httpx2.MockTransport(serve))
    client = Anthropic(base_url="http://gateway.test", api_key="k", http_client=http)
    with client.messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump() == Message.model_validate(message).model_dump()


def test_an_error_has_anthropic_s_shape_and_type_for_its_status() -> None:
    assert error_body(400, "no") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "no"},
    }
    assert error_body(401, "x")["error"]["type"] == "authentication_error"
    assert error_body(413, "x")["error"]["type"] == "request_too_large"
    assert error_body(502, "x")["error"]["type"] == "api_error"
