"""A Claude-style agent (the real ``anthropic`` SDK, examples/agent_anthropic_mcp.py)
through the gateway's ``/v1/messages``, and a Codex-style one (the real ``openai``
SDK's Responses API, examples/agent_responses_mcp.py) through its ``/v1/responses``:
each solves the example tool-use tasks on the emulator, streamed (from a server that
streams a chunk per token) and not, every call recorded with the server's exact token
ids and logprobs; and what the gateway cannot serve gets the dialect's error shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.settings import load_settings
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape, completion
from training_helpers import TASKS, sent_and_recorded, solving

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AGENT = EXAMPLES / "agent_anthropic_mcp.py"
RESPONSES_AGENT = EXAMPLES / "agent_responses_mcp.py"
LEDGER = [TASKS["ledger-001"], TASKS["ledger-002"]]


async def solved_by_an_agent(agent: Path, *, streaming: bool) -> list[dict[str, Any]]:
    """The ledger tasks, twice each, by ``agent`` through the gateway on the emulator:
    every one solved, every turn's token ids and logprobs the server's own.
    Returns the requests the policy server received."""
    async with (
        Emulator() as emu,
        FakeChatServer(solving(LEDGER), vllm=VllmShape(stream=streaming)) as server,
    ):
        policy = {"kind": "openai", "base_url": server.base_url, "model": "served"}
        policy |= {"return_token_ids": True, "logprobs": True}
        settings = load_settings(policy=policy, pool={"concurrency": 4})
        argv = [sys.executable, str(agent), *(["--stream"] if streaming else [])]
        async with (
            RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
            CommandAgent.from_config(argv, chat_policy_config(settings)) as runner,
        ):
            with anyio.fail_after(180):
                results = await pool.run_batch(LEDGER, runner, samples_per_task=2).results()
        replies, requests = list(server.replies), list(server.requests)
        assert emu.ledger.running == 0

    assert sorted((r.task_key, r.status, r.reward) for r in results) == sorted(
        (t.key, "completed", 1.0) for t in LEDGER for _ in range(2)
    ), [r.error for r in results]
    assert all(r.final_answer == "done" for r in results)
    sent, recorded = sent_and_recorded(replies, results)
    assert recorded == sent and sum(len(r.turns) for r in results) == len(replies)
    # A streamed call was streamed from the server (chunk by chunk, assembled for its turn).
    assert all(q.get("stream", False) is streaming for q in requests)
    return requests


@pytest.mark.parametrize("streaming", [False, True], ids=["not_streaming", "streaming"])
async def test_the_anthropic_agent_solves_the_tasks_with_the_server_s_exact_token_ids(
    streaming: bool,
) -> None:
    requests = await solved_by_an_agent(AGENT, streaming=streaming)
    # Each call was translated to the chat route: the tools as functions, the tool
    # results as tool messages, the training fields the policy asks for.
    assert all(q["model"] == "served" and q["return_token_ids"] and q["logprobs"] for q in requests)
    assert all(q["max_tokens"] == 1024 and q["tools"][0]["type"] == "function" for q in requests)
    followed = [q for q in requests if any(m["role"] == "tool" for m in q["messages"])]
    assert followed and all(
        m["tool_call_id"].startswith("call_")
        for q in followed
        for m in q["messages"]
        if m["role"] == "tool"
    )


#: Calls with the standard library, in the Messages API's form: the answers as
#: the final answer.
CALLS = """
import http.client, json, os, urllib.parse
base, key = os.environ["ANTHROPIC_BASE_URL"], os.environ["ANTHROPIC_API_KEY"]
root = urllib.parse.urlsplit(base)

def call(body, headers=None, path="/v1/messages"):
    conn = http.client.HTTPConnection(root.hostname, root.port, timeout=30)
    try:
        sent = {"x-api-key": key, "anthropic-version": "2023-06-01",
                "Content-Type": "application/json", **(headers or {})}
        conn.request("POST", root.path + path, json.dumps(body).encode(), sent)
        answer = conn.getresponse()
        return [answer.status, json.loads(answer.read())]
    finally:
        conn.close()

hi = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
    json.dump({
        "ok": call(hi),
        "bad_key": call(hi, {"x-api-key": "not-the-key"}),
        "document": call({**hi, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}]}),
        "server_tool": call({**hi, "tools": [{"type": "web_search_20250305", "name": "w"}]}),
        "not_json": call("just a string"),
        "count_tokens": call(hi, path="/v1/messages/count_tokens"),
    }, f)
