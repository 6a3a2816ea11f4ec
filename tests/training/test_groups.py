"""Groups as they finish, and oversampling: the pool's bookkeeping on the provider double.

The pool runs for real (limits, cancellation, one result per rollout id) over
:class:`fleetroll.testing.fake_provider.FakeProvider`; a
:class:`~fleetroll.testing.planned_policy.PlannedPolicy` decides, rollout by
rollout, whether it solves its task (reward 1), gives up (reward 0) or waits.
"""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import anyio
import pytest

from fleetroll.pool.rollout_pool import RolloutPool, group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service.training import GroupLog
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_provider import FakeProvider
from fleetroll.testing.planned_policy import PlannedPolicy
from fleetroll.training.groups import Group, GroupTracker, cut_error, groups_of

pytestmark = pytest.mark.anyio

TASK = TaskSpec(
    key="note-done",
    prompt="Write done.",
    env_key="fake",
    modality="tool_use",
    verifier_func="def verify(env):\n    return 1.0\n",
    solution=(SolutionStep(name="note", arguments={"word": "done"}),),
)
OTHER = TASK.model_copy(update={"key": "note-done-too"})


def fake_pool(sink: MemorySink, provider_options: dict[str, Any] | None = None, **overrides: Any):
    settings = load_settings(**overrides)
    provider = FakeProvider(
        settings.modalities, timeouts=settings.timeouts, **(provider_options or {})
    )
    pool = RolloutPool(settings, api_key="unused", events=Events([sink]), provider=provider)
    return pool, provider


def assert_pairs(sink: MemorySink) -> None:
    started = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started"))
    completed = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed"))
    assert started == completed and set(completed.values()) <= {1}


async def test_groups_come_in_completion_order_with_their_reward_statistics() -> None:
    sink = MemorySink()
    policy = PlannedPolicy({TASK.key: ["hold"] * 3, OTHER.key: {0: "solve", 1: "zero", 2: "solve"}})
    pool, provider = fake_pool(sink)
    groups: list[Group] = []
    async with pool:
        batch = pool.run_batch([TASK, OTHER], policy, samples_per_task=3, batch_id="b")
        with anyio.fail_after(10):
            async for group in batch.groups():
                groups.append(group)
                if len(groups) == 1:
                    # The first group came while the other's rollouts were all still held.
                    assert batch.counts().finished == 3
                    policy.release.set()
            results = await batch.results()
    assert [g.task_key for g in groups] == [OTHER.key, TASK.key]
    other, held = groups
    assert other.group_id == group_id("b", OTHER.key) and other.batch_id == "b"
    assert sorted(other.rewards) == [0.0, 1.0, 1.0] and not other.uniform
    assert other.reward_mean == pytest.approx(2 / 3)
    assert other.reward_std == pytest.approx((2 / 9) ** 0.5)  # population std
    assert held.rewards == [1.0] * 3 and held.uniform and held.reward_std == 0.0
    assert [r.reward for r in held.results] == held.rewards
    assert (held.failed, held.superseded, held.expected) == (0, 0, 3)
    assert len(results) == 6 and provider.running == 0
    assert_pairs(sink)


async def test_an_oversampled_group_keeps_its_first_scored_samples_and_stops_the_rest() -> None:
    sink = MemorySink()
    policy = PlannedPolicy({TASK.key: {0: "solve", 1: "zero", 2: "hold", 3: "hold"}})
    pool, provider = fake_pool(sink)
    async with pool:
        batch = pool.run_batch([TASK], policy, samples_per_task=2, oversample=2, batch_id="b")
        with anyio.fail_after(10):
            groups = [g async for g in batch.groups()]
            results = await batch.results()
    assert len(groups) == 1
    (group,) = groups
    assert sorted(group.rewards) == [0.0, 1.0] and group.superseded == 2
    assert sorted(r.sample_index for r in results) == [0, 1, 2, 3]
    assert {r.rollout_id for r in results} == {rollout_id("b", TASK.key, n) for n in range(4)}
    superseded = [r for r in results if r.failure_reason is FailureReason.SUPERSEDED]
    assert len(superseded) == 2
    assert all(r.reward is None and r.status == "failed" for r in superseded)
    assert "had its 2 scored samples" in (superseded[0].error or "")
    assert provider.running == 0 and len(provider.released) == 4
    assert_pairs(sink)


