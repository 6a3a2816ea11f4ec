"""A pool's batches: ids, a batch's result stream and groups, and the map that
forgets finished batches.

:class:`Batch` is what :meth:`fleetroll.pool.rollout_pool.RolloutPool.run_batch` returns;
:class:`ResultStream`, :class:`BatchMap` and the checks are its parts (on Ray
too: one pool, :mod:`fleetroll.pool.ray.executor`). A batch yields exactly one result
per rollout id, whatever happens to the rollout.
"""

from __future__ import annotations

import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self, TypeVar

import anyio
from anyio.lowlevel import checkpoint

from fleetroll.environments.fleet.traces import TraceUploader
from fleetroll.errors import PoolFullError
from fleetroll.pool.executor import RolloutHandle
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.events import EventPage
from fleetroll.rollout.phases import Phase, RolloutView
from fleetroll.tasks import TaskSpec
from fleetroll.training.groups import Completion, Group, GroupTracker, superseded_error

__all__ = [
    "Batch",
    "BatchCounts",
    "BatchMap",
    "ResultStream",
    "check_capacity",
    "check_unique_keys",
    "group_id",
    "rollout_id",
]

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
    """A snapshot of a batch, for progress displays. ``failed`` leaves out the
    ``cancelled`` (:attr:`RolloutResult.outcome`)."""

    total: int
    queued: int
    provisioning: int
    running: int
    done: int
    failed: int
    cancelled: int = 0

    @property
    def finished(self) -> int:
        return self.done + self.failed + self.cancelled


