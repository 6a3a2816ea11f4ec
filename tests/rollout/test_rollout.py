"""One rollout's lifecycle on the emulator: every failure reason, every phase.

Each test runs against a real emulator over loopback (real SDK, real MCP
sessions) and ends by checking the emulator's ledger: no instance left running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import pytest
from mcp.server.mcpserver import MCPServer

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.emulator.computer import Screen
from fleetroll.emulator.envs.base import ToolGate
from fleetroll.emulator.envs.ledger import LedgerEnv, LedgerScreen
from fleetroll.errors import PolicyError
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolCall, ToolSpec
from fleetroll.pool.assembly import fleet_provider, rollout_config
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import Phase, Rollout, RolloutIds
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import Events, MemorySink

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASKS = {
    t.key: t
    for f in sorted((config_dir() / "tasks").glob("*.jsonl"))
    for t in load_tasks(f, modalities=SETTINGS.modalities)
}
#: A three-step ledger task (transfer, then rent, then software).
MULTI_STEP = TASKS["ledger-010"]
FAST_RETRIES = {"max_attempts": 3, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}


@asynccontextmanager
async def engine(
    emu: Emulator, sink: MemorySink | None = None, **overrides: Any
) -> AsyncIterator[RolloutEngine]:
    settings = load_settings(**overrides)
    events = Events([sink or MemorySink()])
    provider = fleet_provider(settings, events, api_key=emu.api_key, base_url=emu.base_url)
    async with RolloutEngine.open(rollout_config(settings), events, provider) as eng:
        yield eng


def ids(n: int = 0) -> RolloutIds:
    return RolloutIds(batch_id="batch", rollout_id=f"rollout-{n}", sample_index=n)


def assert_one_started_and_one_completed(sink: MemorySink) -> None:
    started = [e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started")]
    completed = [e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed")]
    assert sorted(started) == sorted(completed) and len(set(completed)) == len(completed)


async def run_one(
    emu: Emulator,
    task: TaskSpec,
    policy: Any = None,
    sink: MemorySink | None = None,
    **overrides: Any,
) -> RolloutResult:
    sink = sink or MemorySink()
    async with engine(emu, sink, **overrides) as eng:
        with anyio.fail_after(60):
            result = await eng.rollout(task, ids()).run(policy or ScriptedPolicy())
    assert emu.ledger.running == 0
    assert_one_started_and_one_completed(sink)
    return result


class FailingPolicy:
    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        raise PolicyError("the model endpoint answered 500 three times", operation="policy")

    async def aclose(self) -> None:
        pass


class KillingPolicy(ScriptedPolicy):
    """Plays the solution, but the instance dies before the second step."""

    def __init__(self, emu: Emulator) -> None:
        super().__init__()
        self._emu = emu

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if sum(1 for m in messages if m["role"] == "assistant") == 1:
            for inst in self._emu.store:
                self._emu.store.kill(inst)
        return await super().act(task, messages, tools)


class NoToolsEnv(LedgerEnv):
    key: ClassVar[str] = "notools"

    def register_tools(self, server: MCPServer, gate: ToolGate) -> None:
        pass

    def screen(self) -> Screen:
        return LedgerScreen()


# -- the happy paths ---------------------------------------------------------


async def test_every_example_task_rolls_out_with_reward_one(emulator: Emulator) -> None:
    sink = MemorySink()
    results: list[RolloutResult] = []
    async with engine(emulator, sink) as eng:

        async def one(n: int, task: TaskSpec) -> None:
            results.append(await eng.rollout(task, ids(n)).run(ScriptedPolicy()))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for n, task in enumerate(TASKS.values()):
                    tg.start_soon(one, n, task)
    assert len(results) == len(TASKS) >= 28
    failed = [(r.task_key, r.failure_reason, r.error) for r in results if r.reward != 1.0]
    assert failed == []
    assert all(r.status == "completed" and r.instance_id for r in results)
    assert emulator.ledger.running == 0
    assert_one_started_and_one_completed(sink)
    assert len(sink.named("fleet_instance_released")) == len(TASKS)


async def test_a_result_carries_timings_transcript_and_verifier_output(emulator) -> None:
    result = await run_one(emulator, MULTI_STEP)
    assert result.steps == len(MULTI_STEP.solution or ()) and result.tool_errors == 0
    t = result.timings
    assert t.total_s >= t.provision_s + t.tools_s and t.verify_s > 0
    roles = [m["role"] for m in result.transcript]
    assert roles[0] == "user" and roles.count("tool") == result.steps
    assert result.verifier is not None and result.verifier.success
    assert result.verifier.execution_id


async def test_a_final_answer_is_passed_to_the_verifier(emulator: Emulator) -> None:
    task = next(t for t in TASKS.values() if t.requires_final_answer)
    result = await run_one(emulator, task)
    assert result.final_answer and result.reward == 1.0


async def test_computer_use_screenshots_are_elided_from_the_result_transcript(emulator) -> None:
    task = next(t for t in TASKS.values() if t.modality == "computer_use")
    result = await run_one(emulator, task)
    parts = [
        p for m in result.transcript if isinstance(m.get("content"), list) for p in m["content"]
    ]
    assert not [p for p in parts if p["type"] == "image_url"]
    placeholders = [p for p in parts if p["text"].startswith("[image:")]
    assert len(placeholders) == result.steps + 1  # and the initial screenshot


# -- one test per failure reason ---------------------------------------------


async def test_provisioning_that_keeps_failing_is_init_error_with_no_reward() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_create_5xx=1.0)) as emu:
        result = await run_one(emu, MULTI_STEP, sink=sink, provisioning=FAST_RETRIES)
    assert result.failure_reason is FailureReason.INIT_ERROR and result.reward is None
    assert result.status == "failed" and "3 attempt" in (result.error or "")
    assert len(sink.named("fleet_make_retry")) == 2 and len(sink.named("fleet_make_failed")) == 1


async def test_a_permanent_provisioning_error_fails_at_once(emulator: Emulator) -> None:
    task = MULTI_STEP.model_copy(update={"env_version": "v9"})
    sink = MemorySink()
    result = await run_one(emulator, task, sink=sink, provisioning=FAST_RETRIES)
    assert result.failure_reason is FailureReason.INIT_ERROR
    assert "1 attempt" in (result.error or "") and not sink.named("fleet_make_retry")


async def test_an_endpoint_without_tools_is_tools_error() -> None:
    async with Emulator(envs=[NoToolsEnv()]) as emu:
        task = MULTI_STEP.model_copy(update={"env_key": "notools"})
        result = await run_one(emu, task)
    assert result.failure_reason is FailureReason.TOOLS_ERROR and result.reward is None


async def test_computer_use_without_a_computer_tool_is_computer_tool_missing(emulator) -> None:
    task = next(t for t in TASKS.values() if t.modality == "computer_use")
    table = {name: row.model_dump() for name, row in SETTINGS.modalities.items()}
    table["computer_use"]["endpoint"] = "{root}mcp"  # the per-env endpoint: no computer
    result = await run_one(emulator, task, modalities=table)
    assert result.failure_reason is FailureReason.COMPUTER_TOOL_MISSING
    assert result.reward is None


async def test_an_instance_that_dies_mid_rollout_is_instance_lost(emulator: Emulator) -> None:
    result = await run_one(emulator, MULTI_STEP, KillingPolicy(emulator))
    assert result.failure_reason is FailureReason.INSTANCE_LOST and result.reward is None
    # The second step hit the dead instance: a failure, not an answer from the environment.
    assert result.steps == 2 and result.tool_failures == 1 and result.tool_errors == 0


async def test_a_rollout_past_its_deadline_in_a_hung_tool_call_is_platform_timeout() -> None:
    async with Emulator(FaultProfile(p_tool_hang=1.0)) as emu:
        result = await run_one(emu, MULTI_STEP, timeouts={"rollout_s": 1.0, "call_tool_s": 60})
    # The platform's time ran out, not the policy's: not scored (it would be a fake 0.0).
    assert result.failure_reason is FailureReason.PLATFORM_TIMEOUT
    assert result.reward is None and result.verifier is None


async def test_a_failing_policy_is_policy_error(emulator: Emulator) -> None:
    result = await run_one(emulator, MULTI_STEP, FailingPolicy())
    assert result.failure_reason is FailureReason.POLICY_ERROR and result.reward is None
    assert "answered 500" in (result.error or "")


async def test_a_slow_policy_passes_its_own_deadline_as_policy_error(emulator) -> None:
    result = await run_one(
        emulator, MULTI_STEP, ScriptedPolicy(think_time_s=3600), timeouts={"policy_s": 0.2}
    )
    assert result.failure_reason is FailureReason.POLICY_ERROR


async def test_a_verifier_that_cannot_run_is_verifier_error_never_zero() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_verifier_error=1.0)) as emu:
        result = await run_one(emu, MULTI_STEP, sink=sink)
    assert result.failure_reason is FailureReason.VERIFIER_ERROR and result.reward is None
    assert sink.named("fleet_verifier_failed")


async def test_a_verifier_that_crashes_is_verifier_error(emulator: Emulator) -> None:
    task = MULTI_STEP.model_copy(
        update={"verifier_func": "def verify(env, final_answer=None):\n    return 1 / 0\n"}
    )
    result = await run_one(emulator, task)
    assert result.failure_reason is FailureReason.VERIFIER_ERROR and result.reward is None
    assert result.verifier is not None and "ZeroDivisionError" in (result.verifier.error or "")


async def test_running_out_of_steps_is_max_steps_with_the_verifiers_reward(emulator) -> None:
    task = MULTI_STEP.model_copy(update={"max_steps": 1})
    result = await run_one(emulator, task)
    assert result.failure_reason is FailureReason.MAX_STEPS
    assert result.steps == 1 and result.reward == 0.0


async def test_closing_a_session_early_is_abandoned_and_scored(emulator: Emulator) -> None:
    sink = MemorySink()
    async with engine(emulator, sink) as eng:
        async with eng.session(MULTI_STEP, ids()) as env:
            messages = await env.reset()
            assert messages[0]["content"] == MULTI_STEP.prompt
            assert {t.name for t in env.tools} >= {"record_transaction"}
            first = (MULTI_STEP.solution or ())[0]
            step = await env.step({"name": first.name, "arguments": first.arguments})
            assert not step.done and not step.observation.is_error
        result = await env.close()
    assert result is not None and result.failure_reason is FailureReason.ABANDONED
    assert result.reward == 0.0 and result.steps == 1
    assert emulator.ledger.running == 0
    assert_one_started_and_one_completed(sink)


async def test_a_session_that_solves_the_task_completes_with_reward_one(emulator) -> None:
    task = next(t for t in TASKS.values() if t.requires_final_answer)
    async with engine(emulator) as eng, eng.session(task, ids()) as env:
        for step in task.solution or ():
            outcome = await env.step({"name": step.name, "arguments": step.arguments})
        assert outcome.done
    result = await env.close()
    assert result is not None and result.status == "completed" and result.reward == 1.0


async def test_a_cancelled_rollout_is_cancelled_released_and_completed(emulator) -> None:
    sink = MemorySink()
    async with engine(emulator, sink) as eng:
        rollout = eng.rollout(MULTI_STEP, ids())
        with anyio.move_on_after(0.5):
            await rollout.run(ScriptedPolicy(think_time_s=3600))
    assert rollout.result is not None
    assert rollout.result.failure_reason is FailureReason.CANCELLED
    assert rollout.result.reward is None
    assert emulator.ledger.running == 0
    assert_one_started_and_one_completed(sink)


# -- cancellation at every phase ---------------------------------------------

PHASE_FAULTS = {
    Phase.PROVISIONING: FaultProfile(create_latency=Latency(min_s=3600)),
    Phase.RESETTING: FaultProfile(p_reset_hang=1.0),
    Phase.CONNECTING: FaultProfile(mcp_warmup_s=3600),
    Phase.ACTING: FaultProfile(p_tool_hang=1.0),
    Phase.VERIFYING: FaultProfile(),
}


@pytest.mark.parametrize("phase", list(PHASE_FAULTS), ids=str)
async def test_cancelling_at_any_phase_releases_the_instance_and_completes(phase) -> None:
    sink = MemorySink()
    task = MULTI_STEP
    if phase is Phase.VERIFYING:  # a verifier that takes its time
        task = task.model_copy(
            update={
                "verifier_func": (
                    "def verify(env, final_answer=None):\n    import time\n    time.sleep(3600)\n"
                )
            }
        )
    async with Emulator(PHASE_FAULTS[phase]) as emu:
        async with engine(
            emu, sink, timeouts={"reset_s": 3600, "call_tool_s": 3600, "mcp_connect_s": 3600}
        ) as eng:
            rollout = eng.rollout(task, ids())
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(rollout.run, ScriptedPolicy())
                    await wait_for_phase(rollout, phase)
                    tg.cancel_scope.cancel()
        assert emu.ledger.running == 0
    assert rollout.result is not None
    assert rollout.result.failure_reason is FailureReason.CANCELLED
    assert_one_started_and_one_completed(sink)
    if phase is not Phase.PROVISIONING:
        assert sink.named("fleet_instance_released")


async def wait_for_phase(rollout: Rollout, phase: Phase) -> None:
    # Woken at each change of the rollout, bounded by the caller's fail_after.
    await rollout.wait_until(lambda r: r.phase is phase)
    if phase is Phase.ACTING:  # wait until the hung tool call is under way
        await rollout.wait_until(lambda r: r.messages[-1]["role"] == "assistant")


# -- an OpenAI-compatible model, multi-turn, both modalities ------------------


@pytest.mark.parametrize("modality", ["tool_use", "computer_use"])
async def test_an_openai_compatible_policy_drives_multi_turn_tool_use(
    emulator: Emulator, modality: str
) -> None:
    from fleetroll.policies import OpenAIChatPolicy
    from fleetroll.testing.fake_openai import FakeChatServer, tool_calling_script

    task = next(t for t in TASKS.values() if t.modality == modality and len(t.solution or ()) >= 3)
    calls = [(s.name, dict(s.arguments)) for s in task.solution or ()]
    async with FakeChatServer(tool_calling_script(calls)) as model:
        policy = OpenAIChatPolicy(base_url=model.base_url, model="fake", timeout_s=30)
        try:
            result = await run_one(emulator, task, policy)
        finally:
            await policy.aclose()
        requests = list(model.requests)
    assert result.status == "completed" and result.reward == 1.0
    assert result.steps == len(calls) and len(requests) == len(calls) + 1
    last = requests[-1]
    sent_tools = {t["function"]["name"] for t in last["tools"]}
    # The verifiers take final_answer, so submit_final_answer is offered too.
    assert sent_tools == (
        {"computer", "submit_final_answer"}
        if modality == "computer_use"
        else {t for t in sent_tools if t != "computer"}
    )
    assert [m["role"] for m in last["messages"]].count("tool") == len(calls)
    image_parts = [
        p
        for m in last["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
        if p.get("type") == "image_url"
    ]
    if modality == "computer_use":  # screenshots reach the model as images, the first too
        assert len(image_parts) == len(calls) + 1
        assert image_parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    else:
        assert not image_parts


async def test_a_model_calling_an_unknown_tool_gets_a_tool_error_and_goes_on(emulator) -> None:
    from fleetroll.policies import OpenAIChatPolicy
    from fleetroll.testing.fake_openai import FakeChatServer, tool_calling_script

    calls = [
        ("no_such_tool", {}),
        *[(s.name, dict(s.arguments)) for s in MULTI_STEP.solution or ()],
    ]
    async with FakeChatServer(tool_calling_script(calls)) as model:
        policy = OpenAIChatPolicy(base_url=model.base_url, model="fake", timeout_s=30)
        try:
            result = await run_one(emulator, MULTI_STEP, policy)
        finally:
            await policy.aclose()
    assert result.reward == 1.0 and result.tool_errors == 1
    assert "unknown tool 'no_such_tool'" in result.transcript[2]["content"]


async def test_an_error_in_the_callers_session_block_is_raised_as_is_after_scoring(
    emulator: Emulator,
) -> None:
    sink = MemorySink()
    async with engine(emulator, sink) as eng:
        with pytest.raises(KeyError, match="controller bug"):
            async with eng.session(MULTI_STEP, ids()) as env:
                raise KeyError("controller bug")
    result = await env.close()
    assert result is not None and result.failure_reason is FailureReason.ABANDONED
    assert result.reward == 0.0 and result.verifier is not None  # scored all the same
    assert emulator.ledger.running == 0
    assert_one_started_and_one_completed(sink)


# -- tool failures: infrastructure, not feedback -------------------------------


async def test_a_hung_tool_call_ends_the_rollout_as_tool_failure_with_no_reward() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_tool_hang=1.0)) as emu:
        result = await run_one(emu, MULTI_STEP, sink=sink, timeouts={"call_tool_s": 0.3})
    assert result.status == "failed" and result.failure_reason is FailureReason.TOOL_FAILURE
    assert result.reward is None and result.verifier is None  # never a fabricated zero
    assert result.steps == 1 and result.tool_failures == 1 and result.tool_errors == 0
    completed = sink.named("fleet_rollout_completed")[0].attributes
    assert completed["tool_failures"] == 1 and completed["failure_reason"] == "tool_failure"


async def test_with_on_tool_failure_continue_the_agent_goes_on_and_failures_are_counted() -> None:
    async with Emulator(FaultProfile(p_tool_hang=1.0)) as emu:
        result = await run_one(
            emu,
            MULTI_STEP,
            ScriptedPolicy(max_attempts=1),  # one call per step, however it ends
            timeouts={"call_tool_s": 0.3},
            pool={"on_tool_failure": "continue"},
        )
    steps = len(MULTI_STEP.solution or ())
    assert result.status == "completed" and result.failure_reason is None
    assert result.steps == steps and result.tool_failures == steps and result.tool_errors == 0
    assert result.reward == 0.0  # the verifier's verdict on a task left undone, as configured


async def test_an_error_the_environment_answers_is_feedback_not_a_failure() -> None:
    async with Emulator(FaultProfile(p_tool_error=1.0)) as emu:
        result = await run_one(emu, MULTI_STEP, ScriptedPolicy(max_attempts=1))
    steps = len(MULTI_STEP.solution or ())
    assert result.status == "completed" and result.failure_reason is None
    assert result.tool_errors == steps and result.tool_failures == 0


# -- MCP connect timeouts say what timed out -----------------------------------


async def test_an_mcp_endpoint_that_never_comes_up_is_init_error_saying_what_timed_out() -> None:
    async with Emulator(FaultProfile(mcp_warmup_s=3600)) as emu:
        result = await run_one(emu, MULTI_STEP, timeouts={"mcp_connect_s": 0.5})
    assert result.failure_reason is FailureReason.INIT_ERROR and result.reward is None
    error = result.error or ""
    assert "connecting to the MCP endpoint http" in error and "timed out after 0.5 s" in error
    assert "unexpected error" not in error


@pytest.mark.slow
async def test_an_instance_that_dies_while_mcp_connects_is_instance_lost() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(mcp_warmup_s=3600)) as emu:
        async with engine(emu, sink, timeouts={"mcp_connect_s": 2.0}) as eng:
            rollout = eng.rollout(MULTI_STEP, ids())
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(rollout.run, ScriptedPolicy())
                    await wait_for_phase(rollout, Phase.CONNECTING)
                    for inst in emu.store:
                        emu.store.kill(inst)
        assert emu.ledger.running == 0
    result = rollout.result
    assert result is not None and result.failure_reason is FailureReason.INSTANCE_LOST
    assert result.reward is None and "is gone" in (result.error or "")
    assert "timed out after 2 s" in (result.error or "")
    assert_one_started_and_one_completed(sink)


# -- sessions that end on their own complete -------------------------------------


async def test_a_session_the_controller_ends_with_done_completes_and_is_scored(emulator) -> None:
    sink = MemorySink()
    solution = MULTI_STEP.solution or ()
    async with engine(emulator, sink) as eng:
        async with eng.session(MULTI_STEP, ids()) as env:
            for step in solution:
                outcome = await env.step({"name": step.name, "arguments": step.arguments})
                assert not outcome.done
            await env.done()
            after = await env.step({"name": "list_accounts", "arguments": {}})
            assert after.done and after.observation.text == "The episode is over."
        result = await env.close()
    assert result is not None and result.status == "completed" and result.failure_reason is None
    assert result.reward == 1.0 and result.steps == len(solution)
    assert emulator.ledger.running == 0
    assert_one_started_and_one_completed(sink)


# -- secrets never reach a result ------------------------------------------------

SECRET = "sk-test-0123456789abcdef"
SERVICE_TOKEN = "svc-token-fedcba9876543210"
BEARER = "sk-live-abcdefghijklmnop"


class CallsPolicy:
    """Plays fixed tool calls, one per turn, then says "done"."""

    def __init__(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> None:
        self.calls = calls

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if turn >= len(self.calls):
            return AssistantTurn(content="done")
        name, arguments = self.calls[turn]
        return AssistantTurn(
            tool_calls=(ToolCall(id=f"call_{turn}", name=name, arguments=arguments),)
        )

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("verifier_fails", [False, True], ids=["stdout", "error"])
async def test_secrets_in_tool_answers_verifier_output_and_answers_are_redacted(
    emulator: Emulator, verifier_fails: bool
) -> None:
    verifier = (
        "def verify(env, final_answer=None):\n"
        f"    print('key {SECRET} and token {SERVICE_TOKEN}')\n"
        f"    print('Authorization: Bearer {BEARER}')\n"
        + (f"    raise RuntimeError('leaked {SECRET}')\n" if verifier_fails else "    return 1.0\n")
    )
    task = MULTI_STEP.model_copy(update={"verifier_func": verifier, "requires_final_answer": True})
    policy = CallsPolicy(
        [
            ("get_balance", {"account": f"Authorization: Bearer {BEARER}"}),
            ("get_balance", {"account": SECRET}),
            ("submit_final_answer", {"answer": f"my key is {SECRET}"}),
        ]
    )
    result = await run_one(
        emulator, task, policy, openai_api_key=SECRET, service_token=SERVICE_TOKEN
    )
    dumped = result.model_dump_json()
    for secret in (SECRET, SERVICE_TOKEN, BEARER):
        assert secret not in dumped
    tool_answers = [m["content"] for m in result.transcript if m["role"] == "tool"]
    assert all("[REDACTED]" in text for text in tool_answers[:2])
    assert result.final_answer == "my key is [REDACTED]"
    assert result.verifier is not None
    if verifier_fails:
        assert result.failure_reason is FailureReason.VERIFIER_ERROR
        assert "leaked [REDACTED]" in (result.verifier.error or "")
        assert "leaked [REDACTED]" in (result.error or "")
    else:
        assert result.reward == 1.0 and "[REDACTED]" in result.verifier.stdout
