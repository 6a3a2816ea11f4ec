"""Fleet parity with the reference, each behaviour on the emulator (issue 16, Build 3).

Real SDK, real MCP sessions over loopback: the final-answer tool offered as the
reference offers it, JSON answers that say they failed, timeouts tagged
``TimeoutError``, a screenshot in a computer modality's first observation, the
reference's event names, per-task TTLs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import pytest
from mcp.server.mcpserver import Context, MCPServer

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.emulator.computer import Screen
from fleetroll.emulator.envs.base import ToolGate
from fleetroll.emulator.envs.ledger import LedgerEnv, LedgerScreen
from fleetroll.errors import TaskFileError
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.assembly import fleet_provider, rollout_config
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import SolutionStep, TaskSpec, load_tasks, parse_task
from fleetroll.telemetry import Events, MemorySink

pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASKS = {
    t.key: t
    for f in sorted((config_dir() / "tasks").glob("*.jsonl"))
    for t in load_tasks(f, modalities=SETTINGS.modalities)
}
LEDGER = TASKS["ledger-001"]
DESKTOP = next(t for t in TASKS.values() if t.modality == "computer_use")
FINAL_ANSWER = "submit_final_answer"


class Recording(ScriptedPolicy):
    """Plays the solution, and keeps the tools and messages of its first turn."""

    def __init__(self) -> None:
        super().__init__()
        self.tools: list[str] = []
        self.first: list[dict[str, Any]] = []

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if not self.first:
            self.tools = [t.name for t in tools]
            self.first = [dict(m) for m in messages]
        return await super().act(task, messages, tools)


class FailingJsonEnv(LedgerEnv):
    """The ledger, plus a tool that answers a failure in its JSON, not with isError."""

    key: ClassVar[str] = "failingjson"

    def register_tools(self, server: MCPServer, gate: ToolGate) -> None:
        super().register_tools(server, gate)

        @server.tool(description="Sync with the bank (always fails, in its answer).")
        async def sync_bank(ctx: Context) -> dict[str, Any]:
            await gate.enter(ctx)
            return {"status": "failed", "error": "the bank is closed"}

        @server.tool(description="Report the sync state (no error).")
        async def sync_state(ctx: Context) -> dict[str, Any]:
            await gate.enter(ctx)
            return {"status": "ok", "error": None}

    def screen(self) -> Screen:
        return LedgerScreen()


@asynccontextmanager
async def engine(emu: Emulator, sink: MemorySink, **overrides: Any) -> AsyncIterator[RolloutEngine]:
    settings = load_settings(**overrides)
    provider = fleet_provider(settings, Events([sink]), api_key=emu.api_key, base_url=emu.base_url)
    async with RolloutEngine.open(rollout_config(settings), Events([sink]), provider) as eng:
        yield eng


async def run_one(
    emu: Emulator,
    task: TaskSpec,
    policy: Any = None,
    sink: MemorySink | None = None,
    **overrides: Any,
) -> RolloutResult:
    async with engine(emu, sink or MemorySink(), **overrides) as eng:
        with anyio.fail_after(60):
            ids = RolloutIds(batch_id="batch", rollout_id="rollout-0", sample_index=0)
            return await eng.rollout(task, ids).run(policy or ScriptedPolicy())


def ledger_record() -> dict[str, Any]:
    """ledger-001 as its task file holds it (Fleet's export form)."""
    line = (config_dir() / "tasks" / "ledger.jsonl").read_text().splitlines()[0]
    record: dict[str, Any] = json.loads(line)
    assert record["key"] == LEDGER.key
    return record


def without_final_answer_parameter(task: TaskSpec) -> TaskSpec:
    code = (task.verifier_func or "").replace(
        "def verify(env, final_answer=None):", "def verify(env):"
    )
    assert "final_answer" not in code
    return task.model_copy(update={"verifier_func": code})


# -- submit_final_answer ------------------------------------------------------


async def test_a_verifier_taking_final_answer_is_offered_submit_final_answer(emulator) -> None:
    assert not LEDGER.requires_final_answer and "final_answer=None" in (LEDGER.verifier_func or "")
    policy = Recording()
    result = await run_one(emulator, LEDGER, policy)
    assert FINAL_ANSWER in policy.tools and result.reward == 1.0


async def test_a_prompt_naming_submit_final_answer_is_offered_it(emulator) -> None:
    plain = without_final_answer_parameter(LEDGER)
    named = plain.model_copy(update={"prompt": plain.prompt + " Then call submit_final_answer."})
    offered, not_offered = Recording(), Recording()
    await run_one(emulator, named, offered)
    await run_one(emulator, plain, not_offered)
    assert FINAL_ANSWER in offered.tools
    assert FINAL_ANSWER not in not_offered.tools and not_offered.tools


async def test_verifier_code_is_read_as_verifier_func_and_scores(emulator) -> None:
    record = ledger_record()
    record["verifier_code"] = record.pop("verifier_func")
    task = parse_task(record, source="test", modalities=SETTINGS.modalities)
    assert task.verifier_func == LEDGER.verifier_func
    result = await run_one(emulator, task)
    assert result.reward == 1.0


# -- tool errors in the answer's JSON ----------------------------------------


async def test_a_tool_answer_whose_json_says_failed_is_a_tool_error() -> None:
    sink = MemorySink()
    async with Emulator(envs=[FailingJsonEnv()]) as emu:
        task = LEDGER.model_copy(
            update={
                "env_key": "failingjson",
                "solution": (
                    *(LEDGER.solution or ()),
                    SolutionStep(name="sync_bank"),
                    SolutionStep(name="sync_state"),
                ),
            }
        )
        # Each step played once: a flagged error would otherwise be played again.
        result = await run_one(emu, task, ScriptedPolicy(max_attempts=1), sink=sink)
    assert result.tool_errors == 1 and result.reward == 1.0
    (event,) = sink.named("fleet_mcp_tool_error")
    assert event.attributes["tool_name"] == "sync_bank"
    assert "the bank is closed" in event.attributes["error_message"]


# -- timeouts ----------------------------------------------------------------


async def test_a_tool_call_past_its_deadline_is_tagged_timeout_error() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_tool_hang=1.0, tool_hang_s=30.0)) as emu:
        result = await run_one(emu, LEDGER, sink=sink, timeouts={"call_tool_s": 0.5})
    assert result.failure_reason is FailureReason.TOOL_FAILURE and result.reward is None
    (event,) = sink.named("fleet_tool_call_failed")
    assert event.attributes["error_type"] == "TimeoutError"


