"""One batch the service runs, and its results so far: the record every reader
streams from (a result's cursor is its 1-based index), and the plan that runs
its cancelled rollouts again. :class:`~fleetroll.service.batches.BatchRegistry`
keeps them by id.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

import anyio

from fleetroll.pool.batch import BatchCounts as PoolCounts
from fleetroll.pool.batch_pool import RunningBatch
from fleetroll.pool.rollout_pool import group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.events import EventPage, ended_page
from fleetroll.rollout.phases import Phase, RolloutView
from fleetroll.rollout.progress import RolloutIds
from fleetroll.service.models import BatchCounts, BatchState, BatchStatus, PolicyConfig
from fleetroll.service.requests import batch_fingerprint
from fleetroll.service.state import StoredBatch, StoredRequest, rerun_starts
from fleetroll.service.training import GroupLog
from fleetroll.tasks import TaskSpec

__all__ = ["BatchPlan", "BatchRecord"]

#: A results chunk holds at most this many lines (fewer, larger writes).
_LINES_PER_CHUNK = 64
#: Stands in, in a batch read back, for a journal line that is not a result: it keeps
#: its cursor, and streams skip it as they skip a superseded result.
_UNREADABLE = RolloutResult(
    rollout_id="",
    batch_id="",
    task_key="",
    env_key="",
    modality="",
    status="failed",
    error="a journal line that is not a result",
)


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """What a batch runs: enough to run its cancelled rollouts again."""

    tasks: Sequence[TaskSpec]
    policy: PolicyConfig | None
    samples_per_task: int
    deadline_s: float | None
    oversample: int = 0
    #: The command each rollout runs as its agent (``agent_command``), or None.
    agent_command: tuple[str, ...] | None = None
    #: Once this many groups are complete, the others are cut (``groups_target``).
    groups_target: int | None = None
    #: At most this many of its rollouts at once (its share of the pool), or None.
    max_in_flight: int | None = None
    #: The tag on every result (an evaluation's policy version), or None.
    policy_version: int | None = None

    def rollout_ids(self, batch_id: str) -> set[str]:
        return {
            rollout_id(batch_id, task.key, sample)
            for task in self.tasks
            for sample in range(self.samples_per_task + self.oversample)
        }

    def stored(self, batch_id: str, fingerprint: str) -> StoredRequest:
        """The plan as it is kept on disk (its policy without the api_key)."""
        policy = self.policy.model_copy(update={"api_key": None}) if self.policy else None
        return StoredRequest(
            batch_id=batch_id,
            fingerprint=fingerprint,
            tasks=list(self.tasks),
            policy=policy,
            samples_per_task=self.samples_per_task,
            deadline_s=self.deadline_s,
            oversample=self.oversample,
            agent_command=None if self.agent_command is None else list(self.agent_command),
            groups_target=self.groups_target,
            max_in_flight=self.max_in_flight,
            policy_version=self.policy_version,
        )

    def fingerprint(self) -> str:
        """The request's identity (:func:`fleetroll.service.requests.batch_fingerprint`)."""
        return batch_fingerprint(
            self.tasks,
            self.policy,
            self.samples_per_task,
            self.deadline_s,
            self.oversample,
            self.agent_command,
            self.groups_target,
            max_in_flight=self.max_in_flight,
            policy_version=self.policy_version,
        )

    @classmethod
    def of(cls, request: StoredRequest) -> BatchPlan:
        return cls(
            request.tasks,
            request.policy,
            request.samples_per_task,
            request.deadline_s,
            request.oversample,
            None if request.agent_command is None else tuple(request.agent_command),
            request.groups_target,
            request.max_in_flight,
            request.policy_version,
        )


