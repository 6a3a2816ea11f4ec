"""RolloutWorker in this process (no Ray): what one ``take`` answers the driver."""

from __future__ import annotations

import anyio
import pytest

from fleetroll.ray_actors import RolloutWorker, _Buffer
from fleetroll.results import RolloutResult
from fleetroll.settings import load_settings
from fleetroll.telemetry.events import Event

pytestmark = pytest.mark.anyio

Taken = tuple[list[RolloutResult], list[Event], bool, str | None]


def worker_with_shard(shard_id: str) -> tuple[RolloutWorker, _Buffer]:
    """A worker holding one shard's buffer, which the test fills as a running shard would."""
    worker = RolloutWorker(load_settings(), "key", None, limiter=None, index=0)
    buffer = worker._buffers[shard_id] = _Buffer(0)
    return worker, buffer


def event(name: str) -> Event:
    return Event(name, "info", {"rollout_id": "r"})


async def test_a_take_woken_by_an_event_gathers_what_follows_until_the_shard_ends() -> None:
    worker, buffer = worker_with_shard("s")
    taken: list[Taken] = []

    async def take() -> None:
        taken.append(await worker.take("s", wait_s=60, gather_s=60))

    with anyio.fail_after(10):  # the shard's end, not gather_s, ends the gathering
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await anyio.wait_all_tasks_blocked()
            buffer.emit(event("fleet_rollout_started"))
            # Without gathering, the take answers here with the first event alone.
            await anyio.wait_all_tasks_blocked()
            buffer.emit(event("fleet_rollout_completed"))
            buffer.end()
    [(results, events, done, error)] = taken
    assert [e.name for e in events] == ["fleet_rollout_started", "fleet_rollout_completed"]
    assert {e.attributes["worker"] for e in events} == {0}
    assert results == [] and done and error is None
    assert "s" not in worker._buffers  # the driver has it all: the shard goes


async def test_a_take_that_waited_in_vain_answers_at_once_without_gathering() -> None:
    worker, _ = worker_with_shard("s")
    with anyio.fail_after(10):  # not gather_s: nothing came, so there is no burst to gather
        results, events, done, error = await worker.take("s", wait_s=0, gather_s=60)
    assert (results, events, done, error) == ([], [], False, None)
