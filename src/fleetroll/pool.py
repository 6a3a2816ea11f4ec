"""RolloutPool: batches of rollouts for a training controller.

::

    async with RolloutPool(settings, api_key=..., base_url=...) as pool:
        batch = pool.run_batch(tasks, policy, samples_per_task=8)
        async for result in batch:      # each result as soon as its rollout ends
            ...

A batch always yields exactly ``len(tasks) * (samples_per_task + oversample)``
results, one per rollout id: a crash, a timeout or cancellation each still
yields one. :meth:`Batch.groups` yields each task's group of samples as soon
as it is complete (:mod:`fleetroll.groups`).

An asynchronous RL trainer sets :attr:`RolloutPool.policy_version` after each
weight sync (recorded on turns; ``pool.max_staleness`` flags or restarts
rollouts too far behind) and holds new policy calls with
:meth:`RolloutPool.policy_paused` while it swaps weights.

Limits, each a ``CapacityLimiter`` named for what it protects:

* ``instances``: instances held at once (provisioning, waiting or active):
  ``concurrency + max_concurrent_creates``, so instances for waiting rollouts
  are created while others run (provisioning is pipelined);
* ``active``: rollouts acting at once (``pool.concurrency``); a rollout's
  agent clock starts when it gets its slot;
* creates (concurrency and rate), instance caps, Fleet's account limit and
  per-environment circuit breakers: :attr:`RolloutPool.admission`
  (:mod:`fleetroll.admission`), shared by every batch of the pool;
* ``pool.max_queued_rollouts``: rollouts not yet finished across batches; a
  batch that would pass it is refused with :class:`~fleetroll.errors.PoolFullError`.

A pool runs for as long as its controller (days, for a training run), so it
does not keep what it has delivered: ``pool.batches`` holds the running
batches and at most ``pool.keep_finished_batches`` finished ones whose results
were all read, the oldest forgotten first (:meth:`RolloutPool.forget` lets one
go at once).
"""

from __future__ import annotations

import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Self, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from fleetroll._serving import exit_transparently
from fleetroll.admission import AdmissionController
from fleetroll.engine import RolloutEngine
from fleetroll.env_session import EnvSession
from fleetroll.environments import Provider
from fleetroll.errors import PoolFullError
from fleetroll.fleet_traces import TraceUploader, open_trace_uploader
from fleetroll.groups import Completion, Group, GroupTracker
from fleetroll.mixed_provider import MixedProvider
from fleetroll.policies import Policy
from fleetroll.provisioning import CreateGate
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout import Phase, Rollout, RolloutIds, RolloutView
from fleetroll.rollout_events import EventPage
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events

__all__ = ["Batch", "BatchCounts", "BatchMap", "Group", "RolloutPool", "rollout_id"]

_NAMESPACE = uuid.UUID("6c3f2a64-0f8e-4c1e-9d2a-7f1b5e9a4c10")


def rollout_id(batch_id: str, task_key: str, sample_index: int) -> str:
    """The deterministic id of one rollout (the same on every resume)."""
    return uuid.uuid5(_NAMESPACE, f"{batch_id}/{task_key}/{sample_index}").hex


def group_id(batch_id: str, task_key: str) -> str:
    """The id shared by the samples of one task in one batch (a GRPO group)."""
    return uuid.uuid5(_NAMESPACE, f"{batch_id}/{task_key}").hex


def check_unique_keys(tasks: Sequence[TaskSpec]) -> None:
    """Refuse a batch whose tasks share a key (their rollout ids would collide).

    Raises:
        ValueError: naming the key and the two tasks (0-based positions).
    """
    first: dict[str, int] = {}
    for i, task in enumerate(tasks):
        j = first.setdefault(task.key, i)
        if j != i:
            raise ValueError(
                f"duplicate task key {task.key!r} (tasks {j} and {i} of the batch):"
                " keys must be unique within a batch, as in a task file"
            )


@dataclass(frozen=True, slots=True)
class BatchCounts:
    """A snapshot of a batch, for progress displays."""

    total: int
    queued: int
    provisioning: int
    running: int
    done: int
    failed: int

    @property
    def finished(self) -> int:
        return self.done + self.failed


