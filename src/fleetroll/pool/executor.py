"""The seam under :class:`~fleetroll.pool.rollout_pool.RolloutPool`: what runs its rollouts.

As an HTTP client sends requests through a transport, a pool runs rollouts
through an :class:`Executor`. The pool decides *what* runs (ids, groups and
oversampling, resume, the policy gate, admission, the read model of its
batches); the executor only makes rollouts, runs them, and reports them
through a :class:`RolloutHandle`: its phase, its result (exactly one,
whatever happens), a view and its live events.

::

    pool = RolloutPool(settings, executor=LocalExecutor(settings, api_key=...))

What the pool hands an executor when it opens is an :class:`ExecutorContext`
(telemetry, admission, the policy gate, the limits); an executor keeps
nothing of its own about batches. :class:`LocalExecutor` runs rollouts in
this process; the test double is
:class:`fleetroll.testing.fake_executor.FakeExecutor`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from fleetroll.environments.admission import Admission
from fleetroll.environments.fleet.warm import open_warm_pool
from fleetroll.environments.mixed import require_fleet_key
from fleetroll.environments.provider import Provider
from fleetroll.policies import Policy
from fleetroll.policies.gate import PolicyGate
from fleetroll.pool.assembly import mixed_provider, rollout_config
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.env_session import EnvSession
from fleetroll.rollout.events import EventPage
from fleetroll.rollout.phases import Phase, RolloutView
from fleetroll.rollout.progress import RolloutIds
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events, Redactor

__all__ = ["Executor", "ExecutorContext", "LocalExecutor", "RolloutHandle"]


@dataclass(frozen=True, slots=True)
class ExecutorContext:
    """What a pool shares with its executor while it is open."""

    events: Events
    #: Create limits, instance caps, breakers: told how each rollout ended.
    admission: Admission
    #: The version recorded on turns, and the trainer's pause on policy calls.
    policy_gate: PolicyGate
    #: Rollouts acting at once (``pool.concurrency``), entered once an instance is ready.
    active: anyio.CapacityLimiter
    #: Instances held at once (provisioning, waiting or active).
    instances: anyio.CapacityLimiter


class RolloutHandle(Protocol):
    """One rollout as its pool sees it, wherever it runs."""

    @property
    def ids(self) -> RolloutIds: ...

    @property
    def phase(self) -> Phase: ...

    #: Set once it ended (through :attr:`settle`), then never changed.
    result: RolloutResult | None
    #: The pool's last word on the result as it is built, before anyone sees
    #: it (its group's: whether it counts, :mod:`fleetroll.training.groups`).
    settle: Callable[[RolloutResult], RolloutResult] | None

    async def execute(self, policy: Policy) -> None:
        """Run it to its end with ``policy``: on return, :attr:`result` is set.

        :meth:`stop` ends it early (as the reason given); a rollout stopped
        before it started gets its result too. Cancellation records a
        ``cancelled`` result where one can be and is raised again.
        """

    def stop(self, reason: FailureReason, error: str) -> None:
        """End it early, from another task: it ends as ``reason``."""

    @property
    def stop_reason(self) -> tuple[FailureReason, str] | None: ...

    def never_started(self, reason: FailureReason, error: str) -> RolloutResult:
        """The result of a rollout that never ran (its batch ended first)."""

    async def read_view(self, *, messages: bool = True) -> RolloutView:
        """What it is doing now (or its result), wherever it runs."""

    async def events(self, after: int, wait_s: float) -> EventPage:
        """Its live events after cursor ``after``, waiting up to ``wait_s`` for one."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Its transcript (for the trace of its result)."""

    @property
    def redactor(self) -> Redactor:
        """What its strings go through before they leave (every secret it knows)."""