async def test_extras_that_never_got_an_instance_end_superseded_without_one() -> None:
    sink = MemorySink()
    pool, provider = fake_pool(
        sink, pool={"concurrency": 1}, provisioning={"max_concurrent_creates": 1}
    )
    async with pool:
        batch = pool.run_batch([TASK], PlannedPolicy(), samples_per_task=1, oversample=3)
        with anyio.fail_after(10):
            results = await batch.results()
            (group,) = [g async for g in batch.groups()]
    reasons = Counter(r.failure_reason for r in results)
    assert reasons == {None: 1, FailureReason.SUPERSEDED: 3}
    assert group.rewards == [1.0] and group.superseded == 3
    # Two slots for instances: at most one extra was provisioned before the group was complete.
    assert len(provider.states) <= 2 and provider.running == 0
    assert_pairs(sink)


def journaled(batch_id: str, task: TaskSpec, sample: int, reward: float | None) -> RolloutResult:
    """A result an earlier run of the batch wrote to its journal."""
    return RolloutResult(
        rollout_id=rollout_id(batch_id, task.key, sample),
        batch_id=batch_id,
        task_key=task.key,
        sample_index=sample,
        group_id=group_id(batch_id, task.key),
        env_key=task.env_key,
        modality=task.modality,
        status="completed" if reward is not None else "failed",
        failure_reason=None if reward is not None else FailureReason.INSTANCE_LOST,
        reward=reward,
    )


async def test_a_resumed_oversampled_group_counts_what_its_journal_holds() -> None:
    sink = MemorySink()
    policy = PlannedPolicy({TASK.key: ["solve", "hold"]})
    pool, provider = fake_pool(sink)
    previous = [journaled("b", TASK, 0, 1.0)]
    async with pool:
        batch = pool.run_batch(
            [TASK], policy, samples_per_task=2, oversample=1, batch_id="b", previous=previous
        )
        with anyio.fail_after(10):
            results = await batch.results()
            (group,) = [g async for g in batch.groups()]
    # Sample 0 ran before the crash: the group needed one more, not two.
    assert batch.skipped == 1 and sorted(r.sample_index for r in results) == [1, 2]
    assert Counter(r.failure_reason for r in results) == {None: 1, FailureReason.SUPERSEDED: 1}
    assert group.results[0] == previous[0] and group.rewards == [1.0, 1.0]
    assert provider.running == 0
    assert_pairs(sink)


async def test_a_group_complete_in_its_journal_starts_nothing_on_resume() -> None:
    sink = MemorySink()
    pool, provider = fake_pool(sink)
    previous = [journaled("b", TASK, 0, 1.0), journaled("b", TASK, 1, 0.0)]
    async with pool:
        batch = pool.run_batch(
            [TASK],
            PlannedPolicy(),
            samples_per_task=2,
            oversample=2,
            batch_id="b",
            previous=previous,
        )
        with anyio.fail_after(10):
            (group,) = [g async for g in batch.groups()]
            results = await batch.results()
    assert group.rewards == [1.0, 0.0] and group.superseded == 2
    assert {r.failure_reason for r in results} == {FailureReason.SUPERSEDED}
    assert not provider.states and not sink.named("fleet_rollout_started")


async def test_a_group_hit_by_infrastructure_failures_completes_when_its_rollouts_end() -> None:
    sink = MemorySink()
    policy = PlannedPolicy()
    pool, _ = fake_pool(sink, provider_options={"verify_error": "the verifier crashed"})
    async with pool:
        batch = pool.run_batch([TASK], policy, samples_per_task=3)
        with anyio.fail_after(10):
            (group,) = [g async for g in batch.groups()]
    assert (group.failed, group.results, group.rewards) == (3, [], [])
    assert group.reward_mean is None and group.reward_std is None and not group.uniform


