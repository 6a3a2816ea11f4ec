"""RayRollout's view of a rollout on an actor, without a cluster: the actor is a fake at
the edge (what the earlier RayBatch's tests checked, for the Ray executor)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("ray")  # RayRollout names Ray's exception types

from fleetroll.errors import OperationTimeout
from fleetroll.pool.ray.executor import RayExecutor, RayRollout
from fleetroll.pool.rollout_pool import rollout_id
from fleetroll.results import FailureReason
from fleetroll.rollout.machine import Phase, RolloutIds, RolloutView
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

SETTINGS = load_settings(timeouts={"ray_call_s": 0.05})
TASK = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)[0]
RID = rollout_id("b", TASK.key, 0)


class _Method:
    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self.call = call

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.call(*args)


class FakeWorker:
    """An ExecutorWorker's handle: ``view.remote(...)`` gives something to await."""

    def __init__(self, view: Callable[..., Awaitable[Any]]) -> None:
        self.view = _Method(view)


def on(worker: FakeWorker, *, sent: bool = True) -> RayRollout:
    """A RayRollout on ``worker``; ``sent``: as ``execute`` marks it once it sent it there."""
    executor = RayExecutor(SETTINGS, [worker], api_key=None, base_url=None)
    rollout = RayRollout(executor, TASK, RolloutIds("b", RID), "b")
    rollout.sent = sent
    return rollout


async def test_a_rollout_not_yet_sent_is_not_asked_about_on_its_actor() -> None:
    # The actor may still hold an earlier rollout of the same id (the run a
    # resumed batch reruns): its view and its turns are not this rollout's.
    earlier = RolloutView(RolloutIds("b", RID), TASK.key, Phase.ACTING, 7, (), None)

    async def answer(rid: str, messages: bool) -> RolloutView | None:
        return earlier

    view = await on(FakeWorker(answer), sent=False).read_view()
    assert view is not earlier and view.phase is Phase.PENDING and view.steps == 0


async def test_a_running_rollout_is_viewed_on_the_actor_that_runs_it() -> None:
    live = RolloutView(RolloutIds("b", RID), TASK.key, Phase.ACTING, 1, (), None)
    asked: list[tuple[str, bool]] = []

    async def answer(rid: str, messages: bool) -> RolloutView | None:
        asked.append((rid, messages))
        return live

    assert await on(FakeWorker(answer)).read_view(messages=False) is live
    assert asked == [(RID, False)]


async def test_a_rollout_its_actor_does_not_know_is_seen_as_the_driver_sees_it() -> None:
    async def unknown(rid: str, messages: bool) -> RolloutView | None:
        return None

    view = await on(FakeWorker(unknown)).read_view()
    assert view.phase is Phase.PENDING and view.result is None and view.task_key == TASK.key


async def test_a_rollout_that_ended_is_seen_with_the_driver_s_result() -> None:
    async def gone(rid: str, messages: bool) -> RolloutView | None:
        return None  # the actor let it go

    rollout = on(FakeWorker(gone))
    before = await rollout.read_view()
    ended = rollout.never_started(FailureReason.CANCELLED, "cancelled")
    after = await rollout.read_view()
    assert before.phase is Phase.PENDING and before.result is None
    assert after.phase is Phase.DONE and after.result is ended


async def test_an_actor_that_does_not_answer_in_time_is_an_operation_timeout() -> None:
    async def never(rid: str, messages: bool) -> RolloutView | None:
        await anyio.Event().wait()
        return None

    with anyio.fail_after(10), pytest.raises(OperationTimeout, match="ray_call_s") as caught:
        await on(FakeWorker(never)).read_view()
    assert caught.value.rollout_id == RID and caught.value.timeout_s == 0.05
