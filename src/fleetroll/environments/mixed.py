"""One provider for batches that mix Fleet tasks and ``mcp`` tasks.

:class:`MixedProvider` is itself a :class:`fleetroll.environments.provider.Provider`:
a task with an ``environment`` goes to :class:`~fleetroll.environments.mcp.provider.McpProvider`,
any other to :class:`~fleetroll.environments.fleet.provider.FleetProvider`, and every later
call goes to the provider that made the instance. Each is built on first
use, so a file of only ``mcp`` tasks never builds the Fleet one (no Fleet
HTTP clients, no calls to Fleet) and needs no Fleet ``api_key``: without
one, the first Fleet task is refused with a :class:`~fleetroll.errors.ConfigError`
(:func:`require_fleet_key`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
from anyio.abc import TaskGroup

from fleetroll.environments.admission import Admission
from fleetroll.environments.fleet.provider import FleetConfig, FleetProvider
from fleetroll.environments.mcp.provider import McpConfig, McpHandle, McpProvider
from fleetroll.environments.provider import Instance, Provider, Verdict
from fleetroll.errors import ConfigError
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.tools.routing import Route
from fleetroll.tools.session import ToolSession

__all__ = ["MixedProvider", "require_fleet_key"]


def require_fleet_key(tasks: Sequence[TaskSpec], api_key: str | None) -> None:
    """Refuse Fleet tasks (those without an ``environment``) when there is no Fleet key.

    Raises:
        ConfigError: a task is a Fleet task and ``api_key`` is None; the
            message names the first such task and both ways out.
    """
    if api_key is not None:
        return
    for task in tasks:
        if task.environment is None:
            raise ConfigError(
                f"task {task.key!r} runs on Fleet (it has no 'environment') but the pool has"
                " no Fleet api_key: pass api_key= (FLEET_API_KEY) to the pool, or give the"
                " task an 'environment' to run it on an MCP server"
            )


class MixedProvider:
    """Fleet for Fleet tasks, :class:`McpProvider` for tasks with an ``environment``.

    Takes each one's config (``fleet``, ``mcp``) and :class:`FleetProvider`'s
    other arguments; ``api_key`` may be None when no task is a Fleet task.
    """

    def __init__(
        self,
        events: Events,
        *,
        fleet: FleetConfig,
        mcp: McpConfig,
        api_key: str | None = None,
        base_url: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._fleet_config = fleet
        self._mcp_config = mcp
        self._events = events
        self._api_key = api_key
        self._base_url = base_url
        self._admission = admission
        self._fleet: FleetProvider | None = None
        self._mcp: McpProvider | None = None
        self._background: TaskGroup | None = None

    @property
    def fleet(self) -> FleetProvider:
        """The Fleet provider (built on first use).

        Raises:
            ConfigError: the provider has no Fleet ``api_key``.
        """
        if self._fleet is None:
            if self._api_key is None:
                raise ConfigError(
                    "a Fleet task needs a Fleet api_key (FLEET_API_KEY); this pool has none"
                )
            self._fleet = FleetProvider(
                self._fleet_config,
                self._events,
                api_key=self._api_key,
                base_url=self._base_url,
                admission=self._admission,
            )
            if self._background is not None:
                self._fleet.start(self._background)
        return self._fleet

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """While open, the Fleet provider's background work runs (from when it is
        built): heartbeats keep its instances alive, and creates whose rollout was
        cancelled end there (what they made is released). A pool holds it open; on
        exit those creates are waited for (``timeouts.release_s`` at most), then
        the tags of creates that got no answer are swept (what they may have
        made; ``timeouts.release_s`` twice at most)."""
        try:
            async with anyio.create_task_group() as tg:
                self._background = tg
                if self._fleet is not None:
                    self._fleet.start(tg)
                try:
                    yield
                finally:
                    self._background = None
                    if self._fleet is not None:
                        await self._fleet.settle()  # shielded and bounded
                    tg.cancel_scope.cancel()
        finally:
            if self._fleet is not None:
                await self._fleet.collect_unanswered()  # shielded and bounded

    @property
    def mcp(self) -> McpProvider:
        """The mcp provider (built on first use)."""
        if self._mcp is None:
            self._mcp = McpProvider(self._mcp_config, self._events)
        return self._mcp

    def _for(self, instance: Instance) -> Provider:
        return self.mcp if isinstance(instance.handle, McpHandle) else self.fleet

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        """Each provider's checks on its own tasks (Fleet's only if a task is Fleet's).

        Raises:
            ConfigError: a task is a Fleet task and there is no Fleet ``api_key``.
        """
        require_fleet_key(tasks, self._api_key)
        mcp = [task for task in tasks if task.environment is not None]
        fleet = [task for task in tasks if task.environment is None]
        problems = await self.fleet.preflight(fleet) if fleet else []
        return problems + (await self.mcp.preflight(mcp) if mcp else [])

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        require_fleet_key((task,), self._api_key)
        provider: Provider = self.mcp if task.environment is not None else self.fleet
        return await provider.provision(task, run_id=run_id)

    async def reset(self, instance: Instance, task: TaskSpec) -> None:
        await self._for(instance).reset(instance, task)

    def route(self, instance: Instance, task: TaskSpec) -> Route:
        return self._for(instance).route(instance, task)

    def open_tools(
        self, instance: Instance, route: Route
    ) -> AbstractAsyncContextManager[ToolSession]:
        return self._for(instance).open_tools(instance, route)

    async def verify(self, instance: Instance, task: TaskSpec, final_answer: str | None) -> Verdict:
        return await self._for(instance).verify(instance, task, final_answer)

    async def is_alive(self, instance: Instance) -> bool:
        return await self._for(instance).is_alive(instance)

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        return await self._for(instance).release(instance, reuse=reuse)

    async def sweep(self, run_id: str) -> int:
        released = 0
        for provider in (self._fleet, self._mcp):  # only those built
            if provider is not None:
                released += await provider.sweep(run_id)
        return released

    async def aclose(self) -> None:
        for provider in (self._mcp, self._fleet):
            if provider is not None:
                await provider.aclose()


def _type_check(fleet: FleetConfig, mcp: McpConfig) -> Provider:
    return MixedProvider(Events(), fleet=fleet, mcp=mcp)  # mypy: it satisfies the protocol