async def test_a_cancelled_batch_still_yields_every_group_with_what_it_had() -> None:
    sink = MemorySink()
    policy = PlannedPolicy({TASK.key: {0: "solve", 1: "hold", 2: "hold"}})
    pool, provider = fake_pool(sink)
    async with pool:
        batch = pool.run_batch([TASK, OTHER], policy, samples_per_task=3)
        with anyio.fail_after(10):
            async for group in batch.groups():
                assert group.task_key == OTHER.key  # TASK's cannot complete: two are held
                break
            async for result in batch:  # TASK's one sample that can end has ended
                if result.task_key == TASK.key and result.reward is not None:
                    break
            await batch.aclose()
            (_, cancelled) = [g async for g in batch.groups()]  # each reader sees all
    assert cancelled.task_key == TASK.key and cancelled.rewards == [1.0]
    assert cancelled.failed == 2 and provider.running == 0
    assert_pairs(sink)


async def test_a_batch_read_only_through_its_groups_is_forgotten_like_a_drained_one() -> None:
    sink = MemorySink()
    pool, _ = fake_pool(sink, pool={"keep_finished_batches": 1})
    async with pool:
        with anyio.fail_after(10):
            for n in range(3):
                batch = pool.run_batch([TASK], PlannedPolicy(), batch_id=f"b{n}")
                assert [g.rewards async for g in batch.groups()] == [[1.0]]
            held = set(pool.batches)
        del batch
        gc.collect()  # an unread result stream must not warn as it goes
    assert held == {"b2"}


def result(rid: str, reward: float | None, reason: FailureReason | None = None) -> RolloutResult:
    """A result of rollout ``rid`` of group ``g`` (task ``t``), for the tracker alone."""
    return RolloutResult(
        rollout_id=rid,
        batch_id="b",
        task_key="t",
        group_id="g",
        env_key="e",
        modality="tool_use",
        status="completed" if reason is None else "failed",
        failure_reason=reason,
        error=None if reason is None else "boom",
        reward=reward,
    )


def test_a_result_after_its_group_was_delivered_changes_nothing() -> None:
    members = {"g": ("t", ["r0", "r1", "r2"])}
    tracker = GroupTracker("b", 1, members)
    assert tracker.start() == []

    done = tracker.add(result("r1", 0.5))
    assert done is not None
    group, stop = done
    assert group.rewards == [0.5] and stop == ["r0", "r2"] and group.superseded == 2
    assert tracker.add(result("r0", 1.0)) is None
    assert tracker.add(result("r1", 1.0)) is None  # not one of its running rollouts any more


def ranked(rid: str, rank: int, reward: float | None, reason: FailureReason | None = None):
    """:func:`result` of rollout ``rid`` with its rank (``sample_index``)."""
    return result(rid, reward, reason).model_copy(update={"sample_index": rank})


def test_a_scored_extra_counts_only_once_enough_lower_ranks_ended_unscored() -> None:
    rids = [f"r{n}" for n in range(5)]
    tracker = GroupTracker("b", 2, {"g": ("t", rids)}, ranks={r: n for n, r in enumerate(rids)})
    lost = FailureReason.INSTANCE_LOST
    # r4 ends first, scored: r0..r3 may still fill the group, so it is not needed.
    early, done = tracker.settle(ranked("r4", 4, 1.0))
    assert (early.failure_reason, early.reward, done) == (FailureReason.SUPERSEDED, None, None)
    assert early.error is not None and "counts only in place of a failed sample" in early.error
    assert tracker.settle(ranked("r0", 0, None, lost))[1] is None
    # r0 failed: r3 could stand in only if r1 or r2 fails too, and both still run.
    late, _ = tracker.settle(ranked("r3", 3, 0.5))
    assert late.failure_reason is FailureReason.SUPERSEDED
    kept, _ = tracker.settle(ranked("r1", 1, 0.0))
    assert kept.reward == 0.0
    _, done = tracker.settle(ranked("r2", 2, 1.0))  # r2 stands in for r0
    assert done is not None
    group, stop = done
    assert (group.rewards, group.failed, group.superseded, stop) == ([0.0, 1.0], 1, 2, [])
    assert group.complete


