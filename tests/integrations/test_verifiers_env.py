"""A verifiers environment on fleetroll: the installed verifiers' ``Environment``, rollouts.

verifiers 0.2.0 (the one release that accepts fleetroll's mcp) pins
``datasets<4.7``, which the ``train`` extra's TRL refuses, so it is not in
``dev``: this file is skipped there and runs in a venv of its own
(``pip install -e '.[test,verifiers]'``; README.md, "verl, SkyRL and prime-rl"). The policy is the
vLLM-shaped fake chat server (token ids, logprobs) playing each task's
solution, so the verifier's reward is known; each rollout runs on the
embedded emulator.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Mapping
from typing import Any

import anyio.to_thread
import pytest

vf = pytest.importorskip(
    "verifiers",
    reason="verifiers 0.2.0 cannot share a venv with TRL (datasets<4.7):"
    " run this file in a venv with pip install -e '.[test,verifiers]'",
)

from fleetroll.errors import ConfigError  # noqa: E402
from fleetroll.integrations import verifiers as fleetroll_verifiers  # noqa: E402
from fleetroll.settings import config_dir  # noqa: E402
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape  # noqa: E402

TASKS = config_dir() / "tasks" / "ledger.jsonl"

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


def test_the_environment_is_verifiers_own() -> None:
    env_class = fleetroll_verifiers.FleetrollEnv
    assert issubclass(env_class, vf.Environment)
    assert vf.Environment.__abstractmethods__ == {"rollout"}
    assert not inspect.isabstract(env_class)
    assert inspect.iscoroutinefunction(env_class.rollout)


def solving(tasks: Mapping[str, Any]) -> Any:
    """Plays each task's solution (found by its prompt), then says done."""
    from fleetroll.testing.fake_openai import completion, tool_call

    steps = {
        t.prompt: [(s.name, dict(s.arguments)) for s in t.solution or ()] for t in tasks.values()
    }

    def script(body: dict[str, Any]) -> Any:
        messages = body["messages"]
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if turn >= len(steps[prompt]):
            return completion("done")
        name, arguments = steps[prompt][turn]
        return completion(tool_calls=[tool_call(name, arguments, id=f"call_{turn}")])

    return script


async def test_verifiers_loads_it_by_module_name_and_each_rollout_is_a_fleetroll_rollout() -> None:
    from fleetroll.integrations.core import load_task_list
    from fleetroll.settings import load_settings

    tasks = {t.key: t for t in load_task_list(TASKS, load_settings())}
    async with FakeChatServer(solving(tasks), vllm=VllmShape()) as server:
        env = vf.load_environment(
            "fleetroll.integrations.verifiers",
            tasks=str(TASKS),
            settings={
                "policy": {"kind": "openai", "base_url": server.base_url},
                "telemetry": {"db_path": os.devnull},
            },
        )
        try:
            assert isinstance(env, fleetroll_verifiers.FleetrollEnv)
            rows = env.get_dataset()
            first = rows[0]
            client = vf.ClientConfig(api_base_url=server.base_url)
            group = [{"prompt": first["prompt"], "example_id": 0, "info": first["info"]}] * 2
            outputs = await env.run_group(group, client, "model", {}, state_columns=["trajectory"])
            state = await env.rollout(group[0], client, "model", {})
        finally:
            await anyio.to_thread.run_sync(env.close)
    sent = {
        tuple(r["choices"][0]["token_ids"]): [
            e["logprob"] for e in r["choices"][0]["logprobs"]["content"]
        ]
        for r in server.replies
    }
    task = tasks[first["info"]["task_key"]]
    assert len(outputs) == 2
    for output in outputs:
        assert output["reward"] == 1.0  # the solution played: the task's verifier says so
        assert output["error"] is None
    (step,) = state["trajectory"]
    tokens = step["tokens"]
    ids, mask, logprobs = (
        tokens["completion_ids"],
        tokens["completion_mask"],
        tokens["completion_logprobs"],
    )
    assert len(ids) == len(mask) == len(logprobs) and tokens["prompt_ids"]
    # Each run of the model's tokens is exactly one reply the server sent, with its logprobs.
    replies = [
        [(token, logprob) for token, _, logprob in run]
        for bit, run in itertools.groupby(zip(ids, mask, logprobs, strict=True), lambda t: t[1])
        if bit
    ]
    assert len(replies) == len(task.solution or ()) + 1  # each step's call, then "done"
    for reply in replies:
        assert sent[tuple(t for t, _ in reply)] == [lp for _, lp in reply]
    assert state["fleetroll_status"] == "completed"


async def test_a_row_naming_no_task_is_refused_in_one_line() -> None:
    env = fleetroll_verifiers.load_environment(
        TASKS, {"policy": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
    )
    try:
        row = {
            "prompt": [{"role": "user", "content": "hi"}],
            "example_id": 0,
            "info": {"task_key": "no-such-task"},
        }
        with pytest.raises(vf.Error, match="no-such-task"):
            await env.rollout(row, vf.ClientConfig(api_base_url="http://127.0.0.1:9/v1"), "m", {})
    finally:
        await anyio.to_thread.run_sync(env.close)


def test_settings_without_a_model_server_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r'policy\.kind = "openai"'):
        fleetroll_verifiers.load_environment(TASKS, {"policy": {"kind": "scripted"}})


async def test_a_failed_rollout_is_an_infrastructure_error_with_nothing_under_the_mask() -> None:
    from adapter_helpers import failing_for

    probe = fleetroll_verifiers.load_environment(
        TASKS, {"policy": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
    )
    first = probe.get_dataset()[0]
    broken = first["prompt"][-1]["content"]
    async with FakeChatServer(failing_for(broken), vllm=VllmShape()) as server:
        env = fleetroll_verifiers.load_environment(
            TASKS,
            {
                "policy": {"kind": "openai", "base_url": server.base_url, "max_retries": 0},
                "telemetry": {"db_path": os.devnull},
            },
        )
        try:
            client = vf.ClientConfig(api_base_url=server.base_url)
            row = {"prompt": first["prompt"], "example_id": 0, "info": first["info"]}
            (output,) = await env.run_group([row], client, "model", {})
            state = await env.rollout(row, client, "model", {})
        finally:
            await anyio.to_thread.run_sync(env.close)
    assert output["reward"] == 0.0 and output["error"] is not None
    assert "InfraError" in output["error_chain"] and "policy_error" in output["error_chain"]
    assert state["fleetroll_status"] == "policy_error" and state["fleetroll_reward"] is None
    (step,) = state["trajectory"]
    assert not any(step["tokens"]["completion_mask"])
