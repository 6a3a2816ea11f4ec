"""Batches submitted over HTTP: the registry that checks, starts, re-runs,
cancels and keeps them (idempotency, their results in order, the store).

Each batch's own iterator is consumed by exactly one server-side task, which
appends every result to the batch's
:class:`~fleetroll.service.batch_record.BatchRecord` (a list in arrival
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

import logging
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import replace
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from fleetroll.errors import ConfigError, JournalError, PoolFullError, TaskFileError
from fleetroll.policies import Policy
from fleetroll.policies.gateway import Gateway
from fleetroll.pool.batch_pool import BatchPool, RunningBatch
from fleetroll.pool.journal import Journal, journal_line
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.agent_process import AgentRecords
from fleetroll.service.batch_record import BatchPlan, BatchRecord
from fleetroll.service.errors import ApiError
from fleetroll.service.guards import refuse_host_commands
from fleetroll.service.metrics import Metrics
from fleetroll.service.models import (
    BatchRequest,
    PolicyConfig,
)
from fleetroll.service.preflight import BatchPreflight
from fleetroll.service.requests import (
    parse_records,
    task_path,
)
from fleetroll.service.state import BatchStore
from fleetroll.settings import ModalitySettings, PoolSettings, ServiceSettings, TimeoutSettings
from fleetroll.tasks import TaskLimits, TaskSpec, load_task_paths

__all__ = ["BatchRegistry", "RequestPolicies"]

_log = logging.getLogger(__name__)
#: Closing a batch's policy (an HTTP client) after the batch: bounded, shielded.
#: Not a setting: closing a client does no I/O worth waiting for longer.
_POLICY_CLOSE_S = 5.0
#: How long a resubmission waits for a cancelled batch's last results before re-running it.
#: Not a setting: a margin over ``timeouts.release_s``, which is one.
_CANCEL_SETTLE_SLACK_S = 5.0


class RequestPolicies(Protocol):
    """What plays a batch's rollouts, as its request asks (built where the
    service is assembled: :class:`fleetroll.service.app.ServerPolicies`)."""

    def kind(self, config: PolicyConfig | None) -> str:
        """The policy kind the request's policy comes to (``scripted``, ``openai``)."""
        ...

    def build(self, config: PolicyConfig | None) -> Policy:
        """The request's policy, built as ``fleetroll run`` builds its own."""
        ...

    def agent(
        self,
        command: Sequence[str],
        config: PolicyConfig | None,
        *,
        gateway: Gateway,
        records: AgentRecords | None,
    ) -> Policy:
        """The agent ``command`` over the request's policy, through ``gateway``."""
        ...


class BatchRegistry:
    """The service's batches, by id, run on ``pool``. Needs a task group (``tg``) before use.

    With a ``store``, its batches are read back (those it restored) and every
    new one and its results are kept there.
    """

    def __init__(
        self,
        pool: BatchPool,
        metrics: Metrics,
        *,
        preflight: BatchPreflight,
        policies: RequestPolicies,
        service: ServiceSettings,
        pool_settings: PoolSettings,
        timeouts: TimeoutSettings,
        modalities: Mapping[str, ModalitySettings],
        store: BatchStore | None = None,
    ) -> None:
        self._pool = pool
        #: Checks new batches first, with the pool of this process (``pool`` may be Ray's).
        self._preflight = preflight
        self._policies = policies
        self._service = service
        self._pool_settings = pool_settings
        self._timeouts = timeouts
        self._modalities = modalities
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
            allowed=self._service.allow_command_tasks,
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
        limit = self._service.max_batch_rollouts
        oversample = (
            self._pool_settings.oversample if request.oversample is None else request.oversample
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
        if not self._service.allow_command_tasks:
            raise ApiError(
                422,
                "an agent command runs on the service's host; this service refuses it"
                " (service.allow_command_tasks = false)",
                loc=loc,
            )
        if self._policies.kind(policy) != "openai":
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
        plan = BatchPlan(
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
            wait_s = self._timeouts.release_s + _CANCEL_SETTLE_SLACK_S
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
        plan: BatchPlan,
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

    def _policy(self, plan: BatchPlan) -> Policy:
        """What plays ``plan``'s rollouts: its policy, or its agent command over it."""
        if plan.agent_command is None:
            return self._policies.build(plan.policy)
        if self.gateway is None:
            raise RuntimeError("agent commands are allowed but the service serves no gateway")
        return self._policies.agent(
            plan.agent_command, plan.policy, gateway=self.gateway, records=self.agent_records
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
        while len(self._finished) > self._service.keep_finished_batches:
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
        service = self._service
        limits = TaskLimits(
            max_file_bytes=service.max_tasks_file_bytes,
            max_tasks=service.max_batch_rollouts,
            max_verifier_bytes=self._pool_settings.max_verifier_bytes,
        )
        if request.tasks is not None:
            records = [t.record() for t in request.tasks]
            return await anyio.to_thread.run_sync(
                parse_records, records, self._modalities, limits, limiter=self._parsing
            )
        assert request.tasks_file is not None
        path = task_path(request.tasks_file, service.tasks_root)
        try:
            return await anyio.to_thread.run_sync(
                load_task_paths, [path], self._modalities, limits, limiter=self._parsing
            )
        except TaskFileError as exc:
            # Paths as the client gave them: relative to tasks_root, not the server's layout.
            reason = str(exc).replace(f"{service.tasks_root.resolve()}{os.sep}", "")
            if not await anyio.Path(path).exists():
                # Where it was looked for, by the setting's name (its path is the server's).
                reason += (
                    "; tasks_file is a path under the service's service.tasks_root"
                    " (a file or a folder of them)"
                )
            raise ApiError(422, reason, loc=["body", "tasks_file"], type="task_error") from None


def _drop(result: RolloutResult) -> None:
    """Where the results of a batch whose store failed go: nowhere (never shown unkept)."""


def _strerror(error: OSError) -> str:
    return error.strerror or str(error)


async def _close_policy(policy: Policy) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_POLICY_CLOSE_S):
        await policy.aclose()