def test_a_group_whose_rollouts_all_ended_short_of_its_samples_is_incomplete() -> None:
    rids = ["r0", "r1", "r2"]
    tracker = GroupTracker("b", 2, {"g": ("t", rids)}, ranks={r: n for n, r in enumerate(rids)})
    tracker.settle(ranked("r0", 0, None, FailureReason.INSTANCE_LOST))
    tracker.settle(ranked("r1", 1, 1.0))
    _, done = tracker.settle(ranked("r2", 2, None, FailureReason.POLICY_ERROR))
    assert done is not None
    group, _ = done
    assert (group.rewards, group.failed, group.complete) == ([1.0], 2, False)


def test_a_result_settled_after_its_group_completed_is_superseded_whatever_it_was() -> None:
    tracker = GroupTracker("b", 1, {"g": ("t", ["r0", "r1", "r2", "r3"])})
    first, done = tracker.settle(result("r0", 0.5))
    assert first == result("r0", 0.5) and done is not None and done[1] == ["r1", "r2", "r3"]
    scored, _ = tracker.settle(result("r1", 1.0))
    lost, _ = tracker.settle(result("r2", None, FailureReason.INSTANCE_LOST))
    stopped = result("r3", None, FailureReason.SUPERSEDED)
    assert tracker.settle(stopped) == (stopped, None)
    for late in (scored, lost):
        assert (late.status, late.failure_reason, late.reward) == (
            "failed",
            FailureReason.SUPERSEDED,
            None,
        )
    assert (
        scored.error
        == "its group (task 't') had its 1 scored samples; it had ended completed with reward 1"
    )
    assert lost.error is not None and lost.error.endswith("it had ended instance_lost: boom")
    assert done[0].superseded == 3  # the group counted all three as the results now say


async def test_a_shard_yields_only_the_groups_it_runs() -> None:
    sink = MemorySink()
    pool, _ = fake_pool(sink)
    mine = {rollout_id("b", OTHER.key, n) for n in range(2)}
    async with pool:
        batch = pool.run_batch(
            [TASK, OTHER], PlannedPolicy(), samples_per_task=2, batch_id="b", only=mine
        )
        with anyio.fail_after(10):
            groups = [g async for g in batch.groups()]
    assert [(g.task_key, g.rewards) for g in groups] == [(OTHER.key, [1.0, 1.0])]


class HeldReleases(FakeProvider):
    """Releases (shielded, as the real providers' are) wait for :attr:`open` while
    :attr:`holding`; :attr:`all_held` is set once ``expect`` of them wait."""

    def __init__(self, settings: Any, expect: int) -> None:
        super().__init__(settings.modalities, timeouts=settings.timeouts)
        self.holding = False
        self.open = anyio.Event()
        self.all_held = anyio.Event()
        self._expect = expect
        self._held = 0

    async def release(self, instance: Any, *, reuse: bool = False) -> bool:
        with anyio.CancelScope(shield=True):
            if self.holding:
                self._held += 1
                if self._held == self._expect:
                    self.all_held.set()
                await self.open.wait()
        return await super().release(instance, reuse=reuse)


def assert_results_agree_with_groups(results: list[RolloutResult], groups: list[Group]) -> None:
    """Per group: its results are exactly the batch's results with a reward, and
    every other result is counted as failed or superseded, as it says."""
    for group in groups:
        mine = [r for r in results if r.group_id == group.group_id]
        scored = [r for r in mine if r.reward is not None]
        assert {r.rollout_id for r in scored} == {r.rollout_id for r in group.results}
        assert [r.model_dump() for r in group.results] == [
            next(s for s in scored if s.rollout_id == g.rollout_id).model_dump()
            for g in group.results
        ]
        assert len(scored) <= group.expected
        reasons = Counter(r.failure_reason for r in mine if r.reward is None)
        assert reasons.pop(FailureReason.SUPERSEDED, 0) == group.superseded
        assert sum(reasons.values()) == group.failed


