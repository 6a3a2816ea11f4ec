"""The actors of :class:`~fleetroll.ray_pool.RayRolloutPool`, and what they run on.

* :class:`~fleetroll.ray_admission.AdmissionHost` (the limiter): the
  cluster's one admission controller (create limits, instance caps, Fleet's
  account limit, circuit breakers), which every actor's pools use through a
  :class:`~fleetroll.ray_admission.RemoteAdmission`;
* :class:`RolloutWorker`: runs shards of batches, one
  :class:`~fleetroll.pool.RolloutPool` per shard, and keeps what the driver
  takes from it (results, telemetry events stamped with the actor's
  ``worker`` index) and answers views of the shard's rollouts.

The classes are plain here; the pool makes them Ray actors when it opens.
"""

from __future__ import annotations

import os
from typing import Any

import anyio

from fleetroll.errors import ConfigError
from fleetroll.policies import Policy
from fleetroll.pool import Batch, RolloutPool
from fleetroll.ray_admission import RemoteAdmission
from fleetroll.results import RolloutResult
from fleetroll.rollout import RolloutView
from fleetroll.rollout_events import EventPage
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Event, Events

__all__ = ["RolloutWorker", "default_num_actors", "holder", "load_ray"]


def load_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray is not installed: pip install 'fleetroll[ray]'") from None
    return ray


class _Buffer:
    """Results and events of one shard, waiting for the driver to take them."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.results: list[RolloutResult] = []
        self.events: list[Event] = []
        self.done = False
        self.error: str | None = None
        self.changed = anyio.Event()
        self.ended = anyio.Event()

    def end(self) -> None:
        """The shard's pool has closed: nothing more comes."""
        self.done = True
        self.ended.set()
        self.changed.set()

    def emit(self, event: Event) -> None:  # an EventSink
        # Stamped here, in the actor's process: which actor ran what.
        attributes = {**event.attributes, "worker": self.worker}
        self.events.append(Event(event.name, event.level, attributes, event.timestamp))
        self.changed.set()


class RolloutWorker:
    """Runs shards of batches in its own process, one RolloutPool per shard."""

    def __init__(
        self, settings: Settings, api_key: str, base_url: str | None, limiter: Any, index: int
    ) -> None:
        self._settings = settings
        self._api_key = api_key
        self._base_url = base_url
        self._index = index
        self._worker_id = holder(index)
        #: The cluster's admission, shared by every shard's pool on this actor.
        self._admission = RemoteAdmission(limiter, self._worker_id, settings.timeouts.ray_call_s)
        self._buffers: dict[str, _Buffer] = {}
        self._cancel: dict[str, anyio.Event] = {}
        #: Each shard's batch, for views, until the driver has its every result.
        self._batches: dict[str, Batch] = {}

    async def run_shard(
        self,
        shard_id: str,
        tasks: list[TaskSpec],
        policy: Policy,
        samples: int,
        batch_id: str,
        only: list[str],
    ) -> int:
        buffer = self._buffers[shard_id] = _Buffer(self._index)
        # A cancel may have come first (the actor's calls run concurrently).
        cancel = self._cancel.setdefault(shard_id, anyio.Event())
        try:
            pool = RolloutPool(
                self._settings,
                api_key=self._api_key,
                base_url=self._base_url,
                events=Events([buffer]),
                admission=self._admission,
            )
            async with pool, anyio.create_task_group() as tg:
                batch = pool.run_batch(
                    tasks,
                    policy,
                    samples_per_task=samples,
                    batch_id=batch_id,
                    only=set(only),
                    run_id=shard_id,
                )
                self._batches[shard_id] = batch

                async def cancel_on_request() -> None:
                    await cancel.wait()
                    await batch.aclose()

                tg.start_soon(cancel_on_request)
                async for result in batch:
                    buffer.results.append(result)
                    buffer.changed.set()
                tg.cancel_scope.cancel()
        except Exception as exc:  # reported to the driver, which accounts for every rollout
            buffer.error = f"{type(exc).__name__}: {exc}"
        finally:
            buffer.end()
        return len(buffer.results)

    async def take(
        self, shard_id: str, wait_s: float, gather_s: float = 0.0
    ) -> tuple[list[RolloutResult], list[Event], bool, str | None]:
        """What the shard produced since the last take: waits up to ``wait_s`` for
        something, then up to ``gather_s`` for what follows it (unless the shard
        ends first).

        A rollout's events and its result come in bursts: gathered, one answer
        carries a burst, where waking on each event made the driver call once
        per event.
        """
        buffer = self._buffers.get(shard_id)
        if buffer is None:
            return [], [], False, None
        if not (buffer.results or buffer.events or buffer.done):
            with anyio.move_on_after(wait_s):
                await buffer.changed.wait()
        if (buffer.results or buffer.events) and not buffer.done:
            with anyio.move_on_after(gather_s):
                await buffer.ended.wait()
        buffer.changed = anyio.Event()
        results, buffer.results = buffer.results, []
        events, buffer.events = buffer.events, []
        done = buffer.done and not buffer.results
        if done:
            self._buffers.pop(shard_id, None)
            self._cancel.pop(shard_id, None)
        return results, events, done, buffer.error

    async def cancel(self, shard_id: str) -> None:
        self._cancel.setdefault(shard_id, anyio.Event()).set()

    async def view(
        self, shard_id: str, rollout_id: str, messages: bool = True
    ) -> RolloutView | None:
        """One rollout of the shard, as it is now; None if this actor does not hold it."""
        batch = self._batches.get(shard_id)
        if batch is None:
            return None
        try:
            return await batch.view(rollout_id, messages=messages)
        except KeyError:
            return None

    async def events(
        self, shard_id: str, rollout_id: str, after: int, wait_s: float
    ) -> EventPage | None:
        """One rollout's live events after ``after`` (waiting up to ``wait_s``); None if
        this actor does not hold it."""
        batch = self._batches.get(shard_id)
        if batch is None:
            return None
        try:
            return await batch.events(rollout_id, after=after, wait_s=wait_s)
        except KeyError:
            return None

    async def forget(self, shard_id: str) -> None:
        """The driver has every result of the shard: its views may go."""
        self._batches.pop(shard_id, None)

    async def pid(self) -> int:
        import os

        return os.getpid()


def holder(index: int) -> str:
    """The name the limiter knows an actor by."""
    return f"worker-{index}"


def default_num_actors() -> int:
    """One actor per CPU this process may use: the default on one machine.

    Each actor is a process with its own event loop: more actors than cores
    only add start-up and contention (benchmarks/RESULTS.md, "Ray against one
    process").
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
