"""ExecutorWorker in this process (no Ray): what one ``take_events`` answers the driver."""

from __future__ import annotations

import anyio
import pytest

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
