"""An agent command's process and gateway, on in-process instances (the fake
provider) and a vLLM-shaped fake server: its environment, its deadline, its key."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent_helpers import end_marked, marked, new_mark
from fleetroll.policies.gate import PolicyGate, WeightUpdateMode
from fleetroll.policies.openai import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config, rollout_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.agent_command import AgentHost, AgentRecipe, CommandAgent
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.service import serve_app
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec, parse_task
from fleetroll.telemetry import Events, MemorySink
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    FakeError,
    FakeRawResponse,
    Script,
    VllmShape,
    completion,
    context_length_error,
    tool_call,
)
from fleetroll.testing.fake_provider import FakeProvider

#: Real processes and servers on loopback: outside `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture
def mark() -> Iterator[str]:
    """A mark for the test's agents' descendants; what is left of them is ended after."""
    mark = new_mark()
    yield mark
    end_marked(mark)


TASK = TaskSpec(key="t1", prompt="note done", env_key="fake", metadata={"level": 3})
#: The variables an agent is given (LC_CTYPE: Python's own locale coercion may add it).
GIVEN = {"PATH", "HOME", "LANG", "LC_CTYPE", "OPENAI_BASE_URL", "OPENAI_API_KEY"} | {
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "FLEETROLL_MCP_URL",
    "FLEETROLL_TASK_FILE",
    "FLEETROLL_ANSWER_FILE",
}
#: One chat completion through the gateway with the standard library, then the
#: environment and the task file written as the final answer.
ONE_CALL = """
import json, os, sys, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
body = json.dumps({"model": "any", "messages": [{"role": "user", "content": "hi"}]}).encode()
request = urllib.request.Request(base + "/chat/completions", body, {
    "Authorization": "Bearer " + key, "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request))
with open(os.environ["FLEETROLL_TASK_FILE"]) as f:
    task = json.load(f)
with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
    json.dump({"env": dict(os.environ), "task": task, "answer": answer}, f)
"""


class WatchedGate(PolicyGate):
    """The trainer's gate, saying when a call waits at it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = anyio.Event()

    async def admit(self) -> tuple[int, float]:
        if self.paused:
            self.waiting.set()
        return await super().admit()


@asynccontextmanager
async def agent_rollout(
    command: list[str],
    answer_bytes: int = 1024 * 1024,
    gate: PolicyGate | None = None,
    script: Script | None = None,
    token_ids: bool = False,
    kill_grace_s: float = 0.5,
    streaming_server: bool = False,
    weight_update: WeightUpdateMode = "pause",
    **overrides: Any,
) -> AsyncIterator[tuple[RolloutEngine, CommandAgent, FakeChatServer]]:
    settings = load_settings(**overrides)
    events = Events([MemorySink()])
    shape = VllmShape(stream=streaming_server)
    async with (
        FakeChatServer(script or [completion("hello")] * 4, vllm=shape) as server,
        RolloutEngine.open(
            rollout_config(settings),
            events,
            FakeProvider(settings.modalities, timeouts=settings.timeouts),
            policy_gate=gate,
        ) as eng,
        CommandAgent(
            command,
            OpenAIChatPolicy(
                base_url=server.base_url,
                model="served",
                api_key="real-key",
                logprobs=True,
                return_token_ids=token_ids,
                temperature=0.3,
                extra_body={"top_k": 5},
                weight_update=weight_update,
            ),
            kill_grace_s=kill_grace_s,
            max_answer_file_bytes=answer_bytes,
            owns_policy=True,
        ) as agent,
    ):
        yield eng, agent, server


async def run(eng: RolloutEngine, agent: CommandAgent) -> RolloutResult:
    with anyio.fail_after(60):
        return await eng.rollout(TASK, RolloutIds(batch_id="b", rollout_id="r0")).run(agent)


async def test_an_agent_gets_only_its_own_variables_and_none_of_fleetroll_s_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_API_KEY", "fleet-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "real-key")
    monkeypatch.setenv("FLEETROLL_TELEMETRY__DB_PATH", os.devnull)
    async with agent_rollout([sys.executable, "-c", ONE_CALL]) as (eng, agent, server):
        result = await run(eng, agent)

    assert result.final_answer is not None, result.error
    seen = json.loads(result.final_answer)
    assert set(seen["env"]) <= GIVEN
    assert "real-key" not in json.dumps(seen["env"]) and "fleet-secret" not in result.final_answer
    assert seen["task"] == {
        "key": "t1",
        "prompt": "note done",
        "modality": "tool_use",
        "metadata": {"level": 3},
    }
    # The call went to the server with its key, for the policy's model, asking for
    # logprobs, with the policy's sampling where the agent set none, and its extra_body.
    assert server.headers[0]["authorization"] == "Bearer real-key"
    assert server.requests[0] == {
        "model": "served",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.3,
        "logprobs": True,
        "top_k": 5,
    }
    [turn] = result.turns
    reply = server.replies[0]
    assert turn.completion_token_ids == reply["choices"][0]["token_ids"]
    assert seen["answer"]["choices"][0]["token_ids"] == turn.completion_token_ids


async def test_an_agent_s_call_waits_while_the_policy_is_paused_and_carries_the_new_version() -> (
    None
):
    gate = WatchedGate()
    result: list[RolloutResult] = []
    async with agent_rollout([sys.executable, "-c", ONE_CALL], gate=gate) as (eng, agent, server):

        async def rollout() -> None:
            result.append(await run(eng, agent))

        async with anyio.create_task_group() as tg, gate.paused_calls():
            tg.start_soon(rollout)
            with anyio.fail_after(30):
                await gate.waiting.wait()
            # The pause lasts a time a clock can show: uvloop's is read once per loop
            # iteration, in whole milliseconds (a pause ended in the same one is 0 s).
            await anyio.sleep(0.01)
            held = len(server.requests)
            gate.version = 8  # the trainer swapped the weights during the pause

    assert held == 0  # nothing reached the server during the pause
    [turn] = result[0].turns
    assert turn.policy_version == 8 and result[0].timings.paused_s > 0
    assert result[0].final_answer is not None


async def test_the_gateway_refuses_a_rollout_s_key_once_it_has_ended(tmp_path: Path) -> None:
    keep = tmp_path / "where.json"
    script = ONE_CALL + (f"\njson.dump([base, key], open({str(keep)!r}, 'w'))\n")
    async with agent_rollout([sys.executable, "-c", script]) as (eng, agent, server):
        result = await run(eng, agent)
        base, key = json.loads(keep.read_text())
        async with httpx.AsyncClient() as http:
            with anyio.fail_after(10):
                late = await http.post(
                    f"{base}/chat/completions",
                    json={"messages": [{"role": "user", "content": "again"}]},
                    headers={"Authorization": f"Bearer {key}"},
                )
                wrong = await http.get(f"{base}/models", headers={"Authorization": "Bearer x"})

    assert len(result.turns) == 1 and len(server.requests) == 1
    assert late.status_code == 401 and wrong.status_code == 401
    assert "real-key" not in late.text


async def test_an_agent_past_the_rollout_s_deadline_is_killed_with_its_group(
    tmp_path: Path, mark: str
) -> None:
    # Its child is found by a mark in its command line: in a PID namespace of its
    # own, the agent's process ids are not this test's.
    started = tmp_path / "started"
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {mark!r}])\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(600)\n"
    )
    overrides = {"timeouts": {"rollout_s": 1.0}}
    async with agent_rollout([sys.executable, "-c", script], **overrides) as (eng, agent, _):
        result = await run(eng, agent)

    assert result.failure_reason is FailureReason.TIMEOUT
    assert result.reward == 0.0  # scored, as the built-in loop's timeout is
    assert started.exists() and marked(mark) == []


