"""RayBatch's view of a rollout, without a cluster: the actor is a fake at the edge."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

pytest.importorskip("ray")  # RayBatch.view names Ray's exception types

from fleetroll.errors import ConfigError, OperationTimeout
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool import rollout_id
from fleetroll.ray_pool import RayBatch, RayRolloutPool
from fleetroll.results import RolloutResult
from fleetroll.rollout import Phase, RolloutIds, RolloutView
from fleetroll.rollout_events import EventPage, RolloutEvent
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

SETTINGS = load_settings()
TASK = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)[0]
RID = rollout_id("b", TASK.key, 0)


@dataclass
class _Method:
    call: Callable[[str, str], Awaitable[RolloutView | None]]

    def remote(
        self, shard_id: str, rid: str, messages: bool = True
    ) -> Awaitable[RolloutView | None]:
        return self.call(shard_id, rid)


class FakeWorker:
    """A RolloutWorker's handle: ``view.remote(...)`` gives something to await."""

    def __init__(self, call: Callable[[str, str], Awaitable[RolloutView | None]]) -> None:
        self.view = _Method(call)


@pytest.fixture
async def ray_batch() -> AsyncIterator[RayBatch]:
    """A one-rollout batch; its results stream is closed and read to the end afterwards."""
    made = RayBatch("b", {RID: (TASK, 0)}, call_s=0.05)
    yield made
    made.close_stream()
    await made.results()


def result(**fields: Any) -> RolloutResult:
    return RolloutResult(
        rollout_id=RID,
        batch_id="b",
        task_key=TASK.key,
        env_key=TASK.env_key,
        modality=TASK.modality,
        status="completed",
        reward=1.0,
        steps=2,
        transcript=[{"role": "assistant", "content": "done"}],
        **fields,
    )


async def test_a_rollout_not_on_an_actor_yet_is_pending_and_a_delivered_one_is_done(
    ray_batch: RayBatch,
) -> None:
    before = await ray_batch.view(RID)
    ray_batch.deliver(result())
    after = await ray_batch.view(RID)
    assert before.phase is Phase.PENDING and before.result is None and before.messages == ()
    assert before.ids.rollout_id == RID and before.task_key == TASK.key
    assert after.phase is Phase.DONE and after.result is not None and after.steps == 2
    assert after.messages == ({"role": "assistant", "content": "done"},)
    with pytest.raises(KeyError):
        await ray_batch.view("not-in-this-batch")


async def test_a_running_rollout_is_viewed_on_the_actor_and_shard_that_hold_it(
    ray_batch: RayBatch,
) -> None:
    live = RolloutView(RolloutIds("b", RID), TASK.key, Phase.ACTING, 1, (), None)
    asked: list[tuple[str, str]] = []

    async def answer(shard_id: str, rid: str) -> RolloutView | None:
        asked.append((shard_id, rid))
        return live

    ray_batch.place([RID], FakeWorker(answer), "b-0-abc")
    assert await ray_batch.view(RID) is live
    assert asked == [("b-0-abc", RID)]


async def test_an_actor_that_let_the_shard_go_means_the_result_is_in(ray_batch: RayBatch) -> None:
    async def gone(shard_id: str, rid: str) -> RolloutView | None:
        ray_batch.deliver(result())  # the driver delivered it while the view was asked
        return None

    ray_batch.place([RID], FakeWorker(gone), "b-0-abc")
    view = await ray_batch.view(RID)
    assert view.phase is Phase.DONE and view.result is not None


async def test_an_actor_that_does_not_answer_in_time_is_an_operation_timeout(
    ray_batch: RayBatch,
) -> None:
    async def never(shard_id: str, rid: str) -> RolloutView | None:
        await anyio.Event().wait()
        return None

    ray_batch.place([RID], FakeWorker(never), "b-0-abc")
    with anyio.fail_after(10), pytest.raises(OperationTimeout, match="ray_call_s") as caught:
        await ray_batch.view(RID)
    assert caught.value.rollout_id == RID and caught.value.timeout_s == 0.05


class FakeEventsWorker:
    """A RolloutWorker's handle that answers ``events`` from a list (None: no shard yet)."""

    def __init__(self, answers: list[EventPage | None]) -> None:
        self.answers = answers
        self.events = self

    async def remote(self, shard_id: str, rid: str, after: int, wait_s: float) -> Any:
        return self.answers.pop(0)


async def test_a_follower_asking_before_the_actor_opened_the_shard_asks_again_at_once(
    ray_batch: RayBatch,
) -> None:
    # Ray may start `events` on an actor before `run_shard` (whose arguments are
    # bigger): the actor does not hold the shard yet. Waiting for another placement
    # there would show a follower nothing until the end (15 s later, with the shipped
    # heartbeat).
    first = EventPage((RolloutEvent(1, "phase", 0.0, {"phase": "provisioning"}),), 0, False)
    ray_batch.place([RID], FakeEventsWorker([None, None, first]), "b-0-abc")
    with anyio.fail_after(5):
        pages = [await ray_batch.events(RID, after=0, wait_s=15) for _ in range(3)]
    assert [p.events for p in pages[:2]] == [(), ()] and pages[2] is first


@pytest.mark.parametrize(("config", "argument"), [(0, 2), (3, None)])
def test_oversampling_on_ray_is_refused_in_one_line_naming_the_setting(
    config: int, argument: int | None
) -> None:
    pool = RayRolloutPool(load_settings(pool={"oversample": config}), api_key="k")
    given = "pool.oversample" if argument is None else "oversample"
    with pytest.raises(ConfigError, match=f"^{given} = {argument or config} needs the local pool"):
        pool.run_batch([TASK], ScriptedPolicy(), oversample=argument)