async def test_an_extra_scored_while_its_group_completes_ends_superseded_everywhere() -> None:
    # Four rollouts for two samples: one solves first; two are verified (reward 1)
    # and releasing their instances when the group completes, so one of them
    # completes it and the other ended too late; the last is still acting.
    sink = MemorySink()
    settings = load_settings()
    provider = HeldReleases(settings, expect=2)
    pool = RolloutPool(settings, api_key="unused", events=Events([sink]), provider=provider)
    policy = PlannedPolicy({TASK.key: {0: "solve", 1: "gate", 2: "gate", 3: "hold"}})
    async with pool:
        batch = pool.run_batch([TASK], policy, samples_per_task=2, oversample=2, batch_id="b")
        results: list[RolloutResult] = []
        with anyio.fail_after(10):
            async for result in batch:
                results.append(result)
                if len(results) == 1:  # the first solver's, counted
                    assert result.reward == 1.0
                    provider.holding = True
                    policy.go.set()
                    await provider.all_held.wait()  # both gated ones scored, releasing
                    provider.open.set()
            groups = [g async for g in batch.groups()]
            views = [await batch.view(r.rollout_id, messages=False) for r in results]
    (group,) = groups
    assert group.rewards == [1.0, 1.0] and group.superseded == 2
    assert [r.reward for r in results].count(1.0) == 2
    late = [r for r in results if r.error and "it had ended completed with reward 1" in r.error]
    assert len(late) == 1, [r.error for r in results]
    (late_one,) = late
    assert late_one.failure_reason is FailureReason.SUPERSEDED and late_one.reward is None
    assert late_one.status == "failed" and late_one.verifier is not None  # kept for debugging
    assert late_one.steps == 1 and late_one.transcript  # its rollout data stays
    assert_results_agree_with_groups(results, groups)
    # Telemetry and each rollout's own view say the same as the stream.
    events = sink.named("fleet_rollout_completed")
    completed = {e.attributes["rollout_id"]: e.attributes for e in events}
    for result, view in zip(results, views, strict=True):
        event = completed[result.rollout_id]
        assert (event["reward"], event["failure_reason"]) == (
            result.reward,
            result.failure_reason.value if result.failure_reason else None,
        )
        assert view.result == result
    assert provider.running == 0
    assert_pairs(sink)


async def test_samples_solving_one_after_another_fill_their_group_and_the_extra_is_superseded() -> (
    None
):
    # Three rollouts for two samples, all solving one after another: the group's
    # own two count, the extra ends superseded (it stands in only for a failure).
    sink = MemorySink()
    settings = load_settings(pool={"concurrency": 1}, provisioning={"max_concurrent_creates": 2})
    provider = HeldReleases(settings, expect=0)
    pool = RolloutPool(settings, api_key="unused", events=Events([sink]), provider=provider)
    async with pool:
        batch = pool.run_batch([TASK], PlannedPolicy(), samples_per_task=2, oversample=1)
        with anyio.fail_after(10):
            results = await batch.results()
            groups = [g async for g in batch.groups()]
    assert [r.reward for r in results][:2] == [1.0, 1.0]
    assert results[2].failure_reason is FailureReason.SUPERSEDED
    assert_results_agree_with_groups(results, groups)
    assert_pairs(sink)


# -- straggler cut-off by whole groups (groups_target) ---------------------------------------


async def test_groups_target_delivers_the_first_complete_groups_and_cuts_the_others() -> None:
    sink = MemorySink()
    tasks = [TASK.model_copy(update={"key": f"task-{n}"}) for n in range(4)]
    fast, slow = tasks[:2], tasks[2:]
    plans = {t.key: {0: "solve", 1: "zero", 2: "solve"} for t in fast}
    plans |= {t.key: ["hold"] * 3 for t in slow}  # stragglers: held until cut
    policy = PlannedPolicy(plans)
    pool, provider = fake_pool(sink)
    async with pool:
        batch = pool.run_batch(
            tasks, policy, samples_per_task=2, oversample=1, batch_id="b", groups_target=2
        )
        with anyio.fail_after(10):
            groups = [g async for g in batch.groups()]
            kept = [g async for g in batch.groups(complete_only=True)]
            results = await batch.results()

    assert sorted(g.task_key for g in kept) == [t.key for t in fast]
    assert all(g.complete and not g.cut and len(g.rewards) == 2 for g in kept)
    cut = [g for g in groups if g.cut]
    assert sorted(g.task_key for g in cut) == [t.key for t in slow] and len(groups) == 4
    assert not any(g.complete for g in cut)
    # Every straggler of a cut group was stopped: none of them delivered a reward.
    stopped = [r for r in results if r.task_key in {t.key for t in slow}]
    assert len(stopped) == 6
    assert all(r.failure_reason is FailureReason.SUPERSEDED and r.reward is None for r in stopped)
    assert all("groups_target" in (r.error or "") for r in stopped)
    assert not policy.release.is_set()  # stopped by the cut, not let go
    # Exactly one result per rollout, and every instance made was released.
    assert len(results) == len({r.rollout_id for r in results}) == 4 * 3
    assert provider.running == 0 and len(provider.released) == len(provider.states)
    assert_pairs(sink)


