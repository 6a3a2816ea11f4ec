"""A test double of :class:`fleetroll.pool.executor.Executor`: rollouts that run nothing.

It drives a :class:`~fleetroll.pool.rollout_pool.RolloutPool` in unit tests of what the
pool owns (ids, groups and oversampling, resume, the policy gate,
cancellation) without instances, MCP servers or a policy::

    executor = FakeExecutor(hold=True)
    async with RolloutPool(settings, executor=executor) as pool:
        batch = pool.run_batch(tasks, policy, samples_per_task=2, oversample=1)
        await executor.started(rid)          # it runs...
        executor.finish(rid, reward=1.0)     # ...and ends scored

Each fake rollout passes the pool's policy gate once (waiting out a pause,
recording the version on its one turn, as a policy call would), then ends
with ``rewards(ids)`` at once, or, with ``hold``, when the test calls
:meth:`FakeExecutor.finish`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from fleetroll.policies import Policy
from fleetroll.pool.executor import Executor, ExecutorContext, RolloutHandle
from fleetroll.results import FailureReason, RolloutResult, Turn
from fleetroll.rollout.env_session import EnvSession
from fleetroll.rollout.events import EventPage, RolloutEventLog
from fleetroll.rollout.phases import Phase, RolloutView
from fleetroll.rollout.progress import RolloutIds
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Redactor

__all__ = ["FakeExecutor", "FakeRollout"]


class FakeRollout:
    """One rollout of a :class:`FakeExecutor`: a :class:`~fleetroll.pool.executor.RolloutHandle`."""

    def __init__(
        self, executor: FakeExecutor, task: TaskSpec, ids: RolloutIds, run_id: str
    ) -> None:
        self._executor = executor
        self.task = task
        self.ids = ids
        self.run_id = run_id
        self.phase = Phase.PENDING
        self.result: RolloutResult | None = None
        self.settle: Callable[[RolloutResult], RolloutResult] | None = None
        self.live = RolloutEventLog(cap=100, preview_chars=100, redact=lambda s: s)
        self.started = anyio.Event()
        self._end: tuple[float | None, FailureReason | None] | None = None
        self._ended = anyio.Event()
        self._scope = anyio.CancelScope()
        self._stop: tuple[FailureReason, str] | None = None

    async def execute(self, policy: Policy) -> None:
        context = self._executor.context
        try:
            with self._scope:
                async with context.instances:
                    self._enter(Phase.ACTING)
                    self._executor.ran.append(self.ids.rollout_id)
                    self.started.set()
                    version, _ = await context.policy_gate.admit()
                    if self._executor.hold:
                        await self._ended.wait()
                    reward, reason = self._end or (self._executor.rewards(self.ids), None)
                    self._conclude(reward, reason, "the test failed it", version)
        except anyio.get_cancelled_exc_class():
            if self.result is None and self.phase is not Phase.PENDING:
                reason, error = self._stop or (FailureReason.CANCELLED, "the rollout was cancelled")
                self._conclude(None, reason, error, None)
            raise
        if self.result is None:
            reason, error = self._stop or (FailureReason.CANCELLED, "cancelled before it started")
            self._conclude(None, reason, error, None)

    def finish(self, reward: float | None, reason: FailureReason | None) -> None:
        self._end = (reward, reason)
        self._ended.set()

    def stop(self, reason: FailureReason, error: str) -> None:
        if self._stop is None:
            self._stop = (reason, error)
        self._executor.stopped.append(self.ids.rollout_id)
        self._scope.cancel()

    @property
    def stop_reason(self) -> tuple[FailureReason, str] | None:
        return self._stop

    def never_started(self, reason: FailureReason, error: str) -> RolloutResult:
        return self._conclude(None, reason, error, None)

    async def read_view(self, *, messages: bool = True) -> RolloutView:
        steps = 0 if self.result is None else self.result.steps
        return RolloutView(self.ids, self.task.key, self.phase, steps, (), self.result)

    async def events(self, after: int, wait_s: float) -> EventPage:
        return await self.live.page(after, wait_s)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return []

    @property
    def redactor(self) -> Redactor:
        return Redactor()

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.live.observe(self)

    def _conclude(
        self, reward: float | None, reason: FailureReason | None, error: str, version: int | None
    ) -> RolloutResult:
        result = RolloutResult(
            rollout_id=self.ids.rollout_id,
            batch_id=self.ids.batch_id,
            task_key=self.task.key,
            sample_index=self.ids.sample_index,
            group_id=self.ids.group_id,
            env_key=self.task.env_key,
            modality=self.task.modality,
            status="completed" if reason is None else "failed",
            failure_reason=reason,
            error=None if reason is None else error,
            reward=reward,
            steps=0 if version is None else 1,
            turns=[] if version is None else [Turn(index=0, policy_version=version)],
        )
        self._enter(Phase.DONE)
        self.result = result if self.settle is None else self.settle(result)
        self.live.end(self.result)
        return self.result


class FakeExecutor:
    """Runs nothing: each rollout passes the policy gate, then ends as scripted.

    Args:
        rewards: the reward of a rollout that ends on its own (default 1.0).
        hold: rollouts wait for :meth:`finish` (or a stop, or cancellation).
        capacity: rollouts it has room for at once (:attr:`Executor.capacity`).
    """

    def __init__(
        self,
        rewards: Callable[[RolloutIds], float | None] = lambda ids: 1.0,
        *,
        hold: bool = False,
        capacity: float = math.inf,
    ) -> None:
        self.rewards = rewards
        self.hold = hold
        self._capacity = capacity
        #: Every rollout made, by id.
        self.rollouts: dict[str, FakeRollout] = {}
        #: Ids of the rollouts that started running, in order.
        self.ran: list[str] = []
        #: Ids of the rollouts the pool stopped.
        self.stopped: list[str] = []
        #: The run ids swept, in order.
        self.swept: list[str] = []
        self._context: ExecutorContext | None = None

    @property
    def context(self) -> ExecutorContext:
        if self._context is None:
            raise RuntimeError("the executor is not open")
        return self._context

    @asynccontextmanager
    async def open(self, context: ExecutorContext) -> AsyncIterator[None]:
        self._context = context
        try:
            yield
        finally:
            self._context = None

    def check_tasks(self, tasks: Sequence[TaskSpec]) -> None:
        return None

    def rollout(self, task: TaskSpec, ids: RolloutIds, *, run_id: str) -> RolloutHandle:
        rollout = FakeRollout(self, task, ids, run_id)
        self.rollouts[ids.rollout_id] = rollout
        return rollout

    @property
    def capacity(self) -> float:
        return self._capacity

    async def started(self, rollout_id: str) -> None:
        """Wait until the rollout runs."""
        await self.rollouts[rollout_id].started.wait()

    def finish(
        self, rollout_id: str, *, reward: float | None = 1.0, reason: FailureReason | None = None
    ) -> None:
        """End a held rollout with ``reward`` (``reason``: as that failure)."""
        self.rollouts[rollout_id].finish(reward, reason)

    async def sweep(self, run_id: str) -> None:
        self.swept.append(run_id)

    async def gate_synced(self) -> None:
        pass  # its rollouts make no policy calls

    @asynccontextmanager
    async def session(
        self, task: TaskSpec, ids: RolloutIds, *, run_id: str
    ) -> AsyncIterator[EnvSession]:
        raise NotImplementedError("FakeExecutor runs no sessions: use a LocalExecutor")
        yield  # pragma: no cover


if TYPE_CHECKING:  # the double is an Executor, as mypy sees it
    _IS_AN_EXECUTOR: Executor = FakeExecutor()