"""


async def test_what_the_gateway_cannot_serve_gets_anthropic_s_error_shape_never_a_hang() -> None:
    async with (
        Emulator() as emu,
        FakeChatServer([completion("hello")] * 4, vllm=VllmShape()) as server,
    ):
        settings = load_settings(policy={"kind": "openai", "base_url": server.base_url})
        async with (
            RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
            CommandAgent.from_config(
                [sys.executable, "-c", CALLS], chat_policy_config(settings)
            ) as agent,
        ):
            with anyio.fail_after(60):
                [result] = await pool.run_batch(LEDGER[:1], agent).results()
        requests = list(server.requests)

    assert result.final_answer is not None, result.error
    seen = json.loads(result.final_answer)
    status, ok = seen.pop("ok")
    assert status == 200 and ok["type"] == "message"
    assert ok["content"] == [{"type": "text", "text": "hello"}]
    assert {name: status for name, (status, _) in seen.items()} == {
        "bad_key": 401,
        "document": 400,
        "server_tool": 400,
        "not_json": 400,
        "count_tokens": 404,
    }
    for _, body in seen.values():
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert seen["bad_key"][1]["error"]["type"] == "authentication_error"
    assert "cannot translate a 'document' block" in seen["document"][1]["error"]["message"]
    assert seen["count_tokens"][1]["error"]["type"] == "not_found_error"
    assert len(requests) == 1 and len(result.turns) == 1  # only the call that could go


@pytest.mark.parametrize("streaming", [False, True], ids=["not_streaming", "streaming"])
async def test_the_responses_agent_solves_the_tasks_with_the_server_s_exact_token_ids(
    streaming: bool,
) -> None:
    requests = await solved_by_an_agent(RESPONSES_AGENT, streaming=streaming)
    # Each call was translated to the chat route: the instructions as the system
    # prompt, the tools as functions, each function_call_output as a tool message
    # answering its call_id, the training fields the policy asks for.
    assert all(q["model"] == "served" and q["return_token_ids"] and q["logprobs"] for q in requests)
    assert all(q["max_tokens"] == 1024 and q["tools"][0]["type"] == "function" for q in requests)
    assert all(q["messages"][0]["role"] == "system" for q in requests)
    followed = [q for q in requests if any(m["role"] == "tool" for m in q["messages"])]
    assert followed
    for q in followed:
        asked = {c["id"] for m in q["messages"] for c in m.get("tool_calls") or []}
        answered = {m["tool_call_id"] for m in q["messages"] if m["role"] == "tool"}
        assert answered == asked and all(a.startswith("call_") for a in answered)


#: Calls with the standard library, in the Responses API's form: the answers as
#: the final answer.
RESPONSES_CALLS = """
import http.client, json, os, urllib.parse
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
root = urllib.parse.urlsplit(base)

def call(body, headers=None, path="/responses"):
    conn = http.client.HTTPConnection(root.hostname, root.port, timeout=30)
    try:
        sent = {"Authorization": "Bearer " + key, "Content-Type": "application/json",
                **(headers or {})}
        conn.request("POST", root.path + path, json.dumps(body).encode(), sent)
        answer = conn.getresponse()
        return [answer.status, json.loads(answer.read())]
    finally:
        conn.close()

hi = {"model": "m", "input": "hi"}
with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
    json.dump({
        "ok": call(hi),
        "bad_key": call(hi, {"Authorization": "Bearer not-the-key"}),
        "web_search": call({**hi, "tools": [{"type": "web_search"}]}),
        "previous": call({**hi, "previous_response_id": "resp_1"}),
        "not_json": call("just a string"),
        "retrieve": call(hi, path="/responses/resp_1/cancel"),
    }, f)
"""


async def test_what_the_gateway_cannot_serve_gets_the_responses_error_shape_never_a_hang() -> None:
    async with (
        Emulator() as emu,
        FakeChatServer([completion("hello")] * 4, vllm=VllmShape()) as server,
    ):
        settings = load_settings(policy={"kind": "openai", "base_url": server.base_url})
        argv = [sys.executable, "-c", RESPONSES_CALLS]
        async with (
            RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
            CommandAgent.from_config(argv, chat_policy_config(settings)) as agent,
        ):
            with anyio.fail_after(60):
                [result] = await pool.run_batch(LEDGER[:1], agent).results()
        requests = list(server.requests)

    assert result.final_answer is not None, result.error
    seen = json.loads(result.final_answer)
    status, ok = seen.pop("ok")
    assert status == 200 and ok["object"] == "response" and ok["status"] == "completed"
    assert ok["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "hello",
        "annotations": [],
    }
    assert {name: status for name, (status, _) in seen.items()} == {
        "bad_key": 401,
        "web_search": 400,
        "previous": 400,
        "not_json": 400,
        "retrieve": 404,
    }
    for _, body in seen.values():
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert seen["bad_key"][1]["error"]["type"] == "authentication_error"
    assert "a tool of type 'web_search'" in seen["web_search"][1]["error"]["message"]
    assert "stores no responses" in seen["previous"][1]["error"]["message"]
    assert len(requests) == 1 and len(result.turns) == 1  # only the call that could go
