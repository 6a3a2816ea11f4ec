"""Training data at the policy level: what is asked for, what is parsed, how requests are built.

Narrow HTTP cases use ``httpx.MockTransport``; the vLLM-shaped fake server is
checked against its own records. No emulator here (see test_training_rollouts.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import anyio
import httpx
import pytest

from fleetroll.errors import ContextOverflowError, PolicyError
from fleetroll.policies import AssistantTurn, OpenAIChatPolicy, ToolCall, ToolSpec, TurnData
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.rollout.progress import Progress, RolloutIds
from fleetroll.rollout.transcript import Transcript
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Redactor
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    VllmShape,
    completion,
    tool_call,
    toy_tokenize,
)
from fleetroll.tools.session import ToolResult

TEST_DEADLINE_S = 10.0
TASK = TaskSpec(key="t", prompt="Pay the rent.", env_key="ledger")
TOOLS = (
    ToolSpec(
        name="record_transaction",
        description="Move money.",
        input_schema={"type": "object", "properties": {"amount": {"type": "number"}}},
    ),
)
PROMPT = [{"role": "user", "content": "Pay the rent."}]

#: A completion as vLLM answers it with return_token_ids and logprobs (top_logprobs=2).
VLLM_ANSWER: dict[str, Any] = {
    **completion(tool_calls=[tool_call("record_transaction", {"amount": 5}, id="c0")]),
    "model": "qwen3-8b",
    "prompt_token_ids": [151644, 872, 198],
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [tool_call("record_transaction", {"amount": 5}, id="c0")],
            },
            "finish_reason": "tool_calls",
            "token_ids": [151657, 42, 151658],
            "logprobs": {
                "content": [
                    {
                        "token": t,
                        "logprob": lp,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": lp, "bytes": None},
                            {"token": "x", "logprob": lp - 1.5, "bytes": None},
                        ],
                    }
                    for t, lp in (("<tool_call>", -0.01), ("{", -0.25), ("</tool_call>", -0.5))
                ]
            },
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}


def mock_policy(
    answer: Callable[[dict[str, Any]], httpx.Response], **kwargs: Any
) -> tuple[OpenAIChatPolicy, list[dict[str, Any]]]:
    """A policy whose endpoint is ``answer``; the second value collects the request bodies."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return answer(bodies[-1])

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    policy = OpenAIChatPolicy(
        base_url="http://model.test/v1", model="m", http_client=client, max_retries=0, **kwargs
    )
    return policy, bodies


async def act(policy: OpenAIChatPolicy, messages: Any = None) -> AssistantTurn:
    with anyio.fail_after(TEST_DEADLINE_S):
        return await policy.act(TASK, PROMPT if messages is None else messages, TOOLS)


# -- asking -------------------------------------------------------------------------------


async def test_token_ids_and_logprobs_are_asked_for_only_when_configured() -> None:
    plain, plain_bodies = mock_policy(lambda body: httpx.Response(200, json=VLLM_ANSWER))
    asking, asking_bodies = mock_policy(
        lambda body: httpx.Response(200, json=VLLM_ANSWER),
        return_token_ids=True,
        logprobs=True,
        top_logprobs=2,
    )
    await act(plain)
    await act(asking)

    assert not {"return_token_ids", "logprobs", "top_logprobs"} & set(plain_bodies[0])
    assert asking_bodies[0]["return_token_ids"] is True
    assert asking_bodies[0]["logprobs"] is True and asking_bodies[0]["top_logprobs"] == 2


def test_the_settings_reach_the_policy() -> None:
    settings = load_settings(
        policy={"kind": "openai", "return_token_ids": True, "logprobs": True, "top_logprobs": 3}
    )
    policy = OpenAIChatPolicy.from_config(chat_policy_config(settings))
    body = policy._body(PROMPT, TOOLS)
    assert (body["return_token_ids"], body["logprobs"], body["top_logprobs"]) == (True, True, 3)


# -- parsing ------------------------------------------------------------------------------


