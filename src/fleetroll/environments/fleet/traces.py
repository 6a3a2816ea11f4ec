"""Fleet trace upload: each finished rollout posted to Fleet's trace API (``[traces]``).

Part of the Fleet provider's module family (:mod:`fleetroll.environments.fleet.provider`):
besides verification, the only code that talks to the ``fleet`` SDK.

* One trace job per batch (``AsyncFleet.trace_job``, made at the batch's
  first trace), then one session per rollout through the SDK's session
  ingest, in one request: the transcript (redacted like results, images
  inline), the verifier's ``execution_id``, the status and what a result
  says about the rollout in ``metadata``.
* Never on a rollout's path: :meth:`TraceUploader.submit` only queues (a
  bounded stream of ``traces.max_queued``; past it a trace is dropped and
  counted); ``traces.max_parallel`` workers post, each post under
  ``traces.upload_s``.
* A failed post is a ``fleet_trace_upload_failed`` event, never a lost
  result. On close, what is queued gets ``traces.flush_s`` (shielded); what
  is left then, and what was dropped, is one ``fleet_trace_dropped`` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fleet._async.client import AsyncFleet

from fleetroll.results import RolloutResult
from fleetroll.settings import TraceSettings
from fleetroll.telemetry.events import Events

__all__ = ["TraceUploader", "open_trace_uploader", "trace_messages"]

Redact = Callable[[str], str]
#: Keys of a chat message the ingest API has fields for; the rest go in its metadata.
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id")
#: Trace job ids remembered (one per batch).
_KEEP_JOBS = 1024


@dataclass(frozen=True, slots=True)
class _Trace:
    result: RolloutResult
    messages: Sequence[Mapping[str, Any]]
    redact: Redact


def redacted(value: Any, redact: Redact) -> Any:
    """``value`` with ``redact`` applied to each string in it (images kept whole)."""
    if isinstance(value, str):
        # Images (data URLs) are kept whole: a secret cannot hide in base64 of a screenshot.
        return value if value.startswith("data:") else redact(value)
    if isinstance(value, Mapping):
        return {str(k): redacted(v, redact) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v, redact) for v in value]
    return value


def trace_messages(messages: Sequence[Mapping[str, Any]], redact: Redact) -> list[dict[str, Any]]:
    """Chat messages as the ingest API takes them: redacted, images inline."""
    out = []
    for message in messages:
        cleaned = redacted(message, redact)
        item = {k: cleaned[k] for k in _MESSAGE_FIELDS if cleaned.get(k) is not None}
        item.setdefault("role", "user")
        extra = {k: v for k, v in cleaned.items() if k not in _MESSAGE_FIELDS}
        if extra:
            item["metadata"] = extra
        out.append(item)
    return out


def _metadata(result: RolloutResult) -> dict[str, Any]:
    return {
        "source": "fleetroll",
        "rollout_id": result.rollout_id,
        "batch_id": result.batch_id,
        "sample_index": result.sample_index,
        "group_id": result.group_id,
        "env_key": result.env_key,
        "env_version": result.env_version,
        "modality": result.modality,
        "reward": result.reward,
        "failure_reason": result.failure_reason.value if result.failure_reason else None,
        "error": result.error,
        "steps": result.steps,
        "final_answer": result.final_answer,
    }


class TraceUploader:
    """Queues finished rollouts and posts them to Fleet's trace API in the background.

    Made by :func:`open_trace_uploader`, which runs its workers.
    """

    def __init__(self, traces: TraceSettings, events: Events, fleet: AsyncFleet) -> None:
        self._traces = traces
        self._events = events
        self._fleet = fleet
        self._send: MemoryObjectSendStream[_Trace]
        self._receive: MemoryObjectReceiveStream[_Trace]
        self._send, self._receive = anyio.create_memory_object_stream[_Trace](traces.max_queued)
        self._jobs: dict[str, str] = {}
        self._job_lock = anyio.Lock()
        self._pending = 0
        self._workers = traces.max_parallel
        #: Set when every worker has posted everything and the queue is closed.
        self.drained = anyio.Event()
        #: Traces dropped because the queue was full.
        self.dropped = 0
        #: Sessions posted.
        self.uploaded = 0

    def submit(
        self, result: RolloutResult, messages: Sequence[Mapping[str, Any]], redact: Redact
    ) -> None:
        """Queue one finished rollout's trace; never blocks, never raises.

        ``messages`` is the rollout's whole transcript (images included),
        redacted with ``redact`` by the worker that posts it.
        """
        if not messages:  # the ingest API wants at least one message
            return
        try:
            self._send.send_nowait(_Trace(result, list(messages), redact))
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.dropped += 1
        else:
            self._pending += 1

    @property
    def pending(self) -> int:
        """Traces queued or being posted."""
        return self._pending

    async def _work(self, receive: MemoryObjectReceiveStream[_Trace]) -> None:
        try:
            async with receive:
                async for trace in receive:
                    try:
                        await self._post(trace)
                    finally:
                        self._pending -= 1
        finally:
            self._workers -= 1
            if self._workers == 0:
                self.drained.set()

    def close(self) -> None:
        """Take no more traces; the workers end once the queue is posted."""
        self._send.close()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Post queued traces with ``traces.max_parallel`` workers until :meth:`close`."""
        async with anyio.create_task_group() as tg:
            for _ in range(self._traces.max_parallel):
                tg.start_soon(self._work, self._receive.clone())
            self._receive.close()
            task_status.started()

    async def _job(self, batch_id: str) -> str:
        async with self._job_lock:
            job_id = self._jobs.get(batch_id)
            if job_id is None:
                with anyio.fail_after(self._traces.upload_s):
                    job_id = await self._fleet.trace_job(name=f"fleetroll {batch_id}")
                self._jobs[batch_id] = job_id
                while len(self._jobs) > _KEEP_JOBS:  # a long-lived pool: the oldest go
                    del self._jobs[next(iter(self._jobs))]
            return job_id

    async def _post(self, trace: _Trace) -> None:
        result = trace.result
        operation = "trace_job"
        try:
            job_id = await self._job(result.batch_id)
            operation = "ingest"
            messages = trace_messages(trace.messages, trace.redact)
            model = next((t.model for t in result.turns if t.model), None)
            with anyio.fail_after(self._traces.upload_s):
                # The SDK's ingest: the whole session in one request (its public
                # helpers post one message per request).
                await self._fleet._ingest(
                    messages=messages,
                    model=model,
                    task_key=result.task_key,
                    job_id=job_id,
                    instance_id=result.instance_id,
                    status="completed" if result.status == "completed" else "failed",
                    metadata=_metadata(result),
                    verifier_execution_id=result.verifier.execution_id if result.verifier else None,
                )
            self.uploaded += 1
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # the boundary: a failed post is an event, nothing more
            self._events.emit(
                "fleet_trace_upload_failed",
                level="warn",
                batch_id=result.batch_id,
                rollout_id=result.rollout_id,
                task_key=result.task_key,
                operation=operation,
                error_type=type(exc).__name__,
                error_message=trace.redact(str(exc))[:500],
                timeout_s=self._traces.upload_s,
            )


