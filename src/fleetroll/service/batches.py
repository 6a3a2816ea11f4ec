"""Batches submitted over HTTP: validation, idempotency, and their results in order.

Each batch's own iterator is consumed by exactly one server-side task, which
appends every result to the batch's :class:`BatchRecord` (a list in arrival
order; a result's cursor is its 1-based index) and wakes whoever waits.
Readers stream from that list, each at its own pace: a slow reader costs
nothing but the list itself (bounded by the batch's size) and never holds a
rollout back, and a reader that reconnects with ``?after=<cursor>`` resumes
exactly where it left off.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from fleetroll.batch_pool import BatchPool, RunningBatch
from fleetroll.errors import TaskFileError
from fleetroll.policies import OpenAIChatPolicy, Policy, ScriptedPolicy
from fleetroll.pool import Batch
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout import Rollout
from fleetroll.service.errors import ApiError, loc_of
from fleetroll.service.metrics import Metrics
from fleetroll.service.models import (
    BatchCounts,
    BatchRequest,
    BatchState,
    BatchStatus,
    PolicyConfig,
)
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec, load_tasks, parse_task

__all__ = ["BatchRecord", "BatchRegistry", "build_policy", "parse_one", "parse_records"]

#: A results chunk holds at most this many lines (fewer, larger writes).
_LINES_PER_CHUNK = 64
#: Closing a batch's policy (an HTTP client) after the batch: bounded, shielded.
_POLICY_CLOSE_S = 5.0
_SOURCE = "request body"
#: Parsing a request's tasks yields to the event loop every this many records.
_RECORDS_PER_CHECKPOINT = 32


class BatchRecord:
    """One batch and its results so far, in arrival order.

    ``rollouts`` are the live rollouts of a batch run in this process (the
    MCP tools read them), and empty for one run elsewhere (on Ray actors).
    """

    def __init__(self, batch: RunningBatch, fingerprint: str) -> None:
        self.batch = batch
        self.fingerprint = fingerprint
        self.rollouts: Sequence[Rollout] = batch.rollouts if isinstance(batch, Batch) else ()
        self.results: list[RolloutResult] = []
        self.done = False  # every result is in
        self.cancel_requested = False
        self._changed = anyio.Event()

    @property
    def batch_id(self) -> str:
        return self.batch.batch_id

    @property
    def total(self) -> int:
        return self.batch.total

    @property
    def status(self) -> BatchStatus:
        if not self.done:
            return "running"
        cancelled = self.cancel_requested or any(
            r.failure_reason is FailureReason.CANCELLED for r in self.results
        )
        return "cancelled" if cancelled else "finished"

    def state(self) -> BatchState:
        c = self.batch.counts()
        return BatchState(
            batch_id=self.batch_id,
            status=self.status,
            cancel_requested=self.cancel_requested,
            counts=BatchCounts(
                total=c.total,
                queued=c.queued,
                provisioning=c.provisioning,
                running=c.running,
                done=c.done,
                failed=c.failed,
            ),
            results=len(self.results),
        )

    def append(self, result: RolloutResult) -> None:
        self.results.append(result)
        self.notify()

    async def wait_done(self) -> None:
        """Wait until every result is in (bound it with a deadline of your own)."""
        while not self.done:
            await self._changed.wait()

    def finish(self) -> None:
        self.done = True
        self.notify()

    def notify(self) -> None:
        """Wake every waiting reader (each then re-checks what it waits for)."""
        self._changed.set()
        self._changed = anyio.Event()

    async def lines(
        self, after: int, *, heartbeat_s: float, stopping: Callable[[], bool]
    ) -> AsyncIterator[bytes]:
        """NDJSON chunks: the results after cursor ``after``, then an end line.

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
                    body = self.results[i].model_dump_json()
                    chunk.append(f'{{"type":"result","cursor":{i + 1},"result":{body}}}\n')
                cursor = upto
                yield "".join(chunk).encode()
            if self.done:
                end = {"type": "end", "cursor": cursor, "status": self.status}
                yield (json.dumps(end, separators=(",", ":")) + "\n").encode()
                return
            if stopping():
                return
            changed = self._changed
            with anyio.move_on_after(heartbeat_s) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield f'{{"type":"heartbeat","cursor":{cursor}}}\n'.encode()