async def test_an_agent_that_fails_is_scored_with_its_answer_cut_and_its_output_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    script = (
        "import os, sys\n"
        "open(os.environ['FLEETROLL_ANSWER_FILE'], 'w').write('0123456789')\n"
        "print('the agent gave up here')\n"
        "sys.exit(3)\n"
    )
    async with agent_rollout([sys.executable, "-c", script], answer_bytes=4) as (eng, agent, _):
        result = await run(eng, agent)

    assert (result.status, result.reward, result.final_answer) == ("completed", 0.0, "0123")
    [warning] = [
        r.getMessage() for r in caplog.records if r.name == "fleetroll.rollout.agent_command"
    ]
    assert "exited with 3" in warning and "the agent gave up here" in warning


@pytest.mark.parametrize(
    ("more", "said"),
    [
        ((), "--agent-command needs --policy openai"),
        (("--policy", "openai", "--agent-command", "'unclosed"), "cannot be split into words"),
    ],
    ids=["scripted_policy", "unsplittable"],
)
def test_an_agent_command_fleetroll_cannot_run_is_one_line_and_exit_code_2(
    tmp_path: Path, more: tuple[str, ...], said: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK.model_dump(mode="json", exclude_defaults=True)) + "\n")
    args = [sys.executable, "-m", "fleetroll", "run", str(tasks), "--agent-command", "true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET", "OPENAI_"))}
    done = subprocess.run(
        [*args, *more], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
    )

    assert done.returncode == 2, done.stderr
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1


