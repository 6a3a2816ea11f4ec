from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.policies.gate import PolicyGate
from fleetroll.pool.assembly import rollout_config
from fleetroll.results import FailureReason
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import Phase, RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_provider import FakeProvider

pytestmark = pytest.mark.anyio


async def test_an_open_gate_admits_at_once_with_the_current_version() -> None:
    gate = PolicyGate(version=3)
    gate.version = 7
    assert await gate.admit() == (7, 0.0)


async def test_a_pause_holds_new_calls_until_it_ends_and_they_get_the_new_version() -> None:
    gate = PolicyGate()
    admitted: list[int] = []

    async def call() -> None:
        version, _ = await gate.admit()
        admitted.append(version)

    async with anyio.create_task_group() as tg, gate.paused_calls():
        tg.start_soon(call)
        tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert admitted == []
        gate.version = 1
        # The pause is over: both waiting calls go on, with the new version.
    assert admitted == [1, 1]
    assert not gate.paused


async def test_nested_pauses_hold_calls_until_the_last_one_ends() -> None:
    gate = PolicyGate()
    admitted = anyio.Event()

    async def call() -> None:
        await gate.admit()
        admitted.set()

    async with anyio.create_task_group() as tg, gate.paused_calls():
        async with gate.paused_calls():
            tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert gate.paused
        assert not admitted.is_set()
    assert admitted.is_set()


async def test_a_pause_whose_block_raises_still_ends() -> None:
    gate = PolicyGate()
    with pytest.raises(RuntimeError):
        async with gate.paused_calls():
            raise RuntimeError("the weight sync failed")
    assert not gate.paused
    assert (await gate.admit())[0] == 0


def test_a_version_must_be_an_int() -> None:
    gate = PolicyGate()
    with pytest.raises(TypeError, match="not str"):
        gate.version = "2"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="not bool"):
        gate.version = True


# -- the gate in a rollout (on the provider double) ---------------------------

TASK = TaskSpec(
    key="note-done",
    prompt="Write done.",
    env_key="fake",
    modality="tool_use",
    verifier_func="def verify(env):\n    return 1.0\n",
    solution=(SolutionStep(name="note", arguments={"word": "done"}),),
)


