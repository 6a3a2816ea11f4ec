"""OpenAI's Responses API to a chat completion and back
(fleetroll.policies.openai_responses), checked against the ``openai`` SDK's own types."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from openai import OpenAI
from openai.types.responses import Response

from fleetroll.policies.openai_responses import (
    Untranslatable,
    chat_request,
    error_body,
    response_answer,
    response_events,
)
from fleetroll.testing.fake_openai import completion, tool_call

SCHEMA = {"type": "object", "properties": {"account": {"type": "string"}}}
TOOL = {"type": "function", "name": "get_balance", "description": "A balance.",
        "parameters": SCHEMA, "strict": False}  # fmt: skip


def test_instructions_items_and_function_calls_become_chat_messages() -> None:
    body = {
        "model": "gpt-anything",
        "instructions": "You keep books.",
        "input": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "What is in Checking?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_balance",
             "arguments": '{"account": "Checking"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_balance",
             "arguments": '{"account": "Savings"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "12500.0"},
            {"type": "function_call_output", "call_id": "call_2", "output": [
                {"type": "input_text", "text": "300.0"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_balance"},
        "parallel_tool_calls": False,
        "max_output_tokens": 256,
        "temperature": 0.5,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}},
        "store": False,
        "reasoning": {"effort": "low"},
        "include": ["reasoning.encrypted_content"],
        "stream": True,
    }  # fmt: skip

    assert chat_request(body) == {
        "messages": [
            {"role": "system", "content": "You keep books."},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is in Checking?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_balance", "arguments": '{"account": "Checking"}'}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "get_balance", "arguments": '{"account": "Savings"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12500.0"},
            {"role": "tool", "tool_call_id": "call_2", "content": "300.0"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        ],
        "max_tokens": 256,
        "temperature": 0.5,
        "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {
            "name": "get_balance", "parameters": SCHEMA, "description": "A balance.",
            "strict": False}}],
        "tool_choice": {"type": "function", "function": {"name": "get_balance"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    }  # fmt: skip


def test_a_string_input_is_the_user_s_message() -> None:
    assert chat_request({"input": "hi"}) == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"input": []}, "input: must be a string or a non-empty list of items"),
        ({"modalities": ["x"]}, "cannot translate the field 'modalities'"),
        ({"previous_response_id": "resp_1"}, "previous_response_id: the gateway stores no"),
        ({"conversation": "conv_1"}, "conversation: the gateway stores no"),
        (
            {"tools": [{"type": "web_search"}]},
            "tools.0: the gateway cannot translate a tool of type 'web_search'",
        ),
        (
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input.0: the gateway cannot translate an item of type 'item_reference'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0: the gateway cannot translate a 'input_file' content part",
        ),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice: the gateway cannot translate"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role: must be"),
    ],
)
def test_a_request_with_no_chat_equivalent_is_refused_naming_what(
    change: dict[str, Any], said: str
) -> None:
    body = {"input": "hi", **change}
    with pytest.raises(Untranslatable, match=said.replace("(", r"\(").replace(")", r"\)")):
        chat_request(body)


ASKED = {"model": "m", "instructions": "Keep books.", "input": "hi", "tools": [TOOL]}


def answer_with_everything() -> dict[str, Any]:
    reply = completion(
        "I'll check.", [tool_call("get_balance", {"account": "Checking"}, id="call_7")]
    )
    reply["choices"][0]["message"]["reasoning_content"] = "the user wants a balance"
    reply["choices"][0]["finish_reason"] = "tool_calls"
    reply["usage"] = {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}
    return reply


def test_a_chat_completion_becomes_a_response_the_openai_sdk_reads() -> None:
    response = Response.model_validate(response_answer(answer_with_everything(), ASKED))

    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output_text == "I'll check."
    call = response.output[2]
    assert call.type == "function_call"
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_7",
        "get_balance",
        {"account": "Checking"},
    )
    assert response.status == "completed" and response.incomplete_details is None
    assert response.instructions == "Keep books."
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (31, 9)
    assert response.usage.total_tokens == 40


@pytest.mark.parametrize(
    ("finish", "status", "reason"),
    [
        ("stop", "completed", None),
        ("tool_calls", "completed", None),
        ("length", "incomplete", "max_output_tokens"),
        ("content_filter", "incomplete", "content_filter"),
    ],
)
def test_a_finish_reason_becomes_its_status(finish: str, status: str, reason: str | None) -> None:
    reply = completion("text")
    reply["choices"][0]["finish_reason"] = finish
    response = Response.model_validate(response_answer(reply, ASKED))
    assert response.status == status
    assert (response.incomplete_details and response.incomplete_details.reason) == reason


def events_of(response: dict[str, Any]) -> bytes:
    return "".join(response_events(response)).encode()


def sdk(body: bytes) -> OpenAI:
    def serve(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    http = httpx2.Client(transport=httpx2.MockTransport(serve))
    return OpenAI(base_url="http://gateway.test/v1", api_key="k", http_client=http)


def test_the_streamed_events_give_the_same_response_to_the_openai_sdk() -> None:
    response = response_answer(answer_with_everything(), ASKED)
    body = events_of(response)
    events = [
        json.loads(part.split("data: ", 1)[1]) for part in body.decode().split("\n\n") if part
    ]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))

    client = sdk(body)
    seen = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in seen] == [e["type"] for e in events]
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert deltas == ["I'll check."]
    with client.responses.stream(model="m", input="hi") as stream:
        final = stream.get_final_response()
    # (the stream's final response is a ParsedResponse: its extra fields are None)
    expected = Response.model_validate(response).model_dump(exclude_none=True)
    assert final.model_dump(exclude_none=True) == expected


def test_an_incomplete_response_ends_its_stream_with_response_incomplete() -> None:
    reply = completion("cut sh")
    reply["choices"][0]["finish_reason"] = "length"
    events = list(sdk(events_of(response_answer(reply, ASKED))).responses.create(
        model="m", input="hi", stream=True
    ))  # fmt: skip
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"


def test_an_error_has_the_api_s_shape() -> None:
    assert error_body("no") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert error_body("x", kind="authentication_error")["error"]["type"] == "authentication_error"
