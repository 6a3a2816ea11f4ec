"""The pool batches run on: this process (RolloutPool) or Ray actors (RayRolloutPool).

``fleetroll run`` and ``fleetroll serve`` take the same ``--ray [ADDRESS]``
and ``--ray-actors N`` options (:func:`ray_options`) and open the pool they
ask for with :func:`open_batch_pool` (``serve``: :func:`open_service_pools`).
What a caller needs of either pool is a :class:`BatchPool`, and of either's
batches a :class:`RunningBatch`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio

from fleetroll.admission import Admission
from fleetroll.cli_options import ray_options
from fleetroll.errors import ConfigError
from fleetroll.policies import Policy
from fleetroll.pool import BatchCounts, RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.rollout import RolloutView
from fleetroll.rollout_events import EventPage
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events

__all__ = [
    "BatchPool",
    "FleetTarget",
    "RunningBatch",
    "open_batch_pool",
    "open_service_pools",
    "ray_options",
]

F = TypeVar("F", bound=Callable[..., object])


@dataclass(frozen=True, slots=True)
class FleetTarget:
    """Where instances come from: Fleet, a Fleet at FLEET_BASE_URL, or the emulator."""

    api_key: str
    base_url: str | None
    description: str


class RunningBatch(Protocol):
    """A batch as it runs: a RolloutPool's ``Batch`` or a RayRolloutPool's ``RayBatch``."""

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
        """One rollout's live events after cursor ``after`` (:mod:`fleetroll.rollout_events`),
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
    ) -> RunningBatch: ...


async def open_batch_pool(
    stack: AsyncExitStack,
    settings: Settings,
    fleet: FleetTarget,
    events: Events,
    *,
    ray_address: str | None = None,
    ray_actors: int | None = None,
) -> tuple[BatchPool, str]:
    """The pool to run batches on, entered on ``stack``, and where it runs (for humans).

    Without ``ray_address``, a :class:`RolloutPool` in this process; with it, a
    :class:`~fleetroll.ray_pool.RayRolloutPool` of ``ray_actors`` actors (None:
    one per CPU) on a local Ray (``"local"``) or on the cluster at ``ray_address``.

    Raises:
        ConfigError: Ray is asked for but not installed, or with pool.oversample.
    """
    pool: BatchPool
    if ray_address is None:
        pool = await stack.enter_async_context(
            RolloutPool(settings, api_key=fleet.api_key, base_url=fleet.base_url, events=events)
        )
        return pool, fleet.description
    if settings.pool.oversample:
        raise ConfigError(
            f"pool.oversample = {settings.pool.oversample} needs the local pool:"
            " oversampling is not supported with --ray (set it to 0, or drop --ray)"
        )
    from fleetroll.ray_pool import RayRolloutPool

    on_ray = await stack.enter_async_context(
        RayRolloutPool(
            settings,
            api_key=fleet.api_key,
            base_url=fleet.base_url,
            events=events,
            num_actors=ray_actors,
            address=None if ray_address == "local" else ray_address,
        )
    )
    return on_ray, f"{fleet.description} over {on_ray.num_actors} Ray actors"


async def open_service_pools(
    stack: AsyncExitStack,
    settings: Settings,
    fleet: FleetTarget,
    events: Events,
    *,
    ray_address: str | None = None,
    ray_actors: int | None = None,
) -> tuple[RolloutPool, BatchPool, str]:
    """The pools of ``fleetroll serve``, entered on ``stack``: the pool env sessions
    run on (always this process), the pool batches and MCP rollouts run on (the
    same one, or Ray actors with ``ray_address``), and where they run.

    Both share one admission (on Ray, the cluster's): sessions count against the
    same instance caps and circuit breakers as the batches.
    """
    batch_pool: BatchPool | None = None
    backend = fleet.description
    if ray_address is not None:
        batch_pool, backend = await open_batch_pool(
            stack, settings, fleet, events, ray_address=ray_address, ray_actors=ray_actors
        )
    pool = await stack.enter_async_context(
        RolloutPool(
            settings,
            api_key=fleet.api_key,
            base_url=fleet.base_url,
            events=events,
            admission=batch_pool.admission if batch_pool is not None else None,
        )
    )
    return pool, batch_pool or pool, backend