class CountingPolicy(ScriptedPolicy):
    """Plays the solution; counts its calls; ``on_first_turn`` runs on each rollout's first."""

    def __init__(self, on_first_turn: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.calls = 0
        self.on_first_turn = on_first_turn

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        self.calls += 1
        if not any(m.get("role") == "assistant" for m in messages):
            self.on_first_turn()
        return await super().act(task, messages, tools)


@asynccontextmanager
async def engine(
    sink: MemorySink, **overrides: Any
) -> AsyncIterator[tuple[RolloutEngine, FakeProvider]]:
    settings = load_settings(**overrides)
    provider = FakeProvider(settings.modalities, timeouts=settings.timeouts)
    async with RolloutEngine.open(rollout_config(settings), Events([sink]), provider) as eng:
        yield eng, provider


def pairs(sink: MemorySink) -> tuple[list[str], list[str]]:
    return (
        [e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started")],
        [e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed")],
    )


async def test_a_pause_holds_policy_calls_and_charges_no_rollout_deadline() -> None:
    sink = MemorySink()
    policy = CountingPolicy()
    deadline_s = 0.5  # what is left of the rollout after the pause fits, even on a busy machine
    async with engine(sink, timeouts={"rollout_s": deadline_s, "policy_s": deadline_s}) as (
        eng,
        provider,
    ):
        rollout = eng.rollout(TASK, RolloutIds("b", "r"))
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg, eng.policy_gate.paused_calls():
                tg.start_soon(rollout.run, policy)
                await rollout.wait_until(lambda r: r.phase is Phase.ACTING)
                await anyio.wait_all_tasks_blocked()
                # Let both deadlines pass while the rollout waits for the pause.
                await anyio.sleep(3 * deadline_s)
                assert policy.calls == 0
    assert rollout.result is not None
    assert (rollout.result.failure_reason, rollout.result.reward) == (None, 1.0)
    assert policy.calls == 2 and provider.running == 0


async def test_a_rollout_whose_first_turn_is_too_old_when_it_ends_is_stale_and_still_scored() -> (
    None
):
    sink = MemorySink()
    async with engine(sink, pool={"max_staleness": 1}) as (eng, provider):

        def weights_synced_twice() -> None:
            eng.policy_gate.version += 2

        with anyio.fail_after(10):
            result = await eng.rollout(TASK, RolloutIds("b", "r")).run(
                CountingPolicy(weights_synced_twice)
            )
    assert (result.status, result.failure_reason, result.reward) == (
        "failed",
        FailureReason.STALE,
        1.0,
    )
    assert "policy version 0, 2 versions behind version 2" in (result.error or "")
    assert "pool.max_staleness = 1" in (result.error or "")
    assert pairs(sink) == (["r"], ["r"]) and provider.running == 0


async def test_a_stale_rollout_restarts_on_a_fresh_instance_with_one_result_and_one_pair() -> None:
    sink = MemorySink()
    overrides = {"max_staleness": 0, "staleness_action": "restart"}
    async with engine(sink, pool=overrides) as (eng, provider):
        bumps = iter([1])

        def sync_once() -> None:
            eng.policy_gate.version += next(bumps, 0)

        with anyio.fail_after(10):
            result = await eng.rollout(TASK, RolloutIds("b", "r")).run(CountingPolicy(sync_once))
    assert (result.status, result.failure_reason, result.reward) == ("completed", None, 1.0)
    assert len(provider.released) == 2 and provider.running == 0
    assert result.instance_id == provider.released[-1]
    assert pairs(sink) == (["r"], ["r"])
    (restarted,) = sink.named("fleet_rollout_restarted")
    assert restarted.attributes["instance_id"] == provider.released[0]
    assert (
        restarted.attributes["first_policy_version"],
        restarted.attributes["policy_version"],
    ) == (0, 1)


async def test_a_rollout_stale_after_every_restart_is_flagged_once_the_restarts_run_out() -> None:
    sink = MemorySink()
    overrides = {"max_staleness": 0, "staleness_action": "restart", "max_stale_restarts": 2}
    async with engine(sink, pool=overrides) as (eng, provider):

        def sync() -> None:
            eng.policy_gate.version += 1

        with anyio.fail_after(10):
            result = await eng.rollout(TASK, RolloutIds("b", "r")).run(CountingPolicy(sync))
    assert (result.failure_reason, result.reward) == (FailureReason.STALE, 1.0)
    assert len(provider.released) == 3 and provider.running == 0
    assert pairs(sink) == (["r"], ["r"]) and len(sink.named("fleet_rollout_restarted")) == 2


async def test_without_max_staleness_nothing_is_ever_stale() -> None:
    sink = MemorySink()
    async with engine(sink) as (eng, _):

        def sync() -> None:
            eng.policy_gate.version += 100

        with anyio.fail_after(10):
            result = await eng.rollout(TASK, RolloutIds("b", "r")).run(CountingPolicy(sync))
    assert (result.failure_reason, result.reward) == (None, 1.0)


async def test_a_mirror_of_the_gate_wakes_at_each_change_of_version_or_pause() -> None:
    gate = PolicyGate()
    woke: list[tuple[int, bool]] = []

    async def mirror() -> None:
        while True:
            await gate.changed()
            woke.append((gate.version, gate.paused))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(mirror)
            await anyio.wait_all_tasks_blocked()
            async with gate.paused_calls():
                await anyio.wait_all_tasks_blocked()
                gate.version = 3
                await anyio.wait_all_tasks_blocked()
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert woke == [(0, True), (3, True), (3, False)]
    assert gate.generation == 3