async def test_vllm_s_token_ids_and_logprobs_are_parsed_exactly() -> None:
    policy, bodies = mock_policy(
        lambda body: httpx.Response(200, json=VLLM_ANSWER),
        return_token_ids=True,
        logprobs=True,
        top_logprobs=2,
    )
    turn = await act(policy)
    assert turn.data == TurnData(
        model="qwen3-8b",
        finish_reason="tool_calls",
        prompt_token_ids=(151644, 872, 198),
        completion_token_ids=(151657, 42, 151658),
        logprobs=(-0.01, -0.25, -0.5),
        top_logprobs=(
            (("<tool_call>", -0.01), ("x", -1.51)),
            (("{", -0.25), ("x", -1.75)),
            (("</tool_call>", -0.5), ("x", -2.0)),
        ),
        tools=tuple(bodies[0]["tools"]),
    )
    assert turn.tool_calls[0].arguments == {"amount": 5}


async def test_an_openai_like_server_gives_nulls_and_one_warning_per_missing_field(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer = completion("done")  # no token ids, no logprobs
    policy, bodies = mock_policy(
        lambda body: httpx.Response(200, json=answer), return_token_ids=True, logprobs=True
    )
    with caplog.at_level(logging.WARNING, logger="fleetroll.policies.openai"):
        turns = [await act(policy) for _ in range(5)]

    shown = tuple(bodies[0]["tools"])
    assert {t.data for t in turns} == {
        TurnData(model="fake-model", finish_reason="stop", tools=shown)
    }
    warnings = [r.getMessage() for r in caplog.records if r.name == "fleetroll.policies.openai"]
    assert len(warnings) == 1
    assert "prompt_token_ids, completion_token_ids, logprobs" in warnings[0]


async def test_token_data_not_asked_for_is_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy, bodies = mock_policy(lambda body: httpx.Response(200, json=completion("done")))
    with caplog.at_level(logging.WARNING, logger="fleetroll.policies.openai"):
        turn = await act(policy)
    assert turn.data == TurnData(
        model="fake-model", finish_reason="stop", tools=tuple(bodies[0]["tools"])
    )
    assert not [r for r in caplog.records if r.name == "fleetroll.policies.openai"]


async def test_a_turn_says_what_its_call_showed_the_model_besides_the_conversation() -> None:
    policy, bodies = mock_policy(
        lambda body: httpx.Response(200, json=completion("done")), system_prompt="Be brief."
    )
    turn = await act(policy)
    own = [{"role": "system", "content": "Mine."}, *PROMPT]
    with_own = await act(policy, own)

    assert turn.data is not None and with_own.data is not None
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert turn.data.system_prompt == "Be brief."
    assert turn.data.tools == tuple(bodies[0]["tools"])
    assert turn.data.tools == (
        {
            "type": "function",
            "function": {
                "name": "record_transaction",
                "description": "Move money.",
                "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}},
            },
        },
    )
    assert with_own.data.system_prompt == "Mine."  # the transcript's own, not prepended


async def test_a_forwarded_request_s_turns_show_the_agent_s_system_message_and_tools() -> None:
    policy, _ = mock_policy(lambda body: httpx.Response(200, json=completion("done")))
    parts = [{"type": "text", "text": "You are"}, {"type": "text", "text": "an agent."}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"messages": [{"role": "system", "content": parts}, *PROMPT], "tools": tools}

    with anyio.fail_after(TEST_DEADLINE_S):
        _, (turn,) = await policy.forward(body)
        _, (bare,) = await policy.forward({"messages": PROMPT})

    assert turn.data is not None and bare.data is not None
    assert turn.data.system_prompt == "You are\nan agent."
    assert turn.data.tools == tuple(tools)
    assert bare.data.system_prompt is None and bare.data.tools is None


async def test_a_length_finish_with_cut_arguments_is_an_arguments_error_not_a_crash() -> None:
    cut = completion(tool_calls=[tool_call("record_transaction", '{"amount": 5', id="c0")])
    cut["choices"][0]["finish_reason"] = "length"
    policy, _ = mock_policy(lambda body: httpx.Response(200, json=cut))
    turn = await act(policy)
    assert turn.data is not None and turn.data.finish_reason == "length"
    (call,) = turn.tool_calls
    assert call.arguments_error is not None and call.raw_arguments == '{"amount": 5'


@pytest.mark.parametrize(
    "message",
    [
        # vLLM
        "This model's maximum context length is 4096 tokens. However, you requested 5000"
        " tokens (4000 in the messages, 1000 in the completion).",
        # SGLang
        "Input length (5000 tokens) exceeds the maximum allowed length (4096 tokens).",
    ],
)
async def test_a_server_s_context_length_400_is_a_context_overflow(message: str) -> None:
    error = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    policy, _ = mock_policy(lambda body: httpx.Response(400, json=error))
    with pytest.raises(ContextOverflowError, match=r"context|length") as caught:
        await act(policy)
    assert not caught.value.transient


async def test_another_400_stays_a_plain_policy_error() -> None:
    error = {"error": {"message": "unknown field 'foo'", "code": 400}}
    policy, _ = mock_policy(lambda body: httpx.Response(400, json=error))
    with pytest.raises(PolicyError) as caught:
        await act(policy)
    assert not isinstance(caught.value, ContextOverflowError)


# -- building requests --------------------------------------------------------------------


def screenshot(n: int, size: int = 2048) -> str:
    return "data:image/png;base64," + chr(ord("A") + n % 26) * size


def computer_transcript(turns: int, max_images: int | None = None) -> Transcript:
    transcript = Transcript(max_images=max_images)
    transcript.add_prompt("Fill in the form.")
    for n in range(turns):
        call = ToolCall(id=f"call_{n}", name="computer", arguments={"action": "screenshot"})
        transcript.add_turn(AssistantTurn(tool_calls=(call,)))
        transcript.add_answer(call, ToolResult(text="ok", images=(screenshot(n),)))
    return transcript


async def test_a_request_from_encoded_messages_is_the_same_json_as_encoding_it_whole() -> None:
    policy, bodies = mock_policy(
        lambda body: httpx.Response(200, json=completion("done")), system_prompt="Be brief."
    )
    transcript = computer_transcript(3)
    await act(policy, transcript.messages)
    expected = policy._body(list(transcript.messages), TOOLS)
    assert bodies[0] == json.loads(json.dumps(expected))


async def test_each_message_is_encoded_once_however_many_requests_carry_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fleetroll.rollout.transcript as transcript_module

    encoded: list[object] = []
    real_dumps = json.dumps

    def counting_dumps(value: Any, **kwargs: Any) -> str:
        encoded.append(value)
        return real_dumps(value, **kwargs)

    monkeypatch.setattr(transcript_module.json, "dumps", counting_dumps)
    policy, _ = mock_policy(lambda body: httpx.Response(200, json=completion("done")))
    transcript = computer_transcript(0)
    for n in range(10):
        call = ToolCall(id=f"call_{n}", name="computer", arguments={"action": "screenshot"})
        transcript.add_turn(AssistantTurn(tool_calls=(call,)))
        transcript.add_answer(call, ToolResult(text="ok", images=(screenshot(n),)))
        await act(policy, transcript.messages)

    messages = [m for m in encoded if isinstance(m, dict) and "role" in m]
    assert len(messages) == len(transcript.messages)  # 1 prompt + 10 x 3, not 10 x 31 / 2


def test_max_images_keeps_the_last_n_screenshots_and_the_transcript_says_so() -> None:
    transcript = computer_transcript(5, max_images=2)
    images = [
        part["image_url"]["url"]
        for m in transcript.messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    ]
    placeholders = [
        part["text"]
        for m in transcript.messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "text" and part["text"].startswith("[screenshot omitted")
    ]
    assert images == [screenshot(3), screenshot(4)]
    assert placeholders == ["[screenshot omitted: only the last 2 are sent]"] * 3


def test_an_elided_message_is_encoded_again_in_its_new_form() -> None:
    transcript = computer_transcript(1, max_images=1)
    index = len(transcript.messages) - 1
    assert b"image_url" in transcript.messages.encoded(index)
    call = ToolCall(id="call_x", name="computer", arguments={})
    transcript.add_turn(AssistantTurn(tool_calls=(call,)))
    transcript.add_answer(call, ToolResult(text="ok", images=(screenshot(9),)))
    assert b"image_url" not in transcript.messages.encoded(index)
    assert b"screenshot omitted" in transcript.messages.encoded(index)


# -- recording ----------------------------------------------------------------------------


def test_the_context_estimate_is_the_server_s_count_plus_the_text_added_since() -> None:
    progress = Progress()
    progress.transcript.add_prompt("x" * 40)
    assert progress.context_estimate() == 10
    turn = AssistantTurn(
        tool_calls=(ToolCall(id="c", name="n", raw_arguments="{}"),),
        usage={"prompt_tokens": 100, "completion_tokens": 20},
        data=TurnData(),
    )
    progress.record_turn(turn, policy_version=3, latency_s=0.5)
    progress.transcript.add_turn(turn)
    progress.transcript.add_answer(turn.tool_calls[0], ToolResult(text="y" * 81))
    assert progress.context_estimate() == 100 + 20 + 21
    assert progress.turns[0].policy_version == 3
    assert (progress.cost.prompt_tokens, progress.cost.completion_tokens) == (100, 20)


# -- the vLLM-shaped fake server ----------------------------------------------------------


async def test_the_vllm_shaped_fake_answers_token_ids_logprobs_and_usage_it_records() -> None:
    reply = completion(tool_calls=[tool_call("record_transaction", {"amount": 5}, id="c0")])
    async with FakeChatServer([reply], vllm=VllmShape()) as server:
        async with OpenAIChatPolicy(
            base_url=server.base_url,
            model="served-model",
            return_token_ids=True,
            top_logprobs=2,
            timeout_s=5,
        ) as policy:
            turn = await act(policy)
        (sent,) = server.replies
    choice = sent["choices"][0]
    assert turn.data is not None
    assert turn.data.model == sent["model"] == "served-model"
    assert list(turn.data.prompt_token_ids or ()) == sent["prompt_token_ids"]
    assert list(turn.data.completion_token_ids or ()) == choice["token_ids"]
    assert choice["token_ids"][:-1] == toy_tokenize('record_transaction {"amount": 5}')
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == list(turn.data.logprobs or ())
    assert turn.usage == {
        "prompt_tokens": len(sent["prompt_token_ids"]),
        "completion_tokens": len(choice["token_ids"]),
        "total_tokens": len(sent["prompt_token_ids"]) + len(choice["token_ids"]),
    }


async def test_the_vllm_shaped_fake_refuses_a_prompt_over_its_context_like_vllm() -> None:
    async with FakeChatServer([completion("x")], vllm=VllmShape(max_context=5)) as server:
        async with OpenAIChatPolicy(base_url=server.base_url, model="m", timeout_s=5) as policy:
            with pytest.raises(ContextOverflowError, match="maximum context length is 5"):
                await act(policy)
        assert server.replies == []


async def test_a_batch_over_http_asks_for_token_data_as_the_server_or_the_request_says() -> None:
    from fleetroll.service.app import build_policy
    from fleetroll.service.models import PolicyConfig

    settings = load_settings(policy={"kind": "openai", "return_token_ids": True})
    by_server = build_policy(None, settings)
    by_request = build_policy(
        PolicyConfig(return_token_ids=False, logprobs=True, top_logprobs=1), settings
    )
    try:
        assert isinstance(by_server, OpenAIChatPolicy)
        assert isinstance(by_request, OpenAIChatPolicy)
        assert by_server._body(PROMPT, TOOLS)["return_token_ids"] is True
        body = by_request._body(PROMPT, TOOLS)
        assert "return_token_ids" not in body
        assert (body["logprobs"], body["top_logprobs"]) == (True, 1)
    finally:
        await by_server.aclose()
        await by_request.aclose()


# -- training data that cannot be trained on ----------------------------------------------


def vllm_answer(*, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """VLLM_ANSWER with these completion token ids and logprobs (no alternatives)."""
    choice = {
        **VLLM_ANSWER["choices"][0],
        "token_ids": token_ids,
        "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in logprobs]},
    }
    return {**VLLM_ANSWER, "choices": [choice]}


def raw(answer: dict[str, Any]) -> httpx.Response:
    """``answer`` as JSON, with NaN and Infinity as Python writes them (vLLM has sent them)."""
    return httpx.Response(200, content=json.dumps(answer).encode())


@pytest.mark.parametrize(
    ("answer", "why", "logprobs"),
    [
        (
            vllm_answer(token_ids=[1, 2, 3], logprobs=[-0.1, float("nan"), -0.2]),
            "non-finite logprobs: nan (dropped)",
            None,
        ),
        (
            vllm_answer(token_ids=[1, 2, 3], logprobs=[-0.1, float("-inf"), -0.2]),
            "non-finite logprobs: -inf (dropped)",
            None,
        ),
        (
            vllm_answer(token_ids=[1, 2, 3], logprobs=[-0.1, -0.2]),
            "logprobs and completion_token_ids of different lengths: 2 and 3",
            (-0.1, -0.2),
        ),
        (
            vllm_answer(token_ids=[1, -5, 3], logprobs=[-0.1, -0.2, -0.3]),
            "negative completion_token_ids: -5 is no token id",
            (-0.1, -0.2, -0.3),
        ),
    ],
)
async def test_a_turn_with_unusable_training_data_is_flagged_with_one_warning_saying_why(
    answer: dict[str, Any],
    why: str,
    logprobs: tuple[float, ...] | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy, _ = mock_policy(lambda body: raw(answer), return_token_ids=True, logprobs=True)
    with caplog.at_level(logging.WARNING, logger="fleetroll.policies.openai"):
        turns = [await act(policy) for _ in range(3)]

    assert all(t.data is not None and t.data.training_data_error == why for t in turns)
    assert all(t.data is not None and t.data.logprobs == logprobs for t in turns)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fleetroll.policies.openai"]
    assert len(warnings) == 1 and why in warnings[0]
    progress = Progress()
    progress.record_turn(turns[0], policy_version=0, latency_s=0.1)
    assert progress.turns[0].training_data_error == why
    # The result is still valid JSON that reads back (no NaN in it).
    assert json.loads(progress.turns[0].model_dump_json())["training_data_error"] == why


async def test_good_training_data_is_not_flagged() -> None:
    policy, _ = mock_policy(
        lambda body: httpx.Response(200, json=VLLM_ANSWER), return_token_ids=True, logprobs=True
    )
    turn = await act(policy)
    assert turn.data is not None and turn.data.training_data_error is None


# -- the answer's size ----------------------------------------------------------------------


class Endless(httpx.AsyncByteStream):
    """A body that never ends, counting what was pulled of it and whether it was closed."""

    def __init__(self) -> None:
        self.pulled = 0
        self.closed = False

    async def __aiter__(self) -> Any:
        while True:
            self.pulled += 65536
            yield b" " * 65536

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize("status", [200, 500])
async def test_a_chat_answer_over_max_answer_bytes_is_a_policy_error_read_no_further(
    status: int,
) -> None:
    body = Endless()
    policy, _ = mock_policy(
        lambda request: httpx.Response(status, stream=body), max_answer_bytes=1024 * 1024
    )

    with pytest.raises(PolicyError, match=r"policy.max_answer_bytes \(1048576 bytes\)") as failed:
        await act(policy)

    assert not failed.value.transient
    assert 1024 * 1024 < body.pulled <= 1024 * 1024 + 65536 and body.closed


def test_the_answer_cap_setting_reaches_the_policy() -> None:
    settings = load_settings(policy={"kind": "openai", "max_answer_bytes": 4096})
    assert OpenAIChatPolicy.from_config(chat_policy_config(settings)).max_answer_bytes == 4096


def test_a_result_keeps_what_its_first_call_showed_the_model_redacted() -> None:
    secret = "sk-shown-secret-1234"
    schema = MappingProxyType({"type": "object", "properties": {"n": {"type": "integer"}}})
    first = {
        "type": "function",
        "function": {"name": "f", "description": f"key {secret}", "parameters": schema},
    }
    shared = {"type": "object", "properties": {"x": {"type": "string"}}}
    second = {"type": "function", "function": {"name": "g", "parameters": shared}}
    progress = Progress()
    progress.transcript.add_prompt("Pay the rent.")
    for system, tools in (("Be brief.", (first, second)), ("Later.", None)):
        turn = AssistantTurn(content="ok", data=TurnData(system_prompt=system, tools=tools))
        progress.record_turn(turn, policy_version=0, latency_s=0.0)
    progress.reward = 1.0

    result = progress.result(
        RolloutIds(batch_id="b", rollout_id="r"),
        TASK,
        None,
        redact=Redactor([secret]),
        keep_images=False,
    )

    assert result.system_prompt == "Be brief."
    assert result.tools == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "key [REDACTED]",
                "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
            },
        },
        second,
    ]
    assert type(result.tools[0]["function"]["parameters"]) is dict
    # What needed no redaction is the listing's own object (shared by rollouts), not a copy.
    assert result.tools[1]["function"]["parameters"] is shared
    assert json.loads(result.model_dump_json())["tools"] == result.tools


def test_a_result_of_no_model_call_shows_nothing() -> None:
    progress = Progress()
    progress.record_turn(AssistantTurn(content="scripted"), policy_version=0, latency_s=0.0)
    progress.reward = 1.0
    result = progress.result(
        RolloutIds(batch_id="b", rollout_id="r"), TASK, None, redact=str, keep_images=False
    )

    assert result.system_prompt is None and result.tools is None
