"""The pool batches run on: one RolloutPool, its rollouts in this process or on Ray actors.

``fleetroll run`` and ``fleetroll serve`` take the same ``--ray [ADDRESS]``
and ``--ray-actors N`` options (:func:`fleetroll.cli.options.ray_options`) and
open the pool they ask for with :func:`open_batch_pool` (``serve`` too: one pool, its env sessions
in this process under the pool's admission, gate and limits).
What a caller needs of a pool is a :class:`BatchPool`, and of its batches a
:class:`RunningBatch`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Protocol

import anyio

from fleetroll.environments.admission import Admission
from fleetroll.policies import Policy
from fleetroll.pool.assembly import fleet_provider
from fleetroll.pool.rollout_pool import BatchCounts, RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.rollout.events import EventPage
from fleetroll.rollout.machine import RolloutView
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events

__all__ = [
    "BatchPool",
    "FleetTarget",
    "RunningBatch",
    "open_batch_pool",
    "release_run",
]


@dataclass(frozen=True, slots=True)
class FleetTarget:
    """Where instances come from: Fleet, a Fleet at FLEET_BASE_URL, or the emulator."""

    api_key: str
    base_url: str | None
    description: str


class RunningBatch(Protocol):
    """A batch as it runs: a RolloutPool's ``Batch``, whatever its executor."""

    @property
    def batch_id(self) -> str: ...

    @property
    def total(self) -> int: ...

    @property
    def finished(self) -> anyio.Event: ...

    def counts(self) -> BatchCounts: ...

    async def view(self, rollout_id: str, *, messages: bool = True) -> RolloutView:
        """What one of its rollouts is doing, wherever it runs; its result once it ended.

        ``messages=False`` leaves the transcript out (cheap: nothing is exported).

        Raises:
            KeyError: the batch holds no such rollout.
            OperationTimeout: the process running it did not answer in time (Ray).
        """
        ...

    async def events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        """One rollout's live events after cursor ``after`` (:mod:`fleetroll.rollout.events`),
        waiting up to ``wait_s`` for one, wherever it runs.

        Raises:
            KeyError: the batch holds no such rollout.
            OperationTimeout: the process running it did not answer in time (Ray).
        """
        ...

    def cancel(self) -> None:
        """Cancel what is still running; every result still arrives."""

    async def aclose(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[RolloutResult]: ...


class BatchPool(Protocol):
    """What callers need of a pool that runs batches (see ``RolloutPool.run_batch``)."""

    @property
    def admission(self) -> Admission:
        """Its admission (a Ray cluster's one, on Ray): ``state()`` gives the gauges."""
        ...

    def forget(self, batch_id: str) -> None:
        """Let a finished batch go (a long-lived caller's; unknown ids are ignored)."""

    def run_batch(
        self,
        tasks: Sequence[TaskSpec],
        policy: Policy,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        skip: Collection[str] = (),
        max_in_flight: int | None = None,
        policy_version: int | None = None,
    ) -> RunningBatch: ...


async def release_run(
    settings: Settings, fleet: FleetTarget, run_id: str, events: Events
) -> list[str]:
    """Release the running instances of ``run_id`` (and of its tags: a service's
    batches, a Ray actor's) on ``fleet``: what a killed process of that run left.
    Never raises: what could not be released is a ``fleet_instance_release_failed``.
    Returns the ids released.

    For a process's start-up (``run --resume``, ``serve``), before its pool
    holds anything, and for ``fleetroll gc``.
    """
    provider = fleet_provider(settings, events, api_key=fleet.api_key, base_url=fleet.base_url)
    try:
        return await provider.collect(run_id)
    finally:
        with anyio.CancelScope(shield=True):
            await provider.aclose()


async def open_batch_pool(
    stack: AsyncExitStack,
    settings: Settings,
    fleet: FleetTarget,
    events: Events,
    *,
    ray_address: str | None = None,
    ray_actors: int | None = None,
    run_id: str | None = None,
) -> tuple[RolloutPool, str]:
    """The pool to run batches on, entered on ``stack``, and where it runs (for humans).

    One :class:`RolloutPool` either way: without ``ray_address`` its rollouts run
    in this process; with it, on ``ray_actors`` Ray actors (None: one per CPU)
    of a local Ray (``"local"``) or of the cluster at ``ray_address``
    (:func:`fleetroll.pool.ray.executor.ray_pool`). Every pool feature is the same.
    ``run_id``: the process's (``RolloutPool.run_id``; ``serve``'s).

    Raises:
        ConfigError: Ray is asked for but not installed.
    """
    if ray_address is None:
        pool = await stack.enter_async_context(
            RolloutPool(
                settings,
                api_key=fleet.api_key,
                base_url=fleet.base_url,
                events=events,
                run_id=run_id,
            )
        )
        return pool, fleet.description
    from fleetroll.pool.ray.executor import RayExecutor, ray_pool

    on_ray = await stack.enter_async_context(
        ray_pool(
            settings,
            api_key=fleet.api_key,
            base_url=fleet.base_url,
            events=events,
            num_actors=ray_actors,
            address=None if ray_address == "local" else ray_address,
            run_id=run_id,
        )
    )
    executor = on_ray.executor
    assert isinstance(executor, RayExecutor)  # its construction, just above
    return on_ray, f"{fleet.description} over {len(executor.workers)} Ray actors"
