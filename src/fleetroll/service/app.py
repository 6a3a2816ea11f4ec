"""The HTTP service's ASGI app: routes over one shared :class:`RolloutPool`.

::

    async with RolloutPool(settings, api_key=..., base_url=...) as pool:
        service = Service(pool, settings)
        async with serve_app(create_app(service), "127.0.0.1", 8750) as url:
            ...

With ``Service(pool, settings, batch_pool=ray_pool)``, batches and the MCP
tools' rollouts run on another :class:`~fleetroll.batch_pool.BatchPool` (a
RayRolloutPool, whose batches' views are read on the actors); sessions, each
held by one task of this process for its whole life, stay on ``pool``.

Routes (all JSON unless said otherwise; the OpenAPI document at
``/openapi.json`` has every body):

=========================================  ======================================
``POST /v1/batches``                       start a batch → ``{batch_id, rollouts}``
``GET /v1/batches/{id}``                   status and counts
``GET /v1/batches/{id}/results?after=n``   NDJSON results, resumable by cursor
``GET /v1/batches/{id}/groups?after=n``    NDJSON complete groups, resumable by cursor
``DELETE /v1/batches/{id}``                cancel
``GET /v1/policy``                         policy version, pauses held
``PUT /v1/policy/version``                 set the policy version
``POST /v1/policy/pauses``                 pause policy calls (a lease) → ``pause_id``
``PUT /v1/policy/pauses/{id}``             renew a pause's lease
``DELETE /v1/policy/pauses/{id}``          end a pause
``POST /v1/sessions``                      open a session → messages and tools
``POST /v1/sessions/{id}/step``            one tool call → observation
``POST /v1/sessions/{id}/done``            the episode is over (result: completed)
``DELETE /v1/sessions/{id}``               close → the rollout's result
``GET /v1/rollouts/{id}/events?after=n``   NDJSON live events of a rollout
``POST /v1/query``                         read-only SQL on the telemetry store
``GET /v1/stats?batch_id=``                rollouts per env, the telemetry invariant
``GET /healthz``, ``/metrics``,            liveness, Prometheus text, the API
``/openapi.json``
``/mcp``                                   the same verbs as MCP tools
=========================================  ======================================

Every await a route makes on a rollout, a session or the pool is bounded.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fleetroll.batch_pool import BatchPool
from fleetroll.errors import OperationTimeout
from fleetroll.pool import RolloutPool, group_id, rollout_id
from fleetroll.results import RolloutResult
from fleetroll.rollout import RolloutIds, RolloutView
from fleetroll.rollout_events import EventPage, ndjson_lines
from fleetroll.service.batches import BatchRecord, BatchRegistry, parse_one
from fleetroll.service.errors import ApiError
from fleetroll.service.guards import refuse_host_commands
from fleetroll.service.metrics import CONTENT_TYPE, Metrics
from fleetroll.service.models import (
    BatchCreated,
    BatchRequest,
    ErrorItem,
    Health,
    PauseLease,
    PauseRequest,
    PolicyConfig,
    PolicyState,
    PolicyVersionRequest,
    QueryRequest,
    SessionDone,
    SessionRequest,
    StepRequest,
    ValidationErrorBody,
)
from fleetroll.service.openapi import openapi_document
from fleetroll.service.query import run_query, run_stats
from fleetroll.service.security import Guard
from fleetroll.service.sessions import SessionRegistry
from fleetroll.service.state import BatchStore
from fleetroll.service.training import PauseLeases
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Redactor
from fleetroll.telemetry.dashboard import PAGE_PATHS, dashboard_panels, dashboard_routes
from fleetroll.telemetry.dashboard_auth import cookie_authorizer

__all__ = ["Service", "create_app"]

M = TypeVar("M", bound=BaseModel)
_NDJSON = "application/x-ndjson"
#: Slack over ``timeouts.release_s`` for cancelling every batch at shutdown, and
#: over the sum of a rollout's deadlines for waiting on its result. Not
#: settings: margins over deadlines that are settings already.
_SLACK_S = 5.0
_WAIT_SLACK_S = 30.0


class Service:
    """What the routes (and the MCP tools) share: the pools, batches, sessions.

    Run it with :meth:`running` (the app's lifespan does): its task group
    holds one consumer task per batch and one actor task per session.

    Args:
        pool: runs sessions, in this process.
        batch_pool: runs the batches of ``POST /v1/batches`` and the MCP tools'
            rollouts (default: ``pool``).
        store: where batches and their results are kept across restarts
            (:func:`fleetroll.service.state.open_store`; default: memory only).
    """

    def __init__(
        self,
        pool: RolloutPool,
        settings: Settings,
        *,
        batch_pool: BatchPool | None = None,
        store: BatchStore | None = None,
    ) -> None:
        self.pool = pool
        self.batch_pool = batch_pool or pool
        self.settings = settings
        self.metrics = Metrics()
        self.redact = Redactor(settings.secrets())
        self.batches = BatchRegistry(
            self.batch_pool, settings, self.metrics, preflight_pool=pool, store=store
        )
        self.sessions = SessionRegistry(pool, settings, self.metrics, self.redact)
        #: MCP rollouts: rollout id → the id of its one-rollout batch, and back.
        self.rollouts: dict[str, str] = {}
        self._rollout_of: dict[str, str] = {}
        self.batches.on_forget.append(self._forget_rollouts)
        self._queries = anyio.CapacityLimiter(settings.service.max_concurrent_queries)
        #: Pauses of policy calls held for trainers (leases).
        self.pauses = PauseLeases(pool, settings.service.max_pause_ttl_s)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self.batches.tg = tg
            self.sessions.tg = tg
            self.pauses.tg = tg
            try:
                yield
            finally:
                self.stop()
                # Let each batch's consumer see its batch to the end (the pool answers
                # a cancelled batch at once), so nothing is left half-read.
                with anyio.CancelScope(shield=True):
                    await self.batches.cancel_all(self.settings.timeouts.release_s + _SLACK_S)
                tg.cancel_scope.cancel()

    def stop(self) -> None:
        """End every results stream (the server is about to stop)."""
        self.batches.stop()

    def policy_state(self) -> PolicyState:
        """The policy version and pauses.

        Raises:
            ApiError: 409, batches run on Ray actors, which this process
                cannot pause nor tell a version.
        """
        if self.batch_pool is not self.pool:
            raise ApiError(
                409,
                "policy versions and pauses need the local pool: this service runs batches"
                " on Ray actors (serve without --ray)",
            )
        gate = self.pool.engine.policy_gate
        return PolicyState(version=gate.version, paused=gate.paused, pauses=len(self.pauses))

    # -- one-rollout batches, for the MCP tools --------------------------------

    async def start_rollout(
        self, task: Mapping[str, Any], policy: PolicyConfig | None = None
    ) -> RolloutIds:
        """Start one rollout as a batch of its own (on ``batch_pool``); its ids.

        Raises:
            ApiError: 422 (the task is invalid), 503 (the pool is full).
        """
        spec = await self.check_task(task, loc=["task"])
        record, _, _ = await self.batches.start([spec], policy, batch_id=f"mcp-{uuid.uuid4().hex}")
        batch_id = record.batch_id
        ids = RolloutIds(
            batch_id=batch_id,
            rollout_id=rollout_id(batch_id, spec.key, 0),
            group_id=group_id(batch_id, spec.key),
        )
        self.rollouts[ids.rollout_id] = batch_id
        self._rollout_of[batch_id] = ids.rollout_id
        return ids

    async def check_task(self, record: Mapping[str, Any], *, loc: Sequence[str]) -> TaskSpec:
        """One task of a request, checked in a worker thread: its verifier is
        compiled, which for a large one would hold up every other request.

        anyio's default thread limiter bounds how many run at once.

        Raises:
            ApiError: 422 naming the field (``loc`` is where the task is).
        """
        check = partial(
            parse_one,
            record,
            self.settings.modalities,
            loc=loc,
            max_verifier_bytes=self.settings.pool.max_verifier_bytes,
        )
        spec = await anyio.to_thread.run_sync(check)
        refuse_host_commands([spec], allowed=self.settings.service.allow_command_tasks, loc=loc)
        return spec

    def _record_of(self, rollout_id: str) -> BatchRecord:
        """Raises: ApiError: 404, no such rollout."""
        batch_id = self.rollouts.get(rollout_id)
        if batch_id is None:
            raise ApiError(404, f"no rollout {rollout_id!r} (unknown, or finished long ago)")
        return self.batches.get(batch_id)

    async def rollout_view(self, rollout_id: str, *, messages: bool = True) -> RolloutView:
        """What the rollout is doing, wherever it runs (this process, or a Ray actor).

        Raises:
            ApiError: 404 (no such rollout), 504 (its Ray actor did not answer in time).
        """
        record = self._record_of(rollout_id)
        try:
            return await record.batch.view(rollout_id, messages=messages)
        except OperationTimeout as exc:
            raise ApiError(504, str(exc)) from None

    def cancel_rollout(self, rollout_id: str) -> None:
        """Cancel the rollout if it is still running (its result still comes: ``cancelled``).

        Raises:
            ApiError: 404, no such rollout.
        """
        self.batches.cancel(self._record_of(rollout_id).batch_id)

    async def finish_rollout(self, rollout_id: str, timeout_s: float) -> RolloutResult:
        """Wait for the rollout's end (at most ``timeout_s``) and return its result.

        Raises:
            ApiError: 404 (no such rollout), 504 (still running after ``timeout_s``).
        """
        record = self._record_of(rollout_id)
        with anyio.move_on_after(timeout_s):
            await record.wait_done()
        if not record.results:
            raise ApiError(504, f"rollout {rollout_id} is still running after {timeout_s:g} s")
        return record.results[0]

    async def rollout_events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        """A rollout's live events after cursor ``after`` (waiting up to ``wait_s`` for one),
        of any batch or MCP rollout, wherever it runs (this process, or a Ray actor).

        Raises:
            ApiError: 404 (no such rollout), 504 (its Ray actor did not answer in time).
        """
        mcp = self.rollouts.get(rollout_id)
        records = [self.batches.get(mcp)] if mcp is not None else list(self.batches)
        for record in records:
            try:
                return await record.batch.events(rollout_id, after=after, wait_s=wait_s)
            except KeyError:
                continue
            except OperationTimeout as exc:
                raise ApiError(504, str(exc)) from None
        raise ApiError(404, f"no rollout {rollout_id!r} (unknown, or its batch was forgotten)")

    @property
    def progress_flush_s(self) -> float:
        """How long ``run_rollout`` gives its last progress notifications once the result is in."""
        return self.settings.service.stream_heartbeat_s

    @property
    def rollout_wait_s(self) -> float:
        """The longest a rollout can take from start to result."""
        t = self.settings.timeouts
        return t.provision_total_s + t.rollout_s + t.verifier_s + t.release_s + _WAIT_SLACK_S

    def _forget_rollouts(self, record: BatchRecord) -> None:
        rid = self._rollout_of.pop(record.batch_id, None)
        if rid is not None:
            self.rollouts.pop(rid, None)


# ---------------------------------------------------------------------- routes


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


Handler = Callable[[Request], Awaitable[Response]]


def _route(path: str, handler: Handler, methods: list[str]) -> Route:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return _problem(exc)
        except _InvalidBody as exc:
            return _invalid(exc.error)

    return Route(path, endpoint, methods=methods)


def _routes(service: Service) -> list[Route]:
    s = service.settings
    try:
        app_version = version("fleetroll")
    except PackageNotFoundError:  # a source tree without installed metadata
        app_version = "0"

    async def healthz(request: Request) -> Response:
        return _json(Health())

    async def metrics(request: Request) -> Response:
        batches = Counter[str](r.status for r in service.batches)
        text = service.metrics.render(
            in_flight=service.batches.in_flight(),
            sessions_open=service.sessions.open_count,
            batches=batches,
            admission=service.batch_pool.admission.state(),
        )
        return Response(text, media_type=CONTENT_TYPE)

    async def openapi(request: Request) -> Response:
        doc = openapi_document(version=app_version, token_required=s.service_token is not None)
        return JSONResponse(doc)

    async def create_batch(request: Request) -> Response:
        body = await _parse(request, BatchRequest)
        record, created, rerun = await service.batches.submit(body)
        answer = BatchCreated(
            batch_id=record.batch_id, rollouts=record.total, created=created, rerun=rerun
        )
        return _json(answer, 201 if created else 200)

    async def get_batch(request: Request) -> Response:
        return _json(service.batches.get(request.path_params["batch_id"]).state())

    async def cancel_batch(request: Request) -> Response:
        return _json(service.batches.cancel(request.path_params["batch_id"]).state(), 202)

    async def results(request: Request) -> Response:
        record = service.batches.get(request.path_params["batch_id"])
        raw = request.query_params.get("after", "0")
        if not raw.isdigit() or not raw.isascii():
            raise ApiError(422, "must be a whole number ≥ 0", loc=["query", "after"])
        after = int(raw)
        if after > len(record.results):
            raise ApiError(
                422,
                f"cursor {after} is ahead of this batch's {len(record.results)} results",
                loc=["query", "after"],
            )
        lines = record.lines(
            after,
            heartbeat_s=s.service.stream_heartbeat_s,
            stopping=lambda: service.batches.stopping,
        )
        # No buffering by proxies: each line should reach the controller as it is made.
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(lines, media_type=_NDJSON, headers=headers)

    async def groups(request: Request) -> Response:
        record = service.batches.get(request.path_params["batch_id"])
        after = _cursor(request, len(record.groups.groups), "groups")
        lines = record.groups.lines(
            record,
            after,
            heartbeat_s=s.service.stream_heartbeat_s,
            stopping=lambda: service.batches.stopping,
        )
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(lines, media_type=_NDJSON, headers=headers)

    async def rollout_events(request: Request) -> Response:
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
            heartbeat_s=s.service.stream_heartbeat_s,
            stopping=lambda: service.batches.stopping,
        )
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(lines, media_type=_NDJSON, headers=headers)

    async def get_policy(request: Request) -> Response:
        return _json(service.policy_state())

    async def set_policy_version(request: Request) -> Response:
        body = await _parse(request, PolicyVersionRequest)
        service.policy_state()  # refused on Ray
        service.pool.policy_version = body.version
        return _json(service.policy_state())

    async def start_pause(request: Request) -> Response:
        body = await _parse(request, PauseRequest)
        service.policy_state()
        pause_id = await service.pauses.start(body.ttl_s)
        return _json(PauseLease(pause_id=pause_id, ttl_s=body.ttl_s), 201)

    async def renew_pause(request: Request) -> Response:
        body = await _parse(request, PauseRequest)
        pause_id = request.path_params["pause_id"]
        service.pauses.renew(pause_id, body.ttl_s)
        return _json(PauseLease(pause_id=pause_id, ttl_s=body.ttl_s))

    async def end_pause(request: Request) -> Response:
        await service.pauses.release(request.path_params["pause_id"])
        return _json(service.policy_state())

    async def open_session(request: Request) -> Response:
        body = await _parse(request, SessionRequest)
        task = await service.check_task(body.task.record(), loc=["body", "task"])
        opened = await service.sessions.open(
            task, batch_id=body.batch_id, sample_index=body.sample_index
        )
        return _json(opened, 201)

    async def step_session(request: Request) -> Response:
        body = await _parse(request, StepRequest)
        call = body.model_dump(exclude_none=True)
        observation = await service.sessions.step(request.path_params["session_id"], call)
        return _json(observation)

    async def end_episode(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        await service.sessions.done(session_id)
        return _json(SessionDone(session_id=session_id))

    async def close_session(request: Request) -> Response:
        return _json(await service.sessions.close(request.path_params["session_id"]))

    async def query(request: Request) -> Response:
        body = await _parse(request, QueryRequest)
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
            limiter=service._queries,
        )
        return _json(result)

    async def stats(request: Request) -> Response:
        batch_id = request.query_params.get("batch_id")
        result = await anyio.to_thread.run_sync(
            lambda: run_stats(s.telemetry.db_path, batch_id), limiter=service._queries
        )
        return _json(result)

    return [
        _route("/healthz", healthz, ["GET"]),
        _route("/metrics", metrics, ["GET"]),
        _route("/openapi.json", openapi, ["GET"]),
        _route("/v1/batches", create_batch, ["POST"]),
        _route("/v1/batches/{batch_id}", get_batch, ["GET"]),
        _route("/v1/batches/{batch_id}", cancel_batch, ["DELETE"]),
        _route("/v1/batches/{batch_id}/results", results, ["GET"]),
        _route("/v1/batches/{batch_id}/groups", groups, ["GET"]),
        _route("/v1/rollouts/{rollout_id}/events", rollout_events, ["GET"]),
        _route("/v1/policy", get_policy, ["GET"]),
        _route("/v1/policy/version", set_policy_version, ["PUT"]),
        _route("/v1/policy/pauses", start_pause, ["POST"]),
        _route("/v1/policy/pauses/{pause_id}", renew_pause, ["PUT"]),
        _route("/v1/policy/pauses/{pause_id}", end_pause, ["DELETE"]),
        _route("/v1/sessions", open_session, ["POST"]),
        _route("/v1/sessions/{session_id}/step", step_session, ["POST"]),
        _route("/v1/sessions/{session_id}/done", end_episode, ["POST"]),
        _route("/v1/sessions/{session_id}", close_session, ["DELETE"]),
        _route("/v1/query", query, ["POST"]),
        _route("/v1/stats", stats, ["GET"]),
    ]


def create_app(service: Service) -> ASGIApp:
    """The service's ASGI app: routes, MCP tools at ``/mcp``, behind the :class:`Guard`."""
    from fleetroll.service.mcp_tools import build_mcp_server, mcp_app

    mcp = build_mcp_server(service)
    mcp_asgi = mcp_app(mcp)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with service.running(), mcp.session_manager.run():
            yield

    s = service.settings
    dashboard = dashboard_routes(
        s.telemetry.db_path,
        query_timeout_s=s.service.query_timeout_s,
        # Its own threads: an open dashboard never takes a /v1/query slot.
        panels=dashboard_panels(s),
        gauges=lambda: asdict(service.batch_pool.admission.state()),
        token=s.service_token,
    )
    routes = Starlette(routes=[*_routes(service), *dashboard], lifespan=lifespan)

    async def root(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in ("/mcp", "/mcp/"):
            scope = dict(scope, path="/mcp", raw_path=b"/mcp")
            await mcp_asgi(scope, receive, send)
        else:
            await routes(scope, receive, send)

    return Guard(
        root,
        token=service.settings.service_token,
        max_body_bytes=service.settings.service.max_body_bytes,
        open_paths={"/healthz", *PAGE_PATHS},  # the page holds no data; it sends the token
        also_authorized=cookie_authorizer(s.service_token),  # the dashboard's login cookie
    )
