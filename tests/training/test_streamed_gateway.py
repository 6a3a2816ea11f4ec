"""The gateway streams tokens as the server sends them, in each of its dialects.

The tiny model behind its vLLM-shaped server (:class:`~fleetroll.testing.model_server.ModelServer`)
streams a tool call; the server holds the rest of its stream after the first
token's chunk until the agent's SDK (the real ``openai`` and ``anthropic``
clients, in this process) has received that token's delta: a gateway that
waited for the whole answer would deadlock (bounded by ``fail_after``). Each
call's recorded turn is the non-streamed call's, token ids, logprobs and
token versions included. Skipped without the ``train`` extra.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from fleetroll.errors import PolicyError
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.policies.gateway import Gateway, GatewayRefusal
from fleetroll.policies.openai import Streamed
from fleetroll.policies.turns import AssistantTurn
from fleetroll.testing.model_server import ForcedRequest, ModelServer
from fleetroll.testing.tiny_model import save_tiny_model

pytestmark = pytest.mark.slow

SAID = "Let me look it up."
CALL = {"name": "get_balance", "arguments": {"account": "a-1"}}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_balance",
        "description": "An account's balance.",
        "parameters": {"type": "object", "properties": {"account": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", seed=0)


def forced(request: ForcedRequest) -> str:
    return f"{SAID}<tool_call>{json.dumps(CALL)}</tool_call>"


@dataclass
class Recorded:
    """A test link: the policy's calls, each turn recorded once the agent received it."""

    policy: OpenAIChatPolicy
    model: str = "served"
    turns: list[AssistantTurn] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    @asynccontextmanager
    async def complete(self, body: dict[str, Any]) -> AsyncIterator[Any]:
        raise AssertionError("a streamed call goes by stream()")
        yield

    @asynccontextmanager
    async def stream(self, body: dict[str, Any]) -> AsyncIterator[Any]:
        self.bodies.append(body)
        async with self.policy.stream(body) as streamed:
            pending = _Pending(streamed)
            yield pending
        if pending.got:
            self.turns += streamed.result()[1]

    async def relay(self, *args: Any) -> None:
        raise AssertionError("no MCP here")


class _Pending:
    def __init__(self, streamed: Streamed) -> None:
        self.streamed = streamed
        self.whole = streamed.whole
        self.got = False

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in self.streamed.chunks():
                yield chunk
        except PolicyError as exc:  # as the rollout's link: the dialect's error event
            raise GatewayRefusal(502, str(exc), kind="api_error") from None

    def answer(self) -> dict[str, Any]:
        return self.streamed.result()[0]

    def received(self) -> None:
        self.got = True


