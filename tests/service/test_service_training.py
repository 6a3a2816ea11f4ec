"""A remote trainer's verbs over real HTTP: groups with cursors, oversampling, version, pauses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import chain

import anyio
import pytest
from service_helpers import LEDGER, Running, running_service

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.errors import PolicyError, ServiceError
from fleetroll.policies.turns import AssistantTurn, Message, ToolSpec
from fleetroll.results import FailureReason
from fleetroll.rollout.machine import Phase
from fleetroll.service import app as service_app
from fleetroll.tasks import TaskSpec
from fleetroll.testing.planned_policy import PlannedPolicy
from gate_watch import paused_arrival

pytestmark = pytest.mark.slow


def plan(monkeypatch: pytest.MonkeyPatch, policy: PlannedPolicy) -> None:
    """Every batch of the service plays ``policy``."""
    monkeypatch.setattr(service_app, "build_policy", lambda config, settings: policy)


async def test_groups_stream_in_completion_order_and_oversampled_extras_are_superseded(
    served: Running, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = LEDGER[:2]
    policy = PlannedPolicy(
        {
            first.key: {0: "solve", 1: "zero", 2: "hold"},  # by sample: the extra holds
            second.key: {0: "gate", 1: "gate", 2: "hold"},
        }
    )
    plan(monkeypatch, policy)
    async with FleetrollClient(served.url) as client:
        batch = client.run_batch([first, second], samples_per_task=2, oversample=1)
        groups = []
        with anyio.fail_after(60):
            async for group in batch.groups():
                groups.append(group)
                policy.go.set()  # the second group may complete now
            results = await batch.results()
    assert batch.total == 6
    assert [g.task_key for g in groups] == [first.key, second.key]
    assert sorted(groups[0].rewards) == [0.0, 1.0] and groups[0].reward_mean == 0.5
    assert groups[1].rewards == [1.0, 1.0] and groups[1].uniform
    assert all(len(g.results) == 2 and g.superseded == 1 for g in groups)
    superseded = [r for r in results if r.failure_reason is FailureReason.SUPERSEDED]
    assert sorted(r.task_key for r in superseded) == sorted([first.key, second.key])
    assert all(r.reward is None and r.sample_index == 2 for r in superseded)
    assert emulator.ledger.running == 0
    async with served.http() as http:
        with anyio.fail_after(30):
            rest = await http.get(f"/v1/batches/{batch.batch_id}/groups", params={"after": 1})
            ahead = await http.get(f"/v1/batches/{batch.batch_id}/groups", params={"after": 3})
    lines = [json.loads(line) for line in rest.text.splitlines()]
    assert [(line["type"], line["cursor"]) for line in lines] == [("group", 2), ("end", 2)]
    assert lines[0]["group"]["task_key"] == second.key
    assert ahead.status_code == 422 and ahead.json()["detail"][0]["loc"] == ["query", "after"]


async def test_groups_target_streams_the_first_complete_groups_and_the_others_cut(
    served: Running, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, slow = LEDGER[:2], LEDGER[2:4]
    plans = {t.key: ["solve", "zero"] for t in fast} | {t.key: ["hold"] * 2 for t in slow}
    policy = PlannedPolicy(plans)
    plan(monkeypatch, policy)
    async with FleetrollClient(served.url) as client:
        batch = client.run_batch([*fast, *slow], samples_per_task=2, groups_target=2)
        with anyio.fail_after(60):
            results = await batch.results()
            groups = [g async for g in batch.groups()]
            kept = [g async for g in client.batch(batch.batch_id).groups(complete_only=True)]
        too_many = client.run_batch(LEDGER[:2], groups_target=3)
        with anyio.fail_after(30), pytest.raises(ServiceError) as refused:
            await too_many.submit()
    assert sorted(g.task_key for g in kept) == sorted(t.key for t in fast)
    assert all(g.complete and sorted(g.rewards) == [0.0, 1.0] for g in kept)
    cut = [g for g in groups if g.cut]
    assert sorted(g.task_key for g in cut) == sorted(t.key for t in slow)
    assert not any(g.complete for g in cut) and len(groups) == 4
    stopped = [r for r in results if r.task_key in {t.key for t in slow}]
    assert len(stopped) == 4 and len(results) == 8
    assert all(r.failure_reason is FailureReason.SUPERSEDED for r in stopped)
    assert all("groups_target" in (r.error or "") for r in stopped)
    assert refused.value.status_code == 422 and "groups_target" in str(refused.value)
    assert emulator.ledger.running == 0


class FailingPlannedPolicy(PlannedPolicy):
    """A planned policy whose ``"fail"`` choice fails the rollout (no reward)."""

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if not any(m.get("role") == "assistant" for m in messages):
            plan = self._plans.get(task.key)
            choice = next(plan, "solve") if plan is not None else "solve"
            if choice == "fail":
                raise PolicyError("the planned failure")
            self._plans[task.key] = chain([choice], plan or iter(()))
        return await super().act(task, messages, tools)


async def test_complete_only_groups_over_http_skip_short_groups_and_keep_their_cursors(
    served: Running, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    short, full = LEDGER[:2]
    policy = FailingPlannedPolicy({short.key: ["fail", "solve", "fail"]})
    plan(monkeypatch, policy)
    async with FleetrollClient(served.url) as client:
        batch = client.run_batch([short, full], samples_per_task=2, oversample=1)
        with anyio.fail_after(60):
            results = await batch.results()
            every = [g async for g in batch.groups()]
            kept = batch.groups(complete_only=True)
            complete = [g async for g in kept]
    assert len(results) == 6
    assert sorted((g.task_key, g.complete) for g in every) == sorted(
        [(short.key, False), (full.key, True)]
    )
    assert [g.task_key for g in complete] == [full.key]
    assert kept.cursor == [g.task_key for g in every].index(full.key) + 1
    async with served.http() as http:
        with anyio.fail_after(30):
            rest = await http.get(
                f"/v1/batches/{batch.batch_id}/groups", params={"complete_only": "true"}
            )
            wrong = await http.get(
                f"/v1/batches/{batch.batch_id}/groups", params={"complete_only": "yes"}
            )
    lines = [json.loads(line) for line in rest.text.splitlines()]
    # The short group is not sent, but the end line's cursor counts it.
    assert [line["type"] for line in lines] == ["group", "end"]
    assert lines[-1]["cursor"] == 2 and lines[0]["group"]["task_key"] == full.key
    assert wrong.status_code == 422
    assert wrong.json()["detail"][0]["loc"] == ["query", "complete_only"]


async def test_an_oversampled_group_run_again_after_a_cancel_counts_the_samples_it_kept(
    served: Running, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = LEDGER[5]
    policy = PlannedPolicy({task.key: {0: "solve", 1: "hold", 2: "hold"}})
    plan(monkeypatch, policy)
    async with FleetrollClient(served.url) as client:
        batch = client.run_batch([task], samples_per_task=2, oversample=1, batch_id="os-rerun")
        with anyio.fail_after(60):
            async for result in batch:
                if result.reward is not None:
                    await batch.cancel()  # the two held ones end cancelled
            policy.release.set()
            # Resubmitted: its two cancelled rollouts run again, and both would solve.
            again = client.run_batch([task], samples_per_task=2, oversample=1, batch_id="os-rerun")
            results = await again.results()
            groups = [g async for g in again.groups()]
    assert again.rerun == 2 and len(results) == 3
    scored = [r for r in results if r.reward is not None]
    # The group needed one more sample, not two: the last one is superseded.
    assert [r.failure_reason for r in results].count(FailureReason.SUPERSEDED) == 1
    (group,) = groups
    assert sorted(r.rollout_id for r in group.results) == sorted(r.rollout_id for r in scored)
    assert (len(scored), group.superseded, group.failed) == (2, 1, 0)
    assert emulator.ledger.running == 0


async def test_a_pause_over_http_holds_policy_calls_until_the_trainer_lets_go(
    emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = PlannedPolicy()
    plan(monkeypatch, policy)
    task = LEDGER[0]
    async with (
        running_service(emulator, pool={"max_staleness": 0}) as served,
        FleetrollClient(served.url) as client,
    ):
        with anyio.fail_after(60):
            await client.set_policy_version(3)
            held = paused_arrival(served.service.pool.policy_gate, monkeypatch)
            async with client.policy_paused(ttl_s=30):
                batch = await client.run_batch([task]).submit()
                (rollout,) = served.service.pool.batches[batch.batch_id].rollouts
                await rollout.wait_until(lambda r: r.phase is Phase.ACTING)
                await held.wait()  # its first policy call is at the gate
                assert policy.calls[task.key] == 0
                async with served.http() as http:
                    state = (await http.get("/v1/policy")).json()
                assert state == {"version": 3, "paused": True, "pauses": 1}
                await client.set_policy_version(4)  # the weights were swapped
            (result,) = await batch.results()
            assert await client.policy_version() == 4
            async with served.http() as http:
                state = (await http.get("/v1/policy")).json()
    # Its first policy call came after the swap: on version 4, not stale.
    assert (result.failure_reason, result.reward) == (None, 1.0)
    assert state == {"version": 4, "paused": False, "pauses": 0}


async def test_a_pause_lease_nobody_renews_ends_by_itself(served: Running) -> None:
    ttl_s = 0.2
    async with served.http() as http:
        with anyio.fail_after(30):
            lease = (await http.post("/v1/policy/pauses", json={"ttl_s": ttl_s})).json()
            held = (await http.get("/v1/policy")).json()
            await anyio.sleep(3 * ttl_s)  # the trainer crashed: nobody renews
            after = (await http.get("/v1/policy")).json()
            renew = await http.put(f"/v1/policy/pauses/{lease['pause_id']}", json={"ttl_s": 1})
            end = await http.delete(f"/v1/policy/pauses/{lease['pause_id']}")
            too_long = await http.post("/v1/policy/pauses", json={"ttl_s": 10**6})
            bad_version = await http.put("/v1/policy/version", json={"version": "7"})
    assert held["paused"] is True and held["pauses"] == 1
    assert after["paused"] is False and after["pauses"] == 0
    assert renew.status_code == 404 and end.status_code == 404
    assert "released, or its lease expired" in renew.json()["detail"]
    assert too_long.status_code == 422
    assert too_long.json()["detail"][0]["loc"] == ["body", "ttl_s"]
    assert bad_version.status_code == 422


async def test_a_renewed_and_released_pause_lets_policy_calls_go(served: Running) -> None:
    async with FleetrollClient(served.url) as client, served.http() as http:
        with anyio.fail_after(30):
            lease = (await http.post("/v1/policy/pauses", json={"ttl_s": 5})).json()
            renewed = await http.put(f"/v1/policy/pauses/{lease['pause_id']}", json={"ttl_s": 5})
            ended = await http.delete(f"/v1/policy/pauses/{lease['pause_id']}")
            async with client.policy_paused(ttl_s=5):
                inside = (await http.get("/v1/policy")).json()
            outside = (await http.get("/v1/policy")).json()
    assert renewed.status_code == 200 and renewed.json()["ttl_s"] == 5
    assert ended.status_code == 200 and ended.json()["paused"] is False
    assert inside["paused"] is True and outside["paused"] is False
