"""The HTTP API declared once: :data:`ROUTES`, one :class:`Endpoint` per route.

Each endpoint holds what both sides need: the method and path, the handler,
the request and answer models (or the answer's media type), the error
statuses it can answer with their meaning, whether it needs the token, and
its summary. :func:`asgi_routes` makes the Starlette routes of it,
:func:`fleetroll.service.openapi.openapi_document` the OpenAPI document, and
:func:`fleetroll.service.asgi.create_app` the paths the token guard lets
through; a test checks that the app's routes and ``/openapi.json`` agree.

Every await a handler makes on a rollout, a session or the pool is bounded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetroll.errors import OperationTimeout
from fleetroll.evaluation import DEFAULT_SUCCESS_THRESHOLD, evaluate
from fleetroll.results import RolloutResult
from fleetroll.rollout.events import EventPage, ndjson_lines
from fleetroll.service.errors import ApiError
from fleetroll.service.metrics import CONTENT_TYPE
from fleetroll.service.models import (
    EVAL_REPORT_SCHEMA,
    BatchCreated,
    BatchRequest,
    BatchState,
    ErrorItem,
    EventStreamLine,
    GroupStreamLine,
    Health,
    Observation,
    PauseLease,
    PauseRequest,
    PolicyState,
    PolicyVersionRequest,
    QueryRequest,
    QueryResult,
    SessionDone,
    SessionOpened,
    SessionRequest,
    StatsResult,
    StepRequest,
    StreamLine,
    TreeCreated,
    TreeRequest,
    TreeState,
    TreeStreamLine,
    ValidationErrorBody,
)
from fleetroll.service.query import run_query, run_stats

if TYPE_CHECKING:
    from fleetroll.service.app import Service

__all__ = ["PATH_PARAMETERS", "ROUTES", "Api", "Endpoint", "Query", "asgi_routes"]

M = TypeVar("M", bound=BaseModel)
NDJSON: Final = "application/x-ndjson"
# No buffering by proxies: each line should reach the controller as it is made.
_STREAM_HEADERS: Final = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
_INVALID = "Invalid request: each problem with its location"


@dataclass(frozen=True, slots=True)
class Api:
    """What a handler is given besides the request."""

    service: Service
    #: What ``GET /openapi.json`` answers (built once, from :data:`ROUTES`).
    document: Mapping[str, Any]


Handler = Callable[[Api, Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Query:
    """A query parameter (never required)."""

    name: str
    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route: what its ASGI route runs and what ``/openapi.json`` says of it.

    Attributes:
        answers: the success statuses, each with its meaning.
        answer: the success body's model, or its JSON schema when it has none.
        media: the success body's media type.
        body: the request body's model (JSON), if it takes one.
        errors: the error statuses the handler answers, each with its meaning;
            see :meth:`error_statuses` for those every route of its kind answers.
        auth: whether the bearer token is needed (when the service has one).
    """

    method: str
    path: str
    handler: Handler
    operation_id: str
    summary: str
    answers: Mapping[int, str]
    answer: type[BaseModel] | Mapping[str, Any]
    media: str = "application/json"
    body: type[BaseModel] | None = None
    errors: Mapping[int, str] = field(default_factory=dict)
    query: tuple[Query, ...] = ()
    description: str | None = None
    auth: bool = True

    def error_statuses(self, *, token_required: bool) -> dict[int, str]:
        """Every error status it can answer, with its meaning: its own, those of a
        JSON body (413, 415, 422), and the token guard's (401 with a token, 421
        without: the Host check runs on every path)."""
        implied: dict[int, str] = {}
        if token_required and self.auth:
            implied[401] = "Missing or invalid bearer token"
        if not token_required:
            implied[421] = "The Host header does not name loopback"
        if self.body is not None:
            implied[413] = "The request body is over service.max_body_bytes"
            implied[415] = "The body must be JSON (Content-Type: application/json)"
            implied[422] = _INVALID
        return dict(sorted((implied | dict(self.errors)).items()))


#: The description of each path parameter, by name.
PATH_PARAMETERS: Final = {
    "batch_id": "The batch's id",
    "tree_id": "The tree's id",
    "session_id": "The session's id",
    "pause_id": "The pause's id (from POST /v1/policy/pauses)",
    "rollout_id": "The rollout's id",
}


# ---------------------------------------------------------------- plumbing


