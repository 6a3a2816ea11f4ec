"""A pool's rollouts on Ray actors: :class:`RayExecutor`, each actor a LocalExecutor.

DRAFT (branch i28-seam-ray): the pool is the driver's one
:class:`~fleetroll.pool.RolloutPool` (ids, groups, oversampling, resume, the
policy gate, the read model); each actor (:class:`ExecutorWorker`) runs single
rollouts on a :class:`~fleetroll.executor.LocalExecutor` and answers their
views and live events. The driver mirrors its policy gate (version and pauses)
onto every actor and passes the actors' telemetry on. Not yet: a dead actor's
rollouts, traces, sessions on actors.

::

    async with ray_pool(settings, api_key=..., num_actors=2) as pool:
        batch = pool.run_batch(tasks, policy, samples_per_task=8, oversample=2)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import anyio

from fleetroll.env_session import EnvSession
from fleetroll.executor import ExecutorContext, LocalExecutor, RolloutHandle
from fleetroll.mixed_provider import require_fleet_key
from fleetroll.phases import Phase, RolloutView
from fleetroll.policies import Policy
from fleetroll.policy_gate import PolicyGate
from fleetroll.pool import RolloutPool
from fleetroll.progress import RolloutIds
from fleetroll.ray_actors import _Buffer, holder, load_ray
from fleetroll.ray_admission import AdmissionHost, RemoteAdmission
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout_events import EventPage, ended_page
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Event, Events, Redactor

__all__ = ["ExecutorWorker", "RayExecutor", "ray_pool"]

#: How long a driver's take of an actor's telemetry waits for an event.
_TAKE_WAIT_S = 0.5


class ExecutorWorker:
    """A Ray actor's side: single rollouts on a LocalExecutor, views, events, the gate."""

    def __init__(
        self,
        settings: Settings,
        api_key: str | None,
        base_url: str | None,
        limiter: Any,
        index: int,
    ) -> None:
        self._settings = settings
        self._buffer = _Buffer(index)
        admission = RemoteAdmission(limiter, holder(index), settings.timeouts.ray_call_s)
        self._gate = PolicyGate()
        self._pause: AsyncExitStack | None = None
        concurrency = settings.pool.concurrency
        self._context = ExecutorContext(
            Events([self._buffer]),
            admission,
            self._gate,
            anyio.CapacityLimiter(concurrency),
            anyio.CapacityLimiter(concurrency + settings.provisioning.max_concurrent_creates),
        )
        self._executor = LocalExecutor(settings, api_key=api_key, base_url=base_url)
        self._stack: AsyncExitStack | None = None
        self._rollouts: dict[str, RolloutHandle] = {}

    async def start(self) -> int:
        """Open the executor (once); this actor's pid."""
        if self._stack is None:
            stack = AsyncExitStack()
            await stack.enter_async_context(self._executor.open(self._context))
            self._stack = stack
        return os.getpid()

    async def run(
        self, task: TaskSpec, ids: RolloutIds, run_id: str, policy: Policy
    ) -> RolloutResult:
        rollout = self._executor.rollout(task, ids, run_id=run_id)
        self._rollouts[ids.rollout_id] = rollout
        await rollout.execute(policy)
        assert rollout.result is not None
        return rollout.result

    async def stop(self, rollout_id: str, reason: FailureReason, error: str) -> None:
        if (rollout := self._rollouts.get(rollout_id)) is not None:
            rollout.stop(reason, error)

    async def view(self, rollout_id: str, messages: bool) -> RolloutView | None:
        rollout = self._rollouts.get(rollout_id)
        return None if rollout is None else await rollout.read_view(messages=messages)

    async def events(self, rollout_id: str, after: int, wait_s: float) -> EventPage | None:
        rollout = self._rollouts.get(rollout_id)
        return None if rollout is None else await rollout.events(after, wait_s)

    async def forget(self, rollout_id: str) -> None:
        self._rollouts.pop(rollout_id, None)

    async def mirror(self, version: int, paused: bool) -> None:
        """The driver's policy gate, as it is now."""
        self._gate.version = version
        if paused and self._pause is None:
            self._pause = AsyncExitStack()
            await self._pause.enter_async_context(self._gate.paused_calls())
        elif not paused and self._pause is not None:
            pause, self._pause = self._pause, None
            await pause.aclose()

    async def sweep(self, run_id: str) -> None:
        await self._executor.sweep(run_id)

    async def take_events(self, wait_s: float) -> list[Event]:
        buffer = self._buffer
        if not buffer.events:
            with anyio.move_on_after(wait_s):
                await buffer.changed.wait()
        buffer.changed = anyio.Event()
        events, buffer.events = buffer.events, []
        return events