@asynccontextmanager
async def open_trace_uploader(
    t: TraceSettings, events: Events, *, connect_s: float, api_key: str, base_url: str | None
) -> AsyncIterator[TraceUploader | None]:
    """A running :class:`TraceUploader`, or None when ``traces.upload`` is off.

    On exit, queued traces get ``traces.flush_s`` (even when the caller is
    being cancelled); what is left, and what was dropped, is reported in one
    ``fleet_trace_dropped`` event.
    """
    if not t.upload:
        yield None
        return
    timeout = httpx.Timeout(t.upload_s, connect=connect_s)
    async with httpx.AsyncClient(timeout=timeout) as client:
        fleet = AsyncFleet(api_key=api_key, base_url=base_url, max_retries=0, httpx_client=client)
        uploader = TraceUploader(t, events, fleet)
        async with anyio.create_task_group() as tg:
            await tg.start(uploader.run)
            try:
                yield uploader
            finally:
                uploader.close()
                with anyio.CancelScope(shield=True), anyio.move_on_after(t.flush_s):
                    await uploader.drained.wait()
                left = uploader.pending
                tg.cancel_scope.cancel()
                if left or uploader.dropped:
                    events.emit(
                        "fleet_trace_dropped",
                        level="warn",
                        queue_full=uploader.dropped,
                        not_flushed=left,
                        flush_s=t.flush_s,
                    )
