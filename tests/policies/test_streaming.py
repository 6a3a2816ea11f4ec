"""A streamed chat completion, assembled: the same completion, the same turn.

The chunks of vLLM's stream (:func:`~fleetroll.testing.fake_openai.streamed_chunks`)
assembled by :class:`~fleetroll.policies.streaming.ChunkAssembler` give what the
non-streamed answer gives, token ids, versions and logprobs included; the policy's
``stream`` against a streaming server records the turn ``forward`` records, retried
only before its first chunk; and the gateway's incremental encoders give the SDKs
the message and the response the whole answer gives.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from anthropic import Anthropic
from anthropic.types import Message
from openai import OpenAI

from fleetroll.errors import PolicyError
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.policies.anthropic_messages import MessageStream, message_answer
from fleetroll.policies.completions import CompletionReader
from fleetroll.policies.openai_responses import ResponseStream, response_answer
from fleetroll.policies.streaming import ChunkAssembler
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    FakeError,
    VllmShape,
    completion,
    streamed_chunks,
    tool_call,
    toy_tokenize,
)

ASKED_FOR = {"return_token_ids": True, "logprobs": True}


def vllm_answer(*, content: str | None, calls: int = 0, reasoning: str | None = None) -> Any:
    """A vLLM-shaped answer with ``calls`` tool calls, token ids, versions and logprobs."""
    reply = completion(
        content,
        [tool_call("get_balance", {"account": f"a-{i}", "n": i}, id=f"c{i}") for i in range(calls)]
        or None,
    )
    reply["id"], reply["created"], reply["model"] = "chatcmpl-1", 7, "served"
    if reasoning is not None:
        reply["choices"][0]["message"]["reasoning_content"] = reasoning
    ids = list(range(100, 100 + 6 + 4 * calls))
    choice = reply["choices"][0]
    choice["token_ids"] = ids
    choice["token_versions"] = [3] * (len(ids) // 2) + [4] * (len(ids) - len(ids) // 2)
    choice["logprobs"] = {
        "content": [
            {"token": f"t{i}", "logprob": -0.01 * i, "bytes": None, "top_logprobs": []} for i in ids
        ]
    }
    choice["stop_reason"] = None
    reply["prompt_token_ids"] = [1, 2, 3]
    reply["usage"] = {
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "total_tokens": 3 + len(ids),
    }
    return reply


ANSWERS = {
    "text": vllm_answer(content="The balance is 12 dollars."),
    "tool_calls": vllm_answer(content=None, calls=2),
    "text_and_a_call": vllm_answer(content="I'll check.", calls=1, reasoning="they ask"),
    "empty": vllm_answer(content=""),
}


def assembled(answer: dict[str, Any]) -> dict[str, Any]:
    assembler = ChunkAssembler()
    for chunk in streamed_chunks(answer, {"stream_options": {"include_usage": True}}):
        assembler.add(json.loads(json.dumps(chunk)))
    return assembler.answer()


@pytest.mark.parametrize("answer", list(ANSWERS.values()), ids=list(ANSWERS))
def test_the_assembled_chunks_are_the_answer_and_read_as_the_same_turn(
    answer: dict[str, Any],
) -> None:
    joined = assembled(answer)
    message = answer["choices"][0]["message"]
    got = joined["choices"][0]
    assert got["message"]["content"] == message["content"]
    assert got["message"].get("reasoning_content") == message.get("reasoning_content")
    assert got["message"]["tool_calls"] == [
        {**call, "type": "function"} for call in message.get("tool_calls") or ()
    ]
    for name in ("token_ids", "token_versions", "logprobs", "finish_reason", "stop_reason"):
        assert got[name] == answer["choices"][0][name], name
    for name in ("id", "created", "model", "prompt_token_ids", "usage"):
        assert joined[name] == answer[name], name
    reader = CompletionReader("http://x/v1/chat/completions", ASKED_FOR, str)
    url = "http://x/v1/chat/completions"
    assert reader.parse(joined, url=url) == reader.parse(answer, url=url)


def test_tool_call_deltas_are_joined_by_index_whatever_their_order() -> None:
    def delta(**fields: Any) -> dict[str, Any]:
        return {"id": "c", "choices": [{"index": 0, "delta": fields}]}

    assembler = ChunkAssembler()
    for chunk in [
        delta(role="assistant", tool_calls=[{"index": 1, "id": "b", "function": {"name": "g"}}]),
        delta(tool_calls=[{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x"'}}]),
        delta(tool_calls=[{"index": 1, "function": {"arguments": "{}"}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
    ]:
        assembler.add(chunk)
    calls = assembler.answer()["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", "f", '{"x": 1}'),
        ("b", "g", "{}"),
    ]


async def test_a_streamed_call_records_the_turn_a_whole_one_records() -> None:
    answer = vllm_answer(content="I'll check.", calls=1)
    # The fake's own token ids (its toy tokenizer's, and the end token): a version each.
    function = answer["choices"][0]["message"]["tool_calls"][0]["function"]
    words = f"I'll check. {function['name']} {function['arguments']}"
    tokens = len(toy_tokenize(words)) + 1
    answer["choices"][0]["token_versions"] = [5] * (tokens - 2) + [6, 6]
    async with (
        FakeChatServer([answer, answer], vllm=VllmShape(stream=True)) as server,
        OpenAIChatPolicy(base_url=server.base_url, model="served", **ASKED_FOR) as policy,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}]}
        with anyio.fail_after(30):
            async with policy.stream(body) as streamed:
                assert streamed.whole is None
                chunks = [chunk async for chunk in streamed.chunks()]
            _, (turn,) = streamed.result()
            _, (whole,) = await policy.forward(body)
    assert len(chunks) > 5  # a chunk per token, not one answer
    assert server.requests[0]["stream"] is True
    assert server.requests[0]["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in server.requests[0].items() if not k.startswith("stream")} == (
        server.requests[1]
    )
    assert turn == whole
    assert turn.data is not None and turn.data.token_versions == tuple(
        server.replies[0]["choices"][0]["token_versions"]
    )


async def test_a_streamed_call_is_retried_before_its_first_chunk_only() -> None:
    script = [FakeError(503, "busy"), completion("hello")]
    async with (
        FakeChatServer(script, vllm=VllmShape(stream=True)) as server,
        OpenAIChatPolicy(
            base_url=server.base_url, model="served", backoff_initial_s=0, backoff_max_s=0
        ) as policy,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}]}
        with anyio.fail_after(30):
            async with policy.stream(body) as streamed:
                [_ async for _ in streamed.chunks()]
    assert len(server.requests) == 2
    assert streamed.result()[1][0].content == "hello"


async def test_a_server_that_answers_a_stream_with_one_body_is_read_whole() -> None:
    async with (
        FakeChatServer([completion("hello")], vllm=VllmShape()) as server,
        OpenAIChatPolicy(base_url=server.base_url, model="served") as policy,
    ):
        with anyio.fail_after(30):
            async with policy.stream({"messages": [{"role": "user", "content": "hi"}]}) as s:
                assert s.whole == server.replies[0]
                assert [c async for c in s.chunks()] == []
    assert s.result()[1][0].content == "hello"


async def test_a_stream_that_breaks_after_its_first_chunk_is_not_sent_again() -> None:
    asked = []

    async def broken(request: httpx.Request) -> httpx.Response:
        asked.append(request)

        async def events() -> Any:
            yield b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            raise httpx.ReadError("gone")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    http = httpx.AsyncClient(transport=httpx.MockTransport(broken))
    async with (
        http,
        OpenAIChatPolicy(base_url="http://p.test/v1", model="m", http_client=http) as p,
    ):
        with anyio.fail_after(30), pytest.raises(PolicyError, match="broke") as caught:
            async with p.stream({"messages": [{"role": "user", "content": "hi"}]}) as s:
                [_ async for _ in s.chunks()]
    assert len(asked) == 1 and caught.value.transient


def events_of(parts: list[str]) -> bytes:
    return "".join(parts).encode()


def test_the_incremental_messages_events_give_the_anthropic_sdk_the_whole_answer_s_message() -> (
    None
):
    answer = vllm_answer(content="I'll check.", calls=2, reasoning="they ask")
    encoder = MessageStream()
    parts = [p for c in streamed_chunks(answer, {}) for p in encoder.chunk(c)]
    parts += encoder.end(answer)
    kinds = [json.loads(p.split("data: ", 1)[1])["type"] for p in parts]
    assert kinds.count("content_block_delta") > 4  # text and arguments in pieces
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]

    def serve(request: httpx2.Request) -> httpx2.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx2.Response(200, headers=headers, content=events_of(parts))

    http = httpx2.Client(transport=httpx2.MockTransport(serve))
    client = Anthropic(base_url="http://gateway.test", api_key="k", http_client=http)
    with client.messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump() == Message.model_validate(message_answer(answer)).model_dump()


def test_the_incremental_responses_events_give_the_openai_sdk_the_whole_answer_s_response() -> None:
    answer = vllm_answer(content="I'll check.", calls=2, reasoning="they ask")
    asked: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}
    encoder = ResponseStream(asked)
    parts = [p for c in streamed_chunks(answer, {}) for p in encoder.chunk(c)]
    parts += encoder.end(answer)
    events = [json.loads(p.split("data: ", 1)[1]) for p in parts]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert sum(e["type"] == "response.output_text.delta" for e in events) > 1

    def serve(request: httpx2.Request) -> httpx2.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx2.Response(200, headers=headers, content=events_of(parts))

    http = httpx2.Client(transport=httpx2.MockTransport(serve))
    client = OpenAI(base_url="http://gateway.test/v1", api_key="k", http_client=http)
    with client.responses.stream(model="m", input="hi") as stream:
        texts = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    whole = response_answer(answer, asked)
    assert texts == "I'll check."
    assert [item.id for item in final.output] == [item["id"] for item in whole["output"]]
    assert final.output_text == "I'll check."
    calls = [(i.call_id, i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert calls == [
        (i["call_id"], i["name"], i["arguments"])
        for i in whole["output"]
        if i["type"] == "function_call"
    ]


@pytest.mark.parametrize(
    ("options", "streams"),
    [
        ({}, True),
        ({"weight_update": "in_flight"}, True),
        ({"token_in": True}, False),  # a call that continues the last goes to the token route
        ({"token_in": "completions", "max_tokens": 64}, True),  # not applied to an agent's calls
        ({"weight_update": "abort"}, False),  # an aborted answer is resumed, then joined
        ({"image_max_pixels": 28 * 28 * 16}, False),  # images prepared for the prompt
    ],
)
async def test_only_the_settings_that_need_whole_answers_forward_them_whole(
    options: dict[str, Any], streams: bool
) -> None:
    async with OpenAIChatPolicy(base_url="http://p.test/v1", model="m", **options) as policy:
        assert policy.streams_tokens is streams
        if not streams:
            with pytest.raises(RuntimeError, match="use forward"):
                async with policy.stream({"messages": []}):
                    pass


async def test_a_stream_that_breaks_before_its_first_chunk_is_tried_again() -> None:
    asked = []
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    last = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}

    async def flaky(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        first_try = len(asked) == 1

        async def events() -> Any:
            if first_try:
                raise httpx.ReadError("gone")
            for data in (chunk, last):
                yield f"data: {json.dumps(data)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    http = httpx.AsyncClient(transport=httpx.MockTransport(flaky))
    async with (
        http,
        OpenAIChatPolicy(
            base_url="http://p.test/v1", model="m", http_client=http, backoff_initial_s=0
        ) as policy,
    ):
        with anyio.fail_after(30):
            async with policy.stream({"messages": [{"role": "user", "content": "x"}]}) as s:
                assert [c async for c in s.chunks()] == [chunk, last]
    assert len(asked) == 2 and s.result()[1][0].content == "hi"