async def test_an_agent_pickles_as_its_recipe_and_a_host_makes_it_once_while_in_use() -> None:
    settings = load_settings(policy={"kind": "openai", "base_url": "http://127.0.0.1:9/v1"})
    agent = CommandAgent.from_config("python agent.py --fast", chat_policy_config(settings))
    recipe = pickle.loads(pickle.dumps(agent))
    assert isinstance(recipe, AgentRecipe)
    assert recipe.argv == ("python", "agent.py", "--fast") and recipe.config == chat_policy_config(
        settings
    )
    assert pickle.loads(pickle.dumps(agent)).key == recipe.key  # one key per agent
    plain = CommandAgent(
        "python agent.py", OpenAIChatPolicy.from_config(chat_policy_config(settings))
    )
    with pytest.raises(TypeError, match=r"only when made with CommandAgent\.from_config"):
        pickle.dumps(plain)
    await plain.aclose()
    await agent.aclose()

    host = AgentHost()
    other = pickle.loads(
        pickle.dumps(CommandAgent.from_config("python b.py", chat_policy_config(settings)))
    )
    with anyio.fail_after(30):
        async with (
            host.agent(recipe) as first,
            host.agent(recipe) as second,
            host.agent(other) as third,
        ):
            assert first is second and third is not first
            assert third.argv == ["python", "b.py"]
        async with host.agent(recipe) as again:
            assert again is not first  # the last user closed it; made anew
        await host.aclose()


# -- an agent's rollout as honest as the built-in loop's (issue 37) ------------------------

#: What the agents below share: one HTTP call to the gateway (stdlib only), the
#: connection closed whatever happens, and the answer file written as JSON.
CALLS = """
import http.client, json, os, sys, threading, urllib.parse
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
root = urllib.parse.urlsplit(base)

def call(path, body=None, method="POST", auth=None, timeout=30, raw=False):
    conn = http.client.HTTPConnection(root.hostname, root.port, timeout=timeout)
    try:
        headers = {"Authorization": auth or "Bearer " + key, "Content-Type": "application/json"}
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path if raw else root.path + path, data, headers)
        answer = conn.getresponse()
        return [answer.status, answer.read().decode("utf-8", "replace")]
    finally:
        conn.close()

def done(value):
    with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
        json.dump(value, f)

def ask(content, timeout=30, **more):
    body = {"messages": [{"role": "user", "content": content}], **more}
    return call("/chat/completions", body, timeout=timeout)
"""


