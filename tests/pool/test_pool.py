"""RolloutPool: exactly one result per rollout, under load, faults and cancellation.

The load tests run the emulator in its own process (``EmulatorProcess``), so
it has the other core; everything else talks to an in-process emulator.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.errors import PoolFullError
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.machine import Phase, Rollout
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import Events, MemorySink

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
FAST = {
    # A fixed rate that never binds. Learnt (provisioning.adaptive_creates), the
    # chaos profile's random 429s read as the account's rate limit: every
    # Retry-After holds every create, and the rate falls, past the chaos test's
    # 30 s provisioning budget (tests/environments/test_create_rate_emulator.py).
    "adaptive_creates": False,
    "creates_per_second": 1000,
    "max_concurrent_creates": 64,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.5,
}


def pool_for(emu: Any, sink: MemorySink | None = None, **overrides: Any) -> RolloutPool:
    settings = load_settings(**{"provisioning": FAST, **overrides})
    return RolloutPool(
        settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink] if sink else [])
    )


def assert_pairs(sink: MemorySink) -> None:
    started = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started"))
    completed = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed"))
    assert started == completed and set(completed.values()) <= {1}


def assert_one_result_each(results: Sequence[RolloutResult], expected: int) -> None:
    ids = [r.rollout_id for r in results]
    assert len(ids) == expected and len(set(ids)) == expected


#: Rollouts in the load tests: enough for hundreds in flight at once, few enough for CI.
LOAD = 400


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_hundreds_of_rollouts_yield_one_result_each_once() -> None:
    sink = MemorySink()
    tasks, samples = LEDGER[:25], LOAD // 25
    async with EmulatorProcess() as emu:
        async with pool_for(emu, sink, pool={"concurrency": 200}) as pool:
            with anyio.fail_after(300):
                results = await pool.run_batch(
                    tasks, ScriptedPolicy(), samples_per_task=samples
                ).results()
        ledger = await emu.ledger()
    assert_one_result_each(results, LOAD)
    assert Counter(r.status for r in results) == {"completed": LOAD}
    # Each rollout on an instance of its own (none handed out twice), then its 1.0.
    shared = Counter(r.instance_id for r in results) - Counter(set(r.instance_id for r in results))
    assert not shared, shared
    wrong = [
        (r.task_key, r.instance_id, r.reward, r.tool_errors, r.error)
        for r in results
        if r.reward != 1.0
    ]
    assert wrong == []
    assert ledger["running"] == 0 and ledger["created"] == ledger["deleted"] == LOAD
    assert ledger["peak_concurrent_creates"] <= FAST["max_concurrent_creates"]
    assert_pairs(sink)


CHAOS_TIMEOUTS = {
    "provision_create_s": 3.0,
    "provision_total_s": 30.0,
    "reset_s": 1.0,
    "mcp_connect_s": 5.0,
    "list_tools_s": 3.0,
    "call_tool_s": 2.0,
    "policy_s": 10.0,
    "verifier_s": 10.0,
    "release_s": 5.0,
    "rollout_s": 30.0,
}


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_hundreds_of_rollouts_under_chaos_lose_nothing_and_leak_nothing() -> None:
    sink = MemorySink()
    chaos = SETTINGS.emulator.fault_profile("chaos")
    async with EmulatorProcess(chaos) as emu:
        async with pool_for(emu, sink, pool={"concurrency": 250}, timeouts=CHAOS_TIMEOUTS) as pool:
            with anyio.fail_after(400):
                results = await pool.run_batch(
                    LEDGER[:25], ScriptedPolicy(), samples_per_task=LOAD // 25
                ).results()
        ledger = await emu.ledger()
    assert_one_result_each(results, LOAD)
    reasons = Counter(r.failure_reason for r in results)
    # Chaos shows up as failures of the right kinds, never as fake zeros.
    assert reasons[None] > LOAD // 2, reasons
    assert all(
        r.reward is None
        for r in results
        if r.failure_reason not in (None, FailureReason.TIMEOUT, FailureReason.MAX_STEPS)
    )
    assert ledger["running"] == 0, ledger
    assert_pairs(sink)


class ExplodingPolicy(ScriptedPolicy):
    """Plays solutions, but raises a bug of its own on one task."""

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if task.key == LEDGER[3].key:
            raise RuntimeError("tokenizer exploded on turn 1")
        return await super().act(task, messages, tools)


async def test_one_rollout_crashing_in_its_policy_leaves_every_other_result_intact(
    emulator: Emulator,
) -> None:
    async with pool_for(emulator) as pool:
        with anyio.fail_after(120):
            results = await pool.run_batch(LEDGER[:8], ExplodingPolicy()).results()
    assert_one_result_each(results, 8)
    crashed = [r for r in results if r.task_key == LEDGER[3].key]
    assert crashed[0].failure_reason is FailureReason.POLICY_ERROR
    assert "RuntimeError: tokenizer exploded on turn 1" in (crashed[0].error or "")
    assert all(r.reward == 1.0 for r in results if r.task_key != LEDGER[3].key)
    assert emulator.ledger.running == 0


async def test_cancelling_a_batch_halfway_releases_everything_and_yields_every_result() -> None:
    sink = MemorySink()
    profile = FaultProfile(create_latency=Latency(min_s=0.01, max_s=0.2))
    async with Emulator(profile) as emu:
        async with pool_for(emu, sink, pool={"concurrency": 8}) as pool:
            batch = pool.run_batch(LEDGER, ScriptedPolicy(think_time_s=0.2), samples_per_task=4)
            results = []
            with anyio.fail_after(120):
                async for result in batch:
                    results.append(result)
                    if len(results) == 10:
                        await batch.aclose()
        assert emu.ledger.running == 0
    assert_one_result_each(results, len(LEDGER) * 4)
    reasons = Counter(r.failure_reason for r in results)
    assert reasons[None] >= 10 and reasons[FailureReason.CANCELLED] > 0
    assert all(r.reward is None for r in results if r.failure_reason is FailureReason.CANCELLED)
    assert_pairs(sink)


async def test_a_batch_deadline_cancels_what_is_left() -> None:
    async with Emulator() as emu:
        async with pool_for(emu) as pool:
            batch = pool.run_batch(LEDGER[:4], ScriptedPolicy(think_time_s=3600), deadline_s=0.5)
            with anyio.fail_after(60):
                results = await batch.results()
        assert emu.ledger.running == 0
    assert {r.failure_reason for r in results} == {FailureReason.CANCELLED}


async def test_create_limits_hold_in_the_emulators_ledger() -> None:
    profile = FaultProfile(create_latency=Latency(min_s=0.05, max_s=0.1))
    async with Emulator(profile) as emu:
        async with pool_for(emu, provisioning={**FAST, "max_concurrent_creates": 3}) as pool:
            with anyio.fail_after(120):
                results = await pool.run_batch(
                    LEDGER[:6], ScriptedPolicy(), samples_per_task=3
                ).results()
        assert emu.ledger.peak_concurrent_creates == 3
        assert emu.ledger.running == 0
    assert_one_result_each(results, 18)


async def test_active_rollouts_are_limited_while_provisioning_runs_ahead() -> None:
    acting = {Phase.RESETTING, Phase.CONNECTING, Phase.ACTING}
    async with Emulator() as emu:
        async with pool_for(emu, pool={"concurrency": 2}) as pool:
            batch = pool.run_batch(LEDGER[:10], ScriptedPolicy(think_time_s=0.05))
            peak_acting = 0

            def count(_: Rollout) -> None:  # at every change of phase: an exact peak
                nonlocal peak_acting
                now = sum(1 for r in batch.rollouts if r.phase in acting)
                peak_acting = max(peak_acting, now)

            for rollout in batch.rollouts:  # none has started yet
                rollout.observers.append(count)
            with anyio.fail_after(120):
                results = await batch.results()
        # Instances held: active (2) plus those made ahead (max_concurrent_creates).
        assert emu.ledger.peak_running <= 2 + FAST["max_concurrent_creates"]
    assert peak_acting == 2 and len(results) == 10


async def test_samples_of_a_task_form_a_group_with_deterministic_ids(emulator) -> None:
    async with pool_for(emulator) as pool:
        batch = pool.run_batch(
            LEDGER[:2], ScriptedPolicy(), samples_per_task=3, batch_id="grpo-step-7"
        )
        with anyio.fail_after(120):
            results = await batch.results()
    by_task: dict[str, list[RolloutResult]] = {}
    for r in results:
        by_task.setdefault(r.task_key, []).append(r)
    for key, group in by_task.items():
        assert sorted(r.sample_index for r in group) == [0, 1, 2]
        assert len({r.group_id for r in group}) == 1
        for r in group:
            assert r.rollout_id == rollout_id("grpo-step-7", key, r.sample_index)
    assert len({g[0].group_id for g in by_task.values()}) == 2


async def test_a_resumed_batch_runs_only_what_is_missing(emulator: Emulator) -> None:
    done = {rollout_id("b", LEDGER[0].key, 0), rollout_id("b", LEDGER[1].key, 1)}
    async with pool_for(emulator) as pool:
        batch = pool.run_batch(
            LEDGER[:2], ScriptedPolicy(), samples_per_task=2, batch_id="b", skip=done
        )
        with anyio.fail_after(120):
            results = await batch.results()
    assert batch.skipped == 2 and len(results) == 2
    assert not {r.rollout_id for r in results} & done


async def test_sessions_run_under_the_pools_limits(emulator: Emulator) -> None:
    task = LEDGER[0]
    async with pool_for(emulator, pool={"concurrency": 1}) as pool:
        async with pool.session(task) as env:
            assert pool.active.borrowed_tokens == 1
            for step in task.solution or ():
                await env.step({"name": step.name, "arguments": step.arguments})
        result = await env.close()
    assert result is not None and result.reward == 1.0
    assert emulator.ledger.running == 0


class HeldPolicy(ScriptedPolicy):
    """Plays solutions once ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        await self.release.wait()
        return await super().act(task, messages, tools)