class ResultStream:
    """Results of a batch, each delivered once, read as an async iterator.

    The buffer holds the whole batch: a result is never held back, so an
    instance is never held waiting for a slow reader. Once the stream is closed
    and read to its end, it is ``drained`` and calls its ``on_drained`` callbacks.
    """

    batch_id: str

    def __init__(self, size: int) -> None:
        self._expected = size
        self._send: MemoryObjectSendStream[RolloutResult]
        self._receive: MemoryObjectReceiveStream[RolloutResult]
        self._send, self._receive = anyio.create_memory_object_stream[RolloutResult](
            max_buffer_size=max(1, size)
        )
        self.delivered: set[str] = set()
        self.finished = anyio.Event()
        self.drained = False
        self.on_drained: list[Callable[[], None]] = []

    def __del__(self) -> None:
        # Nobody can read an unreachable batch: one read only through its
        # groups (or not at all) closes its stream quietly as it goes.
        self._receive.close()

    def deliver(self, result: RolloutResult) -> None:
        """Pass a result on, unless one with its id already was (exactly once)."""
        if result.rollout_id in self.delivered:
            return
        self.delivered.add(result.rollout_id)
        self._send.send_nowait(result)

    def close_stream(self) -> None:
        self._send.close()
        self.finished.set()

    def unfinished(self) -> int:
        """Rollouts of this batch whose result is not in yet."""
        return 0 if self.finished.is_set() else max(0, self._expected - len(self.delivered))

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RolloutResult:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._receive.close()
            self._mark_drained()
            raise StopAsyncIteration from None

    def _mark_drained(self) -> None:
        if not self.drained:
            self.drained = True
            for callback in self.on_drained:
                callback()

    async def results(self) -> list[RolloutResult]:
        """Every result, once all rollouts have ended."""
        return [r async for r in self]


B = TypeVar("B", bound=ResultStream)


class BatchMap(dict[str, B]):
    """A pool's batches by id: the running ones, and the last ``keep`` drained ones.

    A batch is kept after its end until its results were all read (its stream
    is drained); then it joins the kept ones, and the oldest of those beyond
    ``keep`` is forgotten.
    """

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self._drained: deque[B] = deque()

    def add(self, batch: B) -> None:
        """Hold a new batch (a finished one of the same id gives way)."""
        self.forget(batch.batch_id)
        self[batch.batch_id] = batch
        batch.on_drained.append(lambda: self._retain(batch))

    def forget(self, batch_id: str) -> None:
        """Let a finished batch go; unknown ids are ignored.

        Raises:
            ValueError: the batch is still running.
        """
        batch = self.get(batch_id)
        if batch is None:
            return
        if not batch.finished.is_set():
            raise ValueError(f"batch {batch_id} is still running: cancel it, or wait for its end")
        del self[batch_id]
        if batch in self._drained:
            self._drained.remove(batch)

    def queued(self) -> int:
        """Rollouts not yet finished, across every batch held."""
        return sum(batch.unfinished() for batch in self.values())

    def _retain(self, batch: B) -> None:
        if self.get(batch.batch_id) is not batch:
            return  # forgotten already, or its id was reused by a newer batch
        self._drained.append(batch)
        while len(self._drained) > self.keep:
            old = self._drained.popleft()
            if self.get(old.batch_id) is old:
                del self[old.batch_id]


def check_capacity(batches: BatchMap[B], requested: int, limit: int) -> None:
    """Refuse a batch that would take the unfinished rollouts past ``limit``.

    Raises:
        PoolFullError: it would.
    """
    queued = batches.queued()
    if queued + requested > limit:
        raise PoolFullError(queued=queued, requested=requested, limit=limit)


class _Groups:
    """A batch's complete groups, in completion order; any number of readers.

    Each reader (:meth:`read`) sees every group once, from the first: a
    group is a small summary of results the batch holds anyway.
    """

    def __init__(self) -> None:
        self.complete: list[Group] = []
        self.closed = False
        self._changed = anyio.Event()

    def add(self, group: Group) -> None:
        self.complete.append(group)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def read(self, on_end: Callable[[], None]) -> AsyncIterator[Group]:
        seen = 0
        while True:
            while seen < len(self.complete):
                seen += 1
                yield self.complete[seen - 1]
            if self.closed:
                on_end()
                return
            await self._changed.wait()