def events_of(text: str) -> list[dict[str, Any]]:
    """The JSON chunks of a Server-Sent Events body (``[DONE]`` left out)."""
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def test_the_gateway_answers_a_bad_key_and_an_unknown_route_in_openai_s_error_shape() -> None:
    script = CALLS + (
        "done({\n"
        "    'accented_key': call('/models', method='GET', auth='Bearer cl\\u00e9'),\n"
        "    'unknown_route': call('/embeddings', {'input': 'x'}),\n"
        "    'wrong_method': call('/chat/completions', method='GET'),\n"
        "    'outside': call('/nothing', method='GET', raw=True),\n"
        "    'root': [0, base],\n"
        "})\n"
    )
    async with agent_rollout([sys.executable, "-c", script]) as (eng, agent, _):
        result = await run(eng, agent)

    assert result.final_answer is not None, result.error
    seen = json.loads(result.final_answer)
    _, base = seen.pop("root")
    token = base.split("/r/")[1].split("/")[0]
    assert len(token) > 16
    statuses = {name: status for name, (status, _) in seen.items()}
    assert statuses == {
        "accented_key": 401,
        "unknown_route": 404,
        "wrong_method": 405,
        "outside": 404,
    }
    for status, text in seen.values():
        error = json.loads(text)["error"]
        assert error["message"] and error["type"] and error["code"] == status
        assert token not in text  # the rollout's token (in the URL) is not echoed


async def test_a_streamed_answer_keeps_every_field_the_server_sent(tmp_path: Path) -> None:
    reply = completion("the answer")
    reply["choices"][0]["message"]["reasoning_content"] = "first I think"
    reply["choices"][0]["stop_reason"] = None
    reply["system_fingerprint"] = "fp-1"
    # Kept apart from the answer file: a result redacts its final answer's "token" fields.
    kept = tmp_path / "seen.json"
    script = CALLS + (
        "seen = {'streamed': ask('hi', stream=True, stream_options={'include_usage': True}),"
        " 'whole': ask('hi')}\n"
        f"json.dump(seen, open({str(kept)!r}, 'w'))\n"
    )
    command = [sys.executable, "-c", script]
    async with agent_rollout(command, script=[reply, reply], token_ids=True) as (eng, agent, srv):
        result = await run(eng, agent)

    assert result.failure_reason is None, result.error
    seen = json.loads(kept.read_text())
    sent = srv.replies[0]
    assert sent["prompt_token_ids"] and sent["choices"][0]["token_ids"]  # the test's premise
    assert json.loads(seen["whole"][1]) == srv.replies[1]
    first, *rest = events_of(seen["streamed"][1])
    # The answer's own fields, on the first chunk.
    for name in ("id", "created", "model", "prompt_token_ids", "system_fingerprint"):
        assert first[name] == sent[name], name
    [choice] = first["choices"]
    # The choice's fields on its chunk, its message whole as the delta.
    assert choice["delta"] == sent["choices"][0]["message"]
    for name in ("index", "finish_reason", "logprobs", "token_ids", "stop_reason"):
        assert choice[name] == sent["choices"][0][name], name
    assert [chunk["usage"] for chunk in rest] == [sent["usage"]]
    assert [t.completion_token_ids for t in result.turns] == [
        r["choices"][0]["token_ids"] for r in srv.replies
    ]


@pytest.mark.parametrize("weight_update", ["pause", "abort"])
async def test_a_streamed_call_is_relayed_token_by_token_unless_the_settings_need_whole_answers(
    tmp_path: Path, weight_update: WeightUpdateMode
) -> None:
    kept = tmp_path / "seen.json"
    script = CALLS + (
        "seen = ask('hi', stream=True, stream_options={'include_usage': True})\n"
        f"json.dump(seen, open({str(kept)!r}, 'w'))\n"
        "done('ok')\n"
    )
    command = [sys.executable, "-c", script]
    reply = completion("the answer is four")
    async with agent_rollout(
        command, script=[reply], streaming_server=True, weight_update=weight_update
    ) as (eng, agent, server):
        result = await run(eng, agent)

    assert result.failure_reason is None, result.error
    status, text = json.loads(kept.read_text())
    chunks = events_of(text)
    sent = server.replies[0]
    [turn] = result.turns
    assert turn.completion_token_ids == sent["choices"][0]["token_ids"]
    assert status == 200 and chunks[-1]["usage"] == sent["usage"]
    said = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert said == "the answer is four"
    if weight_update == "pause":  # streamed from the server, a chunk per token
        assert server.requests[0]["stream"] is True
        assert len(chunks) > 4
    else:  # an aborted answer is resumed and joined: asked and relayed whole
        assert "stream" not in server.requests[0]
        [whole, _] = chunks
        assert whole["choices"][0]["delta"]["content"] == "the answer is four"