# -- the first observation of computer modalities ----------------------------


@pytest.mark.parametrize("modality", ["computer_use", "browser_use"])
async def test_a_computer_modality_starts_with_a_screenshot(emulator, modality: str) -> None:
    task = DESKTOP.model_copy(update={"modality": modality})
    policy = Recording()
    result = await run_one(emulator, task, policy)
    assert result.reward == 1.0 and policy.tools == ["computer", FINAL_ANSWER]
    prompt, screen = policy.first
    assert prompt == {"role": "user", "content": task.prompt}
    kinds = [part["type"] for part in screen["content"]]
    assert screen["role"] == "user" and kinds == ["text", "image_url"]
    assert screen["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    inst = next(i for i in emulator.store if i.instance_id == result.instance_id)
    assert inst.image_type == "mcp" and inst.ttl_s == 1800


async def test_a_tool_use_rollout_starts_with_the_prompt_alone(emulator) -> None:
    policy = Recording()
    await run_one(emulator, LEDGER, policy)
    assert policy.first == [{"role": "user", "content": LEDGER.prompt}]


# -- the reference's event names ---------------------------------------------


async def test_a_ready_instance_emits_fleet_env_created(emulator) -> None:
    sink = MemorySink()
    result = await run_one(emulator, LEDGER, sink=sink)
    (created,) = sink.named("fleet_env_created")
    assert created.attributes["instance_id"] == result.instance_id
    assert created.attributes["provisioning_time_s"] >= 0
    assert len(sink.named("fleet_provisioning_completed")) == 1


async def test_a_release_that_leaves_the_instance_running_emits_fleet_env_close_failed() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_delete_error=1.0)) as emu:
        result = await run_one(emu, LEDGER, sink=sink)
        assert emu.ledger.running == 1
    assert result.reward == 1.0
    (failed,) = sink.named("fleet_env_close_failed")
    assert failed.attributes["instance_id"] == result.instance_id
    assert len(sink.named("fleet_instance_release_failed")) == 1


async def test_a_release_that_succeeds_emits_no_fleet_env_close_failed(emulator) -> None:
    sink = MemorySink()
    await run_one(emulator, LEDGER, sink=sink)
    assert sink.named("fleet_env_close_failed") == [] and sink.named("fleet_instance_released")


def test_telemetry_environment_defaults_to_the_references_training_rollouts() -> None:
    assert load_settings().telemetry.environment == "training_rollouts"


# -- per-task TTL --------------------------------------------------------------