class ResultStream:
    """Results of a batch, each delivered once, read as an async iterator.

    The buffer holds the whole batch: a result is never held back, so an
    instance is never held waiting for a slow reader. Once the stream is closed
    and read to its end, it is ``drained`` and calls its ``on_drained`` callbacks.

    A plain buffer and an event, not a memory object stream: a batch whose
    reader was cancelled mid-way (a trainer's time-out) is left unread, and
    an unread memory object stream complains when the collector finds it.
    """

    batch_id: str

    def __init__(self, size: int) -> None:
        self._expected = size
        self._buffer: deque[RolloutResult] = deque()
        self._arrived = anyio.Event()
        self.delivered: set[str] = set()
        self.finished = anyio.Event()
        self.drained = False
        self.on_drained: list[Callable[[], None]] = []

    def deliver(self, result: RolloutResult) -> None:
        """Pass a result on, unless one with its id already was (exactly once)."""
        if result.rollout_id in self.delivered:
            return
        if self.finished.is_set():
            raise anyio.ClosedResourceError(f"batch {self.batch_id} has ended")
        self.delivered.add(result.rollout_id)
        self._buffer.append(result)
        self._arrived.set()

    def close_stream(self) -> None:
        self.finished.set()
        self._arrived.set()

    def unfinished(self) -> int:
        """Rollouts of this batch whose result is not in yet."""
        return 0 if self.finished.is_set() else max(0, self._expected - len(self.delivered))

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RolloutResult:
        await checkpoint()
        while not self._buffer:
            if self.finished.is_set():
                self._mark_drained()
                raise StopAsyncIteration
            if self._arrived.is_set():  # what woke the readers was taken
                self._arrived = anyio.Event()
            await self._arrived.wait()
        return self._buffer.popleft()

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

    async def read(
        self, on_end: Callable[[], None], *, complete_only: bool = False
    ) -> AsyncIterator[Group]:
        seen = 0
        while True:
            while seen < len(self.complete):
                seen += 1
                group = self.complete[seen - 1]
                if group.complete or not complete_only:
                    yield group
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
        rollouts: list[RolloutHandle],
        skipped: int,
        run_id: str | None = None,
        *,
        tracker: GroupTracker | None = None,
        max_in_flight: int | None = None,
        policy_version: int | None = None,
    ) -> None:
        self.batch_id = batch_id
        #: At most this many of its rollouts run at once (None: the pool's limits only).
        self.max_in_flight = max_in_flight
        #: The tag every result of the batch carries (``RolloutResult.policy_version``).
        self.policy_version = policy_version
        self.run_id = run_id or batch_id
        self.rollouts = rollouts
        self.skipped = skipped
        self.scope = anyio.CancelScope()
        super().__init__(len(rollouts))
        self._by_id = {r.ids.rollout_id: r for r in rollouts}
        #: Ids of the rollouts whose task the pool started (the others wait for room).
        self.started: set[str] = set()
        self._tracker = tracker
        self._groups = _Groups()
        #: Where each result's trace goes (``traces.upload``), or None.
        self.traces: TraceUploader | None = None
        for rollout in rollouts:
            rollout.settle = self._settle
        for completion in tracker.start() if tracker else ():
            self._complete(completion)

    @property
    def complete_groups(self) -> list[Group]:
        """The groups complete so far, in completion order."""
        return self._groups.complete

    def groups(self, *, complete_only: bool = False) -> AsyncIterator[Group]:
        """Each group of the batch as soon as it is complete (see :mod:`fleetroll.training.groups`).

        Every group is yielded once (a cancelled batch's groups too, with what
        they had), in completion order; each call reads them from the first.
        ``complete_only``: skip the groups that ended short of
        ``samples_per_task`` scored samples (:attr:`Group.complete` false).
        Reading the groups to their end counts as reading the batch: the pool
        may then forget it (``pool.keep_finished_batches``).
        """
        return self._groups.read(self._mark_drained, complete_only=complete_only)

    def _tagged(self, result: RolloutResult) -> RolloutResult:
        if result.policy_version == self.policy_version:
            return result
        return result.model_copy(update={"policy_version": self.policy_version})

    def deliver(self, result: RolloutResult) -> None:
        if result.rollout_id in self.delivered:
            return
        result = self._tagged(result)
        super().deliver(result)
        if self.traces is not None and (rollout := self._by_id.get(result.rollout_id)):
            self.traces.submit(result, rollout.messages, rollout.redactor)

    def _settle(self, result: RolloutResult) -> RolloutResult:
        """A rollout's result as it is built: its group decides, once, whether it
        counts (:meth:`GroupTracker.settle`), and it is delivered at once, so the
        stream, telemetry and the groups see the same outcome, in the same order."""
        result = self._tagged(result)
        if self._tracker is not None:
            result, completion = self._tracker.settle(result)
            if completion is not None:
                self._complete(completion)
        self.deliver(result)
        return result

    def _complete(self, completion: Completion) -> None:
        group, stop = completion
        for rid in stop:
            rollout, error = self._by_id[rid], superseded_error(group.task_key, group.expected)
            rollout.stop(FailureReason.SUPERSEDED, error)
            if rid not in self.started and rollout.result is None:
                # Still waiting for room: it ends now (its result is delivered as it is built).
                rollout.never_started(FailureReason.SUPERSEDED, error)
        self._groups.add(group)
        # With groups_target: once enough groups are complete, the others are cut.
        for rid, why in self._tracker.cut() if self._tracker else ():
            self._by_id[rid].stop(FailureReason.SUPERSEDED, why)

    def close_stream(self) -> None:
        super().close_stream()
        self._groups.close()

    @property
    def total(self) -> int:
        return len(self.rollouts)

    def counts(self) -> BatchCounts:
        phases = Counter(r.phase for r in self.rollouts)
        results = [r.result for r in self.rollouts if r.result is not None]
        outcomes = Counter(r.outcome for r in results)
        return BatchCounts(
            total=self.total,
            queued=phases[Phase.PENDING],
            provisioning=phases[Phase.PROVISIONING] + phases[Phase.WAITING],
            running=self.total
            - phases[Phase.PENDING]
            - phases[Phase.PROVISIONING]
            - phases[Phase.WAITING]
            - len(results),
            done=outcomes["completed"],
            failed=outcomes["failed"],
            cancelled=outcomes["cancelled"],
        )

    async def view(self, rollout_id: str, *, messages: bool = True) -> RolloutView:
        """What one rollout of the batch is doing (see :meth:`RolloutHandle.view`).

        Raises:
            KeyError: the batch holds no such rollout.
        """
        return await self._by_id[rollout_id].read_view(messages=messages)

    async def events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        """One rollout's live events after cursor ``after``, waiting up to ``wait_s`` for one.

        Raises:
            KeyError: the batch holds no such rollout.
        """
        return await self._by_id[rollout_id].events(after, wait_s)

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
