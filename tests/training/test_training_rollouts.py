"""Training-grade rollouts over real HTTP: the vLLM-shaped fake server and the emulator.

Every policy call becomes a ``turn`` holding exactly what the server sent;
context limits end rollouts as ``context_overflow``; ``cost`` sums match the
server's token counts and the emulator's instance lifetimes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config, fleet_provider, rollout_config
from fleetroll.pool.journal import read_journal
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Events, MemorySink
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    VllmShape,
)
from training_helpers import AGENT, TASK_FILES, TASKS, sent_and_recorded, solving

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TOOL_USE = TASKS["ledger-010"]  # four steps, then "done"
COMPUTER_USE = next(
    t for t in TASKS.values() if t.modality == "computer_use" and len(t.solution or ()) >= 3
)
TRAINING = {"return_token_ids": True, "logprobs": True, "top_logprobs": 2}


@asynccontextmanager
async def engine(
    emu: Emulator, server: FakeChatServer, **policy: Any
) -> AsyncIterator[tuple[RolloutEngine, OpenAIChatPolicy]]:
    overrides: dict[str, Any] = {"policy": {"kind": "openai", "base_url": server.base_url}}
    overrides["policy"].update(policy.pop("policy", {}))
    settings = load_settings(**overrides, **policy)
    events = Events([MemorySink()])
    provider = fleet_provider(settings, events, api_key=emu.api_key, base_url=emu.base_url)
    async with (
        RolloutEngine.open(rollout_config(settings), events, provider) as eng,
        OpenAIChatPolicy.from_config(chat_policy_config(settings)) as model,
    ):
        yield eng, model


async def run(
    emu: Emulator, server: FakeChatServer, task: TaskSpec, n: int = 1, **overrides: Any
) -> list[RolloutResult]:
    results: list[RolloutResult] = []
    async with engine(emu, server, **overrides) as (eng, model):
        eng.policy_gate.version = 7

        async def one(i: int) -> None:
            ids = RolloutIds(batch_id="batch", rollout_id=f"r{i}", sample_index=i)
            results.append(await eng.rollout(task, ids).run(model))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
    assert emu.ledger.running == 0
    return results


def lifetime_s(emu: Emulator, instance_id: str | None) -> float:
    assert instance_id is not None
    instance = emu.store.get(instance_id)
    assert instance is not None and instance.terminated_at is not None
    ended = datetime.fromisoformat(instance.terminated_at)
    return (ended - datetime.fromisoformat(instance.created_at)).total_seconds()


def image_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image_url"
    ]


# -- token data ---------------------------------------------------------------------------


@pytest.mark.parametrize("task", [TOOL_USE, COMPUTER_USE], ids=["tool_use", "computer_use"])
async def test_turns_hold_exactly_what_the_server_sent_and_cost_sums_it(
    emulator: Emulator, task: TaskSpec
) -> None:
    tool_calls_before = emulator.ledger.tool_calls
    async with FakeChatServer(solving([task]), vllm=VllmShape()) as server:
        (result,) = await run(emulator, server, task, policy=TRAINING)
        replies = list(server.replies)

    assert result.status == "completed" and result.reward == 1.0
    assert len(result.turns) == len(replies) == len(task.solution or ()) + 1
    for index, (turn, reply) in enumerate(zip(result.turns, replies, strict=True)):
        choice = reply["choices"][0]
        content = choice["logprobs"]["content"]
        assert turn.index == index and turn.policy_version == 7
        assert turn.model == reply["model"] and turn.finish_reason == choice["finish_reason"]
        assert turn.prompt_token_ids == reply["prompt_token_ids"]
        assert turn.completion_token_ids == choice["token_ids"]
        assert turn.logprobs == [entry["logprob"] for entry in content]
        assert turn.top_logprobs == [
            [(alt["token"], alt["logprob"]) for alt in entry["top_logprobs"]] for entry in content
        ]
        assert turn.usage == reply["usage"] and turn.latency_s >= 0
    assert [t.finish_reason for t in result.turns] == ["tool_calls"] * (len(replies) - 1) + ["stop"]
    # The transcript keeps its shape: chat messages, no token data.
    assert all(
        set(m) <= {"role", "content", "tool_calls", "tool_call_id"} for m in result.transcript
    )

    cost = result.cost
    assert cost.prompt_tokens == sum(r["usage"]["prompt_tokens"] for r in replies)
    assert cost.completion_tokens == sum(r["usage"]["completion_tokens"] for r in replies)
    assert cost.policy_calls == len(replies)
    # The environment also served a computer modality's initial screenshot.
    initial = 1 if task.modality == "computer_use" else 0
    assert cost.tool_calls == emulator.ledger.tool_calls - tool_calls_before - initial
    assert cost.tool_calls == result.steps
    # Two clocks (ours from provisioned to released, the emulator's from created to
    # terminated) a loopback round trip apart at each end.
    assert cost.instance_s == pytest.approx(lifetime_s(emulator, result.instance_id), abs=1.0)


@pytest.mark.parametrize(
    ("drift", "token_in", "drift_turn"),
    [(False, False, None), (True, False, 1), (True, True, None)],
    ids=["consistent", "drifting_template", "drifting_template_token_in"],
)
async def test_a_rollout_s_trajectory_is_its_turns_stitched_and_drift_where_the_template_broke(
    emulator: Emulator, drift: bool, token_in: bool, drift_turn: int | None
) -> None:
    shape = VllmShape(drift=drift, token_in=token_in)
    policy = {"trajectory": True, "token_in": token_in, "logprobs": True}
    async with FakeChatServer(solving([TOOL_USE]), vllm=shape) as server:
        (result,) = await run(emulator, server, TOOL_USE, policy=policy)

    assert result.reward == 1.0 and result.trajectory is not None
    trajectory, last = result.trajectory, result.turns[-1]
    assert trajectory.drift is (drift_turn is not None) and trajectory.drift_turn == drift_turn
    generated = [
        [i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
        for s in trajectory.segments or [trajectory]
    ]
    completions = [t.completion_token_ids or [] for t in result.turns]
    if drift_turn is None:
        assert trajectory.input_ids == [*(last.prompt_token_ids or []), *completions[-1]]
        assert generated == [[i for ids in completions for i in ids]]
    else:
        assert generated == completions  # the thinking the template drops: a segment per turn
    # The mask counts exactly the completion tokens.
    assert sum(len(g) for g in generated) == sum(len(c) for c in completions)
    assert {v for v in trajectory.policy_versions if v is not None} == {7}


async def test_without_the_settings_nothing_is_asked_and_turns_still_record_the_basics(
    emulator: Emulator,
) -> None:
    async with FakeChatServer(solving([TOOL_USE]), vllm=VllmShape()) as server:
        (result,) = await run(emulator, server, TOOL_USE)
        requests, replies = list(server.requests), list(server.replies)

    assert result.reward == 1.0
    assert all(not {"return_token_ids", "logprobs", "top_logprobs"} & set(r) for r in requests)
    assert [(t.model, t.finish_reason, t.usage) for t in result.turns] == [
        (r["model"], r["choices"][0]["finish_reason"], r["usage"]) for r in replies
    ]
    assert all(
        t.prompt_token_ids is None and t.completion_token_ids is None and t.logprobs is None
        for t in result.turns
    )
    assert all(t.latency_s >= 0 for t in result.turns)
    assert result.trajectory is None


async def test_a_server_without_token_data_gives_nulls_and_one_warning_for_the_batch(
    emulator: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    shape = VllmShape(token_ids=False, logprobs=False)
    async with FakeChatServer(solving([TOOL_USE]), vllm=shape) as server:
        with caplog.at_level(logging.WARNING, logger="fleetroll.policies.openai"):
            results = await run(emulator, server, TOOL_USE, n=3, policy=TRAINING)

    assert [r.reward for r in results] == [1.0] * 3
    turns = [t for r in results for t in r.turns]
    assert len(turns) == 3 * 5
    assert all(t.prompt_token_ids is None and t.logprobs is None for t in turns)
    assert all(t.usage is not None and t.model is not None for t in turns)
    warnings = [r for r in caplog.records if r.name == "fleetroll.policies.openai"]
    assert len(warnings) == 1


# -- context limits -----------------------------------------------------------------------


async def test_max_images_sends_only_the_last_screenshots_and_the_transcript_says_so(
    emulator: Emulator,
) -> None:
    async with FakeChatServer(solving([COMPUTER_USE]), vllm=VllmShape()) as server:
        (result,) = await run(emulator, server, COMPUTER_USE, policy={"max_images": 1})
        requests = list(server.requests)

    assert result.reward == 1.0
    # The first request holds the initial screenshot.
    assert [len(image_parts(r["messages"])) for r in requests] == [1] * len(requests)
    omitted = [
        part
        for m in result.transcript
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("text", "").startswith("[screenshot omitted: only the last 1")
    ]
    assert len(omitted) == result.steps  # every screenshot but the last, the initial one too


async def test_a_prompt_over_max_context_tokens_ends_the_rollout_as_context_overflow_scored(
    emulator: Emulator,
) -> None:
    async with FakeChatServer(solving([TOOL_USE]), vllm=VllmShape()) as server:
        # The first prompt (the tools and the task) fits; after one turn it does not.
        first = await run(emulator, server, TOOL_USE)
        limit = first[0].turns[0].usage["prompt_tokens"] + 1  # type: ignore[index]
        server.reset(solving([TOOL_USE]))
        (result,) = await run(emulator, server, TOOL_USE, policy={"max_context_tokens": limit})

    assert result.failure_reason is FailureReason.CONTEXT_OVERFLOW
    assert "policy.max_context_tokens" in (result.error or "")
    assert result.reward is not None and result.verifier is not None  # scored
    assert len(result.turns) == 1 and result.cost.policy_calls == 1


async def test_a_server_s_context_length_error_ends_the_rollout_as_context_overflow(
    emulator: Emulator,
) -> None:
    async with FakeChatServer(solving([TOOL_USE]), vllm=VllmShape(max_context=20)) as server:
        (result,) = await run(emulator, server, TOOL_USE)

    assert result.failure_reason is FailureReason.CONTEXT_OVERFLOW
    assert "maximum context length is 20 tokens" in (result.error or "")
    assert result.reward is not None  # scored, like max_steps
    assert result.turns == [] and result.cost.policy_calls == 0


async def test_a_completion_cut_by_length_is_recorded_and_the_rollout_goes_on(
    emulator: Emulator,
) -> None:
    async with FakeChatServer(solving([TOOL_USE]), vllm=VllmShape(finish_length=True)) as server:
        (result,) = await run(emulator, server, TOOL_USE)

    steps = len(TOOL_USE.solution or ())
    # Every call was cut (an arguments error the agent sees), then the cut "done" ended it.
    assert result.status == "completed" and result.reward == 0.0
    assert [t.finish_reason for t in result.turns] == ["length"] * (steps + 1)
    assert result.tool_errors == steps == result.steps
    assert "arguments are not a JSON object" in result.transcript[2]["content"]


# -- the command line ---------------------------------------------------------------------


async def fleetroll_run(
    tmp_path: Path, tasks: Sequence[TaskSpec], agent: tuple[str, ...] | None = None
) -> tuple[list[RolloutResult], list[dict[str, Any]], list[dict[str, Any]]]:
    """``fleetroll run`` of ``tasks`` against a vLLM-shaped server that solves them,
    asking for token ids and logprobs; with ``agent``, the example agent (with those
    arguments) acts (``--agent-command``). The results, the server's replies and
    the requests it got."""
    task_file = tmp_path / "tasks.jsonl"
    lines = {
        json.loads(line)["key"]: line
        for f in TASK_FILES
        for line in f.read_text().splitlines()
        if line.strip()
    }
    task_file.write_text("".join(lines[t.key] + "\n" for t in tasks))
    out = tmp_path / ("built_in.jsonl" if agent is None else "agent.jsonl")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    async with FakeChatServer(solving(tasks), vllm=VllmShape(stream=True)) as server:
        env |= {
            "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
            "FLEETROLL_POLICY__RETURN_TOKEN_IDS": "true",
            "FLEETROLL_POLICY__LOGPROBS": "true",
        }
        args = [sys.executable, "-m", "fleetroll", "run", str(task_file), "--out", str(out)]
        args += ["--policy", "openai", "--base-url", server.base_url, "--model", "served"]
        if agent is not None:
            args += ["--agent-command", " ".join([sys.executable, str(AGENT), *agent])]
        with anyio.fail_after(180):
            done = await anyio.run_process(args, cwd=tmp_path, env=env, check=False)
        replies, requests = list(server.replies), list(server.requests)
    assert done.returncode == 0, done.stderr.decode()
    return read_journal(out), replies, requests


async def test_fleetroll_run_with_the_environment_variables_writes_turns_with_token_data(
    tmp_path: Path,
) -> None:
    results, replies, _ = await fleetroll_run(tmp_path, [TOOL_USE, COMPUTER_USE])

    assert sorted(r.modality for r in results) == ["computer_use", "tool_use"]
    assert all(r.reward == 1.0 for r in results)
    sent, recorded = sent_and_recorded(replies, results)
    assert recorded == sent and len(recorded) == len(replies)
    assert {t.model for r in results for t in r.turns} == {"served"}


# -- bring your own agent -----------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["not_streaming", "streaming"])
async def test_the_example_agent_scores_every_task_as_the_built_in_loop_with_the_server_s_ids(
    tmp_path: Path, streaming: bool
) -> None:
    tasks = [TOOL_USE, COMPUTER_USE]
    built_in, _, _ = await fleetroll_run(tmp_path, tasks)
    flags = ("--stream",) if streaming else ()
    results, replies, requests = await fleetroll_run(tmp_path, tasks, flags)

    rewards = {r.task_key: (r.status, r.reward) for r in results}
    assert rewards == {r.task_key: (r.status, r.reward) for r in built_in}
    assert set(rewards.values()) == {("completed", 1.0)}
    # Its tool calls went through the rollout's MCP relay, which counted them.
    counted = {r.task_key: (r.cost.tool_calls, r.tool_errors, r.tool_failures) for r in results}
    assert counted == {
        r.task_key: (r.cost.tool_calls, r.tool_errors, r.tool_failures) for r in built_in
    }
    assert all(r.cost.tool_calls for r in results)
    # Every call the agent made is one turn holding exactly what the server sent.
    sent, recorded = sent_and_recorded(replies, results)
    assert recorded == sent
    assert sum(len(r.turns) for r in results) == len(replies) == len(requests)
    assert {t.model for r in results for t in r.turns} == {"served"}
    # The gateway asked for the training data the settings ask for, for the agent.
    assert all(q["return_token_ids"] and q["logprobs"] for q in requests)
    # A streamed call is streamed from the server, chunk by chunk (assembled for its turn).
    assert all(q.get("stream", False) is streaming for q in requests)
    # The tool answers the agent got over MCP are in its transcript, as it sent them
    # back in its next request (the gateway's view), one per tool call.
    for result in results:
        task = next(t for t in tasks if t.key == result.task_key)
        last = max(
            (q["messages"] for q in requests if q["messages"][0]["content"] == task.prompt),
            key=len,
        )
        sent_back = [(m["tool_call_id"], m["content"]) for m in last if m["role"] == "tool"]
        kept = [(m["tool_call_id"], m["content"]) for m in result.transcript if m["role"] == "tool"]
        assert kept == sent_back and len(kept) == result.steps == len(task.solution or ())
        roles = [m["role"] for m in result.transcript]
        assert roles[-1] == "assistant" and roles.count("assistant") == len(result.turns)