class BatchRegistry:
    """The service's batches, by id. Needs a task group (``tg``) before use.

    Batches run on ``pool``; those started with ``local=True`` (the MCP
    tools' one-rollout batches, read live) on ``local`` (default: ``pool``).
    """

    def __init__(
        self,
        pool: BatchPool,
        settings: Settings,
        metrics: Metrics,
        *,
        local: BatchPool | None = None,
    ) -> None:
        self._pool = pool
        self._local = local or pool
        self._settings = settings
        self._metrics = metrics
        self._records: dict[str, BatchRecord] = {}
        self._finished: deque[str] = deque()
        self.tg: TaskGroup | None = None
        self.stopping = False
        #: Called with each record forgotten to make room (see ``keep_finished_batches``).
        self.on_forget: list[Callable[[BatchRecord], None]] = []

    def __iter__(self) -> Iterator[BatchRecord]:
        return iter(list(self._records.values()))

    def get(self, batch_id: str) -> BatchRecord:
        """Raises: ApiError: 404, no such batch (or it was forgotten)."""
        record = self._records.get(batch_id)
        if record is None:
            raise ApiError(404, f"no batch {batch_id!r} (unknown, or finished long ago)")
        return record

    def in_flight(self) -> int:
        return sum(r.total - len(r.results) for r in self._records.values() if not r.done)

    async def submit(self, request: BatchRequest) -> tuple[BatchRecord, bool]:
        """Validate and start a batch, or return the identical one already started.

        Raises:
            ApiError: 422 (invalid tasks, too many rollouts), 409 (the id is
                taken by a different request).
        """
        tasks = await self._resolve_tasks(request)
        limit = self._settings.service.max_batch_rollouts
        total = len(tasks) * request.samples_per_task
        if total > limit:
            raise ApiError(
                422,
                f"{len(tasks)} tasks × {request.samples_per_task} samples = {total} rollouts,"
                f" over this service's limit of {limit} per batch",
                loc=["body", "samples_per_task"],
            )
        return await self.start(
            tasks,
            request.policy,
            samples_per_task=request.samples_per_task,
            batch_id=request.batch_id,
            deadline_s=request.deadline_s,
        )

    async def start(
        self,
        tasks: Sequence[TaskSpec],
        policy_config: PolicyConfig | None,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        local: bool = False,
    ) -> tuple[BatchRecord, bool]:
        """Start a batch of validated tasks (or find the identical one).

        ``local``: on the local pool, whose batches have live ``rollouts``.

        Raises:
            ApiError: 409, the id is taken by a different request.
        """
        if self.tg is None:
            raise RuntimeError("the service is not running")
        fingerprint = _fingerprint(tasks, policy_config, samples_per_task, deadline_s)
        batch_id = batch_id or uuid.uuid4().hex[:12]
        existing = self._records.get(batch_id)
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise ApiError(
                    409,
                    f"batch {batch_id!r} already exists with different tasks, samples, policy"
                    " or deadline; resubmit the same request, or use another batch_id",
                )
            return existing, False
        policy = build_policy(policy_config, self._settings)
        try:
            pool = self._local if local else self._pool
            batch = pool.run_batch(
                tasks,
                policy,
                samples_per_task=samples_per_task,
                batch_id=batch_id,
                deadline_s=deadline_s,
            )
        except ValueError as exc:  # e.g. an in-process batch of the pool holds the id
            await _close_policy(policy)
            raise ApiError(409, str(exc)) from None
        record = BatchRecord(batch, fingerprint)
        self._records[batch_id] = record
        self.tg.start_soon(self._consume, record, policy)
        return record, True

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
        """Cancel every running batch and wait (at most ``wait_s``) for their last results."""
        running = [r for r in self._records.values() if not r.done]
        for record in running:
            record.cancel_requested = True
            record.batch.cancel()
        with anyio.move_on_after(wait_s):
            for record in running:
                await record.wait_done()

    async def _consume(self, record: BatchRecord, policy: Policy) -> None:
        try:
            async for result in record.batch:
                record.append(result)
                self._metrics.observe(result)
            record.finish()
            self._retire(record)
        finally:
            await _close_policy(policy)

    def _retire(self, record: BatchRecord) -> None:
        self._finished.append(record.batch_id)
        while len(self._finished) > self._settings.service.keep_finished_batches:
            old = self._records.pop(self._finished.popleft(), None)
            if old is None:
                continue
            for pool in (self._pool, self._local):  # the pools let go of the transcripts too
                if old.batch.finished.is_set():
                    pool.forget(old.batch_id)
            for forget in self.on_forget:
                forget(old)

    async def _resolve_tasks(self, request: BatchRequest) -> list[TaskSpec]:
        modalities = self._settings.modalities
        if request.tasks is not None:
            return await parse_records([t.record() for t in request.tasks], modalities)
        assert request.tasks_file is not None
        path = _task_path(request.tasks_file, self._settings.service.tasks_root)
        try:
            return load_tasks(path, modalities=modalities)  # on the loop: see parse_records
        except TaskFileError as exc:
            raise ApiError(422, str(exc), loc=["body", "tasks_file"], type="task_error") from None


