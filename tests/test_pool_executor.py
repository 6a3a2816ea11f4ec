"""The pool over its executor seam: what the pool owns, driven through the executor double.

:class:`~fleetroll.testing.fake_executor.FakeExecutor` runs nothing: each of
its rollouts passes the pool's policy gate and ends as the test says. So these
tests show that ids, groups and oversampling, resume, the policy version and
pauses, and cancellation are the pool's, whatever runs the rollouts.
"""

from __future__ import annotations

import anyio
import pytest

from fleetroll.groups import Group
from fleetroll.phases import Phase
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool import RolloutPool, group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.testing.fake_executor import FakeExecutor
from fleetroll.testing.fake_provider import FakeProvider

pytestmark = pytest.mark.anyio

TASK = TaskSpec(
    key="t",
    prompt="Do it.",
    env_key="fake",
    modality="tool_use",
    verifier_func="def verify(env):\n    return 1.0\n",
)
OTHER = TASK.model_copy(update={"key": "u"})


def pool_over(executor: FakeExecutor) -> RolloutPool:
    return RolloutPool(load_settings(), executor=executor)


async def test_a_group_completes_at_its_first_scored_samples_and_the_extra_is_superseded() -> None:
    executor = FakeExecutor(hold=True)
    rids = [rollout_id("b", TASK.key, i) for i in range(3)]
    async with pool_over(executor) as pool:
        batch = pool.run_batch(
            [TASK], ScriptedPolicy(), samples_per_task=2, oversample=1, batch_id="b"
        )
        with anyio.fail_after(5):
            for rid in rids:
                await executor.started(rid)
            executor.finish(rids[2], reward=0.0)
            executor.finish(rids[0], reward=1.0)
            groups: list[Group] = [g async for g in batch.groups()]
            results = {r.rollout_id: r async for r in batch}
    assert executor.stopped == [rids[1]]
    assert results[rids[1]].failure_reason is FailureReason.SUPERSEDED
    (group,) = groups
    assert group.group_id == group_id("b", TASK.key)
    assert [r.rollout_id for r in group.results] == [rids[2], rids[0]]
    assert (group.rewards, group.superseded) == ([0.0, 1.0], 1)
    assert executor.swept == ["b"]


async def test_a_resumed_batch_runs_only_what_is_missing_and_counts_what_came_before() -> None:
    executor = FakeExecutor(rewards=lambda ids: 0.5)
    first = rollout_id("b", TASK.key, 0)
    before = RolloutResult(
        rollout_id=first,
        batch_id="b",
        task_key=TASK.key,
        sample_index=0,
        group_id=group_id("b", TASK.key),
        env_key=TASK.env_key,
        modality=TASK.modality,
        status="completed",
        reward=1.0,
    )
    async with pool_over(executor) as pool:
        batch = pool.run_batch(
            [TASK, OTHER],
            ScriptedPolicy(),
            samples_per_task=2,
            batch_id="b",
            previous=[before],
            skip={rollout_id("b", OTHER.key, 1)},
        )
        with anyio.fail_after(5):
            results = await batch.results()
    assert sorted(executor.ran) == sorted(
        [rollout_id("b", TASK.key, 1), rollout_id("b", OTHER.key, 0)]
    )
    assert len(results) == 2 and batch.skipped == 2
    by_task = {g.task_key: g for g in batch.complete_groups}
    assert sorted(by_task[TASK.key].rewards) == [0.5, 1.0]


async def test_turns_carry_the_version_the_pool_has_once_its_pause_ends() -> None:
    executor = FakeExecutor()
    async with pool_over(executor) as pool:
        pool.policy_version = 2
        with anyio.fail_after(5):
            async with pool.policy_paused():
                batch = pool.run_batch([TASK, OTHER], ScriptedPolicy(), batch_id="b")
                for rid in (rollout_id("b", t.key, 0) for t in (TASK, OTHER)):
                    await executor.started(rid)
                await anyio.wait_all_tasks_blocked()
                assert batch.counts().finished == 0  # their policy calls wait
                pool.policy_version = 3
            results = await batch.results()
    assert [[t.policy_version for t in r.turns] for r in results] == [[3], [3]]


async def test_cancelling_a_batch_gives_each_rollout_a_cancelled_result_once() -> None:
    executor = FakeExecutor(hold=True)
    async with pool_over(executor) as pool:
        batch = pool.run_batch([TASK], ScriptedPolicy(), samples_per_task=3, batch_id="b")
        with anyio.fail_after(5):
            await executor.started(rollout_id("b", TASK.key, 0))
            batch.cancel()
            results = await batch.results()
    assert len(results) == 3 and len({r.rollout_id for r in results}) == 3
    assert {r.failure_reason for r in results} == {FailureReason.CANCELLED}
    assert executor.swept == ["b"]


async def test_the_live_view_and_events_of_a_rollout_come_from_its_executor() -> None:
    executor = FakeExecutor(hold=True)
    rid = rollout_id("b", TASK.key, 0)
    async with pool_over(executor) as pool:
        batch = pool.run_batch([TASK], ScriptedPolicy(), batch_id="b")
        with anyio.fail_after(5):
            await executor.started(rid)
            assert (await batch.view(rid)).phase is Phase.ACTING
            executor.finish(rid, reward=1.0)
            (result,) = await batch.results()
            page = await batch.events(rid, after=0, wait_s=0)
    assert (await batch.view(rid)).result == result
    assert page.ended and [e.kind for e in page.events][-1] == "end"


def test_a_pool_given_an_executor_refuses_a_provider_too() -> None:
    settings = load_settings()
    with pytest.raises(ValueError, match="provider= to the executor"):
        RolloutPool(settings, executor=FakeExecutor(), provider=FakeProvider(settings))