async def test_a_long_lived_pool_keeps_only_the_last_few_batches_it_delivered(
    emulator: Emulator,
) -> None:
    async with pool_for(emulator, pool={"keep_finished_batches": 2}) as pool:
        with anyio.fail_after(120):
            for n in range(5):
                await pool.run_batch(LEDGER[:1], ScriptedPolicy(), batch_id=f"b{n}").results()
            unread = pool.run_batch(LEDGER[:1], ScriptedPolicy(), batch_id="unread")
            await unread.finished.wait()
            held = HeldPolicy()
            running = pool.run_batch(LEDGER[:1], held, batch_id="running")
            kept = set(pool.batches)
            with pytest.raises(ValueError, match="still running"):
                pool.forget("running")
            pool.forget("b4")
            pool.forget("no-such-batch")  # nothing to let go
            after_forget = set(pool.batches)
            held.release.set()
            await running.results()
            await unread.results()
            at_the_end = set(pool.batches)
    # Drained batches beyond the last two are gone; one nobody read yet stays.
    assert kept == {"b3", "b4", "unread", "running"}
    assert after_forget == {"b3", "unread", "running"}
    assert at_the_end == {"unread", "running"}


async def test_two_tasks_sharing_a_key_are_refused_before_anything_runs(
    emulator: Emulator,
) -> None:
    created = emulator.ledger.created
    async with pool_for(emulator) as pool:
        with pytest.raises(ValueError, match=f"duplicate task key '{LEDGER[1].key}'"):
            pool.run_batch([LEDGER[0], LEDGER[1], LEDGER[1]], ScriptedPolicy())
        assert not pool.batches
    assert emulator.ledger.created == created