class Batch(ResultStream):
    """A running batch: an async iterator of its results.

    Iterate it to receive results as rollouts end; :meth:`aclose` (or leaving
    ``async with batch``) cancels what is still in flight, and the iterator
    still yields a result for every rollout. :meth:`groups` yields the
    batch's groups as they complete, whether or not the results are read too.
    """

    def __init__(
        self,
        batch_id: str,
        rollouts: list[Rollout],
        skipped: int,
        run_id: str | None = None,
        *,
        tracker: GroupTracker | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.run_id = run_id or batch_id
        self.rollouts = rollouts
        self._by_id = {r.ids.rollout_id: r for r in rollouts}
        self.skipped = skipped
        self.scope = anyio.CancelScope()
        super().__init__(len(rollouts))
        self._by_id = {r.ids.rollout_id: r for r in rollouts}
        self._tracker = tracker
        self._groups = _Groups()
        #: Where each result's trace goes (``traces.upload``), or None.
        self.traces: TraceUploader | None = None
        for completion in tracker.start() if tracker else ():
            self._complete(completion)

    @property
    def complete_groups(self) -> list[Group]:
        """The groups complete so far, in completion order."""
        return self._groups.complete

    def groups(self) -> AsyncIterator[Group]:
        """Each group of the batch as soon as it is complete (see :mod:`fleetroll.groups`).

        Every group is yielded once (a cancelled batch's groups too, with what
        they had), in completion order; each call reads them from the first.
        Reading the groups to their end counts as reading the batch: the pool
        may then forget it (``pool.keep_finished_batches``).
        """
        return self._groups.read(self._mark_drained)

    def deliver(self, result: RolloutResult) -> None:
        if result.rollout_id in self.delivered:
            return
        super().deliver(result)
        if self.traces is not None and (rollout := self._by_id.get(result.rollout_id)):
            self.traces.submit(result, rollout.messages, rollout.engine.redactor)
        if self._tracker is not None:
            completion = self._tracker.add(result)
            if completion is not None:
                self._complete(completion)

    def _complete(self, completion: Completion) -> None:
        group, stop = completion
        for rid in stop:
            self._by_id[rid].stop(
                FailureReason.SUPERSEDED,
                f"its group (task {group.task_key!r}) had its {group.expected} scored samples",
            )
        self._groups.add(group)

    def close_stream(self) -> None:
        super().close_stream()
        self._groups.close()

    @property
    def total(self) -> int:
        return len(self.rollouts)

    def counts(self) -> BatchCounts:
        phases = Counter(r.phase for r in self.rollouts)
        results = [r.result for r in self.rollouts if r.result is not None]
        failed = sum(1 for r in results if r.status == "failed")
        return BatchCounts(
            total=self.total,
            queued=phases[Phase.PENDING],
            provisioning=phases[Phase.PROVISIONING] + phases[Phase.WAITING],
            running=self.total
            - phases[Phase.PENDING]
            - phases[Phase.PROVISIONING]
            - phases[Phase.WAITING]
            - len(results),
            done=len(results) - failed,
            failed=failed,
        )

    async def view(self, rollout_id: str, *, messages: bool = True) -> RolloutView:
        """What one rollout of the batch is doing (see :meth:`Rollout.view`).

        Raises:
            KeyError: the batch holds no such rollout.
        """
        return self._by_id[rollout_id].view(messages=messages)

    async def events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        """One rollout's live events after cursor ``after``, waiting up to ``wait_s`` for one.

        Raises:
            KeyError: the batch holds no such rollout.
        """
        return await self._by_id[rollout_id].live.page(after, wait_s)

    def cancel(self) -> None:
        self.scope.cancel()

    async def aclose(self) -> None:
        """Cancel whatever is still running; results keep coming until all are in."""
        self.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class RolloutPool:
    """Runs batches of rollouts under shared limits. An async context manager.

    ``provider`` replaces Fleet (the emulator's or the real one) with another
    :class:`~fleetroll.environments.Provider` (tests use the in-memory
    :class:`~fleetroll.testing.fake_provider.FakeProvider`); the pool closes it.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        api_key: str,
        base_url: str | None = None,
        events: Events | None = None,
        create_gate: CreateGate | None = None,
        provider: Provider | None = None,
    ) -> None:
        self.settings = settings
        self._provider = provider
        self.events = events or Events()
        self._api_key = api_key
        self._create_gate = create_gate
        self._base_url = base_url
        self._engine: RolloutEngine | None = None
        self._traces: TraceUploader | None = None
        self._tg: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        concurrency = settings.pool.concurrency
        self.active = anyio.CapacityLimiter(concurrency)
        self.instances = anyio.CapacityLimiter(
            concurrency + settings.provisioning.max_concurrent_creates
        )
        #: Instance caps, Fleet's account limit, per-environment breakers (and
        #: the create limits, unless ``create_gate`` holds them cluster-wide).
        self.admission = AdmissionController(settings, self.events)
        #: Running batches, and the last ``pool.keep_finished_batches`` drained ones.
        self.batches = BatchMap[Batch](settings.pool.keep_finished_batches)

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            raise RuntimeError("the pool is not open: use `async with RolloutPool(...)`")
        return self._engine

    @property
    def policy_version(self) -> int:
        """The policy version recorded on turns from now on (the trainer sets it).

        Raises:
            TypeError: (setting) the value is not an int.
        """
        return self.engine.policy_gate.version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.engine.policy_gate.version = value

    def policy_paused(self) -> AbstractAsyncContextManager[None]:
        """Hold new policy calls for the block (a weight swap); pauses nest.

        Calls already running finish; tool calls, provisioning and verification
        go on. The wait is charged to no rollout deadline, only to the batch's
        ``deadline_s``.
        """
        return self.engine.policy_gate.paused_calls()

    async def __aenter__(self) -> Self:
        stack = AsyncExitStack()
        async with stack:
            self._engine = await stack.enter_async_context(
                RolloutEngine.open(
                    self.settings,
                    self.events,
                    self._provider
                    or MixedProvider(
                        self.settings,
                        self.events,
                        api_key=self._api_key,
                        base_url=self._base_url,
                        create_gate=self._create_gate,
                        admission=self.admission,
                    ),
                    self.admission,
                )
            )
            # Entered before the batches' task group: its bounded flush runs after them.
            self._traces = await stack.enter_async_context(
                open_trace_uploader(
                    self.settings, self.events, api_key=self._api_key, base_url=self._base_url
                )
            )
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._cancel_all)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._stack is not None
        try:
            await exit_transparently(self._stack, exc_type, exc, tb)
        finally:
            self._engine = None
            self._tg = None

    async def _cancel_all(self) -> None:
        for batch in self.batches.values():
            batch.cancel()

    def forget(self, batch_id: str) -> None:
        """Let a finished batch go: ``pool.batches`` no longer holds it (nor its transcripts).

        Unknown ids are ignored (the pool may have forgotten it already).

        Raises:
            ValueError: the batch is still running.
        """
        self.batches.forget(batch_id)

    def run_batch(
        self,
        tasks: Sequence[TaskSpec],
        policy: Policy,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
        run_id: str | None = None,
        oversample: int | None = None,
        previous: Sequence[RolloutResult] = (),
    ) -> Batch:
        """Start a batch; iterate the returned :class:`Batch` for its results.

        Args:
            samples_per_task: rollouts per task (a group, for GRPO-style training).
            batch_id: reuse an id to resume a batch (rollout ids are derived from it).
            deadline_s: cancel whatever is still running after this many seconds.
            skip: rollout ids already finished (a resumed batch runs only the rest).
            only: run just these rollout ids (a shard of a larger batch).
            run_id: Fleet's ``run_id`` for the instances (default: the batch id);
                instances left behind are swept by it when the batch ends.
            oversample: extra rollouts per group (default ``pool.oversample``),
                sample indices ``samples_per_task`` and up; a group is complete
                at its first ``samples_per_task`` scored samples and the extras
                still running end as ``superseded``.
            previous: results of this batch's rollouts from an earlier run (a
                resume): they are not run again and count in their groups.

        Raises:
            ValueError: ``samples_per_task`` is below 1, ``oversample`` below 0,
                two tasks share a key, or a batch with this id is still running.
            PoolFullError: the batch would take the pool's unfinished
                rollouts past ``pool.max_queued_rollouts``.
        """
        if self._tg is None:
            raise RuntimeError("the pool is not open: use `async with RolloutPool(...)`")
        if samples_per_task < 1:
            raise ValueError("samples_per_task must be at least 1")
        extra = self.settings.pool.oversample if oversample is None else oversample
        if extra < 0:
            raise ValueError("oversample must be at least 0")
        check_unique_keys(tasks)
        batch_id = batch_id or uuid.uuid4().hex[:12]
        if batch_id in self.batches and not self.batches[batch_id].finished.is_set():
            raise ValueError(f"batch {batch_id} is already running")
        skip = set(skip) | {r.rollout_id for r in previous}
        rollouts = []
        members: dict[str, tuple[str, list[str]]] = {}
        for task in tasks:
            members[group_id(batch_id, task.key)] = (task.key, [])
            for sample in range(samples_per_task + extra):
                rid = rollout_id(batch_id, task.key, sample)
                if rid in skip or (only is not None and rid not in only):
                    continue
                ids = RolloutIds(
                    batch_id=batch_id,
                    rollout_id=rid,
                    sample_index=sample,
                    group_id=group_id(batch_id, task.key),
                )
                members[ids.group_id or ""][1].append(rid)
                rollouts.append(
                    self.engine.rollout(
                        task, ids, run_id=run_id or batch_id, gate=lambda: self.active
                    )
                )
        # A group of this batch is one with a rollout here or a result from before
        # (a shard, ``only``, holds some groups only).
        before = {r.group_id for r in previous}
        members = {gid: m for gid, m in members.items() if m[1] or gid in before}
        check_capacity(self.batches, len(rollouts), self.settings.pool.max_queued_rollouts)
        batch = Batch(
            batch_id,
            rollouts,
            skipped=len(tasks) * (samples_per_task + extra) - len(rollouts),
            run_id=run_id or batch_id,
            tracker=GroupTracker(batch_id, samples_per_task, members, previous),
        )
        if deadline_s is not None:
            batch.scope.deadline = anyio.current_time() + deadline_s
        batch.traces = self._traces
        self.batches.add(batch)
        self._tg.start_soon(self._run_batch, batch, policy)
        return batch

    async def _run_batch(self, batch: Batch, policy: Policy) -> None:
        e = self.engine
        e.events.emit(
            "fleet_batch_started",
            batch_id=batch.batch_id,
            rollouts=batch.total,
            concurrency=self.settings.pool.concurrency,
        )
        try:
            with batch.scope:
                async with anyio.create_task_group() as tg:
                    for rollout in batch.rollouts:
                        tg.start_soon(self._one, batch, rollout, policy)
        finally:
            # Rollouts cancelled before they started still get their result.
            for rollout in batch.rollouts:
                if rollout.result is None:
                    reason, error = rollout.stop_reason or (
                        FailureReason.CANCELLED,
                        "the batch was cancelled before this rollout started",
                    )
                    batch.deliver(rollout.never_started(reason, error))
            batch.close_stream()
            # Instances of this batch no rollout knows about carry its run_id.
            await self.engine.provider.sweep(batch.run_id)
            statuses = Counter(
                (r.result.failure_reason.value if r.result.failure_reason else "completed")
                for r in batch.rollouts
                if r.result is not None
            )
            e.events.emit(
                "fleet_batch_completed",
                batch_id=batch.batch_id,
                rollouts=batch.total,
                counts=dict(statuses),
            )

    async def _one(self, batch: Batch, rollout: Rollout, policy: Policy) -> None:
        try:
            # rollout.stop() (its group is complete) cancels just this rollout.
            with rollout.stop_scope:
                async with self.instances:
                    await rollout.run(policy)
        except anyio.get_cancelled_exc_class():
            if rollout.result is not None:
                batch.deliver(rollout.result)
            raise
        except Exception as exc:  # the rollout's own boundary failed: still one result
            if rollout.result is None:
                rollout.never_started(FailureReason.INIT_ERROR, f"fleetroll bug: {exc!r}")
        if rollout.result is None:  # stopped while it waited for an instance slot
            reason, error = rollout.stop_reason or (
                FailureReason.CANCELLED,
                "the rollout was cancelled before it started",
            )
            rollout.never_started(reason, error)
        assert rollout.result is not None
        batch.deliver(rollout.result)

    @asynccontextmanager
    async def session(
        self, task: TaskSpec, *, batch_id: str | None = None, sample_index: int = 0
    ) -> AsyncIterator[EnvSession]:
        """An env-style session (``reset``/``step``/``close``) under the pool's limits."""
        batch_id = batch_id or "sessions"
        ids = RolloutIds(
            batch_id=batch_id,
            sample_index=sample_index,
            rollout_id=uuid.uuid4().hex,
            group_id=group_id(batch_id, task.key),
        )
        async with (
            self.instances,
            self.engine.session(task, ids, run_id=batch_id, gate=lambda: self.active) as env,
        ):
            yield env
