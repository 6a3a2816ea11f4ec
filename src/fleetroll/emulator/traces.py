"""Fleet's trace API, emulated: trace jobs and session ingest, kept for tests to read.

The two routes the SDK's ``AsyncFleet.trace_job`` and ``AsyncFleet._ingest``
call, with the SDK's own request and response models (``fleet.models``), so a
payload the real API would refuse is refused here too (422). What was received
is kept in a :class:`TraceStore` (bounded: the oldest sessions go first).
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fleet.models import (
    SessionIngestRequest,
    SessionIngestResponse,
    TraceJobRequest,
    TraceJobResponse,
)
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["TraceJob", "TraceSession", "TraceStore"]


@dataclass(slots=True)
class TraceJob:
    job_id: str
    name: str


@dataclass(slots=True)
class TraceSession:
    """One ingested session: the request as received, every message appended."""

    session_id: str
    job_id: str | None
    task_key: str | None
    instance_id: str | None
    status: str | None
    verifier_execution_id: str | None
    metadata: dict[str, Any] | None
    messages: list[dict[str, Any]] = field(default_factory=list)


class TraceStore:
    """What the trace API received, in order (at most ``keep`` sessions and jobs)."""

    def __init__(self, keep: int = 10_000) -> None:
        self.jobs: deque[TraceJob] = deque(maxlen=keep)
        self._sessions: dict[str, TraceSession] = {}
        self._keep = keep

    @property
    def sessions(self) -> list[TraceSession]:
        return list(self._sessions.values())

    def add_job(self, request: TraceJobRequest) -> TraceJobResponse:
        job = TraceJob(uuid.uuid4().hex, request.name or f"job-{len(self.jobs) + 1}")
        self.jobs.append(job)
        return TraceJobResponse(job_id=job.job_id, name=job.name, status="running")

    def ingest(self, request: SessionIngestRequest) -> SessionIngestResponse | None:
        """Create or append to a session; None when ``session_id`` names no session."""
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        created = request.session_id is None
        if created:
            session = TraceSession(
                session_id=uuid.uuid4().hex,
                job_id=request.job_id,
                task_key=request.task_key,
                instance_id=request.instance_id,
                status=None,
                verifier_execution_id=None,
                metadata=request.metadata,
            )
            self._sessions[session.session_id] = session
            while len(self._sessions) > self._keep:
                del self._sessions[next(iter(self._sessions))]
        else:
            found = self._sessions.get(request.session_id or "")
            if found is None:
                return None
            session = found
        session.messages.extend(messages)
        if request.status is not None:
            session.status = request.status.value
        if request.verifier_execution_id is not None:
            session.verifier_execution_id = request.verifier_execution_id
        return SessionIngestResponse(
            success=True,
            session_id=session.session_id,
            message_count=len(session.messages),
            created_new_session=created,
        )


def _invalid(exc: ValidationError) -> Response:
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    return JSONResponse({"detail": errors}, status_code=422)


async def read_json(request: Request) -> Any:
    """The request's JSON body, or a 422 response when it is not JSON."""
    try:
        return await request.json()
    except ValueError:
        return JSONResponse({"detail": "the body is not JSON"}, status_code=422)


async def trace_job(store: TraceStore, request: Request) -> Response:
    body = await read_json(request)
    if isinstance(body, Response):
        return body
    try:
        parsed = TraceJobRequest.model_validate(body)
    except ValidationError as exc:
        return _invalid(exc)
    return JSONResponse(store.add_job(parsed).model_dump())


async def ingest(store: TraceStore, request: Request) -> Response:
    body = await read_json(request)
    if isinstance(body, Response):
        return body
    try:
        parsed = SessionIngestRequest.model_validate(body)
    except ValidationError as exc:
        return _invalid(exc)
    answer = store.ingest(parsed)
    if answer is None:
        return JSONResponse({"detail": "Session not found"}, status_code=404)
    return JSONResponse(answer.model_dump())