class RayRollout:
    """A rollout running on an actor, as the driver's pool sees it."""

    def __init__(
        self, worker: Any, task: TaskSpec, ids: RolloutIds, run_id: str, call_s: float
    ) -> None:
        self._worker = worker
        self._task = task
        self.ids = ids
        self._run_id = run_id
        self._call_s = call_s
        self.phase = Phase.PENDING
        self.result: RolloutResult | None = None
        self.settle: Callable[[RolloutResult], RolloutResult] | None = None
        self._stop: tuple[FailureReason, str] | None = None

    async def execute(self, policy: Policy) -> None:
        if self._stop is not None:
            self.never_started(*self._stop)
            return
        self.phase = Phase.PROVISIONING
        ref = self._worker.run.remote(self._task, self.ids, self._run_id, policy)
        try:
            result = await ref
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._call_s):
                why = self._stop or (FailureReason.CANCELLED, "the rollout was cancelled")
                await self._worker.stop.remote(self.ids.rollout_id, *why)
                self._end(await ref)
            raise
        self._end(result)

    def _end(self, result: RolloutResult) -> None:
        self.phase = Phase.DONE
        self.result = result if self.settle is None else self.settle(result)

    def stop(self, reason: FailureReason, error: str) -> None:
        if self._stop is None:
            self._stop = (reason, error)
        self._worker.stop.remote(self.ids.rollout_id, reason, error)

    @property
    def stop_reason(self) -> tuple[FailureReason, str] | None:
        return self._stop

    def never_started(self, reason: FailureReason, error: str) -> RolloutResult:
        task = self._task
        self._end(
            RolloutResult(
                rollout_id=self.ids.rollout_id,
                batch_id=self.ids.batch_id,
                task_key=task.key,
                sample_index=self.ids.sample_index,
                group_id=self.ids.group_id,
                env_key=task.env_key,
                env_version=task.env_version,
                modality=task.modality,
                status="failed",
                failure_reason=reason,
                error=error,
            )
        )
        assert self.result is not None
        return self.result

    async def read_view(self, *, messages: bool = True) -> RolloutView:
        with anyio.fail_after(self._call_s):
            view: RolloutView | None = await self._worker.view.remote(self.ids.rollout_id, messages)
        if view is None:
            return RolloutView(self.ids, self._task.key, self.phase, 0, (), self.result)
        if self.result is not None:  # the driver's (settled) result is the one that counts
            view = RolloutView(
                view.ids, view.task_key, view.phase, view.steps, view.messages, self.result
            )
        return view

    async def events(self, after: int, wait_s: float) -> EventPage:
        with anyio.fail_after(self._call_s + wait_s):
            page: EventPage | None = await self._worker.events.remote(
                self.ids.rollout_id, after, wait_s
            )
        if page is None and self.result is not None:
            return ended_page(after, self.result)
        return page or EventPage((), 0, False)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return []  # traces of rollouts on actors: not yet

    @property
    def redactor(self) -> Redactor:
        return Redactor()


class RayExecutor:
    """Runs a pool's rollouts on Ray actors (see the module docstring).

    Made by :func:`ray_pool`, which starts the actors and the cluster's
    admission first (the pool's admission is the cluster's).
    """

    def __init__(
        self, settings: Settings, workers: list[Any], api_key: str | None, base_url: str | None
    ) -> None:
        self.settings = settings
        self.workers = workers
        self._api_key = api_key
        self._local = LocalExecutor(settings, api_key=api_key, base_url=base_url)
        self._next = itertools.cycle(range(len(workers)))

    @asynccontextmanager
    async def open(self, context: ExecutorContext) -> AsyncIterator[None]:
        async with self._local.open(context), anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(self._pass_events, worker, context.events)
            tg.start_soon(self._mirror, context.policy_gate)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def _mirror(self, gate: PolicyGate) -> None:
        while True:
            seen = gate.generation
            with anyio.fail_after(self.settings.timeouts.ray_call_s):
                for worker in self.workers:
                    await worker.mirror.remote(gate.version, gate.paused)
            if gate.generation == seen:
                await gate.changed()

    async def _pass_events(self, worker: Any, events: Events) -> None:
        while True:
            for event in await worker.take_events.remote(_TAKE_WAIT_S):
                events.emit(event.name, level=event.level, **dict(event.attributes))

    def check_tasks(self, tasks: Sequence[TaskSpec]) -> None:
        require_fleet_key(tasks, self._api_key)

    def rollout(self, task: TaskSpec, ids: RolloutIds, *, run_id: str) -> RolloutHandle:
        worker = self.workers[next(self._next)]
        return RayRollout(worker, task, ids, run_id, self.settings.timeouts.ray_call_s)

    async def sweep(self, run_id: str) -> None:
        await self._local.sweep(run_id)

    def session(
        self, task: TaskSpec, ids: RolloutIds, *, run_id: str
    ) -> AbstractAsyncContextManager[EnvSession]:
        # Sessions are driven from this process: they run here, under the pool's limits.
        return self._local.session(task, ids, run_id=run_id)


@asynccontextmanager
async def ray_pool(
    settings: Settings,
    *,
    api_key: str | None,
    base_url: str | None = None,
    events: Events | None = None,
    num_actors: int = 2,
    address: str | None = None,
) -> AsyncIterator[RolloutPool]:
    """One RolloutPool whose rollouts run on ``num_actors`` Ray actors."""
    ray = load_ray()
    async with AsyncExitStack() as stack:
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            stack.callback(ray.shutdown)
        limiter = ray.remote(num_cpus=0, max_concurrency=100_000)(AdmissionHost).remote(settings)
        worker_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(ExecutorWorker)
        workers = [
            worker_cls.remote(settings, api_key, base_url, limiter, n) for n in range(num_actors)
        ]
        stack.callback(lambda: [ray.kill(a) for a in [*workers, limiter]])
        with anyio.fail_after(settings.timeouts.ray_call_s * 10):
            for worker in workers:
                await worker.start.remote()
        admission = RemoteAdmission(limiter, "driver", settings.timeouts.ray_call_s)
        events = events or Events()
        await stack.enter_async_context(admission.followed(events))
        pool = RolloutPool(
            settings,
            api_key=api_key,
            base_url=base_url,
            events=events,
            admission=admission,
            executor=RayExecutor(settings, workers, api_key, base_url),
        )
        yield await stack.enter_async_context(pool)
