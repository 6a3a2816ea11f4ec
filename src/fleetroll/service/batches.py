"""Batches submitted over HTTP: validation, idempotency, and their results in order.

Each batch's own iterator is consumed by exactly one server-side task, which
appends every result to the batch's :class:`BatchRecord` (a list in arrival
order; a result's cursor is its 1-based index) and wakes whoever waits.
Readers stream from that list, each at its own pace: a slow reader costs
nothing but the list itself (bounded by the batch's size) and never holds a
rollout back, and a reader that reconnects with ``?after=<cursor>`` resumes
exactly where it left off.

Resubmitting a batch (the same request under the same ``batch_id``) after it
ended with cancelled rollouts (a cancel, a deadline) runs those rollouts
again, on the same record: their cancelled results are then skipped by every
stream, so a reader from the start gets one result per rollout, the newest.

With a :class:`~fleetroll.service.state.BatchStore` (``fleetroll serve``),
each batch's request and results are on disk, and a result reaches the
record (and its readers) only once it is: a restarted service reads every
batch back with the same cursors. Rollouts cut short by the service stopping
(a kill, or the cancel at shutdown, whose ``cancelled`` results are not
kept) have no result: the batch is ``interrupted``, its streams say so, and
a resubmission runs exactly the rollouts without a result (and those whose
newest result is ``cancelled``), so no rollout is ever delivered twice.

A write to the store that fails (a full disk) stops the batch at once: it is
``interrupted`` with an ``error`` (its state and its streams' last line say
it), the results it could not write are never shown, and the service takes
no new rollouts until it is restarted (``store_error``; ``/healthz`` answers
503). What readers saw is exactly what is on disk, so after the restart a
resubmission runs the rest and nothing is delivered twice.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, replace

import anyio
from anyio.abc import TaskGroup

from fleetroll.errors import ConfigError, JournalError, PoolFullError, TaskFileError
from fleetroll.policies import Policy
from fleetroll.policies.gateway import Gateway
from fleetroll.pool.batch import BatchCounts as PoolCounts
from fleetroll.pool.batch_pool import BatchPool, RunningBatch
from fleetroll.pool.journal import Journal, journal_line
from fleetroll.pool.rollout_pool import RolloutPool, chat_policy_config, group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.rollout.agent_process import AgentRecords
from fleetroll.rollout.events import EventPage, ended_page
from fleetroll.rollout.phases import Phase, RolloutView
from fleetroll.rollout.progress import RolloutIds
from fleetroll.service.errors import ApiError
from fleetroll.service.guards import refuse_host_commands
from fleetroll.service.metrics import Metrics
from fleetroll.service.models import (
    BatchCounts,
    BatchRequest,
    BatchState,
    BatchStatus,
    PolicyConfig,
)
from fleetroll.service.preflight import BatchPreflight
from fleetroll.service.requests import (
    batch_fingerprint,
    build_policy,
    parse_one,
    parse_records,
    request_settings,
    task_path,
)
from fleetroll.service.state import BatchStore, StoredBatch, StoredRequest, rerun_starts
from fleetroll.service.training import GroupLog
from fleetroll.settings import Settings
from fleetroll.tasks import TaskLimits, TaskSpec, load_task_paths

__all__ = ["BatchRecord", "BatchRegistry", "build_policy", "parse_one", "parse_records"]

_log = logging.getLogger(__name__)
#: A results chunk holds at most this many lines (fewer, larger writes).
_LINES_PER_CHUNK = 64
#: Closing a batch's policy (an HTTP client) after the batch: bounded, shielded.
#: Not a setting: closing a client does no I/O worth waiting for longer.
_POLICY_CLOSE_S = 5.0
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
#: How long a resubmission waits for a cancelled batch's last results before re-running it.
#: Not a setting: a margin over ``timeouts.release_s``, which is one.
_CANCEL_SETTLE_SLACK_S = 5.0


@dataclass(frozen=True, slots=True)
class _Plan:
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
    def of(cls, request: StoredRequest) -> _Plan:
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

    def __init__(self, batch_id: str, plan: _Plan, newest: Callable[[str], RolloutResult | None]):
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
        return PoolCounts(self.total, 0, 0, 0, 0, 0)

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

    def __init__(self, batch: RunningBatch, fingerprint: str, plan: _Plan) -> None:
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
        plan = _Plan.of(request)
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
        failed = sum(1 for r in newest if r.status == "failed")
        done = len(newest) - failed
        return BatchState(
            batch_id=self.batch_id,
            status=self.status,
            cancel_requested=self.cancel_requested,
            counts=BatchCounts(
                total=self.total,
                queued=c.queued,
                provisioning=c.provisioning,
                running=max(0, self.total - c.queued - c.provisioning - done - failed),
                done=done,
                failed=failed,
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


class BatchRegistry:
    """The service's batches, by id, run on ``pool``. Needs a task group (``tg``) before use.

    With a ``store``, its batches are read back (those it restored) and every
    new one and its results are kept there.
    """

    def __init__(
        self,
        pool: BatchPool,
        settings: Settings,
        metrics: Metrics,
        *,
        preflight_pool: RolloutPool,
        store: BatchStore | None = None,
    ) -> None:
        self._pool = pool
        #: Checks new batches first, with the pool of this process (``pool`` may be Ray's).
        self._preflight = BatchPreflight(preflight_pool, settings)
        self._settings = settings
        self._metrics = metrics
        self._records: dict[str, BatchRecord] = {}
        self._finished: deque[str] = deque()
        #: Reading and checking task files and lists: in a worker thread, one at a time.
        #: Not a setting: each is bounded by the service's size limits, and one at
        #: a time leaves the other worker threads to queries and verifiers.
        self._parsing = anyio.CapacityLimiter(1)
        self.tg: TaskGroup | None = None
        #: The gateway of batches' agent commands (with ``service.allow_command_tasks``).
        self.gateway: Gateway | None = None
        #: Where the batches' agent commands are noted (the service's, with a store).
        self.agent_records: AgentRecords | None = None
        self.stopping = False
        #: Called with each record forgotten to make room (see ``keep_finished_batches``).
        self.on_forget: list[Callable[[BatchRecord], None]] = []
        self._store = store
        #: Batch ids whose files are being removed: a new batch of the id waits for it.
        self._removing: dict[str, anyio.Event] = {}
        #: Batches read back from the store at start-up.
        self.restored = 0
        #: Why the store could not be written (a full disk): then no new rollout starts
        #: until the service is restarted. None while it is fine.
        self.store_error: str | None = None
        if store is not None:
            restored, store.restored = store.restored, []  # the records hold them now
            for stored in restored:
                record = BatchRecord.restored(stored)
                self._records[record.batch_id] = record
                self._finished.append(record.batch_id)  # oldest first: forgotten first
            self.restored = len(restored)

    def __iter__(self) -> Iterator[BatchRecord]:
        return iter(list(self._records.values()))

    def get(self, batch_id: str) -> BatchRecord:
        """Raises: ApiError: 404, no such batch (or it was forgotten)."""
        record = self._records.get(batch_id)
        if record is None:
            raise ApiError(404, f"no batch {batch_id!r} (unknown, or finished long ago)")
        return record

    def in_flight(self) -> int:
        return sum(r.total - r.results_in() for r in self._records.values() if not r.done)

    async def submit(self, request: BatchRequest) -> tuple[BatchRecord, bool, int]:
        """Validate and start a batch, or return the identical one already started.

        Returns the record, whether it is new, and how many rollouts of an
        identical earlier batch run again (those that ended cancelled).

        Raises:
            ApiError: 422 (invalid tasks, too many rollouts), 409 (the id is
                taken by a different request), 503 (the pool is full).
        """
        if request.agent_command is not None:
            self._check_agent_command(request.policy)
        tasks = await self._resolve_tasks(request)
        refuse_host_commands(
            tasks,
            allowed=self._settings.service.allow_command_tasks,
            loc=["body", "tasks" if request.tasks is not None else "tasks_file"],
            indexed=request.tasks is not None,
        )
        if request.groups_target is not None and request.groups_target > len(tasks):
            raise ApiError(
                422,
                f"{request.groups_target} groups wanted of a batch of {len(tasks)} tasks (groups):"
                " give at most as many as the tasks",
                loc=["body", "groups_target"],
            )
        limit = self._settings.service.max_batch_rollouts
        oversample = (
            self._settings.pool.oversample if request.oversample is None else request.oversample
        )
        total = len(tasks) * (request.samples_per_task + oversample)
        if total > limit:
            extra = f" + {oversample} oversampled" if oversample else ""
            raise ApiError(
                422,
                f"{len(tasks)} tasks × ({request.samples_per_task} samples{extra}) = {total}"
                " rollouts,"
                f" over this service's limit of {limit} per batch",
                loc=["body", "samples_per_task"],
            )
        return await self.start(
            tasks,
            request.policy,
            samples_per_task=request.samples_per_task,
            batch_id=request.batch_id,
            deadline_s=request.deadline_s,
            oversample=oversample,
            max_in_flight=request.max_in_flight,
            policy_version=request.policy_version,
            loc=["body", "tasks" if request.tasks is not None else "tasks_file"],
            agent_command=request.agent_command,
            groups_target=request.groups_target,
        )

    def _check_agent_command(self, policy: PolicyConfig | None) -> None:
        """Refuse a batch with an agent command unless this service runs them.

        Raises:
            ApiError: 422: ``service.allow_command_tasks`` is false, or the
                batch's policy is not an OpenAI-compatible one.
        """
        loc = ["body", "agent_command"]
        if not self._settings.service.allow_command_tasks:
            raise ApiError(
                422,
                "an agent command runs on the service's host; this service refuses it"
                " (service.allow_command_tasks = false)",
                loc=loc,
            )
        if request_settings(policy, self._settings).policy.kind != "openai":
            raise ApiError(
                422,
                "an agent command needs an openai policy (its gateway forwards the agent's"
                ' calls to the policy servers): give policy.kind = "openai"',
                loc=loc,
            )

    async def start(
        self,
        tasks: Sequence[TaskSpec],
        policy_config: PolicyConfig | None,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        oversample: int = 0,
        max_in_flight: int | None = None,
        policy_version: int | None = None,
        loc: Sequence[str] = ("task",),
        agent_command: Sequence[str] | None = None,
        groups_target: int | None = None,
    ) -> tuple[BatchRecord, bool, int]:
        """Start a batch of validated tasks (or find the identical one).

        A new batch passes the pre-flight first (:mod:`fleetroll.service.preflight`);
        ``loc`` is where its tasks are in the request (default: an MCP tool's
        ``task``). Returns the record, whether it is new, and the rollouts run
        again (see :meth:`submit`).

        Raises:
            ApiError: 422 (the pre-flight found a problem), 409 (the id is
                taken by a different request), 503 (the pool is full, or a
                cancel of the identical batch is still settling).
        """
        plan = _Plan(
            tasks,
            policy_config,
            samples_per_task,
            deadline_s,
            oversample,
            None if agent_command is None else tuple(agent_command),
            groups_target,
            max_in_flight,
            policy_version,
        )
        fingerprint = plan.fingerprint()
        batch_id = batch_id or uuid.uuid4().hex[:12]
        existing = self._records.get(batch_id)
        if existing is None:
            self._check_store()
            await self._preflight.check(tasks, policy_config, loc=loc)
            existing = self._records.get(batch_id)  # its twin may have started it meanwhile
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise ApiError(
                    409,
                    f"batch {batch_id!r} already exists with different tasks, samples, policy,"
                    " deadline, share or tag; resubmit the same request, or use another"
                    " batch_id",
                )
            await existing.saved.wait()
            # Its own policy: the same but for the api_key, which is never stored.
            return existing, False, await self._rerun_cancelled(existing, policy_config)
        batch, policy = self._run(plan, batch_id)
        record = BatchRecord(batch, fingerprint, plan)
        self._records[batch_id] = record
        self._consume_soon(record, policy)
        await record.saved.wait()  # accepted once it would survive a restart
        if record.error is not None:  # it would not
            raise ApiError(503, self._refusal(record.error))
        return record, True, 0

    async def _rerun_cancelled(self, record: BatchRecord, policy: PolicyConfig | None) -> int:
        """Run again the rollouts of ``record`` without a result or whose newest is cancelled.

        A cancel still settling (a resubmission right after a ``DELETE``) is
        waited for first, within the time a release takes.

        Raises:
            ApiError: 503 (the cancel has not settled, or the pool is full).
        """
        if not record.done and record.cancel_requested:
            wait_s = self._settings.timeouts.release_s + _CANCEL_SETTLE_SLACK_S
            with anyio.move_on_after(wait_s):
                await record.wait_cancelled()
            if not record.done and record.cancel_requested:
                raise ApiError(
                    503,
                    f"batch {record.batch_id!r} is still being cancelled; resubmit it shortly",
                    headers={"Retry-After": "5"},
                )
        if not record.done:
            return 0  # running (or re-running already): this request is the same batch
        keep = {r.rollout_id for r in record.newest()} - record.cancelled_ids()
        again = record.plan.rollout_ids(record.batch_id) - keep
        if not again:
            return 0
        self._check_store()
        kept = [r for r in record.newest() if r.rollout_id in keep]
        batch, running = self._run(
            replace(record.plan, policy=policy), record.batch_id, skip=keep, previous=kept
        )
        with suppress(ValueError):
            self._finished.remove(record.batch_id)
        record.rerun(batch, again)
        self._consume_soon(record, running)
        return batch.total

    def _run(
        self,
        plan: _Plan,
        batch_id: str,
        *,
        skip: set[str] | None = None,
        previous: Sequence[RolloutResult] = (),
    ) -> tuple[RunningBatch, Policy]:
        """Start ``plan`` on the pool (all of it, or all but ``skip``); its policy.

        ``previous``: the results kept from an earlier run; an oversampled
        group counts them, so it stops at ``samples_per_task`` scored in all,
        and so does ``groups_target`` (the groups already complete).

        Raises:
            ApiError: 409 (the pool runs a batch of this id), 503 (the pool is full).
        """
        if self.tg is None:
            raise RuntimeError("the service is not running")
        policy = self._policy(plan)
        try:
            extra: dict[str, object] = {}
            if plan.oversample or plan.groups_target is not None:
                extra |= {"oversample": plan.oversample, "previous": previous}
            if plan.groups_target is not None:
                extra["groups_target"] = plan.groups_target
            batch = self._pool.run_batch(
                plan.tasks,
                policy,
                samples_per_task=plan.samples_per_task,
                batch_id=batch_id,
                deadline_s=plan.deadline_s,
                skip=skip or (),
                max_in_flight=plan.max_in_flight,
                policy_version=plan.policy_version,
                **extra,
            )
        except PoolFullError as exc:
            self._close_soon(policy)
            if exc.requested > exc.limit:  # too big on its own: waiting cannot help
                raise ApiError(422, str(exc), loc=["body", "samples_per_task"]) from None
            raise ApiError(503, str(exc), headers={"Retry-After": "30"}) from None
        except ValueError as exc:  # e.g. an in-process batch of the pool holds the id
            self._close_soon(policy)
            raise ApiError(409, str(exc)) from None
        return batch, policy

    def _check_store(self) -> None:
        """Raises: ApiError: 503, the store could not be written: no new rollout starts."""
        if self.store_error is not None:
            raise ApiError(503, self._refusal(self.store_error))

    @staticmethod
    def _refusal(error: str) -> str:
        return (
            f"{error}; this service takes no new rollouts until it is restarted: make room"
            " in service.state_dir, restart fleetroll serve, then submit again"
        )

    def _store_failed(self, record: BatchRecord, why: str) -> None:
        """Writing ``record``'s request or results failed: the batch stops (nothing it
        ran from now on could be kept), and no new rollout starts until a restart."""
        assert self._store is not None
        error = f"service.state_dir: cannot keep batch {record.batch_id}: {why}"
        if self.store_error is None:
            self.store_error = f"service.state_dir {self._store.root} cannot be written: {why}"
        _log.error(
            "%s; the batch was stopped, and this service takes no new rollouts until it is"
            " restarted (make room in %s first; then resubmit the batch: it runs the rest)",
            error,
            self._store.root,
        )
        record.fail(error)
        record.batch.cancel()

    def _policy(self, plan: _Plan) -> Policy:
        """What plays ``plan``'s rollouts: its policy, or its agent command over it."""
        if plan.agent_command is None:
            return build_policy(plan.policy, self._settings)
        if self.gateway is None:
            raise RuntimeError("agent commands are allowed but the service serves no gateway")
        settings = request_settings(plan.policy, self._settings)
        return CommandAgent.from_config(
            plan.agent_command,
            chat_policy_config(settings),
            gateway=self.gateway,
            records=self.agent_records,
        )

    def _consume_soon(self, record: BatchRecord, policy: Policy) -> None:
        assert self.tg is not None
        self.tg.start_soon(self._consume, record, record.batch, policy)

    def _close_soon(self, policy: Policy) -> None:
        assert self.tg is not None
        self.tg.start_soon(_close_policy, policy)

    def cancel(self, batch_id: str) -> BatchRecord:
        """Cancel what is still running; every result still arrives.

        Raises:
            ApiError: 404, no such batch.
        """
        record = self.get(batch_id)
        if not record.done:
            record.cancel_requested = True
            record.batch.cancel()
        return record

    def stop(self) -> None:
        """The server is stopping: end every results stream now."""
        self.stopping = True
        for record in self._records.values():
            record.notify()

    async def cancel_all(self, wait_s: float) -> None:
        """Cancel every running batch and wait (at most ``wait_s``) for their last results.

        For the service's shutdown: the ``cancelled`` results of batches nobody
        asked to cancel are not kept, so those rollouts run when the batch is
        resubmitted (after a restart) and no rollout is delivered twice.
        """
        running = [r for r in self._records.values() if not r.done]
        for record in running:
            record.interrupting = not record.cancel_requested
            record.cancel_requested = True
            record.batch.cancel()
        with anyio.move_on_after(wait_s):
            for record in running:
                await record.wait_done()

    async def _consume(self, record: BatchRecord, batch: RunningBatch, policy: Policy) -> None:
        try:
            async with self._journal(record) as keep:
                async for result in batch:
                    self._metrics.observe(result)
                    if record.interrupting and result.failure_reason is FailureReason.CANCELLED:
                        continue  # cut short by the shutdown: it runs on a resubmission
                    keep(result)
            record.finish()
            self._retire(record)
        finally:
            await _close_policy(policy)

    @asynccontextmanager
    async def _journal(
        self, record: BatchRecord
    ) -> AsyncIterator[Callable[[RolloutResult], object]]:
        """What to call with each of ``record``'s results: it puts them in the record,
        through the batch's journal when there is a store (a new batch's request is
        written first). Leaving the block waits until every result given is in.

        A result JSON cannot hold is kept as its rollout's ``result_error``
        (:func:`~fleetroll.pool.journal.journal_line`). A store that fails stops
        the batch (:meth:`_store_failed`): what it could not write is dropped,
        never shown to a reader.
        """
        store = self._store
        if store is None:
            record.saved.set()
            yield lambda result: record.append(journal_line(result)[0])
            return
        assert self.tg is not None
        journal: Journal | None = None
        # Its failure was said by _store_failed, which stopped the batch.
        with suppress(JournalError):
            async with AsyncExitStack() as stack:
                try:
                    if not record.saved.is_set():
                        removing = self._removing.get(record.batch_id)
                        if removing is not None:  # an older batch of this id is being forgotten
                            await removing.wait()
                        request = record.plan.stored(record.batch_id, record.fingerprint)
                        await anyio.to_thread.run_sync(store.save_request, request)
                    path = store.journal_path(record.batch_id)
                    journal = Journal(
                        path,
                        self.tg,
                        on_written=record.append_all,
                        on_failed=lambda exc: self._store_failed(record, _strerror(exc)),
                    )
                    await stack.enter_async_context(journal)
                except (OSError, JournalError, ConfigError) as exc:
                    error = exc.error if isinstance(exc, JournalError) else exc
                    self._store_failed(
                        record, _strerror(error) if isinstance(error, OSError) else str(error)
                    )
                    journal = None
                record.saved.set()
                yield _drop if journal is None else journal.append

    def _retire(self, record: BatchRecord) -> None:
        self._finished.append(record.batch_id)
        while len(self._finished) > self._settings.service.keep_finished_batches:
            old = self._records.pop(self._finished.popleft(), None)
            if old is None:
                continue
            self._pool.forget(old.batch_id)  # its pool lets go of the transcripts too
            for forget in self.on_forget:
                forget(old)
            if self._store is not None:
                assert self.tg is not None
                removed = self._removing[old.batch_id] = anyio.Event()
                self.tg.start_soon(self._remove, old.batch_id, removed)

    async def _remove(self, batch_id: str, removed: anyio.Event) -> None:
        assert self._store is not None
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._store.remove, batch_id)
        except OSError as exc:
            _log.warning("service.state_dir: cannot remove batch %s's files: %s", batch_id, exc)
        finally:
            if self._removing.get(batch_id) is removed:
                del self._removing[batch_id]
            removed.set()

    async def _resolve_tasks(self, request: BatchRequest) -> list[TaskSpec]:
        """The request's tasks, read and checked in a worker thread, limits first.

        Raises:
            ApiError: 422 naming the item (or the file, line) and field.
        """
        s = self._settings
        limits = TaskLimits(
            max_file_bytes=s.service.max_tasks_file_bytes,
            max_tasks=s.service.max_batch_rollouts,
            max_verifier_bytes=s.pool.max_verifier_bytes,
        )
        if request.tasks is not None:
            records = [t.record() for t in request.tasks]
            return await anyio.to_thread.run_sync(
                parse_records, records, s.modalities, limits, limiter=self._parsing
            )
        assert request.tasks_file is not None
        path = task_path(request.tasks_file, s.service.tasks_root)
        try:
            return await anyio.to_thread.run_sync(
                load_task_paths, [path], s.modalities, limits, limiter=self._parsing
            )
        except TaskFileError as exc:
            # Paths as the client gave them: relative to tasks_root, not the server's layout.
            reason = str(exc).replace(f"{s.service.tasks_root.resolve()}{os.sep}", "")
            raise ApiError(422, reason, loc=["body", "tasks_file"], type="task_error") from None


def _drop(result: RolloutResult) -> None:
    """Where the results of a batch whose store failed go: nowhere (never shown unkept)."""


def _strerror(error: OSError) -> str:
    return error.strerror or str(error)


async def _close_policy(policy: Policy) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_POLICY_CLOSE_S):
        await policy.aclose()
