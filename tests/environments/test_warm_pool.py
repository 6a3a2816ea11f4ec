"""The warm pool (fleetroll.environments.fleet.warm) on the in-memory provider double."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from fleetroll.environments.fleet.warm import open_warm_pool, reuse_key
from fleetroll.environments.provider import Instance
from fleetroll.errors import ProvisionError
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.progress import Progress
from fleetroll.rollout.stages import instance_reusable
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.testing.fake_provider import FakeProvider

pytestmark = pytest.mark.anyio

TASK = TaskSpec(
    key="note-done",
    prompt="Write done.",
    env_key="fake",
    modality="tool_use",
    verifier_func="def verify(env):\n    return 1.0\n",
    solution=(SolutionStep(name="note", arguments={"word": "done"}),),
)
#: Same kind of instance, other actions: its verifier (the fake's) gives 0.0
#: unless the instance's notes hold "done", which only another rollout wrote.
NOTHING = (SolutionStep(name="note", arguments={"word": "x"}),)
IDLE_HANDS = TASK.model_copy(update={"key": "note-nothing", "solution": NOTHING})


class Watched(FakeProvider):
    """Counts releases and sweeps, and sets :attr:`released_one` at each release."""

    def __init__(self, settings: Any, **options: Any) -> None:
        super().__init__(settings.modalities, timeouts=settings.timeouts, **options)
        self.released_one = anyio.Event()
        self.swept: list[str] = []

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        done = await super().release(instance, reuse=reuse)
        self.released_one.set()
        self.released_one = anyio.Event()
        return done

    async def sweep(self, run_id: str) -> int:
        self.swept.append(run_id)
        return 0


def _sections(settings: Settings) -> dict[str, Any]:
    """What the warm pool takes of the settings."""
    return {
        "provisioning": settings.provisioning,
        "timeouts": settings.timeouts,
        "modalities": settings.modalities,
    }


def settings_with(**provisioning: Any) -> Any:
    return load_settings(provisioning={"reuse": True, **provisioning}, pool={"concurrency": 1})


async def run_in_sequence(
    tasks: list[TaskSpec], provider: FakeProvider, **provisioning: Any
) -> list[RolloutResult]:
    settings = settings_with(**provisioning)
    results: list[RolloutResult] = []
    async with RolloutPool(settings, api_key="unused", provider=provider) as pool:
        for task in tasks:
            with anyio.fail_after(10):
                results += await pool.run_batch([task], ScriptedPolicy()).results()
    return results


async def test_a_reused_instance_s_verifier_sees_only_its_own_rollout_s_notes() -> None:
    provider = FakeProvider(settings_with().modalities)
    results = await run_in_sequence([TASK, IDLE_HANDS, TASK], provider)
    assert [r.instance_uses for r in results] == [1, 2, 3]
    assert len({r.instance_id for r in results}) == 1
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    assert provider.running == 0


async def test_rewards_are_the_same_with_and_without_reuse() -> None:
    tasks = [TASK, IDLE_HANDS, IDLE_HANDS, TASK, IDLE_HANDS]
    fresh = await run_in_sequence(tasks, FakeProvider(settings_with().modalities), reuse=False)
    reused = await run_in_sequence(tasks, FakeProvider(settings_with().modalities))
    assert [r.reward for r in reused] == [r.reward for r in fresh] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert [r.instance_uses for r in fresh] == [1] * 5
    assert [r.instance_uses for r in reused] == [1, 2, 3, 4, 5]


async def test_an_instance_whose_reset_fails_is_released_not_reused() -> None:
    provider = FakeProvider(settings_with().modalities, reset_error=RuntimeError("seed gone"))
    results = await run_in_sequence([TASK, TASK, TASK], provider)
    assert [r.instance_uses for r in results] == [1, 1, 1]
    assert len(provider.released) == 3 and provider.running == 0
    assert [r.reward for r in results] == [1.0] * 3


async def test_an_instance_whose_rollout_failed_for_infrastructure_reasons_is_not_reused() -> None:
    provider = FakeProvider(settings_with().modalities, verify_error="verifier runtime down")
    results = await run_in_sequence([TASK, TASK], provider)
    assert [r.failure_reason and r.failure_reason.value for r in results] == ["verifier_error"] * 2
    assert [r.instance_uses for r in results] == [1, 1]
    assert provider.running == 0


async def test_max_reuses_bounds_the_rollouts_of_one_instance() -> None:
    provider = FakeProvider(settings_with().modalities)
    results = await run_in_sequence([TASK] * 5, provider, max_reuses=1)
    assert [r.instance_uses for r in results] == [1, 2, 1, 2, 1]
    assert len(provider.states) == 3 and provider.running == 0


async def test_an_idle_instance_is_released_after_warm_idle_s() -> None:
    settings = settings_with(warm_idle_s=0.05)
    provider = Watched(settings)
    async with open_warm_pool(provider, Events(), **_sections(settings)) as warm:
        instance = await warm.provision(TASK)
        released = provider.released_one
        await warm.release(instance, reuse=True)
        with anyio.fail_after(5):
            await released.wait()
        assert provider.released == [instance.instance_id]
        assert warm.idle == 0


async def test_closing_the_pool_releases_every_idle_instance_and_runs_the_sweeps_put_off() -> None:
    settings = settings_with(warm_instances=4, warm_idle_s=600, reuse_wait_s=0)
    provider = Watched(settings)
    async with open_warm_pool(provider, Events(), **_sections(settings)) as warm:
        lent = [await warm.provision(TASK, run_id="batch-1") for _ in range(3)]
        for instance in lent:
            await warm.release(instance, reuse=True)
        with anyio.fail_after(5):
            while warm.idle < 3:  # the resets run in the background
                await anyio.sleep(0)
        # Its instances go on to the next batch: the sweep would delete them.
        assert await warm.sweep("batch-1") == 0
        assert provider.swept == [] and provider.running == 3
    assert provider.running == 0
    assert provider.swept == ["batch-1"]


async def test_more_idle_instances_than_warm_instances_are_released_at_once() -> None:
    settings = settings_with(warm_instances=1, warm_idle_s=600, reuse_wait_s=0)
    provider = Watched(settings)
    async with open_warm_pool(provider, Events(), **_sections(settings)) as warm:
        lent = [await warm.provision(TASK) for _ in range(3)]
        for instance in lent:
            await warm.release(instance, reuse=True)
        with anyio.fail_after(5):
            while len(provider.released) < 2:
                await anyio.sleep(0)
        assert warm.idle == 1 and provider.running == 1
    assert provider.running == 0


async def second_while_first_is_given_back(*, reuse: bool) -> tuple[Instance, Instance, Watched]:
    """A rollout holds an instance, a second waits for one of its kind; then the
    first gives its instance back (``reuse``). Both instances, and the provider."""
    settings = settings_with(reuse_wait_s=600)
    provider = Watched(settings)
    async with open_warm_pool(provider, Events(), **_sections(settings)) as warm:
        first = await warm.provision(TASK)
        got: list[Instance] = []
        async with anyio.create_task_group() as tg:

            async def second() -> None:
                got.append(await warm.provision(TASK))

            tg.start_soon(second)
            await anyio.wait_all_tasks_blocked()
            await warm.release(first, reuse=reuse)
        await warm.release(got[0])
    return first, got[0], provider


async def test_a_waiting_rollout_gets_the_instance_given_back_instead_of_creating() -> None:
    first, second, provider = await second_while_first_is_given_back(reuse=True)
    assert second.instance_id == first.instance_id and second.uses == 2
    assert len(provider.states) == 1 and provider.running == 0


async def test_a_waiting_rollout_creates_its_own_once_nothing_of_its_kind_may_come_back() -> None:
    # The first rollout failed: its instance is gone, nothing can come back.
    first, second, provider = await second_while_first_is_given_back(reuse=False)
    assert second.instance_id != first.instance_id and second.uses == 1
    assert len(provider.states) == 2 and provider.running == 0


async def test_a_reused_instance_is_not_reset_twice() -> None:
    settings = settings_with()
    provider = FakeProvider(settings.modalities, timeouts=settings.timeouts)
    async with open_warm_pool(provider, Events(), **_sections(settings)) as warm:
        first = await warm.provision(TASK)
        await warm.reset(first, TASK)  # a fresh one's own reset goes through
        await warm.release(first, reuse=True)
        with anyio.fail_after(5):
            while warm.idle < 1:
                await anyio.sleep(0)
        again = await warm.provision(TASK)
        await warm.reset(again, TASK)  # reset when it was given back: nothing to do
        assert again.uses == 2 and provider.resets == 2
        await warm.reset(again, TASK)  # asked again: it may have been touched since
        assert provider.resets == 3
        await warm.release(again)


async def test_a_reused_instance_is_reset_again_for_a_task_with_another_seed_or_time() -> None:
    seeded = TASK.model_copy(update={"key": "seeded", "seed": 7, "timestamp": 1_767_225_600})
    other = seeded.model_copy(update={"key": "other", "seed": 8})
    settings = settings_with()
    provider = FakeProvider(settings)
    async with open_warm_pool(provider, Events(), **_sections(settings)) as warm:

        async def given_back(instance: Instance) -> None:
            await warm.release(instance, reuse=True)
            with anyio.fail_after(5):
                while warm.idle < 1:
                    await anyio.sleep(0)

        first = await warm.provision(seeded)
        await warm.reset(first, seeded)
        await given_back(first)  # reset for reuse to the seed of the task it served
        again = await warm.provision(seeded)
        await warm.reset(again, seeded)  # the same seed and time: nothing left to do
        await given_back(again)
        third = await warm.provision(other)
        await warm.reset(third, other)  # another seed: reset again, to its own
        assert third.instance_id == first.instance_id
        assert provider.reset_points == [(7, 1_767_225_600)] * 3 + [(8, 1_767_225_600)]
        await warm.release(third)


def test_only_api_tool_fleet_tasks_are_reused_and_kinds_follow_what_a_create_asks_for() -> None:
    modalities = load_settings().modalities
    assert reuse_key(TASK, modalities) == reuse_key(IDLE_HANDS, modalities)
    assert reuse_key(TASK, modalities) != reuse_key(
        TASK.model_copy(update={"env_variables": {"TZ": "UTC"}}), modalities
    )
    assert reuse_key(TASK, modalities) != reuse_key(
        TASK.model_copy(update={"data_key": "other"}), modalities
    )
    assert reuse_key(TASK.model_copy(update={"modality": "computer_use"}), modalities) is None


@pytest.mark.parametrize(
    ("reason", "tool_failures", "reusable"),
    [
        (None, 0, True),
        (FailureReason.TIMEOUT, 0, True),
        (FailureReason.MAX_STEPS, 0, True),
        (FailureReason.POLICY_ERROR, 0, True),
        (None, 1, False),  # a call without an answer could still land after the reset
        (FailureReason.TOOLS_ERROR, 0, False),
        (FailureReason.INSTANCE_LOST, 0, False),
        (FailureReason.VERIFIER_ERROR, 0, False),
        (FailureReason.PLATFORM_TIMEOUT, 0, False),
        (FailureReason.CANCELLED, 0, False),
        (FailureReason.SUPERSEDED, 0, False),
    ],
)
def test_an_instance_is_reusable_only_after_a_rollout_without_infrastructure_failure(
    reason: FailureReason | None, tool_failures: int, reusable: bool
) -> None:
    progress = Progress()
    progress.tool_failures = tool_failures
    if reason is not None:
        progress.fail(reason, "why")
    assert instance_reusable(progress) is reusable


async def test_failed_creates_end_their_rollouts_and_leave_no_one_waiting() -> None:
    settings = load_settings(provisioning={"reuse": True}, pool={"concurrency": 4})
    failing = ProvisionError("no capacity", transient=False)
    provider = FakeProvider(
        settings.modalities, timeouts=settings.timeouts, provision_error=failing
    )
    async with RolloutPool(settings, api_key="unused", provider=provider) as pool:
        with anyio.fail_after(10):
            results = await pool.run_batch([TASK], ScriptedPolicy(), samples_per_task=4).results()
    assert [r.failure_reason and r.failure_reason.value for r in results] == ["init_error"] * 4
    assert all(r.instance_uses is None for r in results)