class _Stored:
    """The :class:`RunningBatch` of a batch read back from disk: nothing runs, results only."""

    def __init__(
        self, batch_id: str, plan: BatchPlan, newest: Callable[[str], RolloutResult | None]
    ):
        self._batch_id = batch_id
        self._rollouts = {
            rollout_id(batch_id, task.key, n): (task.key, n)
            for task in plan.tasks
            for n in range(plan.samples_per_task + plan.oversample)
        }
        self._newest = newest
        self._finished = anyio.Event()
        self._finished.set()

    @property
    def batch_id(self) -> str:
        return self._batch_id

    @property
    def total(self) -> int:
        return len(self._rollouts)

    @property
    def finished(self) -> anyio.Event:
        return self._finished

    def counts(self) -> PoolCounts:
        return PoolCounts(self.total, 0, 0, 0, 0, 0, 0)

    async def view(self, rollout_id: str, *, messages: bool = True) -> RolloutView:
        key, sample = self._rollouts[rollout_id]
        ids = RolloutIds(self._batch_id, rollout_id, sample, group_id(self._batch_id, key))
        result = self._newest(rollout_id)
        if result is None:
            return RolloutView(ids, key, Phase.PENDING, 0, (), None)
        transcript = tuple(result.transcript) if messages else ()
        return RolloutView(ids, key, Phase.DONE, result.steps, transcript, result)

    async def events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        self._rollouts[rollout_id]  # KeyError: not this batch's
        result = self._newest(rollout_id)
        if result is None:
            return EventPage((), missed=0, ended=True)
        return ended_page(after, result)

    def cancel(self) -> None:
        pass  # nothing runs

    async def aclose(self) -> None:
        pass

    def __aiter__(self) -> AsyncIterator[RolloutResult]:
        return _no_results()


async def _no_results() -> AsyncIterator[RolloutResult]:
    return
    yield  # an async generator that yields nothing


