"""The pool over its executor seam: what the pool owns, driven through the executor double.

:class:`~fleetroll.testing.fake_executor.FakeExecutor` runs nothing: each of
its rollouts passes the pool's policy gate and ends as the test says. So these
tests show that ids, groups and oversampling, resume, the policy version and
pauses, and cancellation are the pool's, whatever runs the rollouts.
"""

from __future__ import annotations

import anyio
import pytest

from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import Batch, RolloutPool, group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.phases import Phase
from fleetroll.rollout.progress import RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.testing.fake_executor import FakeExecutor
from fleetroll.testing.fake_provider import FakeProvider
from fleetroll.training.groups import Group

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


async def test_a_group_keeps_its_own_samples_and_an_extra_that_ended_first_is_superseded() -> None:
    # The extra ends first, scored: samples 0 and 1 may still both score, so it
    # is not needed and ends superseded at once; the group waits for its own two.
    executor = FakeExecutor(hold=True)
    rids = [rollout_id("b", TASK.key, i) for i in range(3)]
    async with pool_over(executor) as pool:
        batch = pool.run_batch(
            [TASK], ScriptedPolicy(), samples_per_task=2, oversample=1, batch_id="b"
        )
        with anyio.fail_after(5):
            for rid in rids:
                await executor.started(rid)
            order = [(rids[2], 0.0), (rids[0], 1.0), (rids[1], 1.0)]
            results = await finish_in_order(executor, batch, order)
            groups: list[Group] = [g async for g in batch.groups()]
            results += await batch.results()
    assert executor.stopped == []
    (extra,) = [r for r in results if r.rollout_id == rids[2]]
    assert (extra.failure_reason, extra.reward) == (FailureReason.SUPERSEDED, None)
    assert extra.error is not None and extra.error.endswith("it had ended completed with reward 0")
    (group,) = groups
    assert group.group_id == group_id("b", TASK.key)
    assert [r.rollout_id for r in group.results] == [rids[0], rids[1]]
    assert (group.rewards, group.superseded, group.complete) == ([1.0, 1.0], 1, True)
    assert executor.swept == ["b"]


async def finish_in_order(
    executor: FakeExecutor,
    batch: Batch,
    order: list[tuple[str, float | None]],
    reason: FailureReason = FailureReason.INSTANCE_LOST,
) -> list[RolloutResult]:
    """End held rollouts one at a time, in ``order`` (a null reward: failed as
    ``reason``), each only once the one before has its result; skip the ones
    the pool stopped meanwhile. The results read meanwhile, in order."""
    seen: list[RolloutResult] = []
    for rid, reward in order:
        if rid in {r.rollout_id for r in seen}:
            continue  # stopped (superseded) before its turn
        executor.finish(rid, reward=reward, reason=None if reward is not None else reason)
        async for result in batch:
            seen.append(result)
            if result.rollout_id == rid:
                break
    return seen


def slow_ones_score(ids: RolloutIds) -> float:
    """Even samples take long and solve their task (1.0); odd ones end fast with 0.0."""
    return 1.0 if ids.sample_index % 2 == 0 else 0.0


async def group_mean(samples: int, oversample: int) -> tuple[float | None, list[int]]:
    """The group mean and kept ranks of one task when the episodes that score end last."""
    executor = FakeExecutor(hold=True)
    total = samples + oversample
    rids = [rollout_id("b", TASK.key, i) for i in range(total)]
    async with pool_over(executor) as pool:
        batch = pool.run_batch(
            [TASK], ScriptedPolicy(), samples_per_task=samples, oversample=oversample, batch_id="b"
        )
        with anyio.fail_after(5):
            for rid in rids:
                await executor.started(rid)
            fast_first = sorted(range(total), key=lambda i: (i % 2 == 0, i))
            order = [(rids[i], slow_ones_score(executor.rollouts[rids[i]].ids)) for i in fast_first]
            await finish_in_order(executor, batch, order)
            (group,) = [g async for g in batch.groups()]
            await batch.results()
    return group.reward_mean, sorted(r.sample_index for r in group.results)


async def test_oversampling_keeps_the_group_mean_when_long_episodes_score_higher() -> None:
    # Tolerance: none. The double is deterministic and, with no failures, an
    # oversampled group keeps exactly the samples 0..n-1 it would keep without.
    plain = await group_mean(4, 0)
    oversampled = await group_mean(4, 4)
    assert plain == (0.5, [0, 1, 2, 3])
    assert oversampled == plain  # before: 0.0, the four fast odd samples 1, 3, 5, 7


