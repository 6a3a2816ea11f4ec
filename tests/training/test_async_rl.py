"""Asynchronous RL against the embedded emulator (real HTTP and MCP over loopback).

Policy versions across a mid-batch bump, the trainer's pause on policy calls,
staleness (flag and restart), groups in completion order and oversampling,
each checked against the emulator's ledger (nothing left running) and the
telemetry invariant (one started and one completed event per rollout id).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.jobs.job import run_job
from fleetroll.policies import OpenAIChatPolicy, ScriptedPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.journal import BatchIdentity, Journal, claim_journal, read_journal
from fleetroll.pool.rollout_pool import RolloutPool, group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink
from fleetroll.testing.fake_openai import FakeChatServer, Reply, VllmShape, completion, tool_call
from fleetroll.testing.planned_policy import PlannedPolicy
from gate_watch import paused_arrival

pytestmark = pytest.mark.slow

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
FAST = {"creates_per_second": 1000, "max_concurrent_creates": 16}


def pool_for(emu: Emulator, sink: MemorySink, **overrides: Any) -> RolloutPool:
    settings = load_settings(**{"provisioning": FAST, **overrides})
    return RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink]))


def assert_pairs(sink: MemorySink) -> None:
    started = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started"))
    completed = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed"))
    assert started == completed and set(completed.values()) <= {1}


async def test_a_version_bump_mid_batch_marks_the_rollouts_that_began_before_it_stale(
    emulator: Emulator,
) -> None:
    sink = MemorySink()
    early, late = LEDGER[:2], LEDGER[2:4]
    policy = PlannedPolicy({t.key: ["hold"] for t in early})
    async with pool_for(emulator, sink, pool={"max_staleness": 0}) as pool:
        batch = pool.run_batch([*early, *late], policy)
        results: list[RolloutResult] = []
        with anyio.fail_after(60):
            async for result in batch:
                results.append(result)
                if len(results) == len(late):  # the held ones began on version 0
                    pool.policy_version = 1
                    policy.release.set()
    by_key = {r.task_key: r for r in results}
    for task in late:
        assert (by_key[task.key].failure_reason, by_key[task.key].reward) == (None, 1.0)
    for task in early:
        stale = by_key[task.key]
        assert (stale.failure_reason, stale.reward) == (FailureReason.STALE, 1.0)
        assert "policy version 0, 1 versions behind version 1" in (stale.error or "")
    assert emulator.ledger.running == 0
    assert_pairs(sink)


async def test_a_pause_holds_only_policy_calls_and_a_tool_call_under_way_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = MemorySink()
    task = next(t for t in LEDGER if t.solution and len(t.solution) >= 2)
    profile = FaultProfile(tool_latency=Latency(min_s=0.2, max_s=0.2))
    async with Emulator(profile) as emu:
        policy = PlannedPolicy()
        async with pool_for(emu, sink) as pool:
            held = paused_arrival(pool.policy_gate, monkeypatch)
            batch = pool.run_batch([task], policy)
            (rollout,) = batch.rollouts
            with anyio.fail_after(60):
                # The first tool call is on its way to the emulator...
                await rollout.wait_until(
                    lambda r: bool(r.messages) and r.messages[-1]["role"] == "assistant"
                )
                async with pool.policy_paused():
                    # ...and its answer comes in during the pause,
                    await rollout.wait_until(lambda r: r.messages[-1]["role"] == "tool")
                    await held.wait()  # its next policy call is at the gate
                    # but the next policy call waits for the pause to end.
                    assert policy.calls[task.key] == 1
                (result,) = await batch.results()
        assert emu.ledger.running == 0
    assert (result.failure_reason, result.reward) == (None, 1.0)
    assert policy.calls[task.key] == len(task.solution or ()) + 1
    assert_pairs(sink)


async def test_stale_rollouts_restart_on_fresh_instances_with_one_result_each() -> None:
    sink = MemorySink()
    overrides = {"max_staleness": 0, "staleness_action": "restart"}
    async with Emulator() as emu:
        async with pool_for(emu, sink, pool={**overrides, "concurrency": 1}) as pool:
            policy = PlannedPolicy({LEDGER[0].key: ["gate"]})
            batch = pool.run_batch(LEDGER[:1], policy, samples_per_task=2)
            with anyio.fail_after(60):
                # Whichever sample took the one slot first is at the gate (the
                # first's view alone would wait forever if the second went first).
                while policy.calls[LEDGER[0].key] < 1:
                    await anyio.sleep(0.01)
                pool.policy_version += 1  # a weight sync while the first rollout acts
                policy.go.set()
                results = await batch.results()
        assert emu.ledger.running == 0
        created = emu.ledger.created
    assert [(r.failure_reason, r.reward) for r in results] == [(None, 1.0), (None, 1.0)]
    assert len(sink.named("fleet_rollout_restarted")) == 1
    assert created == 3  # the stale attempt's instance, and one per result
    assert_pairs(sink)


async def test_oversampled_groups_stream_in_completion_order_with_exactly_their_samples() -> None:
    sink = MemorySink()
    first, second = LEDGER[:2]
    policy = PlannedPolicy(
        {
            first.key: {0: "solve", 1: "zero", 2: "hold"},  # by sample: the extra holds
            second.key: {0: "gate", 1: "gate", 2: "hold"},
        }
    )
    async with Emulator() as emu:
        async with pool_for(emu, sink) as pool:
            batch = pool.run_batch(
                [first, second], policy, samples_per_task=2, oversample=1, batch_id="step-1"
            )
            groups = []
            with anyio.fail_after(60):
                async for group in batch.groups():
                    groups.append(group)
                    policy.go.set()  # the second group's samples may go on now
                results = await batch.results()
        ledger = emu.ledger
        assert ledger.running == 0 and ledger.created == ledger.deleted
    assert [g.task_key for g in groups] == [first.key, second.key]
    one, two = groups
    assert sorted(one.rewards) == [0.0, 1.0] and one.reward_mean == 0.5 and not one.uniform
    assert one.reward_std == pytest.approx(0.5)
    assert two.rewards == [1.0, 1.0] and two.uniform and two.reward_std == 0.0
    assert all(g.superseded == 1 and g.failed == 0 and len(g.results) == 2 for g in groups)
    reasons = Counter(r.failure_reason for r in results)
    # The given-up sample completed with the verifier's 0.0: scored, so it counts.
    assert reasons == {None: 4, FailureReason.SUPERSEDED: 2}
    assert all(
        r.reward is None and r.sample_index == 2
        for r in results
        if r.failure_reason is FailureReason.SUPERSEDED
    )
    assert_pairs(sink)


@pytest.mark.timeout(300)
async def test_oversampled_groups_agree_exactly_with_results_journal_and_telemetry(
    tmp_path: Path,
) -> None:
    # 25 groups of 2 samples + 2 extras, every rollout solving its task, tool
    # latencies spread so that extras are verified and releasing their instances
    # just as their groups complete: no group may count more, or other, samples
    # than the results, the journal and the completed events say were scored.
    sink = MemorySink()
    profile = FaultProfile(seed=27, tool_latency=Latency(min_s=0.0, max_s=0.3))
    out = tmp_path / "results.jsonl"
    results: list[RolloutResult] = []
    async with Emulator(profile) as emu:
        async with (
            anyio.create_task_group() as tg,
            Journal(out, tg) as journal,
            pool_for(emu, sink, pool={"concurrency": 100}) as pool,
        ):
            batch = pool.run_batch(
                LEDGER, ScriptedPolicy(), samples_per_task=2, oversample=2, batch_id="b"
            )
            with anyio.fail_after(240):
                async for result in batch:
                    journal.append(result)
                    results.append(result)
                groups = [g async for g in batch.groups()]
        assert emu.ledger.running == 0
    assert len(results) == 100 and len(groups) == 25
    journaled = {r.rollout_id: r for r in read_journal(out, latest=False)}
    assert len(journaled) == 100
    events = sink.named("fleet_rollout_completed")
    completed = {e.attributes["rollout_id"]: e.attributes for e in events}
    for group in groups:
        mine = [r for r in results if r.group_id == group.group_id]
        scored = [r for r in mine if r.reward is not None]
        # Every rollout solves: each group has its 2 scored samples, not one more.
        assert len(scored) == min(group.expected, len(scored)) == 2, group.task_key
        assert [r.rollout_id for r in group.results] == [r.rollout_id for r in scored]
        assert group.results == scored
        superseded = [r for r in mine if r.failure_reason is FailureReason.SUPERSEDED]
        assert (group.superseded, group.failed) == (len(superseded), 0) == (2, 0)
        for result in mine:
            assert journaled[result.rollout_id] == result
            event = completed[result.rollout_id]
            assert (event["reward"], event["failure_reason"]) == (
                result.reward,
                result.failure_reason.value if result.failure_reason else None,
            )
    assert_pairs(sink)


async def test_a_resumed_oversampled_run_only_runs_what_its_groups_still_lack(
    tmp_path: Path,
) -> None:
    task = LEDGER[0]
    settings = load_settings(provisioning=FAST, pool={"oversample": 1})
    out = tmp_path / "results.jsonl"
    # A run that was killed after its first sample was scored.
    claim = claim_journal(out, BatchIdentity.of("b", [task], 2, oversample=1), resume=False)
    claim.close()
    journaled = RolloutResult(
        rollout_id=rollout_id("b", task.key, 0),
        batch_id="b",
        task_key=task.key,
        sample_index=0,
        group_id=group_id("b", task.key),
        env_key=task.env_key,
        modality=task.modality,
        status="completed",
        reward=1.0,
    )
    out.write_text(journaled.model_dump_json() + "\n")
    # Of the two samples left, the group needs one: sample 1 (its own). The
    # extra (sample 2) is held until superseded. (Held by the order of first
    # calls instead, sample 1 could be the held one: the group keeps its
    # lowest ranks, so it would wait for it, and the solved extra would end
    # superseded: a deadlock of the test's own making, CI6 and CI9.)
    policy = PlannedPolicy({task.key: {2: "hold"}})
    with anyio.fail_after(60):
        report = await run_job(
            settings,
            [task],
            policy,
            samples=2,
            out=out,
            resume=True,
            batch_id="b",
        )
    final = {r.sample_index: r for r in read_journal(out)}
    assert report.resumed == 1 and sorted(final) == [0, 1, 2]
    reasons = Counter(r.failure_reason for r in final.values())
    assert reasons == {None: 2, FailureReason.SUPERSEDED: 1}
    assert policy.calls[task.key] >= 2  # the held one asked once, and never went on


async def test_turns_carry_the_policy_version_they_were_admitted_under_across_a_bump(
    emulator: Emulator,
) -> None:
    sink = MemorySink()
    task = next(t for t in LEDGER if len(t.solution or ()) >= 3)
    steps = [(s.name, dict(s.arguments)) for s in task.solution or ()]
    pool: RolloutPool | None = None

    def script(body: dict[str, Any]) -> Reply:
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn == 1 and pool is not None and pool.policy_version == 0:
            pool.policy_version = 1  # a weight sync while this call is answered
        if turn >= len(steps):
            return completion("done")
        name, arguments = steps[turn]
        return completion(tool_calls=[tool_call(name, arguments, id=f"call_{turn}")])

    async with FakeChatServer(script, vllm=VllmShape()) as server:
        openai = {"kind": "openai", "base_url": server.base_url}
        async with (
            pool_for(emulator, sink, policy=openai) as pool,
            OpenAIChatPolicy.from_config(chat_policy_config(pool.settings)) as model,
        ):
            with anyio.fail_after(60):
                (result,) = await pool.run_batch([task], model).results()
    versions = [turn.policy_version for turn in result.turns]
    # Calls admitted before the bump carry 0 (the second one was answered during it).
    assert versions == [0, 0] + [1] * (len(steps) - 1)
    assert (result.failure_reason, result.reward) == (None, 1.0)
    assert_pairs(sink)