async def test_a_batch_past_the_cap_on_queued_rollouts_is_refused_until_room_is_made(
    emulator: Emulator,
) -> None:
    async with pool_for(emulator, pool={"max_queued_rollouts": 3}) as pool:
        held = HeldPolicy()
        first = pool.run_batch(LEDGER[:1], held, samples_per_task=2)
        with pytest.raises(PoolFullError) as refused:
            pool.run_batch(LEDGER[1:2], ScriptedPolicy(), samples_per_task=2)
        with pytest.raises(PoolFullError) as too_big:  # alone over the cap: no wait helps
            pool.run_batch(LEDGER[1:2], ScriptedPolicy(), samples_per_task=4)
        held.release.set()
        with anyio.fail_after(120):
            await first.results()
            later = await pool.run_batch(
                LEDGER[1:2], ScriptedPolicy(), samples_per_task=2
            ).results()
    assert (refused.value.queued, refused.value.requested, refused.value.limit) == (2, 2, 3)
    assert "the pool is full" in str(refused.value)
    assert "pool.max_queued_rollouts = 3" in str(refused.value)
    assert "split it" in str(too_big.value)
    assert [r.reward for r in later] == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_memory_stays_flat_over_hundreds_of_batches_in_one_pool() -> None:
    """A soak: a training controller's pool runs batch after batch for days.

    Before, every finished batch stayed in ``pool.batches`` with its
    transcripts: ~46 KB per ledger rollout, ~5.5 MiB over these 60 batches of
    two (the bound is under a fifth of that). Measured with tracemalloc (Python's own
    allocations, so the allocator's noise in the resident size does not count).
    """
    batches, warm_up, samples = 90, 30, 2
    tracemalloc.start(1)
    try:
        async with EmulatorProcess() as emu, pool_for(emu) as pool:
            with anyio.fail_after(360):
                for n in range(batches):
                    results = await pool.run_batch(
                        LEDGER[:1], ScriptedPolicy(), samples_per_task=samples
                    ).results()
                    assert [r.reward for r in results] == [1.0] * samples
                    if n + 1 == warm_up:
                        gc.collect()
                        before, _ = tracemalloc.get_traced_memory()
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
            held = len(pool.batches)
    finally:
        tracemalloc.stop()
    growth_mib = (after - before) / 2**20
    assert growth_mib < 1.0, f"memory grew {growth_mib:.1f} MiB over {batches - warm_up} batches"
    assert held == SETTINGS.pool.keep_finished_batches