class BatchRecord:
    """One batch and its results so far, in arrival order.

    ``results`` only grows (a result's cursor is its index + 1); a result
    replaced by a re-run of its rollout is ``superseded`` and skipped by streams.
    """

    def __init__(self, batch: RunningBatch, fingerprint: str, plan: BatchPlan) -> None:
        self.batch = batch
        self.fingerprint = fingerprint
        self.plan = plan
        self.total = batch.total
        self.results: list[RolloutResult] = []
        self.done = False  # every result is in (or, once interrupted, will not come)
        self.cancel_requested = False
        #: The service is stopping: the ``cancelled`` results of its rollouts are not kept.
        self.interrupting = False
        #: Set once its request is on disk (at once without a store).
        self.saved = anyio.Event()
        #: Why it stopped early: its results could not be kept (a full disk), or None.
        self.error: str | None = None
        self._latest: dict[str, int] = {}  # rollout id → index of its newest result
        self._superseded: set[int] = set()
        self._pending: set[str] = set()  # re-run rollouts whose new result is not in yet
        self._changed = anyio.Event()
        #: Its complete groups, streamed by ``GET /v1/batches/{id}/groups``.
        self.groups = GroupLog(
            batch.batch_id,
            plan.tasks,
            plan.samples_per_task,
            plan.oversample,
            groups_target=plan.groups_target,
        )

    def changed(self) -> anyio.Event:
        """Set at the next change (a result, the end, a re-run)."""
        return self._changed

    @property
    def batch_id(self) -> str:
        return self.batch.batch_id

    @property
    def status(self) -> BatchStatus:
        if not self.done:
            return "running"
        if self.interrupted:
            return "interrupted"
        cancelled = self.cancel_requested or bool(self.cancelled_ids())
        return "cancelled" if cancelled else "finished"

    @property
    def interrupted(self) -> bool:
        """Over without a result for every rollout: the service stopped while it ran,
        or could not keep its results (``error``)."""
        return self.done and (self.error is not None or self.results_in() < self.total)

    @classmethod
    def restored(cls, stored: StoredBatch) -> BatchRecord:
        """A batch read back from disk: its results in their stored order (the same cursors),
        re-runs replayed where they began, every result in."""
        request = stored.request
        plan = BatchPlan.of(request)
        stand_in = _Stored(request.batch_id, plan, lambda rid: None)
        record = cls(stand_in, request.fingerprint, plan)
        stand_in._newest = record.newest_of
        starts = dict(rerun_starts(stored.results, plan.rollout_ids(request.batch_id)))
        for i, result in enumerate(stored.results):
            if i in starts:
                record.rerun(record.batch, set(starts[i]))
            if result is None:  # its cursor is kept; its rollout has no result from it
                record.results.append(_UNREADABLE)
                record._superseded.add(len(record.results) - 1)
            else:
                record.append(result)
        record.saved.set()
        record.finish()
        return record

    def newest_of(self, rollout_id: str) -> RolloutResult | None:
        """The newest result of a rollout (None: none yet, or it runs again)."""
        index = self._latest.get(rollout_id)
        if index is None or index in self._superseded:
            return None
        return self.results[index]

    def newest(self) -> list[RolloutResult]:
        """The newest result of each rollout, in arrival order."""
        return [r for i, r in enumerate(self.results) if i not in self._superseded]

    def cancelled_ids(self) -> set[str]:
        """Rollouts whose newest result is ``cancelled``."""
        return {
            rid
            for rid, i in self._latest.items()
            if self.results[i].failure_reason is FailureReason.CANCELLED
        }

    def results_in(self) -> int:
        """Rollouts with a result that is not waiting to be replaced by a re-run."""
        return len(self._latest) - len(self._pending)

    def state(self) -> BatchState:
        c = self.batch.counts()
        newest = [r for r in self.newest() if r.rollout_id not in self._pending]
        outcomes = Counter(r.outcome for r in newest)
        ended = len(newest)
        return BatchState(
            batch_id=self.batch_id,
            status=self.status,
            cancel_requested=self.cancel_requested,
            counts=BatchCounts(
                total=self.total,
                queued=c.queued,
                provisioning=c.provisioning,
                running=max(0, self.total - c.queued - c.provisioning - ended),
                done=outcomes["completed"],
                failed=outcomes["failed"],
                cancelled=outcomes["cancelled"],
            ),
            results=len(self.results),
            error=self.error,
        )

    def append_all(self, results: Iterable[RolloutResult]) -> None:
        for result in results:
            self.append(result)

    def append(self, result: RolloutResult) -> None:
        self.results.append(result)
        self._latest[result.rollout_id] = len(self.results) - 1
        self._pending.discard(result.rollout_id)
        self.groups.add(result)
        self.notify()

    def rerun(self, batch: RunningBatch, rollout_ids: set[str]) -> None:
        """``batch`` runs ``rollout_ids`` again: their results so far are superseded."""
        for rid in rollout_ids:
            index = self._latest.get(rid)
            if index is not None:
                self._superseded.add(index)
        self._pending = set(rollout_ids)
        self.groups.rerun(rollout_ids, self.newest())
        self.batch = batch
        self.done = False
        self.cancel_requested = False
        self.notify()

    async def wait_done(self) -> None:
        """Wait until every result is in (bound it with a deadline of your own)."""
        while not self.done:
            await self._changed.wait()

    async def wait_cancelled(self) -> None:
        """Wait until a requested cancel has settled (every result in, or a re-run started)."""
        while self.cancel_requested and not self.done:
            await self._changed.wait()

    def finish(self) -> None:
        self.done = True
        self.notify()

    def fail(self, error: str) -> None:
        """Its results can no longer be kept: it ends here, ``interrupted`` with ``error``
        (the results still to come are dropped, never shown)."""
        if self.error is None:
            self.error = error
        self.finish()

    def notify(self) -> None:
        """Wake every waiting reader (each then re-checks what it waits for)."""
        self._changed.set()
        self._changed = anyio.Event()

    def last_line(self, cursor: int) -> bytes:
        """A stream's last line once the batch is over: ``end``, or ``interrupted``
        when rollouts have no result (the batch runs them when resubmitted)."""
        last: dict[str, object]
        if self.interrupted:
            missing = self.total - self.results_in()
            last = {"type": "interrupted", "cursor": cursor, "missing": missing}
            if self.error is not None:
                last["error"] = self.error
        else:
            last = {"type": "end", "cursor": cursor, "status": self.status}
        return (json.dumps(last, separators=(",", ":")) + "\n").encode()

    async def lines(
        self, after: int, *, heartbeat_s: float, stopping: Callable[[], bool]
    ) -> AsyncIterator[bytes]:
        """NDJSON chunks: the results after cursor ``after``, then an end (or interrupted) line.

        Heartbeat lines go out while nothing happens for ``heartbeat_s``.
        ``stopping()`` true (the server is shutting down) ends the stream
        without an end line, so the client knows to reconnect.
        """
        cursor = after
        while True:
            while cursor < len(self.results):
                upto = min(len(self.results), cursor + _LINES_PER_CHUNK)
                chunk = []
                for i in range(cursor, upto):
                    if i in self._superseded:
                        continue  # its rollout ran again: the newer result follows
                    body = self.results[i].model_dump_json()
                    chunk.append(f'{{"type":"result","cursor":{i + 1},"result":{body}}}\n')
                cursor = upto
                if chunk:
                    yield "".join(chunk).encode()
            if self.done:
                yield self.last_line(cursor)
                return
            if stopping():
                return
            changed = self._changed
            with anyio.move_on_after(heartbeat_s) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield f'{{"type":"heartbeat","cursor":{cursor}}}\n'.encode()