class _InvalidBody(Exception):
    def __init__(self, error: ValidationError) -> None:
        self.error = error


async def _parse(request: Request, model: type[M]) -> M:
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "send the body as JSON, with Content-Type: application/json")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise _InvalidBody(exc) from None


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, media_type="application/json")


def _problem(exc: ApiError) -> Response:
    if exc.status == 422:
        body = ValidationErrorBody(detail=[ErrorItem(loc=exc.loc, msg=exc.detail, type=exc.type)])
        return Response(body.model_dump_json(), 422, exc.headers, "application/json")
    return JSONResponse({"detail": exc.detail}, exc.status, exc.headers)


def _invalid(exc: ValidationError) -> Response:
    # Never include the input: it may hold a secret (a policy's api_key).
    items = [
        ErrorItem(loc=["body", *e["loc"]], msg=e["msg"], type=e["type"])
        for e in exc.errors(include_url=False, include_input=False, include_context=False)
    ]
    return Response(
        ValidationErrorBody(detail=items).model_dump_json(), 422, None, "application/json"
    )


def _cursor(request: Request, available: int, what: str, whose: str = "this batch's") -> int:
    """The ``after`` query parameter of a stream.

    Raises:
        ApiError: 422, not a whole number, or ahead of what the stream holds.
    """
    raw = request.query_params.get("after", "0")
    if not raw.isdigit() or not raw.isascii():
        raise ApiError(422, "must be a whole number ≥ 0", loc=["query", "after"])
    after = int(raw)
    if after > available:
        raise ApiError(
            422,
            f"cursor {after} is ahead of {whose} {available} {what}",
            loc=["query", "after"],
        )
    return after


def _flag(request: Request, name: str) -> bool:
    """A boolean query parameter (``true`` or ``false``, absent is false).

    Raises:
        ApiError: 422, neither ``true`` nor ``false``.
    """
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false"):
        raise ApiError(422, "must be true or false", loc=["query", name])
    return raw == "true"


def _endpoint(handler: Handler, api: Api) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(api, request)
        except ApiError as exc:
            return _problem(exc)
        except _InvalidBody as exc:
            return _invalid(exc.error)

    return endpoint


def asgi_routes(api: Api) -> list[Route]:
    """The Starlette routes of :data:`ROUTES`, their handlers given ``api``."""
    return [Route(e.path, _endpoint(e.handler, api), methods=[e.method]) for e in ROUTES]


# ---------------------------------------------------------------- handlers


async def healthz(api: Api, request: Request) -> Response:
    error = api.service.batches.store_error
    if error is not None:
        return _json(Health(status="failing", error=error), 503)
    return _json(Health())


async def metrics(api: Api, request: Request) -> Response:
    service = api.service
    batches = Counter[str](r.status for r in service.batches)
    text = service.metrics.render(
        in_flight=service.batches.in_flight(),
        sessions_open=service.sessions.open_count,
        batches=batches,
        admission=service.pool.admission.state(),
    )
    return Response(text, media_type=CONTENT_TYPE)


async def openapi(api: Api, request: Request) -> Response:
    return JSONResponse(api.document)


async def create_batch(api: Api, request: Request) -> Response:
    body = await _parse(request, BatchRequest)
    record, created, rerun = await api.service.batches.submit(body)
    answer = BatchCreated(
        batch_id=record.batch_id, rollouts=record.total, created=created, rerun=rerun
    )
    return _json(answer, 201 if created else 200)


async def get_batch(api: Api, request: Request) -> Response:
    return _json(api.service.batches.get(request.path_params["batch_id"]).state())


async def cancel_batch(api: Api, request: Request) -> Response:
    return _json(api.service.batches.cancel(request.path_params["batch_id"]).state(), 202)


async def results(api: Api, request: Request) -> Response:
    service = api.service
    record = service.batches.get(request.path_params["batch_id"])
    after = _cursor(request, len(record.results), "results")
    lines = record.lines(
        after,
        heartbeat_s=service.settings.service.stream_heartbeat_s,
        stopping=lambda: service.batches.stopping,
    )
    return StreamingResponse(lines, media_type=NDJSON, headers=_STREAM_HEADERS)


