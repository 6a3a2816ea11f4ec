"""Issue 13's acceptance check: on the emulator's faulty profiles, with the
scripted policy (whose solutions are correct), no rollout is scored 0.0.

Every result is either the solution's reward, 1.0, or an infrastructure
failure with a ``failure_reason`` and ``reward: null``; a fault never turns
into a fabricated zero a trainer would learn from. Issue 27's: neither does
a rollout deadline (``timeouts.rollout_s``) shorter than the platform's hangs.
Issue 37's: nor an agent of its own (``--agent-command``) on the faults where
the built-in loop's rollout is unscored.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
import pytest
from test_rollout_deadlines import assert_timings_add_up

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.policies import OpenAIChatPolicy, ScriptedPolicy
from fleetroll.pool.assembly import chat_policy_config, fleet_provider, rollout_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    FakeError,
    Reply,
    Script,
    VllmShape,
    context_length_error,
)
from training_helpers import AGENT, solving

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASKS = [
    t
    for f in sorted((config_dir() / "tasks").glob("*.jsonl"))
    for t in load_tasks(f, modalities=SETTINGS.modalities)
]

#: Four steps, then "done".
TOOL_USE = next(t for t in TASKS if t.key == "ledger-010")

#: Small deadlines, so that the profile's hangs end in seconds: a hang passes
#: its deadline (and is a failure) instead of holding the test for an hour.
TIMEOUTS = {
    "provision_create_s": 3.0,
    "provision_total_s": 30.0,
    "reset_s": 1.0,
    "mcp_connect_s": 10.0,
    "list_tools_s": 5.0,
    "call_tool_s": 1.0,
    "verifier_s": 20.0,
    "release_s": 5.0,
    "rollout_s": 60.0,
}
#: The profile's hangs, shortened (whatever the shipped config says), yet
#: each longer than the deadline it must trip.
HANGS = {"create_hang_s": 6.0, "tool_hang_s": 6.0, "reset_hang_s": 3.0}
PROVISIONING = {"creates_per_second": 1000, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}
#: An injected tool error is an error *answer* (feedback, scored), which the scripted
#: policy plays again; after ``max_attempts`` it goes on with the next step, and the
#: skipped step earns a true 0.0. With the default 3, three in a row at the chaos
#: profile's 5 % happen somewhere in the 122 steps in 1.5 % of runs; with 10, never.
SOLVER = ScriptedPolicy(max_attempts=10)


async def run_every_task(profile: FaultProfile, timeouts: dict[str, float]) -> list[RolloutResult]:
    """One rollout of every shipped task on the emulator with ``profile``, the scripted policy."""
    settings = load_settings(timeouts=timeouts, provisioning=PROVISIONING)
    results: list[RolloutResult] = []
    async with Emulator(profile) as emu:
        async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
            with anyio.fail_after(240):
                async for result in pool.run_batch(TASKS, SOLVER):
                    results.append(result)
        assert emu.ledger.running == 0
    assert len(results) == len(TASKS)
    return results


def fake_zeros(results: list[RolloutResult]) -> list[tuple[Any, ...]]:
    """The results that are neither the solution's 1.0 nor an unscored failure."""
    return [
        (r.task_key, r.status, r.failure_reason, r.reward, r.error, r.tool_errors, r.tool_failures)
        for r in results
        if not (r.reward == 1.0 or (r.failure_reason is not None and r.reward is None))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("profile_name", ["realistic", "chaos"])
async def test_faults_never_give_a_zero_reward_to_a_correct_solution(profile_name: str) -> None:
    profile = SETTINGS.emulator.fault_profile(profile_name).model_copy(update=HANGS)
    results = await run_every_task(profile, TIMEOUTS)
    assert fake_zeros(results) == []


#: The rollout's deadline passes first: every wait's own deadline is longer, and
#: every injected hang (and warm-up) longer still. A rollout the platform does
#: not hold up ends well inside it.
SHORT_ROLLOUT = {
    **TIMEOUTS,
    "reset_s": 20.0,
    "mcp_connect_s": 20.0,
    "list_tools_s": 20.0,
    "call_tool_s": 20.0,
    "rollout_s": 10.0,
}
LONG_HANGS = {**HANGS, "tool_hang_s": 30.0, "reset_hang_s": 30.0}
#: Per profile, the platform delays injected over its own faults.
DELAYS: dict[str, dict[str, Any]] = {
    # An MCP service still starting when the rollout's deadline passes.
    "clean": {"mcp_warmup_s": 30.0},
    "realistic": {**LONG_HANGS, "p_tool_hang": 0.1, "p_reset_hang": 0.1},
    "chaos": {**LONG_HANGS, "p_tool_hang": 0.1, "p_reset_hang": 0.1},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("profile_name", list(DELAYS))
async def test_a_rollout_deadline_shorter_than_the_platform_hangs_gives_no_fake_zero(
    profile_name: str,
) -> None:
    profile = SETTINGS.emulator.fault_profile(profile_name).model_copy(update=DELAYS[profile_name])
    results = await run_every_task(profile, SHORT_ROLLOUT)
    # The solutions are right: a 0.0 could only be a deadline charged to the policy.
    assert fake_zeros(results) == []
    # The deadline did pass in waits on the platform (the test is not vacuous).
    assert any(r.failure_reason is FailureReason.PLATFORM_TIMEOUT for r in results)
    for r in results:
        assert_timings_add_up(r.timings)


# -- an agent of its own (--agent-command) on the same faults (issue 37) ----------------


async def built_in_and_agent(
    profile: FaultProfile,
    timeouts: dict[str, float],
    script: Script,
    *,
    vllm: VllmShape | None = None,
    policy_settings: dict[str, Any] | None = None,
    sink: MemorySink | None = None,
) -> dict[str, RolloutResult]:
    """One rollout of ``TOOL_USE`` by the built-in loop and one by the example agent
    (plain ``openai`` and ``mcp``, through the gateway and its MCP relay), side by
    side on the emulator with ``profile``, the policy server playing ``script``
    shaped as ``vllm``, the policy's settings ``policy_settings`` on top; their
    events to ``sink`` if given."""
    results: dict[str, RolloutResult] = {}
    async with (
        Emulator(profile) as emu,
        FakeChatServer(script, vllm=vllm or VllmShape()) as server,
    ):
        policy = {"kind": "openai", "base_url": server.base_url, "model": "served"}
        policy |= policy_settings or {}
        settings = load_settings(timeouts=timeouts, provisioning=PROVISIONING, policy=policy)
        events = Events([sink or MemorySink()])
        provider = fleet_provider(settings, events, api_key=emu.api_key, base_url=emu.base_url)
        async with (
            RolloutEngine.open(rollout_config(settings), events, provider) as eng,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as model,
            CommandAgent.from_config(
                [sys.executable, str(AGENT)], chat_policy_config(settings)
            ) as agent,
        ):

            async def one(name: str, actor: OpenAIChatPolicy | CommandAgent) -> None:
                ids = RolloutIds(batch_id="b", rollout_id=name)
                results[name] = await eng.rollout(TOOL_USE, ids).run(actor)

            with anyio.fail_after(180):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(one, "built_in", model)
                    tg.start_soon(one, "agent", agent)
        assert emu.ledger.running == 0
    return results


def outcome(result: RolloutResult) -> tuple[Any, ...]:
    return (result.status, result.failure_reason, result.reward)


#: Every tool call hangs, longer than any deadline below.
HANGING_TOOLS = FaultProfile(p_tool_hang=1.0, tool_hang_s=120.0)


@pytest.mark.timeout(300)
async def test_an_agent_s_tool_call_waiting_when_the_deadline_passes_is_platform_timeout() -> None:
    # The rollout's deadline passes while the tool call waits (call_tool_s is longer).
    timeouts = {**TIMEOUTS, "call_tool_s": 100.0, "rollout_s": 20.0}
    results = await built_in_and_agent(HANGING_TOOLS, timeouts, solving([TOOL_USE]))

    assert outcome(results["built_in"]) == ("failed", FailureReason.PLATFORM_TIMEOUT, None)
    assert outcome(results["agent"]) == outcome(results["built_in"])
    assert "the tool call" in (results["agent"].error or "")
    assert results["agent"].cost.tool_calls == 1


@pytest.mark.timeout(300)
async def test_an_agent_s_tool_call_past_call_tool_s_is_a_tool_failure() -> None:
    timeouts = {**TIMEOUTS, "call_tool_s": 2.0}
    sink = MemorySink()
    results = await built_in_and_agent(HANGING_TOOLS, timeouts, solving([TOOL_USE]), sink=sink)

    assert outcome(results["built_in"]) == ("failed", FailureReason.TOOL_FAILURE, None)
    assert outcome(results["agent"]) == outcome(results["built_in"])
    agent = results["agent"]
    assert (agent.cost.tool_calls, agent.tool_failures) == (1, 1)
    assert "call_tool_s" in (agent.error or "")
    # Each rollout's call is one fleet_tool_call, failed after call_tool_s, and one
    # fleet_tool_call_failed, both with the rollout's attributes (the relay's too).
    tool = TOOL_USE.solution[0].name if TOOL_USE.solution else None
    for name in ("fleet_tool_call", "fleet_tool_call_failed"):
        events = sink.named(name)
        assert sorted(e.attributes["rollout_id"] for e in events) == ["agent", "built_in"]
        assert {(e.attributes["tool_name"], e.attributes["env_key"]) for e in events} == {
            (tool, TOOL_USE.env_key)
        }
    for event in sink.named("fleet_tool_call"):
        assert event.attributes["outcome"] == "failed"
        assert event.attributes["duration_s"] >= 2.0


@pytest.mark.timeout(300)
async def test_a_policy_failure_fails_an_agent_s_rollout_as_the_built_in_loop_s() -> None:
    refused = FakeError(400, "the server refused the request")
    results = await built_in_and_agent(FaultProfile(), TIMEOUTS, lambda body: refused)

    assert outcome(results["built_in"]) == ("failed", FailureReason.POLICY_ERROR, None)
    assert outcome(results["agent"]) == outcome(results["built_in"])


#: The task's reward with none of its solution played (the verifier's, on the
#: untouched instance): what a rollout that overflowed at its first call scores.
UNSOLVED = 0.0


@pytest.mark.timeout(300)
async def test_a_context_length_error_ends_an_agent_s_rollout_as_the_built_in_loop_s() -> None:
    # vLLM's HTTP 400 ("This model's maximum context length is 8 tokens...") on every call.
    results = await built_in_and_agent(
        FaultProfile(), TIMEOUTS, solving([TOOL_USE]), vllm=VllmShape(max_context=8)
    )

    assert outcome(results["built_in"]) == ("failed", FailureReason.CONTEXT_OVERFLOW, UNSOLVED)
    assert outcome(results["agent"]) == outcome(results["built_in"])
    # The server's own words, which the agent got as its answer too.
    assert "maximum context length is 8 tokens" in (results["agent"].error or "")
    assert results["agent"].cost.policy_calls == 0


@pytest.mark.timeout(300)
async def test_a_context_length_error_mid_rollout_keeps_the_agent_s_turns_and_is_scored() -> None:
    solve = solving([TOOL_USE])

    def script(body: dict[str, Any]) -> Reply:
        # The third call's prompt no longer fits: the two tool calls before it stand.
        if sum(1 for m in body["messages"] if m["role"] == "assistant") >= 2:
            return context_length_error(4096, 4000, 512)
        return solve(body)

    results = await built_in_and_agent(FaultProfile(), TIMEOUTS, script)

    built_in, agent = results["built_in"], results["agent"]
    assert (built_in.status, built_in.failure_reason) == ("failed", FailureReason.CONTEXT_OVERFLOW)
    assert built_in.reward is not None  # the verifier's, on what the two steps did
    assert outcome(agent) == outcome(built_in)
    assert len(agent.turns) == len(built_in.turns) == 2
    assert agent.cost.tool_calls == built_in.cost.tool_calls == 2


@pytest.mark.timeout(300)
async def test_max_context_tokens_ends_an_agent_s_rollout_before_a_call_as_the_built_in_s() -> None:
    results = await built_in_and_agent(
        FaultProfile(),
        TIMEOUTS,
        solving([TOOL_USE]),
        policy_settings={"max_context_tokens": 5},
    )

    assert outcome(results["built_in"]) == ("failed", FailureReason.CONTEXT_OVERFLOW, UNSOLVED)
    assert outcome(results["agent"]) == outcome(results["built_in"])
    assert "policy.max_context_tokens = 5" in (results["agent"].error or "")
    assert results["agent"].cost.policy_calls == 0