async def test_a_server_failing_mid_stream_fails_the_rollout_with_no_turn_and_no_resend() -> None:
    first = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "served"}
    first["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]
    broken = FakeRawResponse(f"data: {json.dumps(first)}\n\n", media_type="text/event-stream")
    script = CALLS + "ask('hi', stream=True)\ndone('the stream ended')\n"
    command = [sys.executable, "-c", script]
    async with agent_rollout(command, script=[broken, completion("again")]) as (eng, agent, srv):
        result = await run(eng, agent)

    # Asked as a stream, once: a failure after the first chunk is never re-sent.
    assert [q["stream"] for q in srv.requests] == [True]
    assert result.failure_reason == "policy_error" and result.turns == []
    assert "ended before its 'data: [DONE]'" in (result.error or "")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_call_the_agent_gave_up_on_is_not_recorded(stream: bool) -> None:
    second = anyio.Event()

    async def script(body: dict[str, Any]) -> dict[str, Any]:
        if body["messages"][0]["content"] == "first":
            await second.wait()  # answered only once the agent gave up and asked again
            return completion("too late")
        second.set()
        return completion("in time")

    agent_script = CALLS + (
        "try:\n"
        f"    gave_up = ask('first', stream={stream}, timeout=1)\n"
        "except OSError as exc:\n"
        "    gave_up = repr(exc)\n"
        f"done({{'gave_up': gave_up, 'answer': ask('second', stream={stream})}})\n"
    )
    async with agent_rollout([sys.executable, "-c", agent_script], script=script) as (
        eng,
        agent,
        server,
    ):
        result = await run(eng, agent)

    assert result.final_answer is not None, result.error
    seen = json.loads(result.final_answer)
    assert "timed out" in seen["gave_up"] and seen["answer"][0] == 200
    # One answer received, one turn: the call it gave up on is not its turn.
    assert [m["content"] for m in result.transcript if m["role"] == "assistant"] == ["in time"]
    assert len(result.turns) == 1 and result.cost.policy_calls == 1
    assert [m["content"] for m in server.requests[1]["messages"]] == ["second"]
    # The gateway did not wait for the server's answer to the call it gave up on.
    assert server.abandoned == [0]


async def test_a_call_asking_for_several_choices_records_each_as_a_turn() -> None:
    reply = completion("one")
    reply["choices"].append(
        {"index": 1, "message": {"role": "assistant", "content": "two"}, "finish_reason": "stop"}
    )
    script = CALLS + "done({'answer': ask('hi', n=2)})\n"
    command = [sys.executable, "-c", script]
    async with agent_rollout(command, script=[reply], token_ids=True) as (eng, agent, server):
        result = await run(eng, agent)

    assert result.final_answer is not None, result.error
    [sent] = server.replies
    assert server.requests[0]["n"] == 2
    assert [t.choice for t in result.turns] == [0, 1]
    assert [t.index for t in result.turns] == [0, 1]
    assert [t.completion_token_ids for t in result.turns] == [
        c["token_ids"] for c in sent["choices"]
    ]
    assert [t.prompt_token_ids for t in result.turns] == [sent["prompt_token_ids"]] * 2
    # One call: counted once, its usage on its first choice.
    assert result.cost.policy_calls == 1
    assert [t.usage for t in result.turns] == [sent["usage"], None]


async def test_the_result_keeps_the_system_message_and_tools_of_the_agent_s_first_call() -> None:
    tools = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}]
    script = CALLS + (
        f"tools = {tools!r}\n"
        "def asks(system, tools):\n"
        "    body = {'messages': [{'role': 'system', 'content': system},"
        " {'role': 'user', 'content': 'hi'}], 'tools': tools}\n"
        "    return call('/chat/completions', body)\n"
        "first = asks('You are an agent.', tools)\n"
        "done({'answer': [first, asks('Another.', [])]})\n"
    )
    command = [sys.executable, "-c", script]
    async with agent_rollout(command, script=[completion("one"), completion("two")]) as (
        eng,
        agent,
        server,
    ):
        result = await run(eng, agent)

    assert result.final_answer is not None, result.error
    assert len(server.requests) == len(result.turns) == 2
    assert server.requests[0]["tools"] == tools
    assert result.system_prompt == "You are an agent."
    assert result.tools == tools