async def groups(api: Api, request: Request) -> Response:
    service = api.service
    record = service.batches.get(request.path_params["batch_id"])
    after = _cursor(request, len(record.groups.groups), "groups")
    complete_only = _flag(request, "complete_only")
    lines = record.groups.lines(
        record,
        after,
        heartbeat_s=service.settings.service.stream_heartbeat_s,
        stopping=lambda: service.batches.stopping,
        complete_only=complete_only,
    )
    return StreamingResponse(lines, media_type=NDJSON, headers=_STREAM_HEADERS)


async def create_tree(api: Api, request: Request) -> Response:
    body = await _parse(request, TreeRequest)
    task = await api.service.check_task(body.task.record(), loc=["body", "task"])
    record, created = await api.service.trees.submit(body, task)
    run = record.run
    answer = TreeCreated(
        tree_id=record.tree_id,
        rollouts=1 + run.width,
        created=created,
        root_batch_id=run.root_batch_id,
        branches_batch_id=run.branches_batch_id,
    )
    return _json(answer, 201 if created else 200)


async def get_tree(api: Api, request: Request) -> Response:
    return _json(api.service.trees.get(request.path_params["tree_id"]).state())


async def cancel_tree(api: Api, request: Request) -> Response:
    return _json(api.service.trees.cancel(request.path_params["tree_id"]).state(), 202)


async def tree_results(api: Api, request: Request) -> Response:
    service = api.service
    record = service.trees.get(request.path_params["tree_id"])
    after = _cursor(request, len(record.results), "results", "this tree's")
    lines = record.lines(
        after,
        heartbeat_s=service.settings.service.stream_heartbeat_s,
        stopping=lambda: service.trees.stopping,
    )
    return StreamingResponse(lines, media_type=NDJSON, headers=_STREAM_HEADERS)


def _number(request: Request, name: str, default: float, *, whole: bool = False) -> float:
    """A number query parameter (a whole number ≥ 1 with ``whole``).

    Raises:
        ApiError: 422, not such a number.
    """
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or (whole and value < 1):
        kind = "a whole number ≥ 1" if whole else "a number"
        raise ApiError(422, f"must be {kind}", loc=["query", name])
    return value


async def batch_eval(api: Api, request: Request) -> Response:
    record = api.service.batches.get(request.path_params["batch_id"])
    k = int(_number(request, "k", record.plan.samples_per_task, whole=True))
    most = record.plan.samples_per_task + record.plan.oversample
    if k > most:
        raise ApiError(422, f"must be at most {most}, the samples of a task", loc=["query", "k"])
    threshold = _number(request, "success_threshold", DEFAULT_SUCCESS_THRESHOLD)
    if not record.done:
        raise ApiError(
            409,
            f"batch {record.batch_id!r} is still running: read its results stream to its end"
            " (or wait for status finished), then ask again",
        )
    results, version = record.newest(), record.plan.policy_version
    try:
        # Off the loop: a bootstrap over thousands of tasks takes a while.
        report = await anyio.to_thread.run_sync(
            lambda: evaluate(results, k=k, success_threshold=threshold, policy_version=version),
            limiter=api.service.queries,
        )
    except ValueError as exc:  # k past the samples a task has
        raise ApiError(422, str(exc), loc=["query", "k"]) from None
    return JSONResponse(report.to_json())


async def rollout_events(api: Api, request: Request) -> Response:
    service = api.service
    rid = request.path_params["rollout_id"]
    first = await service.rollout_events(rid, after=0, wait_s=0)  # 404 before the stream
    known = first.events[-1].seq if first.events else 0
    # Built from a result (its Ray actor let the log go): any cursor is fine.
    after = _cursor(request, 2**62 if first.from_result else known, "events", "this rollout's")

    async def read(cursor: int, wait_s: float) -> EventPage:
        try:
            return await service.rollout_events(rid, after=cursor, wait_s=wait_s)
        except ApiError:
            # Forgotten, or its actor is slow: the stream stops without its end,
            # so the client reconnects (and hears why).
            return EventPage((), missed=0, ended=True)

    lines = ndjson_lines(
        read,
        after,
        heartbeat_s=service.settings.service.stream_heartbeat_s,
        stopping=lambda: service.batches.stopping,
    )
    return StreamingResponse(lines, media_type=NDJSON, headers=_STREAM_HEADERS)


async def get_policy(api: Api, request: Request) -> Response:
    return _json(api.service.policy_state())