async def parse_records(records: Sequence[Mapping[str, Any]], modalities: Any) -> list[TaskSpec]:
    """Tasks of a request's ``tasks`` list, checked as a task file is.

    Parsing runs on the event loop's thread, yielding between records, and
    never in a worker thread: a verifier is checked with ``ast.parse``, which
    the rollouts' verification also calls on the loop, and CPython 3.11's
    parser fails ("AST constructor recursion depth mismatch") when two
    threads parse at once.

    Raises:
        ApiError: 422 naming the item and field (``["body", "tasks", 2, "env_key"]``).
    """
    if not records:
        raise ApiError(422, "no tasks", loc=["body", "tasks"])
    tasks: list[TaskSpec] = []
    first_use: dict[str, int] = {}
    for i, record in enumerate(records):
        if i % _RECORDS_PER_CHECKPOINT == 0:
            await anyio.lowlevel.checkpoint()
        try:
            task = parse_task(record, source=_SOURCE, modalities=modalities)
        except TaskFileError as exc:
            reason = f"{exc.reason} (the {_nth(i + 1)} task in the list)"
            loc = ["body", "tasks", i, *loc_of(exc.field)]
            raise ApiError(422, reason, loc=loc, type="task_error") from None
        first = first_use.setdefault(task.key, i)
        if first != i:
            reason = f"duplicate key {task.key!r}, first used by the {_nth(first + 1)} task"
            raise ApiError(422, reason, loc=["body", "tasks", i, "key"], type="task_error")
        tasks.append(task)
    return tasks


def parse_one(record: Mapping[str, Any], modalities: Any, *, loc: Sequence[str]) -> TaskSpec:
    """One task of a request (a session's, an MCP tool's); on the loop, as above.

    Raises:
        ApiError: 422 naming the field.
    """
    try:
        return parse_task(record, source=_SOURCE, modalities=modalities)
    except TaskFileError as exc:
        raise ApiError(422, exc.reason, loc=[*loc, *loc_of(exc.field)], type="task_error") from None


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _task_path(given: str, root: Path) -> Path:
    base = root.resolve()
    try:
        path = (base / given).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, NUL bytes
        raise ApiError(422, f"not a usable path: {exc}", loc=["body", "tasks_file"]) from None
    if not path.is_relative_to(base):
        raise ApiError(
            422,
            "is outside the folder this service reads task files from (service.tasks_root)",
            loc=["body", "tasks_file"],
        )
    return path


def _fingerprint(
    tasks: Sequence[TaskSpec],
    policy: PolicyConfig | None,
    samples_per_task: int,
    deadline_s: float | None,
) -> str:
    """What makes two submissions "the same batch" (a policy's api_key does not)."""
    identity = {
        "tasks": [t.model_dump(mode="json") for t in tasks],
        "samples_per_task": samples_per_task,
        "policy": policy.model_dump(mode="json", exclude={"api_key"}) if policy else None,
        "deadline_s": deadline_s,
    }
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def build_policy(config: PolicyConfig | None, settings: Settings) -> Policy:
    """The policy a request asks for; unset fields come from ``settings.policy``.

    The server's own ``OPENAI_API_KEY`` goes only to the server's configured
    endpoint: a request naming another ``base_url`` must bring its own key.
    """
    base = settings.policy
    cfg = config or PolicyConfig()
    if (cfg.kind or base.kind) == "scripted":
        think = base.think_time_s if cfg.think_time_s is None else cfg.think_time_s
        return ScriptedPolicy(think_time_s=think)
    base_url = cfg.base_url or base.base_url
    api_key = cfg.api_key
    if api_key is None and base_url.rstrip("/") == base.base_url.rstrip("/"):
        api_key = settings.openai_api_key
    return OpenAIChatPolicy(
        base_url=base_url,
        model=cfg.model or base.model,
        api_key=api_key,
        temperature=base.temperature if cfg.temperature is None else cfg.temperature,
        top_p=base.top_p if cfg.top_p is None else cfg.top_p,
        max_tokens=base.max_tokens if cfg.max_tokens is None else cfg.max_tokens,
        extra_body=base.extra_body if cfg.extra_body is None else cfg.extra_body,
        system_prompt=base.system_prompt if cfg.system_prompt is None else cfg.system_prompt,
        timeout_s=settings.timeouts.policy_s,
        max_retries=base.max_retries if cfg.max_retries is None else cfg.max_retries,
    )


async def _close_policy(policy: Policy) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_POLICY_CLOSE_S):
        await policy.aclose()
