"""One provider for batches that mix Fleet tasks and ``mcp`` tasks.

:class:`MixedProvider` is itself a :class:`fleetroll.environments.Provider`:
a task with an ``environment`` goes to :class:`~fleetroll.mcp_provider.McpProvider`,
any other to :class:`~fleetroll.provisioning.FleetProvider`, and every later
call goes to the provider that made the instance. Each is built on first
use, so a file of only ``mcp`` tasks never builds the Fleet one (no Fleet
HTTP clients, no calls to Fleet).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

from fleetroll.admission import Admission
from fleetroll.environments import Instance, Provider, Verdict
from fleetroll.mcp_provider import McpHandle, McpProvider
from fleetroll.provisioning import FleetProvider
from fleetroll.routing import Route
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.tools import ToolSession

__all__ = ["MixedProvider"]


class MixedProvider:
    """Fleet for Fleet tasks, :class:`McpProvider` for tasks with an ``environment``.

    Takes :class:`FleetProvider`'s arguments.
    """

    def __init__(
        self,
        settings: Settings,
        events: Events,
        *,
        api_key: str,
        base_url: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._settings = settings
        self._events = events
        self._api_key = api_key
        self._base_url = base_url
        self._admission = admission
        self._fleet: FleetProvider | None = None
        self._mcp: McpProvider | None = None

    @property
    def fleet(self) -> FleetProvider:
        """The Fleet provider (built on first use)."""
        if self._fleet is None:
            self._fleet = FleetProvider(
                self._settings,
                self._events,
                api_key=self._api_key,
                base_url=self._base_url,
                admission=self._admission,
            )
        return self._fleet

    @property
    def mcp(self) -> McpProvider:
        """The mcp provider (built on first use)."""
        if self._mcp is None:
            self._mcp = McpProvider(self._settings, self._events)
        return self._mcp

    def _for(self, instance: Instance) -> Provider:
        return self.mcp if isinstance(instance.handle, McpHandle) else self.fleet

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        """Each provider's checks on its own tasks (Fleet's only if a task is Fleet's)."""
        mcp = [task for task in tasks if task.environment is not None]
        fleet = [task for task in tasks if task.environment is None]
        problems = await self.fleet.preflight(fleet) if fleet else []
        return problems + (await self.mcp.preflight(mcp) if mcp else [])

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        provider: Provider = self.mcp if task.environment is not None else self.fleet
        return await provider.provision(task, run_id=run_id)

    async def reset(self, instance: Instance) -> None:
        await self._for(instance).reset(instance)

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

    async def release(self, instance: Instance) -> bool:
        return await self._for(instance).release(instance)

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


def _type_check(settings: Settings) -> Provider:
    return MixedProvider(settings, Events(), api_key="")  # mypy: it satisfies the protocol