async def set_policy_version(api: Api, request: Request) -> Response:
    body = await _parse(request, PolicyVersionRequest)
    try:
        # Answered once every Ray actor has it: each policy call after the answer records it.
        await api.service.pool.set_policy_version(body.version)
    except OperationTimeout as exc:
        raise ApiError(504, str(exc)) from None
    return _json(api.service.policy_state())


async def start_pause(api: Api, request: Request) -> Response:
    body = await _parse(request, PauseRequest)
    api.service.policy_state()
    pause_id = await api.service.pauses.start(body.ttl_s)
    return _json(PauseLease(pause_id=pause_id, ttl_s=body.ttl_s), 201)


async def renew_pause(api: Api, request: Request) -> Response:
    body = await _parse(request, PauseRequest)
    pause_id = request.path_params["pause_id"]
    api.service.pauses.renew(pause_id, body.ttl_s)
    return _json(PauseLease(pause_id=pause_id, ttl_s=body.ttl_s))


async def end_pause(api: Api, request: Request) -> Response:
    await api.service.pauses.release(request.path_params["pause_id"])
    return _json(api.service.policy_state())


async def open_session(api: Api, request: Request) -> Response:
    body = await _parse(request, SessionRequest)
    task = await api.service.check_task(body.task.record(), loc=["body", "task"])
    opened = await api.service.sessions.open(
        task, batch_id=body.batch_id, sample_index=body.sample_index
    )
    return _json(opened, 201)


async def step_session(api: Api, request: Request) -> Response:
    body = await _parse(request, StepRequest)
    call = body.model_dump(exclude_none=True)
    observation = await api.service.sessions.step(request.path_params["session_id"], call)
    return _json(observation)


async def end_episode(api: Api, request: Request) -> Response:
    session_id = request.path_params["session_id"]
    await api.service.sessions.done(session_id)
    return _json(SessionDone(session_id=session_id))


async def close_session(api: Api, request: Request) -> Response:
    return _json(await api.service.sessions.close(request.path_params["session_id"]))


async def query(api: Api, request: Request) -> Response:
    body = await _parse(request, QueryRequest)
    s = api.service.settings
    limit = min(body.max_rows or s.service.query_max_rows, s.service.query_max_rows)
    result = await anyio.to_thread.run_sync(
        lambda: run_query(
            s.telemetry.db_path,
            body.sql,
            body.params,
            max_rows=limit,
            timeout_s=s.service.query_timeout_s,
            max_bytes=s.service.query_max_bytes,
        ),
        limiter=api.service.queries,
    )
    return _json(result)


async def stats(api: Api, request: Request) -> Response:
    batch_id = request.query_params.get("batch_id")
    db_path = api.service.settings.telemetry.db_path
    result = await anyio.to_thread.run_sync(
        lambda: run_stats(db_path, batch_id), limiter=api.service.queries
    )
    return _json(result)


# ---------------------------------------------------------------- the table

_NO_BATCH = "No such batch (unknown, or finished long ago and forgotten)"
_NO_TREE = "No such tree (unknown, finished long ago and forgotten, or before a restart)"
_NO_SESSION = "No such session"
_NO_PAUSE = "No such pause (released, or its lease expired)"
_ENDED = "The session has ended: DELETE it for its result"
_SLOW_SESSION = "The session did not answer in time"


def _after(lines: str) -> Query:
    return Query(
        "after",
        f"Send only {lines} with a cursor above this one",
        {"type": "integer", "minimum": 0, "default": 0},
    )