class Hold:
    """The server's ``stream_hold``: the rest of a stream waits for :meth:`seen`."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.held = 0

    async def __call__(self) -> None:
        self.held += 1
        await self.event.wait()

    def seen(self) -> None:
        self.event.set()


Agent = Callable[[str, str, Hold], Awaitable[dict[str, Any]]]


async def chat_agent(base_url: str, key: str, hold: Hold) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is the balance of a-1?"}],
            tools=[TOOL],  # type: ignore[list-item]
            stream=True,
        )
        text, arguments, name = "", "", None
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    hold.seen()
                    text += choice.delta.content
                for call in choice.delta.tool_calls or ():
                    name = name or (call.function.name if call.function else None)
                    arguments += (call.function.arguments or "") if call.function else ""
        return {"text": text, "name": name, "arguments": json.loads(arguments)}


async def anthropic_agent(base_url: str, key: str, hold: Hold) -> dict[str, Any]:
    root = base_url.removesuffix("/v1")
    client = AsyncAnthropic(base_url=root, api_key=key, max_retries=0)
    async with (
        client,
        client.messages.stream(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": "What is the balance of a-1?"}],
            tools=[{"name": "get_balance", "input_schema": TOOL["function"]["parameters"]}],  # type: ignore[index]
        ) as stream,
    ):
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                hold.seen()
        message = await stream.get_final_message()
    [text, use] = message.content
    assert text.type == "text" and use.type == "tool_use"
    assert message.stop_reason == "tool_use"
    return {"text": text.text, "name": use.name, "arguments": use.input}


async def responses_agent(base_url: str, key: str, hold: Hold) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        stream = await client.responses.create(
            model="m",
            input="What is the balance of a-1?",
            tools=[{"type": "function", "name": "get_balance", "parameters": {}}],  # type: ignore[list-item,typeddict-item]
            stream=True,
        )
        final = None
        async for event in stream:
            if event.type == "response.output_text.delta":
                hold.seen()
            if event.type == "response.completed":
                final = event.response
    assert final is not None
    [message, call] = final.output
    assert message.type == "message" and call.type == "function_call"
    return {
        "text": message.content[0].text,  # type: ignore[union-attr]
        "name": call.name,
        "arguments": json.loads(call.arguments),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "agent",
    [chat_agent, anthropic_agent, responses_agent],
    ids=["chat_completions", "messages", "responses"],
)
async def test_each_dialect_streams_tokens_as_they_come_and_records_them_exactly(
    model_dir: Path, agent: Agent
) -> None:
    hold = Hold()
    async with (
        ModelServer(model_dir, forced=forced, stream_hold=hold) as server,
        OpenAIChatPolicy(
            base_url=server.base_url, model="served", return_token_ids=True, logprobs=True
        ) as policy,
        Gateway(max_request_bytes=1 << 20) as gateway,
    ):
        link = Recorded(policy)
        with gateway.open(link) as opened, anyio.fail_after(120):
            got = await agent(opened.base_url, opened.key, hold)
        # The same call, not streamed: its turn is the streamed one's.
        with anyio.fail_after(120):
            _, (whole,) = await policy.forward(link.bodies[0])
        [(prompt, streamed_generation), (_, whole_generation)] = server.generations

    assert hold.held == 1  # the server held its stream: the agent got a token before the rest
    assert got == {"text": SAID, "name": "get_balance", "arguments": {"account": "a-1"}}
    [turn] = link.turns
    assert turn == whole
    data = turn.data
    assert data is not None and data.training_data_error is None
    assert data.prompt_token_ids == prompt
    assert data.completion_token_ids == streamed_generation.token_ids
    assert data.logprobs == streamed_generation.logprobs == whole_generation.logprobs
    assert data.token_versions == streamed_generation.token_versions
    assert turn.content == SAID and [c.name for c in turn.tool_calls] == ["get_balance"]


async def test_a_server_failing_mid_stream_ends_the_agent_s_stream_with_an_error() -> None:
    """The first chunk relayed, then the server's connection drops: the agent's SDK
    raises (the dialect's error event), nothing is recorded."""

    async def broken(request: httpx.Request) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            first = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
            delta = {"role": "assistant", "content": "Hel"}
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            yield f"data: {json.dumps({**first, 'choices': [choice]})}\n\n".encode()
            raise httpx.ReadError("the server went away")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    http = httpx.AsyncClient(transport=httpx.MockTransport(broken))
    async with (
        OpenAIChatPolicy(base_url="http://policy.test/v1", model="m", http_client=http) as policy,
        Gateway(max_request_bytes=1 << 20) as gateway,
        http,
    ):
        link = Recorded(policy)
        with gateway.open(link) as opened, anyio.fail_after(60):
            async with AsyncAnthropic(
                base_url=opened.anthropic_base_url, api_key=opened.key, max_retries=0
            ) as client:
                seen: list[str] = []
                with pytest.raises(Exception, match="the server went away"):
                    async with client.messages.stream(
                        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                    ) as stream:
                        async for event in stream:
                            seen.append(event.type)
    assert "text" in seen or "content_block_delta" in seen
    assert link.turns == []


@pytest.mark.timeout(300)
async def test_a_streamed_call_keeps_each_token_s_version_across_an_update_in_flight(
    model_dir: Path, tmp_path: Path
) -> None:
    """The weights change between the third and fourth tokens of each generation
    (``in_flight_updates``): the streamed call's turn has the server's per-token
    versions, as the non-streamed call's has."""
    newer = save_tiny_model(tmp_path / "newer", seed=1)
    server: ModelServer

    def update_after_three(generated: int) -> None:
        if generated == 3:
            anyio.from_thread.run(server.update_weights, newer)

    hold = Hold()
    hold.seen()  # nothing held: this test is about the versions
    server = ModelServer(
        model_dir, forced=forced, in_flight_updates=True, after_token=update_after_three
    )
    async with (
        server,
        OpenAIChatPolicy(
            base_url=server.base_url, model="served", return_token_ids=True, logprobs=True
        ) as policy,
        Gateway(max_request_bytes=1 << 20) as gateway,
    ):
        link = Recorded(policy)
        with gateway.open(link) as opened, anyio.fail_after(120):
            await chat_agent(opened.base_url, opened.key, hold)
        with anyio.fail_after(120):
            _, (whole,) = await policy.forward(link.bodies[0])
        [(_, streamed_generation), (_, whole_generation)] = server.generations

    [turn] = link.turns
    assert turn.data is not None and whole.data is not None
    versions = turn.data.token_versions
    assert versions is not None and versions[:4] == (0, 0, 0, 1) and set(versions) == {0, 1}
    assert versions == streamed_generation.token_versions
    assert whole.data.token_versions == whole_generation.token_versions
    assert whole.data.token_versions is not None and set(whole.data.token_versions) == {1, 2}