async def test_groups_target_outside_the_batch_s_groups_is_refused() -> None:
    pool, _ = fake_pool(MemorySink())
    async with pool:
        for target in (0, 3):
            with pytest.raises(ValueError, match="groups_target must be between 1 and"):
                pool.run_batch([TASK, OTHER], PlannedPolicy(), groups_target=target)


def test_a_cut_group_s_rollout_that_ends_scored_after_the_cut_is_not_kept() -> None:
    members = {"g": ("t", ["r0", "r1"]), "h": ("u", ["s0", "s1"])}
    tracker = GroupTracker("b", 1, members, target=1)
    _, done = tracker.settle(result("r0", 1.0))
    assert done is not None and done[0].complete
    assert tracker.cut() == [(rid, cut_error("u", 1)) for rid in ("s0", "s1")]
    assert tracker.cut() == []  # once
    # s0 was verifying when the stop came: it ends scored, yet its group was cut.
    late, _ = tracker.settle(
        result("s0", 1.0).model_copy(update={"task_key": "u", "group_id": "h"})
    )
    assert (late.failure_reason, late.reward) == (FailureReason.SUPERSEDED, None)
    stopped = result("s1", None, FailureReason.SUPERSEDED)
    _, done = tracker.settle(stopped.model_copy(update={"task_key": "u", "group_id": "h"}))
    assert done is not None
    group, _ = done
    assert (group.cut, group.complete, group.rewards, group.superseded) == (True, False, [], 2)


def test_the_service_s_group_log_marks_the_groups_the_pool_cut_also_on_a_rerun() -> None:
    tasks = [TASK, OTHER]
    log = GroupLog("b", tasks, 1, 0, groups_target=1)

    def of(task: TaskSpec, reward: float | None, reason: FailureReason | None = None):
        return result(rollout_id("b", task.key, 0), reward, reason).model_copy(
            update={"task_key": task.key, "group_id": group_id("b", task.key)}
        )

    log.add(of(TASK, 1.0))
    log.add(of(OTHER, None, FailureReason.CANCELLED))  # cancelled before the cut reached it
    assert [(g.task_key, g.complete, g.cut) for g in log.groups] == [
        (TASK.key, True, False),
        (OTHER.key, False, True),
    ]
    # Resubmitted, its cancelled rollout runs again: the pool cuts it at once (one group is
    # complete already), so it ends superseded, and its group comes again, cut.
    log.rerun([rollout_id("b", OTHER.key, 0)], [of(TASK, 1.0)])
    log.add(of(OTHER, None, FailureReason.SUPERSEDED))
    assert [(g.task_key, g.complete, g.cut) for g in log.groups[2:]] == [(OTHER.key, False, True)]


async def test_the_groups_of_a_batch_s_results_are_the_groups_it_delivered() -> None:
    sink = MemorySink()
    policy = PlannedPolicy(
        {TASK.key: {0: "solve", 1: "zero", 2: "solve"}, OTHER.key: ["solve"] * 3}
    )
    pool, _ = fake_pool(sink)
    async with pool:
        batch = pool.run_batch([TASK, OTHER], policy, samples_per_task=2, oversample=1)
        with anyio.fail_after(10):
            delivered = [g async for g in batch.groups()]
            results = await batch.results()
    rebuilt = groups_of(batch.batch_id, 2, results)  # what a journal's reader gets

    def summary(groups: list[Group]) -> list[tuple[str, list[float], bool, int, int]]:
        return sorted(
            (g.task_key, sorted(g.rewards), g.uniform, g.failed, g.superseded) for g in groups
        )

    assert summary(rebuilt) == summary(delivered)
    assert {g.task_key: g.uniform for g in rebuilt} == {TASK.key: False, OTHER.key: True}
    assert sum(g.superseded for g in rebuilt) == 2  # each group's extra
