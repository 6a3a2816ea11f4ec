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

from agent_helpers import end_marked, marked, new_mark
from fleetroll.policies.gate import PolicyGate
from fleetroll.policies.openai import OpenAIChatPolicy
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.agent_command import AgentHost, AgentRecipe, CommandAgent
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Events, MemorySink
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape, completion
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
    **overrides: Any,
) -> AsyncIterator[tuple[RolloutEngine, CommandAgent, FakeChatServer]]:
    settings = load_settings(**overrides)
    events = Events([MemorySink()])
    async with (
        FakeChatServer([completion("hello")] * 4, vllm=VllmShape()) as server,
        RolloutEngine.open(settings, events, FakeProvider(settings), policy_gate=gate) as eng,
        CommandAgent(
            command,
            OpenAIChatPolicy(
                base_url=server.base_url,
                model="served",
                api_key="real-key",
                logprobs=True,
                temperature=0.3,
                extra_body={"top_k": 5},
            ),
            kill_grace_s=0.5,
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
    agent = CommandAgent.from_settings("python agent.py --fast", settings)
    recipe = pickle.loads(pickle.dumps(agent))
    assert isinstance(recipe, AgentRecipe)
    assert recipe.argv == ("python", "agent.py", "--fast") and recipe.settings == settings
    assert pickle.loads(pickle.dumps(agent)).key == recipe.key  # one key per agent
    plain = CommandAgent("python agent.py", OpenAIChatPolicy.from_settings(settings))
    with pytest.raises(TypeError, match=r"only when made with CommandAgent\.from_settings"):
        pickle.dumps(plain)
    await plain.aclose()
    await agent.aclose()

    host = AgentHost()
    other = pickle.loads(pickle.dumps(CommandAgent.from_settings("python b.py", settings)))
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