async def test_an_extra_stands_in_for_a_sample_that_failed_and_the_next_extra_is_stopped() -> None:
    executor = FakeExecutor(hold=True)
    rids = [rollout_id("b", TASK.key, i) for i in range(4)]
    async with pool_over(executor) as pool:
        batch = pool.run_batch(
            [TASK], ScriptedPolicy(), samples_per_task=2, oversample=2, batch_id="b"
        )
        with anyio.fail_after(5):
            for rid in rids:
                await executor.started(rid)
            order = [(rids[0], None), (rids[1], 0.0), (rids[2], 1.0)]
            seen = await finish_in_order(executor, batch, order)
            (group,) = [g async for g in batch.groups()]
            results = {r.rollout_id: r for r in seen + await batch.results()}
    assert [r.sample_index for r in group.results] == [1, 2]
    assert (group.rewards, group.failed, group.superseded) == ([0.0, 1.0], 1, 1)
    assert group.complete and executor.stopped == [rids[3]]
    assert results[rids[3]].failure_reason is FailureReason.SUPERSEDED


async def test_a_group_short_of_its_scored_samples_is_marked_incomplete_and_can_be_dropped() -> (
    None
):
    executor = FakeExecutor(hold=True)
    mine = [rollout_id("b", TASK.key, i) for i in range(3)]
    other = [rollout_id("b", OTHER.key, i) for i in range(3)]
    async with pool_over(executor) as pool:
        batch = pool.run_batch(
            [TASK, OTHER], ScriptedPolicy(), samples_per_task=2, oversample=1, batch_id="b"
        )
        with anyio.fail_after(5):
            for rid in mine + other:
                await executor.started(rid)
            order = [(mine[0], None), (mine[1], 1.0), (mine[2], None)]
            await finish_in_order(executor, batch, [*order, (other[0], 1.0), (other[1], 0.0)])
            every = [g async for g in batch.groups()]
            kept = [g async for g in batch.groups(complete_only=True)]
    short, full = every
    assert (short.task_key, short.complete, short.rewards, short.failed) == (
        TASK.key,
        False,
        [1.0],
        2,
    )
    assert full.task_key == OTHER.key and full.complete
    assert kept == [full]


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
        RolloutPool(
            settings,
            executor=FakeExecutor(),
            provider=FakeProvider(settings.modalities, timeouts=settings.timeouts),
        )


async def test_a_batch_starts_rollouts_only_as_the_executor_has_room_for_them() -> None:
    # The others wait as handles (no task, no cancel scope) until one ends.
    executor = FakeExecutor(hold=True, capacity=3)
    async with pool_over(executor) as pool:
        batch = pool.run_batch([TASK], ScriptedPolicy(), samples_per_task=10)
        rids = [r.ids.rollout_id for r in batch.rollouts]
        with anyio.fail_after(5):
            for rid in rids[:3]:
                await executor.started(rid)
            await anyio.wait_all_tasks_blocked()
            assert executor.ran == rids[:3] and batch.started == set(rids[:3])
            assert all(r.phase is Phase.PENDING for r in batch.rollouts[3:])
            executor.finish(rids[0])
            await executor.started(rids[3])
            await anyio.wait_all_tasks_blocked()
            assert executor.ran == rids[:4]
            for rid in rids[1:]:
                executor.finish(rid)
            results = await batch.results()
    assert sorted(r.rollout_id for r in results) == sorted(rids)
    assert [r.reward for r in results] == [1.0] * 10


async def test_extras_still_waiting_for_room_end_superseded_as_their_group_completes() -> None:
    executor = FakeExecutor(hold=True, capacity=1)
    async with pool_over(executor) as pool:
        batch = pool.run_batch([TASK], ScriptedPolicy(), samples_per_task=1, oversample=3)
        first = rollout_id(batch.batch_id, TASK.key, 0)
        with anyio.fail_after(5):
            await executor.started(first)
            executor.finish(first)
            results = await batch.results()
    assert executor.ran == [first]  # the extras never took room
    reasons = sorted(str(r.failure_reason) for r in results)
    assert reasons == ["None"] + [str(FailureReason.SUPERSEDED)] * 3


async def test_a_batch_held_by_its_share_takes_no_room_from_another() -> None:
    # max_in_flight holds the batch's others before they take room in the pool.
    executor = FakeExecutor(hold=True, capacity=2)
    async with pool_over(executor) as pool:
        a = pool.run_batch([TASK], ScriptedPolicy(), samples_per_task=5, max_in_flight=1)
        b = pool.run_batch([OTHER], ScriptedPolicy(), samples_per_task=1)
        first, other = rollout_id(a.batch_id, TASK.key, 0), rollout_id(b.batch_id, OTHER.key, 0)
        with anyio.fail_after(5):
            await executor.started(first)
            await executor.started(other)
            await anyio.wait_all_tasks_blocked()
            assert sorted(executor.ran) == sorted([first, other])
            for rid in list(executor.rollouts):
                executor.finish(rid)
            done = await a.results() + await b.results()
    assert [r.reward for r in done] == [1.0] * 6