ROUTES: Final[tuple[Endpoint, ...]] = (
    Endpoint(
        "GET",
        "/healthz",
        healthz,
        "healthz",
        "Liveness (needs no token)",
        answers={
            200: "The service is up",
            503: "The service cannot write service.state_dir (a full disk): it takes no"
            " new rollouts until it is restarted (status failing, with the error)",
        },
        answer=Health,
        auth=False,
    ),
    Endpoint(
        "GET",
        "/metrics",
        metrics,
        "metrics",
        "Prometheus metrics (text exposition format)",
        answers={200: "Rollouts by status, in flight, provisioning latency"},
        answer={"type": "string"},
        media="text/plain",
    ),
    Endpoint(
        "GET",
        "/openapi.json",
        openapi,
        "openapi",
        "This document",
        answers={200: "The OpenAPI document"},
        answer={"type": "object"},
    ),
    Endpoint(
        "POST",
        "/v1/batches",
        create_batch,
        "createBatch",
        "Start a batch of rollouts (idempotent with batch_id)",
        answers={
            201: "The batch started",
            200: "An identical request already started it; those of its rollouts"
            " that ended cancelled run again (`rerun`)",
        },
        answer=BatchCreated,
        body=BatchRequest,
        errors={
            409: "The batch_id is taken by a different request",
            422: "Invalid request: each problem with its location; or the pre-flight"
            " refused the batch (type preflight_error, nothing provisioned)",
            503: "The pool is full (pool.max_queued_rollouts), or a cancel of this"
            " batch is still settling: retry after Retry-After seconds; or the service"
            " cannot write service.state_dir (a full disk) and takes no new rollouts until"
            " it is restarted",
        },
    ),
    Endpoint(
        "GET",
        "/v1/batches/{batch_id}",
        get_batch,
        "getBatch",
        "A batch's status and counts",
        answers={200: "The batch"},
        answer=BatchState,
        errors={404: _NO_BATCH},
    ),
    Endpoint(
        "DELETE",
        "/v1/batches/{batch_id}",
        cancel_batch,
        "cancelBatch",
        "Cancel a batch (every result still arrives, cancelled ones too)",
        answers={202: "Cancelling"},
        answer=BatchState,
        errors={404: _NO_BATCH},
    ),
    Endpoint(
        "GET",
        "/v1/batches/{batch_id}/results",
        results,
        "streamResults",
        "The batch's results as NDJSON, streamed as rollouts end",
        description=(
            "One JSON object per line (StreamLine): `result` lines carry the n-th"
            " result with `cursor` n; `heartbeat` lines keep an idle stream alive;"
            " an `end` line closes a complete stream. A stream that stops without"
            " an `end` line was cut: reconnect with `?after=<last cursor>` to get"
            " the rest, nothing lost and nothing twice. An `interrupted` line"
            " closes the stream of a batch the service stopped while it ran (a"
            " restart): resubmit the same request to run its rollouts without a"
            " result, then reconnect with `?after=`."
        ),
        answers={200: "NDJSON: one StreamLine per line"},
        answer=StreamLine,
        media=NDJSON,
        query=(_after("results"),),
        errors={404: _NO_BATCH, 422: _INVALID},
    ),
    Endpoint(
        "GET",
        "/v1/batches/{batch_id}/groups",
        groups,
        "streamGroups",
        "The batch's groups as NDJSON, each as soon as it is complete",
        description=(
            "One JSON object per line (GroupStreamLine): `group` lines carry the n-th"
            " complete group (all samples of one task: rewards, mean, std, uniform)"
            " with `cursor` n, in completion order; `heartbeat`, `end` and"
            " `interrupted` lines as on the results stream. Reconnect with"
            " `?after=<last cursor>`. With `?complete_only=true`, groups short of"
            " samples_per_task scored samples (`complete: false`) are not sent;"
            " they still take their cursor, so cursors are the same either way."
        ),
        answers={200: "NDJSON: one GroupStreamLine per line"},
        answer=GroupStreamLine,
        media=NDJSON,
        query=(
            _after("lines"),
            Query(
                "complete_only",
                "Send only complete groups (each with samples_per_task scored samples)",
                {"type": "boolean", "default": False},
            ),
        ),
        errors={404: _NO_BATCH, 422: _INVALID},
    ),
    Endpoint(
        "GET",
        "/v1/batches/{batch_id}/eval",
        batch_eval,
        "evalBatch",
        "The batch's evaluation: pass@1 … pass@k per task, per environment and overall",
        description=(
            "Computed from the newest result of each rollout once the batch is over"
            " (fleetroll.evaluation): a sample is a success when its reward is at least"
            " `success_threshold`; samples without a reward are counted apart (per failure"
            " reason), never as failures of the policy; a task's pass@j uses its scored"
            " samples and is null when it has fewer than j. Run an evaluation as a batch"
            " with `samples_per_task` = k, `oversample` 0 and, beside training batches, a"
            " `max_in_flight` share and a `policy_version` tag."
        ),
        answers={200: "The evaluation (the JSON of `fleetroll eval --json`)"},
        answer=EVAL_REPORT_SCHEMA,
        query=(
            Query(
                "k",
                "The largest j of pass@j (default: the batch's samples_per_task; at most"
                " the samples a task has)",
                {"type": "integer", "minimum": 1},
            ),
            Query(
                "success_threshold",
                "The reward at or above which a sample is a success",
                {"type": "number", "default": DEFAULT_SUCCESS_THRESHOLD},
            ),
        ),
        errors={
            404: _NO_BATCH,
            409: "The batch is still running: read its results to the end, then ask again",
            422: _INVALID,
        },
    ),
    Endpoint(
        "POST",
        "/v1/trees",
        create_tree,
        "createTree",
        "Start a rollout tree: a root to step branch_at, then width branches (idempotent"
        " with tree_id)",
        description=(
            "As RolloutPool.run_tree: the root runs its first `branch_at` steps (the shared"
            " prefix) and stops there; then `width` branches each replay the prefix on a"
            " fresh or reset instance, every answer checked equal to the root's"
            " (`replay_diverged` otherwise), and sample on. The root is batch"
            " `{tree_id}-root`, the branches batch `{tree_id}-b{branch_at}`. Trees are"
            " kept in memory: after a restart the id is unknown, and submitting it again"
            " runs it anew."
        ),
        answers={
            201: "The tree started (its root runs)",
            200: "An identical request already started it",
        },
        answer=TreeCreated,
        body=TreeRequest,
        errors={
            409: "The tree_id is taken by a different request, or a running batch holds"
            " the id of its root's batch",
            422: "Invalid request: each problem with its location; an agent_command (a tree"
            " cannot branch an agent of its own); width over service.max_batch_rollouts;"
            " or the pre-flight refused the task (type preflight_error, nothing provisioned)",
            503: "The pool is full (pool.max_queued_rollouts): retry after Retry-After"
            " seconds; or the service cannot write service.state_dir (a full disk) and"
            " takes no new rollouts until it is restarted",
        },
    ),
    Endpoint(
        "GET",
        "/v1/trees/{tree_id}",
        get_tree,
        "getTree",
        "A tree's status, its root and the branches that ended (and its groups at the end)",
        answers={200: "The tree"},
        answer=TreeState,
        errors={404: _NO_TREE},
    ),
    Endpoint(
        "DELETE",
        "/v1/trees/{tree_id}",
        cancel_tree,
        "cancelTree",
        "Cancel a tree (no branch starts after it; every result still arrives)",
        answers={202: "Cancelling"},
        answer=TreeState,
        errors={404: _NO_TREE},
    ),
    Endpoint(
        "GET",
        "/v1/trees/{tree_id}/results",
        tree_results,
        "streamTreeResults",
        "The tree's results as NDJSON: the root (cursor 1), then each branch as it ends",
        description=(
            "One JSON object per line (TreeStreamLine), as a batch's results stream:"
            " `result` lines with their `cursor`, `heartbeat` lines while idle, and an"
            " `end` line (its `status`; `error` when the branches could not start)."
            " A stream that stops without an `end` line was cut: reconnect with"
            " `?after=<last cursor>`."
        ),
        answers={200: "NDJSON: one TreeStreamLine per line"},
        answer=TreeStreamLine,
        media=NDJSON,
        query=(_after("results"),),
        errors={404: _NO_TREE, 422: _INVALID},
    ),
    Endpoint(
        "GET",
        "/v1/rollouts/{rollout_id}/events",
        rollout_events,
        "streamRolloutEvents",
        "A rollout's live events as NDJSON: phases, turns, tool calls, the end",
        description=(
            "One JSON object per line (EventStreamLine): `event` lines carry the n-th"
            " event with `cursor` n; the stream ends after the `end` event. A `gap`"
            " line says events after the cursor are no longer held (pool.events_max)."
            " Reconnect with `?after=<last cursor>`."
        ),
        answers={200: "NDJSON: one EventStreamLine per line"},
        answer=EventStreamLine,
        media=NDJSON,
        query=(_after("lines"),),
        errors={
            404: "No such rollout (unknown, or its batch was forgotten)",
            422: _INVALID,
            504: "The Ray actor running the rollout did not answer in time",
        },
    ),
    Endpoint(
        "GET",
        "/v1/policy",
        get_policy,
        "getPolicy",
        "The policy version recorded on turns, and the pauses held",
        answers={200: "The policy"},
        answer=PolicyState,
    ),
    Endpoint(
        "PUT",
        "/v1/policy/version",
        set_policy_version,
        "setPolicyVersion",
        "Set the policy version (after a weight sync)",
        description=(
            "Answered once every place policy calls start in has the version (with"
            " `serve --ray`, every live actor): each call made after the answer records it."
        ),
        answers={200: "The policy"},
        answer=PolicyState,
        body=PolicyVersionRequest,
        errors={
            504: "A Ray actor did not confirm the version within timeouts.ray_call_s"
            " (it is set, and reaches the actor when it answers)"
        },
    ),
    Endpoint(
        "POST",
        "/v1/policy/pauses",
        start_pause,
        "startPause",
        "Pause new policy calls (tool calls go on) for a lease of ttl_s",
        description=(
            "The pause ends after `ttl_s` unless renewed with PUT, or at once with"
            " DELETE: a trainer that crashed mid weight swap cannot pause forever."
            " Waiting is charged to no rollout deadline, only to a batch's deadline_s."
        ),
        answers={201: "The pause is held"},
        answer=PauseLease,
        body=PauseRequest,
        errors={504: "A Ray actor did not confirm the pause within timeouts.ray_call_s"},
    ),
    Endpoint(
        "PUT",
        "/v1/policy/pauses/{pause_id}",
        renew_pause,
        "renewPause",
        "Renew a pause: it now ends ttl_s from now",
        answers={200: "Renewed"},
        answer=PauseLease,
        body=PauseRequest,
        errors={404: _NO_PAUSE},
    ),
    Endpoint(
        "DELETE",
        "/v1/policy/pauses/{pause_id}",
        end_pause,
        "endPause",
        "End a pause (policy calls go on when no other is held)",
        answers={200: "The policy"},
        answer=PolicyState,
        errors={404: _NO_PAUSE},
    ),
    Endpoint(
        "POST",
        "/v1/sessions",
        open_session,
        "openSession",
        "Open an env-style session on one task (provisions an instance)",
        answers={201: "The opening messages and the tools"},
        answer=SessionOpened,
        body=SessionRequest,
        errors={
            502: "The environment could not be set up",
            503: "No instance in time, a transient platform failure, or the service"
            " is shutting down",
        },
    ),
    Endpoint(
        "POST",
        "/v1/sessions/{session_id}/step",
        step_session,
        "stepSession",
        "Run one tool call in the session",
        answers={200: "The tool's answer"},
        answer=Observation,
        body=StepRequest,
        errors={
            404: _NO_SESSION,
            410: _ENDED,
            502: "The instance is gone: the session has ended",
            504: _SLOW_SESSION,
        },
    ),
    Endpoint(
        "POST",
        "/v1/sessions/{session_id}/done",
        end_episode,
        "endEpisode",
        "End the episode: the agent finished (the result will be completed,"
        " not abandoned); then DELETE the session for its result",
        answers={200: "The episode is over"},
        answer=SessionDone,
        errors={
            404: _NO_SESSION,
            410: _ENDED,
            502: "Ending the episode failed",
            504: _SLOW_SESSION,
        },
    ),
    Endpoint(
        "DELETE",
        "/v1/sessions/{session_id}",
        close_session,
        "closeSession",
        "Close the session: score it (if not yet), release it, get its result",
        answers={200: "The rollout's result"},
        answer=RolloutResult,
        errors={
            404: _NO_SESSION,
            410: "The session ended without a result (scoring it failed)",
            502: "Closing failed",
            504: _SLOW_SESSION,
        },
    ),
    Endpoint(
        "POST",
        "/v1/query",
        query,
        "query",
        "Run one read-only SQL statement on the local telemetry store",
        answers={200: "The rows"},
        answer=QueryResult,
        body=QueryRequest,
        errors={
            400: "Invalid SQL, too slow, or more than one statement",
            403: "The statement tries to change something",
            404: "No telemetry store yet",
        },
    ),
    Endpoint(
        "GET",
        "/v1/stats",
        stats,
        "stats",
        "Rollouts per environment from the telemetry store, and its invariant",
        answers={200: "The statistics"},
        answer=StatsResult,
        query=(Query("batch_id", "Only this batch's rollouts"),),
        errors={404: "No telemetry store yet, or no such batch"},
    ),
)