async def test_concurrent_calls_of_one_agent_cannot_pass_max_steps() -> None:
    everyone_asked = anyio.Event()
    asked = 0

    async def script(body: dict[str, Any]) -> dict[str, Any]:
        nonlocal asked
        asked += 1
        if asked == 8:
            everyone_asked.set()
        await everyone_asked.wait()  # held until all 8 calls are in (or the test ends)
        return completion(tool_calls=[tool_call("note", {"word": "x"}, id="c1")])

    agent_script = CALLS + (
        "statuses = []\n"
        "go = threading.Barrier(8)\n"
        "def one():\n"
        "    go.wait()\n"
        "    statuses.append(ask('go')[0])\n"
        "threads = [threading.Thread(target=one) for _ in range(8)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "done(statuses)\n"
    )
    overrides = {"pool": {"max_steps": 3}}
    command = [sys.executable, "-c", agent_script]
    async with agent_rollout(command, script=script, **overrides) as (eng, agent, server):
        try:
            result = await run(eng, agent)
        finally:
            everyone_asked.set()

    assert result.failure_reason is FailureReason.MAX_STEPS, (result.status, result.error)
    # Each call forwarded held a step: at most three reached the server.
    assert len(server.requests) <= 3
    assert result.steps <= 3 and len(result.turns) <= 3


@pytest.mark.parametrize("then", ["exits_0", "exits_1"])
async def test_a_policy_failure_behind_the_gateway_fails_the_rollout_whatever_the_agent_does(
    then: str,
) -> None:
    agent_script = CALLS + (
        "status, text = ask('hi')\n"
        "done({'status': status})\n"  # an agent that answers anyway, then exits
        f"sys.exit({then[-1]})\n"
    )
    script = [FakeError(400, "the server refused the request")]
    command = [sys.executable, "-c", agent_script]
    async with agent_rollout(command, script=script) as (eng, agent, _):
        result = await run(eng, agent)

    assert (result.failure_reason, result.reward) == (FailureReason.POLICY_ERROR, None)
    assert "the server refused the request" in (result.error or "")
    assert result.turns == []


