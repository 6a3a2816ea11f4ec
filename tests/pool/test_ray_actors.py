"""ExecutorWorker in this process (no Ray): what one ``take_events`` answers the
driver, and the policies an actor makes from their recipes."""

from __future__ import annotations

import pickle

import anyio
import pytest

from fleetroll.policies import OpenAIChatPolicy
from fleetroll.policies.openai import PolicyRecipe
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.ray.actors import PolicyHost
from fleetroll.pool.ray.executor import ExecutorWorker
from fleetroll.settings import load_settings
from fleetroll.telemetry.events import Event

pytestmark = pytest.mark.anyio


def worker() -> ExecutorWorker:
    return ExecutorWorker(load_settings(), "key", None, limiter=None, index=1)


def event(name: str) -> Event:
    return Event(name, "info", {"rollout_id": "r"})


async def test_a_take_woken_by_an_event_answers_it_stamped_with_the_actor_s_index() -> None:
    on_actor = worker()
    taken: list[list[Event]] = []

    async def take() -> None:
        taken.append(await on_actor.take_events(wait_s=60))

    with anyio.fail_after(10):  # the event, not wait_s, ends the take
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await anyio.wait_all_tasks_blocked()
            on_actor._buffer.emit(event("fleet_rollout_started"))
    [events] = taken
    assert [e.name for e in events] == ["fleet_rollout_started"]
    assert {e.attributes["worker"] for e in events} == {1}
    assert on_actor._buffer.events == []  # the driver has it: nothing is taken twice


async def test_a_take_that_waited_in_vain_answers_at_once_with_nothing() -> None:
    with anyio.fail_after(10):
        assert await worker().take_events(wait_s=0) == []


def recipe() -> PolicyRecipe:
    settings = load_settings(
        policy={"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    )
    travelled = pickle.loads(
        pickle.dumps(OpenAIChatPolicy.from_config(chat_policy_config(settings)))
    )
    assert isinstance(travelled, PolicyRecipe)
    return travelled


def closed(policy: OpenAIChatPolicy) -> bool:
    return policy._client.is_closed


async def test_an_actor_makes_one_policy_per_recipe_and_closes_it_when_idle_or_at_its_end() -> None:
    host, first, second = PolicyHost(), recipe(), recipe()
    with anyio.fail_after(10):
        async with host.policy(first) as a, host.policy(first) as again:
            assert a is again  # the rollouts of one batch share one client
        async with host.policy(first) as a_later:
            assert a_later is a and not closed(a)  # idle is not closed by itself
            async with host.policy(second) as b:
                # In use, the first is kept when another recipe arrives.
                assert b is not a and not closed(a)
        async with host.policy(recipe()) as c:
            # Idle ones go when another recipe arrives (a service makes one per batch).
            assert closed(a) and closed(b) and not closed(c)
            await host.aclose()  # the actor's end
        assert closed(c)
