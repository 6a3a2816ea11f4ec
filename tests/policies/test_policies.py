"""Policies: the scripted one, and the OpenAI one against a real HTTP server on loopback."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx
import pytest

from fleetroll.errors import PolicyError
from fleetroll.policies import (
    AssistantTurn,
    Message,
    OpenAIChatPolicy,
    Policy,
    ScriptedPolicy,
    ToolCall,
    ToolSpec,
)
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.rollout.transcript import Transcript, assistant_message
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.testing.fake_openai import (
    HANG,
    FakeChatServer,
    FakeError,
    FakeRawResponse,
    completion,
    tool_call,
    tool_calling_script,
)
from fleetroll.tools.session import ToolResult

API_KEY = "sk-test-5f3a9c1e7b2d4068"
#: Bounds every test's waiting; the policies' own deadlines are shorter.
TEST_DEADLINE_S = 10.0

TASK = TaskSpec(
    key="ledger-004",
    prompt="Pay off the Credit Card from Checking.",
    env_key="ledger",
    solution=(
        SolutionStep(name="get_balance", arguments={"account": "Credit Card"}),
        SolutionStep(
            name="record_transaction",
            arguments={"from_account": "Checking", "to_account": "Credit Card", "amount": 850},
        ),
    ),
)
TOOLS = (
    ToolSpec(
        name="get_balance",
        description="The balance of an account.",
        input_schema={
            "type": "object",
            "properties": {"account": {"type": "string"}},
            "required": ["account"],
        },
    ),
    ToolSpec(
        name="record_transaction",
        description="Move money between accounts.",
        input_schema={"type": "object", "properties": {"amount": {"type": "number"}}},
    ),
)
SCREENSHOT = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4"
    "DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
)
USER_MESSAGE: dict[str, Any] = {
    "role": "user",
    "content": [
        {"type": "text", "text": TASK.prompt},
        {"type": "image_url", "image_url": {"url": SCREENSHOT}},
    ],
}


@pytest.fixture(scope="module")
async def shared_fake_openai() -> AsyncIterator[FakeChatServer]:
    async with FakeChatServer() as server:
        yield server


@pytest.fixture
def fake_openai(shared_fake_openai: FakeChatServer) -> FakeChatServer:
    """A running fake chat completions server, fresh for each test; tests set its ``script``."""
    shared_fake_openai.reset()
    return shared_fake_openai


@pytest.fixture
async def policy(fake_openai: FakeChatServer) -> AsyncIterator[OpenAIChatPolicy]:
    """An OpenAI policy on the fake server, with retries fast enough for tests."""
    async with OpenAIChatPolicy(
        base_url=fake_openai.base_url,
        model="fake-model",
        api_key=API_KEY,
        timeout_s=5.0,
        max_retries=2,
        backoff_initial_s=0.001,
        backoff_max_s=0.01,
    ) as policy:
        yield policy


def transcript_after(messages: list[dict[str, Any]], turn: AssistantTurn) -> list[dict[str, Any]]:
    """The transcript with the turn and a tool result per call appended, as a rollout would."""
    assistant = assistant_message(turn)
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": f"{call.name} ok"}
        for call in turn.tool_calls
    ]
    return [*messages, assistant, *results]


async def act(policy: Policy, messages: Sequence[Message] | None = None) -> AssistantTurn:
    with anyio.fail_after(TEST_DEADLINE_S):
        return await policy.act(TASK, messages or [USER_MESSAGE], TOOLS)


# ---------------------------------------------------------------- scripted


async def test_the_scripted_policy_plays_the_solution_then_says_done() -> None:
    policy = ScriptedPolicy()
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK.prompt}]
    turns = []
    for _ in range(3):
        turn = await act(policy, messages)
        turns.append(turn)
        messages = transcript_after(messages, turn)

    assert [[(c.id, c.name, dict(c.arguments)) for c in t.tool_calls] for t in turns] == [
        [("call_0", "get_balance", {"account": "Credit Card"})],
        [
            (
                "call_1",
                "record_transaction",
                {"from_account": "Checking", "to_account": "Credit Card", "amount": 850},
            )
        ],
        [],
    ]
    assert turns[-1].content == "done"
    await policy.aclose()


def transcript_of(*answers: ToolResult) -> Transcript:
    """A rollout's transcript: the prompt, then each answer to the scripted policy's call."""
    transcript = Transcript()
    transcript.add_prompt(TASK.prompt)
    for turn, answer in enumerate(answers):
        call = ToolCall(id=f"call_{turn}", name="get_balance")
        transcript.add_turn(AssistantTurn(tool_calls=(call,)))
        transcript.add_answer(call, answer)
    return transcript


async def test_the_scripted_policy_plays_a_step_again_after_an_error_answer() -> None:
    policy = ScriptedPolicy(max_attempts=2)
    error = ToolResult(text="Error: injected fault", is_error=True)
    ok = ToolResult(text="Balance: 850")

    again = await act(policy, transcript_of(error).messages)
    after_ok = await act(policy, transcript_of(error, ok).messages)
    gave_up = await act(policy, transcript_of(error, error).messages)

    assert [(c.id, c.name) for c in again.tool_calls] == [("call_1", "get_balance")]
    assert [c.name for c in after_ok.tool_calls] == ["record_transaction"]
    assert [c.name for c in gave_up.tool_calls] == ["record_transaction"]


async def test_the_scripted_policy_replays_on_the_tools_error_flag_not_on_the_answers_text() -> (
    None
):
    policy = ScriptedPolicy(max_attempts=2)
    says_error = ToolResult(text="Error codes on this account: none. Balance: 850")
    flagged = ToolResult(text='{"status": "failed", "reason": "ledger locked"}', is_error=True)

    after_text = await act(policy, transcript_of(says_error).messages)
    after_flag = await act(policy, transcript_of(flagged).messages)

    assert [c.name for c in after_text.tool_calls] == ["record_transaction"]
    assert [c.name for c in after_flag.tool_calls] == ["get_balance"]


async def test_the_scripted_policy_refuses_a_task_without_a_solution() -> None:
    task = TASK.model_copy(update={"solution": None})

    with pytest.raises(PolicyError, match="has no solution") as caught:
        await ScriptedPolicy().act(task, [{"role": "user", "content": task.prompt}], TOOLS)

    assert caught.value.transient is False
    assert caught.value.operation == "policy"


async def test_both_policies_are_policies(policy: OpenAIChatPolicy) -> None:
    assert isinstance(ScriptedPolicy(), Policy)
    assert isinstance(policy, Policy)


# ------------------------------------------------------------------ openai


async def test_a_conversation_of_tool_calls_ends_with_the_final_answer(
    fake_openai: FakeChatServer,
) -> None:
    fake_openai.script = tool_calling_script(
        [("get_balance", {"account": "Credit Card"}), ("record_transaction", {"amount": 850})],
        final_answer="Paid.",
    )
    async with OpenAIChatPolicy(
        base_url=fake_openai.base_url,
        model="fake-model",
        api_key=API_KEY,
        temperature=0.7,
        top_p=0.9,
        max_tokens=256,
        extra_body={"top_k": 20, "temperature": 0.5},
        system_prompt="You are a bookkeeper.",
    ) as policy:
        messages: list[dict[str, Any]] = [USER_MESSAGE]
        turns = []
        for _ in range(3):
            turn = await act(policy, messages)
            turns.append(turn)
            messages = transcript_after(messages, turn)

    assert [[(c.id, c.name, c.arguments) for c in t.tool_calls] for t in turns] == [
        [("call_0", "get_balance", {"account": "Credit Card"})],
        [("call_1", "record_transaction", {"amount": 850})],
        [],
    ]
    assert [t.content for t in turns] == [None, None, "Paid."]
    assert turns[0].usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}

    first, last = fake_openai.requests[0], fake_openai.requests[-1]
    assert first["model"] == "fake-model"
    assert first["tools"] == [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.input_schema,
            },
        }
        for tool in TOOLS
    ]
    assert first["tool_choice"] == "auto"
    # extra_body wins over the sampling parameters it repeats.
    assert (first["temperature"], first["top_p"], first["max_tokens"], first["top_k"]) == (
        0.5,
        0.9,
        256,
        20,
    )
    assert first["messages"] == [
        {"role": "system", "content": "You are a bookkeeper."},
        USER_MESSAGE,
    ]
    assert last["messages"] == [
        {"role": "system", "content": "You are a bookkeeper."},
        *messages[:-1],  # the final assistant turn was never sent
    ]
    assert all(h["authorization"] == f"Bearer {API_KEY}" for h in fake_openai.headers)


async def test_a_system_prompt_is_not_added_to_a_transcript_that_has_one(
    fake_openai: FakeChatServer,
) -> None:
    fake_openai.script = [completion("hi")]
    own_system = {"role": "system", "content": "Be brief."}
    async with OpenAIChatPolicy(
        base_url=fake_openai.base_url, model="m", system_prompt="You are a bookkeeper."
    ) as policy:
        await act(policy, [own_system, USER_MESSAGE])

    assert fake_openai.requests[0]["messages"] == [own_system, USER_MESSAGE]
    assert "authorization" not in fake_openai.headers[0]


async def test_no_tools_means_no_tool_choice(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [completion("hi")]

    with anyio.fail_after(TEST_DEADLINE_S):
        turn = await policy.act(TASK, [USER_MESSAGE], [])

    assert turn == AssistantTurn(content="hi", usage=turn.usage, data=turn.data)
    assert "tools" not in fake_openai.requests[0]
    assert "tool_choice" not in fake_openai.requests[0]


async def test_arguments_that_are_not_a_json_object_become_an_arguments_error(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [
        completion(
            tool_calls=[
                tool_call("get_balance", '{"account": "Check', id="bad_json"),
                tool_call("get_balance", '["Checking"]', id="a_list"),
                tool_call("get_balance", "", id="empty"),
                tool_call("get_balance", '{"account":"Checking"}', id="good"),
            ]
        )
    ]

    turn = await act(policy)

    bad, a_list, empty, good = turn.tool_calls
    assert bad.arguments == {}
    assert bad.arguments_error is not None
    assert bad.arguments_error.startswith("arguments are not a JSON object: ")
    assert bad.raw_arguments == '{"account": "Check'
    assert a_list.arguments == {}
    assert a_list.arguments_error == 'arguments are not a JSON object: got list ["Checking"]'
    assert (empty.arguments, empty.arguments_error) == ({}, None)
    assert (good.arguments, good.arguments_error) == ({"account": "Checking"}, None)
    assert good.raw_arguments == '{"account":"Checking"}'


async def test_a_tool_call_without_an_id_gets_one(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [completion(tool_calls=[tool_call("a"), tool_call("b")])]

    turn = await act(policy)

    ids = [call.id for call in turn.tool_calls]
    assert all(ids) and len(set(ids)) == 2


async def test_server_errors_are_retried_until_one_succeeds(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [FakeError(500), FakeError(503), completion("recovered")]

    turn = await act(policy)

    assert turn.content == "recovered"
    assert len(fake_openai.requests) == 3
    assert fake_openai.requests[0] == fake_openai.requests[2]


async def test_a_rate_limit_is_retried_after_the_time_the_server_asks_for(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [
        FakeError(429, "slow down", headers={"Retry-After": "0"}),
        FakeError(429, "slow down", headers={"retry-after-ms": "5"}),
        completion("ok"),
    ]

    turn = await act(policy)

    assert turn.content == "ok"
    assert len(fake_openai.requests) == 3


async def test_a_retry_after_past_the_deadline_fails_at_once_and_is_transient(
    fake_openai: FakeChatServer,
) -> None:
    fake_openai.script = [FakeError(429, "slow down", headers={"Retry-After": "120"}), completion()]
    async with OpenAIChatPolicy(
        base_url=fake_openai.base_url, model="m", timeout_s=5.0, backoff_max_s=60.0
    ) as policy:
        with pytest.raises(
            PolicyError, match=r"HTTP 429: slow down.*pass the policy deadline"
        ) as caught:
            await act(policy)

    assert caught.value.transient is True
    assert len(fake_openai.requests) == 1


async def test_when_retries_run_out_the_error_names_the_status_and_the_body(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = lambda body: FakeError(502, "upstream model crashed")

    with pytest.raises(PolicyError) as caught:
        await act(policy)

    assert caught.value.transient is True
    assert "HTTP 502: upstream model crashed (attempt 3 of 3)" in str(caught.value)
    assert len(fake_openai.requests) == 3


async def test_a_client_error_fails_at_once_and_is_not_transient(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [FakeError(400, "'messages' is too long"), completion("never")]

    with pytest.raises(PolicyError, match=r"HTTP 400: 'messages' is too long") as caught:
        await act(policy)

    assert caught.value.transient is False
    assert len(fake_openai.requests) == 1


async def test_a_hanging_server_fails_within_the_policy_deadline(
    fake_openai: FakeChatServer,
) -> None:
    fake_openai.script = [HANG]
    async with OpenAIChatPolicy(base_url=fake_openai.base_url, model="m", timeout_s=0.5) as policy:
        with pytest.raises(PolicyError, match=r"within the policy deadline of 0\.5s") as caught:
            await act(policy)

    assert caught.value.transient is True


async def test_the_api_key_is_sent_but_never_appears_in_an_error(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    echo = f"bad key {API_KEY}; you sent Authorization: Bearer {API_KEY}"
    fake_openai.script = [
        FakeError(401, echo),
        FakeError(500, echo),
        FakeError(500, echo),
        FakeError(500, echo),
        FakeRawResponse(echo),
    ]
    errors = []
    for _ in range(3):
        with pytest.raises(PolicyError) as caught:
            await act(policy)
        errors.append(caught.value)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    async with OpenAIChatPolicy(
        base_url=f"http://127.0.0.1:{closed_port}/v1",
        model="m",
        api_key=API_KEY,
        max_retries=1,
        backoff_initial_s=0.001,
    ) as unreachable:
        with pytest.raises(PolicyError, match="could not reach") as caught:
            await act(unreachable)
        errors.append(caught.value)

    assert fake_openai.headers[0]["authorization"] == f"Bearer {API_KEY}"
    assert [e.transient for e in errors] == [False, True, False, True]
    assert "HTTP 401: bad key ***" in str(errors[0])
    for error in errors:
        assert API_KEY not in str(error)
        assert API_KEY not in repr(error)
        assert API_KEY not in repr(error.args)
    assert API_KEY not in repr(policy)


async def test_a_body_that_is_not_json_is_a_policy_error(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy
) -> None:
    fake_openai.script = [FakeRawResponse('{"choices": [{"message": ', media_type="text/plain")]

    with pytest.raises(PolicyError, match=r'HTTP 200 with a body that is not JSON: \{"choices"'):
        await act(policy)

    assert len(fake_openai.requests) == 1


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"object": "chat.completion"}, "no 'choices'"),
        ({"choices": []}, "no 'choices'"),
        ({"choices": [{"text": "hi"}]}, "choices[0] has no 'message' object"),
        (
            {"choices": [{"message": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]},
            "tool_calls[0] has no function name",
        ),
    ],
)
async def test_a_body_that_is_not_a_chat_completion_is_a_policy_error(
    fake_openai: FakeChatServer, policy: OpenAIChatPolicy, body: dict[str, Any], problem: str
) -> None:
    fake_openai.script = [body]

    with pytest.raises(PolicyError) as caught:
        await act(policy)

    assert problem in str(caught.value)
    assert caught.value.transient is False


async def test_the_policy_is_built_from_the_settings(fake_openai: FakeChatServer) -> None:
    fake_openai.script = [completion("ok")]
    settings = load_settings(
        openai_api_key=API_KEY,
        policy={
            "kind": "openai",
            "base_url": fake_openai.base_url,
            "model": "served-model",
            "temperature": 0.2,
            "extra_body": {"top_k": 5},
            "max_retries": 4,
        },
        timeouts={"policy_s": 42},
    )

    async with OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy:
        await act(policy)

    assert (policy.timeout_s, policy.max_retries) == (42, 4)
    body = fake_openai.requests[0]
    assert (body["model"], body["temperature"], body["top_k"]) == ("served-model", 0.2, 5)
    assert fake_openai.headers[0]["authorization"] == f"Bearer {API_KEY}"


async def test_a_client_it_was_given_is_left_open(fake_openai: FakeChatServer) -> None:
    fake_openai.script = [completion("ok")]
    async with httpx.AsyncClient() as client:
        async with OpenAIChatPolicy(
            base_url=fake_openai.base_url, model="m", http_client=client
        ) as policy:
            await act(policy)

        assert not client.is_closed


async def test_the_policy_opens_connections_within_timeouts_policy_connect_s() -> None:
    settings = load_settings(
        policy={"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"},
        timeouts={"policy_connect_s": 2.5},
    )
    async with OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy:
        assert policy._client.timeout.connect == 2.5
        assert policy._client.timeout.read == settings.timeouts.policy_s


def test_a_policy_made_from_settings_pickles_as_its_recipe_and_one_made_by_hand_refuses() -> None:
    import pickle

    from fleetroll.policies.openai import PolicyRecipe

    settings = load_settings(
        policy={"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"},
        openai_api_key=API_KEY,
    )
    policy = OpenAIChatPolicy.from_config(chat_policy_config(settings))
    recipe = pickle.loads(pickle.dumps(policy))
    assert isinstance(recipe, PolicyRecipe) and recipe.config == chat_policy_config(settings)
    remade = recipe.make()
    assert type(remade) is OpenAIChatPolicy and remade.model == "m" and remade.url == policy.url
    # Made again elsewhere, it keeps its key: a process makes one per recipe.
    assert pickle.loads(pickle.dumps(remade)).key == recipe.key
    with pytest.raises(TypeError, match=r"OpenAIChatPolicy\.from_config"):
        pickle.dumps(OpenAIChatPolicy(base_url="http://127.0.0.1:9/v1", model="m"))
