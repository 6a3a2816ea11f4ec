"""An evaluation's share of the pool and its tag, on the provider double.

The pool runs for real over :class:`fleetroll.testing.fake_provider.FakeProvider`;
a :class:`~fleetroll.testing.planned_policy.PlannedPolicy` holds rollouts until
told, so what is in flight can be looked at while nothing moves.
"""

from __future__ import annotations

import anyio
import pytest

from fleetroll.evaluation import EvalReport
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.rollout.machine import Phase
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.testing.fake_provider import FakeProvider
from fleetroll.testing.planned_policy import PlannedPolicy

pytestmark = pytest.mark.anyio

TASKS = [
    TaskSpec(
        key=f"note-{i}",
        prompt="Write done.",
        env_key="fake",
        modality="tool_use",
        verifier_func="def verify(env):\n    return 1.0\n",
        solution=(SolutionStep(name="note", arguments={"word": "done"}),),
    )
    for i in range(3)
]


def fake_pool() -> RolloutPool:
    settings = load_settings(pool={"concurrency": 8})
    return RolloutPool(
        settings,
        api_key="unused",
        events=Events([]),
        provider=FakeProvider(settings.modalities, timeouts=settings.timeouts),
    )


def in_flight(pool: RolloutPool, batch_id: str) -> int:
    batch = pool.batches[batch_id]
    return sum(r.phase is not Phase.PENDING and r.result is None for r in batch.rollouts)


async def test_an_evaluation_runs_no_more_rollouts_at_once_than_its_share() -> None:
    policy = PlannedPolicy({t.key: ["hold", "hold"] for t in TASKS})
    reports: list[EvalReport] = []

    async def evaluate() -> None:
        reports.append(
            await pool.run_eval(
                TASKS, policy, k=2, max_concurrency=2, batch_id="e", policy_version=9
            )
        )

    async with fake_pool() as pool, anyio.create_task_group() as tg:
        tg.start_soon(evaluate)
        with anyio.fail_after(10):
            await anyio.wait_all_tasks_blocked()
            # Two rollouts hold their policy call; the other four wait for the share.
            assert in_flight(pool, "e") == 2 and sum(policy.calls.values()) == 2
            assert sum(r.phase is Phase.PENDING for r in pool.batches["e"].rollouts) == 4
            policy.release.set()
    report = reports[0]
    assert report.overall.samples == 6 and report.overall.unscored == 0
    assert all(t.successes == 2 and t.pass_at == (1.0, 1.0) for t in report.tasks.values())
    assert report.policy_version == 9 and {r.policy_version for r in report.results} == {9}


async def test_every_result_of_a_tagged_batch_carries_the_tag_even_those_never_started() -> None:
    policy = PlannedPolicy({t.key: ["hold"] for t in TASKS})
    async with fake_pool() as pool:
        batch = pool.run_batch(TASKS, policy, max_in_flight=1, policy_version=4, batch_id="t")
        with anyio.fail_after(10):
            await anyio.wait_all_tasks_blocked()
            assert in_flight(pool, "t") == 1
            batch.cancel()
            results = await batch.results()
    assert len(results) == 3 and {r.policy_version for r in results} == {4}
    assert {r.failure_reason for r in results} == {FailureReason.CANCELLED}


async def test_an_untagged_batch_leaves_the_tag_null_and_bad_shares_are_refused() -> None:
    async with fake_pool() as pool:
        with anyio.fail_after(10):
            results = await pool.run_batch(TASKS[:1], PlannedPolicy()).results()
        assert [r.policy_version for r in results] == [None] and results[0].reward == 1.0
        with pytest.raises(ValueError, match="max_in_flight"):
            pool.run_batch(TASKS, PlannedPolicy(), max_in_flight=0)
        with pytest.raises(ValueError, match="k must be at least 1"):
            await pool.run_eval(TASKS, PlannedPolicy(), k=0)