async def test_a_context_length_error_behind_the_gateway_reaches_the_agent_and_is_scored(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen.json"
    # An agent that outlives the rollout's end (SIGTERM ignored, within kill_grace_s)
    # long enough to keep what it was answered.
    agent_script = (
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        + CALLS
        + f"open({str(seen)!r}, 'w').write(json.dumps(ask('hi')))\n"
    )
    script = [context_length_error(16, 40, 8)]
    command = [sys.executable, "-c", agent_script]
    async with agent_rollout(command, script=script, kill_grace_s=30.0) as (eng, agent, _):
        result = await run(eng, agent)

    assert (result.status, result.failure_reason) == ("failed", FailureReason.CONTEXT_OVERFLOW)
    assert result.reward is not None  # scored, as the built-in loop's
    assert result.turns == []
    status, text = json.loads(seen.read_text())
    assert status == 400
    vllm_said = "This model's maximum context length is 16 tokens"
    assert vllm_said in json.loads(text)["error"]["message"]  # the server's error, as it said it
    assert vllm_said in (result.error or "")


async def test_a_call_over_max_context_tokens_is_refused_unsent_and_ends_as_context_overflow() -> (
    None
):
    # The first call fits; the second adds about 150 tokens of text (600 characters)
    # to the server's count of the first: over 50, refused before it is sent.
    agent_script = CALLS + (
        "first = ask('hi')\n"
        "history = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]\n"
        "more = [{'role': 'user', 'content': 'abc ' * 150}]\n"
        "call('/chat/completions', {'messages': history + more})\n"
    )
    command = [sys.executable, "-c", agent_script]
    async with agent_rollout(command, policy={"max_context_tokens": 50}) as (eng, agent, server):
        result = await run(eng, agent)

    assert (result.status, result.failure_reason) == ("failed", FailureReason.CONTEXT_OVERFLOW)
    assert result.reward is not None
    assert "over policy.max_context_tokens = 50" in (result.error or "")
    assert len(server.requests) == len(result.turns) == 1


def sse_mcp_server(stop: anyio.Event) -> Starlette:
    """An MCP server (streamable HTTP) that answers the ``note`` tool as Server-Sent
    Events and keeps that stream open after the answer, as the spec allows; every
    other request (fleetroll's own session, the ``finish`` verifier) it answers as JSON."""

    def result(message: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": message["id"], "result": value}

    async def mcp(request: Request) -> Response:
        message = json.loads(await request.body())
        method = message.get("method")
        if "id" not in message:
            return Response(status_code=202)  # a notification
        if method == "initialize":
            return JSONResponse(
                result(
                    message,
                    {
                        "protocolVersion": message["params"]["protocolVersion"],
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "kept-open", "version": "1"},
                    },
                )
            )
        if method == "tools/list":
            schema = {"type": "object", "properties": {"word": {"type": "string"}}}
            tools = [{"name": n, "inputSchema": schema} for n in ("note", "finish")]
            return JSONResponse(result(message, {"tools": tools}))
        if method != "tools/call":
            return JSONResponse(result(message, {}))  # ping and the like
        if message["params"]["name"] == "finish":
            return JSONResponse(result(message, {"content": [{"type": "text", "text": "1.0"}]}))
        answer = {"content": [{"type": "text", "text": "noted, badly"}], "isError": True}

        async def events() -> AsyncIterator[str]:
            yield f"event: message\ndata: {json.dumps(result(message, answer))}\n\n"
            await stop.wait()  # open after the answer, until the test ends

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/mcp", mcp, methods=["POST"])])


async def test_an_agent_s_tool_call_answered_on_a_stream_kept_open_returns_at_its_answer(
    tmp_path: Path,
) -> None:
    script = (
        "import http.client, json, os, urllib.parse\n"
        "mcp = urllib.parse.urlsplit(os.environ['FLEETROLL_MCP_URL'])\n"
        "conn = http.client.HTTPConnection(mcp.hostname, mcp.port, timeout=60)\n"
        "call = {'jsonrpc': '2.0', 'id': 7, 'method': 'tools/call',\n"
        "        'params': {'name': 'note', 'arguments': {'word': 'done'}}}\n"
        "conn.request('POST', mcp.path, json.dumps(call),\n"
        "             {'Content-Type': 'application/json',\n"
        "              'Accept': 'application/json, text/event-stream'})\n"
        "text = conn.getresponse().read().decode()\n"  # to the end of the stream
        "open(os.environ['FLEETROLL_ANSWER_FILE'], 'w').write(text)\n"
    )
    stop = anyio.Event()
    settings = load_settings(
        timeouts={"call_tool_s": 3.0, "rollout_s": 30.0},
        mcp={"workdir_root": str(tmp_path / "workdirs")},
    )
    policy = OpenAIChatPolicy(base_url="http://127.0.0.1:9/v1", model="unused")
    try:
        async with serve_app(sse_mcp_server(stop), "127.0.0.1", 0) as url:
            record = {
                "key": "kept-open",
                "prompt": "Note it.",
                "environment": {"url": f"{url}/mcp"},
                "verifier": {"tool": {"name": "finish"}},
            }
            task = parse_task(record, source="test", modalities={"tool_use"})
            with anyio.fail_after(60):
                async with (
                    RolloutPool(settings, api_key="unused", base_url="http://127.0.0.1:9") as pool,
                    CommandAgent([sys.executable, "-c", script], policy, owns_policy=True) as agent,
                ):
                    [result] = await pool.run_batch([task], agent).results()
    finally:
        stop.set()

    # The relay ended the agent's stream at the answer: no wait for call_tool_s, no failure.
    assert (result.status, result.reward, result.tool_failures) == ("completed", 1.0, 0)
    assert result.final_answer is not None and "noted, badly" in result.final_answer
    # It counted the call, and the error the tool answered.
    assert (result.cost.tool_calls, result.tool_errors) == (1, 1)