async def test_a_tasks_ttl_seconds_overrides_the_modality_default(emulator) -> None:
    record = ledger_record()
    record["ttl_seconds"] = 1234
    task = parse_task(record, source="test", modalities=SETTINGS.modalities)
    result = await run_one(emulator, task)
    plain = await run_one(emulator, LEDGER)
    ttl = {i.instance_id: i.ttl_s for i in emulator.store}
    assert ttl[result.instance_id] == 1234
    assert ttl[plain.instance_id] == SETTINGS.modalities["tool_use"].ttl_s


# -- retries: list_tools (idempotent), requests that never left --------------


async def test_list_tools_is_retried_inside_its_deadline() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(list_tools_failures=2)) as emu:
        result = await run_one(emu, LEDGER, sink=sink)
    assert result.reward == 1.0
    retries = [e for e in sink.named("fleet_retry") if e.attributes["operation"] == "list_tools"]
    assert [e.attributes["attempt"] for e in retries] == [1, 2]


async def test_list_tools_failing_past_its_attempts_is_a_tools_failure() -> None:
    async with Emulator(FaultProfile(list_tools_failures=5)) as emu:
        result = await run_one(emu, LEDGER, retries={"list_tools_attempts": 2})
    assert result.failure_reason is FailureReason.TOOLS_ERROR and result.reward is None
    assert "still loading" in (result.error or "")


# -- browser_use's lease flow ------------------------------------------------


def leased_browser_use() -> dict[str, dict[str, Any]]:
    table = {name: row.model_dump() for name, row in SETTINGS.modalities.items()}
    table["browser_use"]["browser_lease"] = True
    return table


async def test_browser_use_by_lease_drives_the_leased_browser_and_deletes_the_lease() -> None:
    sink = MemorySink()
    policy = Recording()
    task = DESKTOP.model_copy(update={"modality": "browser_use"})
    async with Emulator() as emu:
        assert emu.app is not None
        result = await run_one(emu, task, policy, sink=sink, modalities=leased_browser_use())
        leases = emu.app.leases
        assert leases.created == 1 and leases.open == {} and leases.served > 0
        assert emu.ledger.running == 0
    assert result.reward == 1.0 and policy.tools == ["computer", FINAL_ANSWER]
    assert [p["type"] for p in policy.first[1]["content"]] == ["text", "image_url"]
    assert sink.named("fleet_instance_release_failed") == []


async def test_a_browser_lease_is_deleted_when_the_rollout_fails() -> None:
    task = DESKTOP.model_copy(update={"modality": "browser_use"})
    async with Emulator(FaultProfile(p_tool_hang=1.0, tool_hang_s=30.0)) as emu:
        assert emu.app is not None
        result = await run_one(
            emu, task, modalities=leased_browser_use(), timeouts={"call_tool_s": 0.5}
        )
        assert emu.app.leases.created == 1 and emu.app.leases.open == {}
        assert emu.ledger.running == 0
    assert result.failure_reason is FailureReason.TOOL_FAILURE


# -- task-file checks of the new fields -----------------------------------------


def test_verifier_func_and_verifier_code_together_are_an_error_naming_the_field() -> None:
    record = ledger_record()
    record["verifier_code"] = record["verifier_func"]
    with pytest.raises(TaskFileError, match="not both") as caught:
        parse_task(record, source="t.jsonl", modalities=SETTINGS.modalities)
    assert caught.value.field == "verifier_code"


@pytest.mark.parametrize("ttl", [0, -5, 1.5, "600", True])
def test_a_ttl_seconds_that_is_not_a_whole_number_of_seconds_is_an_error(ttl: object) -> None:
    record = ledger_record()
    record["ttl_seconds"] = ttl
    with pytest.raises(TaskFileError, match="whole number") as caught:
        parse_task(record, source="t.jsonl", modalities=SETTINGS.modalities)
    assert caught.value.field == "ttl_seconds"


async def test_a_browser_lease_that_never_turns_healthy_is_init_error_and_gives_all_back() -> None:
    sink = MemorySink()
    task = DESKTOP.model_copy(update={"modality": "browser_use"})
    async with Emulator(FaultProfile(p_browser_lease_unhealthy=1.0)) as emu:
        assert emu.app is not None
        result = await run_one(emu, task, sink=sink, modalities=leased_browser_use())
        assert emu.app.leases.created == 1 and emu.app.leases.open == {}
        assert emu.ledger.running == 0 and emu.ledger.created == 1
    assert result.failure_reason is FailureReason.INIT_ERROR and result.reward is None
    assert "browser lease" in (result.error or "")
    (failed,) = sink.named("fleet_make_failed")
    assert "browser lease" in failed.attributes["error_message"]