class Executor(Protocol):
    """Runs a pool's rollouts; knows nothing of batches, groups or resume.

    The pool enters :meth:`open` once, and calls the rest only while it is open.
    """

    def open(self, context: ExecutorContext) -> AbstractAsyncContextManager[None]:
        """Get ready to run rollouts (open the provider); on exit, let everything go."""

    def check_tasks(self, tasks: Sequence[TaskSpec]) -> None:
        """Refuse, before a batch starts, tasks this executor cannot run.

        Raises:
            ConfigError: which task, and what to do.
        """

    def rollout(self, task: TaskSpec, ids: RolloutIds, *, run_id: str) -> RolloutHandle:
        """A rollout, not started (:meth:`RolloutHandle.execute` runs it)."""

    @property
    def capacity(self) -> float:
        """How many rollouts it can have under way at once (while open): the pool
        starts no more, so a large batch's others wait as handles, not tasks."""

    async def sweep(self, run_id: str) -> None:
        """Release instances tagged ``run_id`` that no rollout holds (a batch ended)."""

    async def gate_synced(self) -> None:
        """Return once every place policy calls start in has the pool's policy
        gate as it is now (the pool awaits it entering and leaving a pause).

        Raises:
            OperationTimeout: a live place did not confirm in time.
        """

    def session(
        self, task: TaskSpec, ids: RolloutIds, *, run_id: str
    ) -> AbstractAsyncContextManager[EnvSession]:
        """An env-style session (``reset``/``step``/``close``) under the pool's limits.

        Raises:
            ToolsError, ProvisionError: the environment could not be set up.
        """


_Limit = Callable[[], AbstractAsyncContextManager[Any]]


class LocalExecutor:
    """Runs rollouts in this process, over a provider (default: Fleet and MCP servers).

    ``provider`` replaces Fleet with another
    :class:`~fleetroll.environments.provider.Provider` (tests use the in-memory
    :class:`~fleetroll.testing.fake_provider.FakeProvider`); the executor closes it.
    Without one, ``api_key`` is Fleet's: without it, Fleet tasks are refused.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        provider: Provider | None = None,
    ) -> None:
        self.settings = settings
        self._api_key = api_key
        self._base_url = base_url
        self._provider = provider
        self._engine: RolloutEngine | None = None
        self._context: ExecutorContext | None = None
        #: The rollouts' ``gate`` and ``hold`` (while open).
        self._limits: tuple[_Limit, _Limit] | None = None

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            raise RuntimeError("the pool is not open: use `async with RolloutPool(...)`")
        return self._engine

    @asynccontextmanager
    async def open(self, context: ExecutorContext) -> AsyncIterator[None]:
        ours = mixed_provider(
            self.settings,
            context.events,
            api_key=self._api_key,
            base_url=self._base_url,
            admission=context.admission,
        )
        provider = self._provider or ours
        async with AsyncExitStack() as stack:
            if self.settings.provisioning.reuse:
                # Instances go from one rollout to the next (and the next batch's).
                provider = await stack.enter_async_context(
                    open_warm_pool(
                        provider,
                        context.events,
                        provisioning=self.settings.provisioning,
                        timeouts=self.settings.timeouts,
                        modalities=self.settings.modalities,
                    )
                )
            self._engine = await stack.enter_async_context(
                RolloutEngine.open(
                    rollout_config(self.settings),
                    context.events,
                    provider,
                    context.admission,
                    policy_gate=context.policy_gate,
                )
            )
            if self._provider is None:  # ours (under a warm pool or not): heartbeats
                # stop before it closes
                await stack.enter_async_context(ours.running())
            self._context = context
            # One pair of callables for every rollout, not a pair each.
            self._limits = (lambda: context.active), (lambda: context.instances)
            try:
                yield
            finally:
                self._engine = self._context = self._limits = None

    def check_tasks(self, tasks: Sequence[TaskSpec]) -> None:
        if self._provider is None:
            require_fleet_key(tasks, self._api_key)

    def rollout(self, task: TaskSpec, ids: RolloutIds, *, run_id: str) -> RolloutHandle:
        self._opened()
        assert self._limits is not None
        gate, hold = self._limits
        return self.engine.rollout(task, ids, run_id=run_id, gate=gate, hold=hold)

    @property
    def capacity(self) -> float:
        # A rollout holds an instance slot from its start (``hold``).
        return self._opened().instances.total_tokens

    async def sweep(self, run_id: str) -> None:
        await self.engine.provider.sweep(run_id)

    async def gate_synced(self) -> None:
        pass  # policy calls start in this process, on the pool's gate itself

    @asynccontextmanager
    async def session(
        self, task: TaskSpec, ids: RolloutIds, *, run_id: str
    ) -> AsyncIterator[EnvSession]:
        context = self._opened()
        async with (
            context.instances,
            self.engine.session(task, ids, run_id=run_id, gate=lambda: context.active) as env,
        ):
            yield env

    def _opened(self) -> ExecutorContext:
        if self._context is None:
            raise RuntimeError("the pool is not open: use `async with RolloutPool(...)`")
        return self._context
