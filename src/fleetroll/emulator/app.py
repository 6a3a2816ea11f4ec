"""The emulator's HTTP surface: Fleet's control plane and the instances' APIs.

Wire shapes follow the fleet-python SDK (``fleet/models.py``,
``fleet/_async/client.py``, ``fleet/_async/base.py``): bodies are the SDK's
models as JSON, and error bodies are shaped so that the SDK raises its own
typed exceptions (``{"detail": "..."}``, or a structured ``detail`` for the
instance limit and for retryable errors).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
from fleet.instance.models import ResetRequest
from fleet.models import InstanceRequest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from fleetroll.emulator import traces as trace_api
from fleetroll.emulator.envs.base import SampleEnv
from fleetroll.emulator.faults import FaultInjector, hang
from fleetroll.emulator.instances import MISSED_HEARTBEATS, Instance, InstanceStore, NewDatabase
from fleetroll.emulator.leases import BrowserLeases
from fleetroll.emulator.ledger import Ledger
from fleetroll.emulator.mcp_routing import McpRouter
from fleetroll.emulator.verifiers import BundleError, VerifierRunner

__all__ = ["EmulatorApp", "RecordedRequest"]

#: Create request ids remembered for the duplicate-create answer (409).
_KEEP_REQUEST_IDS = 4096


@dataclass(slots=True)
class RecordedRequest:
    """One HTTP request the emulator received (its MCP traffic is not recorded)."""

    method: str
    path: str
    query: str
    #: Lower-case names; a repeated header's last value.
    headers: dict[str, str]
    body: bytes = b""
    #: The answer's status (0 until it was sent).
    status: int = 0
    _chunks: list[bytes] = field(default_factory=list, repr=False)

    def json(self) -> object:
        return json.loads(self.body) if self.body else None


def _error(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _create_timed_out(max_wait: float) -> JSONResponse:
    waited = "" if math.isinf(max_wait) else f" within max_wait_seconds={max_wait:g}"
    return _error(504, f"Create timed out upstream: the instance was not ready{waited}")


class EmulatorApp:
    """An ASGI app serving one emulated Fleet: control plane, instances, MCP."""

    def __init__(
        self,
        envs: Sequence[SampleEnv],
        store: InstanceStore,
        faults: FaultInjector,
        ledger: Ledger,
        verifiers: VerifierRunner,
        *,
        api_key: str,
    ) -> None:
        self.envs = {env.key: env for env in envs}
        self.store = store
        self.faults = faults
        self.ledger = ledger
        self.verifiers = verifiers
        self.base_url = ""  # set once the server knows its port
        self._api_key = api_key
        self._create_queue = anyio.Lock()
        self._reaper_wake: anyio.Event | None = None
        self._next_create_slot = 0.0
        #: The account's create rate limit (``create_rate_limit``): tokens, and when.
        self._rate_tokens = faults.profile.create_rate_limit or 0.0
        self._rate_updated = time.monotonic()
        #: Creates admitted under the instance limit and not answered yet: like
        #: Fleet, the limit counts instances still starting, so concurrent
        #: creates cannot pass it together.
        self._starting = 0
        #: Worker threads making instances' files (a file's work is I/O mostly).
        self._database_threads = anyio.CapacityLimiter(4)
        #: Instances by the request id (``X-Request-ID``) of the create that
        #: made them: a create sent again with the same id is answered 409
        #: ``duplicate_request_id`` pointing at it, as Fleet answers.
        self._made_by_request: OrderedDict[str, str] = OrderedDict()
        #: Creates at work, by request id: the same request sent again meanwhile
        #: waits for the first's outcome.
        self._creating: dict[str, anyio.Event] = {}
        #: Every control-plane and instance-API request, in arrival order, when
        #: recording (``Emulator(record_requests=...)``; up to that many).
        self.requests: deque[RecordedRequest] | None = None
        self.mcp = McpRouter(envs, store, faults, ledger)
        #: What the trace API received (``/v1/traces/jobs``, ``/v1/sessions/ingest``).
        self.traces = trace_api.TraceStore()
        self.leases = BrowserLeases(
            store,
            authorized=self._authorized,
            unauthorized=self._unauthorized,
            base_url=lambda: self.base_url,
            faults=faults,
        )
        self._starlette = Starlette(
            routes=[
                Route("/v1/env/", self.list_envs, methods=["GET"]),
                Route("/v1/env/instances", self.list_instances, methods=["GET"]),
                Route("/v1/env/instances", self.create_instance, methods=["POST"]),
                Route("/v1/env/instances/batch", self.delete_batch, methods=["DELETE"]),
                Route("/v1/env/runs", self.list_runs, methods=["GET"]),
                Route("/v1/env/instances/{instance_id}", self.get_instance, methods=["GET"]),
                Route("/v1/env/instances/{instance_id}", self.delete_instance, methods=["DELETE"]),
                Route(
                    "/v1/env/instances/{instance_id}/heartbeat", self.heartbeat, methods=["POST"]
                ),
                Route("/v1/env/{env_key}", self.get_env, methods=["GET"]),
                Route("/v1/account", self.account, methods=["GET"]),
                Route("/v1/verifiers/check", self.check_bundle, methods=["GET"]),
                Route("/v1/verifiers/execute", self.execute_verifier, methods=["POST"]),
                Route("/v1/traces/jobs", self.trace_job, methods=["POST"]),
                Route("/v1/sessions/ingest", self.ingest_trace, methods=["POST"]),
                *self.leases.routes(),
                Route("/_emulator/ledger", self.get_ledger, methods=["GET"]),
                Route("/instances/{instance_id}/api/v1/env/reset", self.reset, methods=["POST"]),
                Route("/instances/{instance_id}/api/v1/env/health", self.health, methods=["GET"]),
                Route(
                    "/instances/{instance_id}/api/v1/env/resources", self.resources, methods=["GET"]
                ),
                Route(
                    "/instances/{instance_id}/api/v1/env/resources/sqlite/{name}/query",
                    self.query,
                    methods=["POST"],
                ),
            ],
            lifespan=self._lifespan,
        )

    def record_requests(self, keep: int) -> None:
        """Record the requests received from now on (the latest ``keep``)."""
        self.requests = deque(maxlen=keep)

    def _recorded(self, scope: Scope, receive: Receive, send: Send) -> tuple[Receive, Send]:
        assert self.requests is not None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode("latin-1")
        entry = RecordedRequest(scope["method"], scope["path"], query, headers)
        self.requests.append(entry)

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                entry._chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    entry.body = b"".join(entry._chunks)
                    entry._chunks.clear()
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry.status = int(message["status"])
            await send(message)

        return receiving, sending

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["type"] == "http":
                matched = McpRouter.match(scope["path"])
                if matched is not None:
                    await self.mcp.handle(*matched, scope, receive, send)
                    return
                lease_id = BrowserLeases.match(scope["path"])
                if lease_id is not None:
                    # A leased browser's MCP: the computer tool on its instance's screen.
                    leased = self.leases.instance_of(lease_id) or ""
                    await self.mcp.handle(leased, "aggregator", scope, receive, send)
                    return
                if self.requests is not None:
                    receive, send = self._recorded(scope, receive, send)
            await self._starlette(scope, receive, send)
        except* ClientDisconnect:
            # The client went away before its request was read (a cancelled
            # rollout, Ctrl-C): nobody is left to answer, and nothing is wrong.
            pass

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            async with self.mcp.run(), anyio.create_task_group() as tg:
                tg.start_soon(self._reap)
                yield
                tg.cancel_scope.cancel()
        finally:
            await self.verifiers.aclose()

    async def _reap(self) -> None:
        """Apply TTL expiry and instance deaths even to instances nobody asks
        about, and forget old ended instances: asleep until the next deadline,
        or until the store has an earlier one."""
        self.store.on_earlier_deadline = self._wake_reaper
        try:
            while True:
                self._reaper_wake = anyio.Event()
                self.store.expire_due()
                deadline = self.store.next_deadline()
                wait = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
                with anyio.move_on_after(wait):
                    await self._reaper_wake.wait()
        finally:
            self.store.on_earlier_deadline = None

    def _wake_reaper(self) -> None:
        if self._reaper_wake is not None:
            self._reaper_wake.set()

    # -- helpers ------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        """The request carries the emulator's key (``Authorization: Bearer KEY``).

        Instance routes (MCP, the manager API) do not ask for it, as on Fleet,
        where the SDK sends no key to an instance: their URLs hold an instance
        id that only an authorized control-plane answer reveals.
        """
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            given.strip().encode(), self._api_key.encode()
        )

    def _unauthorized(self) -> JSONResponse:
        return _error(401, "Invalid or missing API key")

    def _instance(self, request: Request, *, alive: bool = False) -> Instance | JSONResponse:
        instance_id = request.path_params["instance_id"]
        inst = self.store.get(instance_id)
        if inst is None or (alive and not inst.alive):
            return _error(404, f"Instance '{instance_id}' not found")
        return inst

    # -- control plane ------------------------------------------------------

    async def list_envs(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        self.ledger.env_listings += 1
        return JSONResponse([env.describe() for env in self.envs.values()])

    async def get_env(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        env = self.envs.get(request.path_params["env_key"])
        if env is None:
            return _error(404, f"Environment '{request.path_params['env_key']}' not found")
        return JSONResponse(env.describe())

    async def account(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        limit = self.faults.profile.instance_limit
        return JSONResponse(
            {
                "team_id": "team-emulator",
                "team_name": "fleetroll emulator",
                "instance_limit": -1 if limit is None else limit,
                "instance_count": self._instance_count(),
            }
        )

    async def create_instance(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        request_id = request.headers.get("x-request-id")
        if request_id and (creating := self._creating.get(request_id)) is not None:
            # The same request while the first is still at work: answered once
            # that one is decided (Fleet answers 409 with the starting instance,
            # which the SDK then waits for: the same outcome).
            await creating.wait()
        made = self._made_by_request.get(request_id) if request_id else None
        if made is not None:
            # The SDK's duplicate-create answer (fleet/_async/base.py reads it).
            return _error(
                409,
                {
                    "error": "duplicate_request_id",
                    "instance_id": made,
                    "message": f"Request '{request_id}' already created instance {made}",
                },
            )
        try:
            body = InstanceRequest.model_validate(await request.json())
        except (ValueError, ValidationError) as exc:
            return _error(422, f"Invalid instance request: {exc}")
        env = self.envs.get(body.env_key)
        if env is None:
            return _error(400, f"Environment '{body.env_key}' not found")
        version = body.env_version or env.versions[-1]
        if version not in env.versions:
            return _error(400, f"Version '{version}' not found for env '{env.key}'")
        data_key = body.data_key
        if data_key is not None and data_key not in env.data_keys:
            return _error(400, f"Data key '{data_key}' is not available for env '{env.key}'")

        self.ledger.create_started()
        outcome = "error"
        creating = anyio.Event()
        if request_id:
            self._creating[request_id] = creating
        try:
            response, outcome = await self._create(request, body, env, version)
        finally:
            self.ledger.create_finished(outcome)
            if request_id and self._creating.get(request_id) is creating:
                del self._creating[request_id]
            creating.set()
        return response

    def _rate_limited(self) -> float | None:
        """Seconds until the account may create again (``create_rate_limit``); None: now."""
        limit = self.faults.profile.create_rate_limit
        if limit is None:
            return None
        now = time.monotonic()
        burst = max(1.0, limit)
        self._rate_tokens = min(burst, self._rate_tokens + (now - self._rate_updated) * limit)
        self._rate_updated = now
        if self._rate_tokens >= 1.0:
            self._rate_tokens -= 1.0
            return None
        return (1.0 - self._rate_tokens) / limit

    def _instance_count(self) -> int:
        """Instances counted against the account's limit: running and starting."""
        return self.ledger.running + self._starting

    async def _create(
        self, request: Request, body: InstanceRequest, env: SampleEnv, version: str
    ) -> tuple[Response, str]:
        count = self._instance_count()
        decision = self.faults.create_outcome(count)
        if decision == "instance_limit":
            limit = self.faults.profile.instance_limit
            return _error(
                403,
                {
                    "error_type": "instance_limit_exceeded",
                    "message": (
                        f"Instance limit reached: You have {count} running "
                        f"instances out of a maximum of {limit}."
                    ),
                    "running_instances": count,
                    "instance_limit": limit,
                },
            ), "instance_limit"
        faults = self.faults
        wait_s = self._rate_limited()
        if wait_s is not None:
            return _error(
                429,
                "Rate limit exceeded: too many instance creates",
                headers={"Retry-After": f"{wait_s:.3g}"},
            ), "429"
        # As on Fleet, a create answers within the wait the client asked for
        # (the SDK asks for its own timeout minus 30 s; 0 when that is shorter
        # than 30 s, which we read as "no wait asked": its own deadline rules).
        wait = body.max_wait_seconds
        max_wait = float(wait) if wait is not None and wait > 0 else math.inf
        if decision == "hang":
            gone = await hang(request, min(faults.profile.create_hang_s, max_wait))
            return _create_timed_out(max_wait), "hang_abandoned" if gone else "hang"
        if decision == "429":
            return _error(
                429,
                "Rate limit exceeded: too many instance creates",
                headers={"Retry-After": f"{faults.profile.retry_after_s:g}"},
            ), "429"
        if decision == "5xx":
            status = faults.server_error_status()
            if faults.chance(faults.profile.p_retryable_body):
                detail: Any = {"message": "Provisioning backend unavailable", "retryable": True}
            else:
                detail = "Provisioning backend unavailable"
            return _error(status, detail), str(status)
        self._starting += 1
        try:
            return await self._make(request, body, env, version)
        finally:
            self._starting -= 1

    async def _make(
        self, request: Request, body: InstanceRequest, env: SampleEnv, version: str
    ) -> tuple[Response, str]:
        faults = self.faults
        wait = body.max_wait_seconds
        max_wait = float(wait) if wait is not None and wait > 0 else math.inf
        await self._wait_create_slot()
        latency = faults.create_latency()
        # The instance's file is made in a worker thread while the create's
        # latency runs, as Fleet provisions an instance while its create waits.
        # Made on the loop after the latency, a thousand creates that ended
        # together each waited for the files of those before it.
        database = self.store.new_database(env, body.data_key)
        outcome = "ok"
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._make_database, database)
                began, waited = time.monotonic(), min(latency, max_wait)
                gone = bool(latency) and await hang(request, waited)
                if gone and faults.profile.creates_outlive_clients:
                    # As Fleet: the create goes on without its client.
                    outcome = "client_gone"
                    await anyio.sleep(max(0.0, waited - (time.monotonic() - began)))
            # A client that left while its file was made (a cancelled batch) gets
            # no instance either: it could never learn its id to release it.
            if not faults.profile.creates_outlive_clients and (
                gone or await request.is_disconnected()
            ):
                return _error(499, "client went away"), "abandoned"
            if latency > max_wait:
                return _create_timed_out(max_wait), "timed_out"
            ttl = body.ttl_seconds if body.ttl_seconds is not None else faults.profile.default_ttl_s
            inst = self.store.create(
                env,
                version=version,
                data_key=body.data_key,
                data_version=body.data_version,
                region=body.region or "us-west-1",
                run_id=body.run_id,
                env_variables=body.env_variables,
                image_type=body.image_type,
                ttl_s=ttl,
                dies_after_s=faults.death_after(),
                heartbeat_interval=body.heartbeat_interval,
                database=database,
            )
        finally:
            database.discard()  # no instance took it
        request_id = request.headers.get("x-request-id")
        if request_id:
            self._made_by_request[request_id] = inst.instance_id
            while len(self._made_by_request) > _KEEP_REQUEST_IDS:
                self._made_by_request.popitem(last=False)
        # Made, but its answer is late: a client whose deadline passes meanwhile
        # never learns the instance's id.
        delay = faults.profile.create_answer_delay_s
        if delay and await hang(request, delay):
            outcome = "answer_lost"
        return JSONResponse(inst.to_response(self.base_url)), outcome

    async def _make_database(self, database: NewDatabase) -> None:
        await anyio.to_thread.run_sync(database.make, limiter=self._database_threads)

    async def _wait_create_slot(self) -> None:
        interval = self.faults.profile.create_queue_interval_s
        if not interval:
            return
        async with self._create_queue:
            wait = self._next_create_slot - time.monotonic()
            if wait > 0:
                await anyio.sleep(wait)
            self._next_create_slot = time.monotonic() + interval

    async def list_instances(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        status = request.query_params.get("status")
        run_id = request.query_params.get("run_id")
        self.store.refresh_all()
        out = [
            inst.to_response(self.base_url)
            for inst in self.store
            if (status is None or inst.status.value == status)
            and (run_id is None or inst.run_id == run_id)
        ]
        return JSONResponse(out)

    async def list_runs(self, request: Request) -> Response:
        """Instances grouped by ``run_id`` (the SDK's ``list_runs``): ``active``
        (default: runs with a running instance), ``inactive`` or ``all``."""
        if not self._authorized(request):
            return self._unauthorized()
        which = request.query_params.get("active", "active")
        if which not in ("active", "inactive", "all"):
            return _error(422, f"active must be 'active', 'inactive' or 'all', not {which!r}")
        self.store.refresh_all()
        runs: dict[str, list[Instance]] = {}
        for inst in self.store:
            if inst.run_id is not None:
                runs.setdefault(inst.run_id, []).append(inst)
        out = []
        for run_id, members in sorted(runs.items()):
            running = sum(inst.alive for inst in members)
            if (which == "active" and not running) or (which == "inactive" and running):
                continue
            created = sorted(inst.created_at for inst in members)
            out.append(
                {
                    "run_id": run_id,
                    "running_count": running,
                    "total_count": len(members),
                    "first_created_at": created[0],
                    "last_created_at": created[-1],
                    "profile_id": None,
                }
            )
        return JSONResponse(out)

    async def get_instance(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        inst = self._instance(request)
        if isinstance(inst, Response):
            return inst
        return JSONResponse(inst.to_response(self.base_url))

    async def delete_instance(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        inst = self._instance(request)
        if isinstance(inst, Response):
            return inst
        if inst.alive and self.faults.chance(self.faults.profile.p_delete_error):
            return _error(500, "Instance manager error: the instance could not be stopped")
        self.store.delete(inst)
        return JSONResponse(inst.to_response(self.base_url))

    async def delete_batch(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        run_id = request.query_params.get("run_id")
        if not run_id:
            return _error(400, "run_id or profile_id is required")
        deleted = []
        for inst in self.store:
            if inst.run_id == run_id and inst.alive:
                self.store.delete(inst)
                deleted.append(inst.to_response(self.base_url))
        return JSONResponse(deleted)

    async def heartbeat(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        inst = self._instance(request, alive=True)
        if isinstance(inst, Response):
            return inst
        self.store.heartbeat(inst)
        interval = inst.heartbeat_interval
        return JSONResponse(
            {
                "success": True,
                "instance_id": inst.instance_id,
                "last_heartbeat": inst.last_heartbeat_at,
                # When it stops without another beat.
                "deadline_timestamp": (
                    time.time() + MISSED_HEARTBEATS * interval if interval else None
                ),
                "interval_seconds": interval,
            }
        )

    async def get_ledger(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        self.store.refresh_all()
        return JSONResponse(self.ledger.snapshot())

    # -- traces -------------------------------------------------------------

    async def _trace_fault(self, request: Request) -> Response | None:
        if not self._authorized(request):
            return self._unauthorized()
        faults = self.faults
        if faults.chance(faults.profile.p_trace_hang):
            await hang(request, faults.profile.trace_hang_s)
            return _error(504, "the trace API timed out upstream")
        if faults.chance(faults.profile.p_trace_5xx):
            return _error(faults.server_error_status(), "the trace API failed")
        return None

    async def trace_job(self, request: Request) -> Response:
        return await self._trace_fault(request) or await trace_api.trace_job(self.traces, request)

    async def ingest_trace(self, request: Request) -> Response:
        return await self._trace_fault(request) or await trace_api.ingest(self.traces, request)

    # -- verifiers ----------------------------------------------------------

    async def check_bundle(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        sha = request.query_params.get("sha256", "")
        return JSONResponse({"success": self.verifiers.has_bundle(sha), "key": None})

    async def execute_verifier(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        try:
            body = await request.json()
            sha = str(body["sha256"])
            function_name = str(body["function_name"])
            args_b64 = str(body.get("args") or "")
            args_array = body.get("args_array") or []
            timeout = float(body.get("timeout") or 30)
        except (ValueError, KeyError, TypeError) as exc:
            return _error(422, f"Invalid verifier execute request: {exc!r}")
        if self.faults.chance(self.faults.profile.p_verifier_error):
            self.ledger.verifier_ran("injected_error")
            return _error(503, "Verifier runtime unavailable (injected fault)")
        if body.get("bundle"):
            import base64

            try:
                self.verifiers.add_bundle(sha, base64.b64decode(body["bundle"]))
            except (BundleError, ValueError) as exc:
                return _error(400, f"Invalid verifier bundle: {exc}")
        instance_id = next(
            (a["env"] for a in reversed(args_array) if isinstance(a, dict) and "env" in a), None
        )
        inst = self.store.get(str(instance_id)) if instance_id else None
        base = {
            "key": body.get("key"),
            "version": 1,
            "verifier_id": sha[:16],
            "bundle_cache_hit": not body.get("bundle"),
        }
        if inst is None or not inst.alive:
            self.ledger.verifier_ran("instance_gone")
            return JSONResponse(
                {
                    **base,
                    "success": False,
                    "result": None,
                    "execution_id": None,
                    "execution_time_ms": 0,
                    "stdout": "",
                    "error": {
                        "type": "RuntimeError",
                        "message": f"Instance '{instance_id}' not running",
                    },
                }
            )
        try:
            answer = await self.verifiers.execute(
                sha256=sha,
                function_name=function_name,
                args_b64=args_b64,
                instance_id=inst.instance_id,
                databases={"current": str(inst.db_path)},
                timeout_s=timeout,
            )
        except BundleError as exc:
            return _error(404, str(exc))
        self.ledger.verifier_ran("ok" if answer["success"] else "error")
        return JSONResponse({**base, **answer})

    # -- instance manager API -----------------------------------------------

    async def reset(self, request: Request) -> Response:
        inst = self._instance(request, alive=True)
        if isinstance(inst, Response):
            return inst
        if self.faults.chance(self.faults.profile.p_reset_hang):
            await hang(request, self.faults.profile.reset_hang_s)
            return _error(504, "Reset timed out")
        # The SDK's ResetRequest (``AsyncEnv.reset(seed, timestamp)``); no body: neither.
        try:
            raw = await request.body()
            body = ResetRequest.model_validate(json.loads(raw) if raw.strip() else {})
        except (ValueError, ValidationError) as exc:
            return _error(422, f"Invalid reset request: {exc}")
        if self.faults.chance(self.faults.profile.p_reset_error):
            message = f"Instance {inst.instance_id} could not be reset (injected fault)"
            return JSONResponse({"success": False, "message": message})
        self.store.reseed(inst, seed=body.seed, timestamp=body.timestamp)
        self.ledger.reset(seed=body.seed, timestamp=body.timestamp)
        return JSONResponse({"success": True, "message": f"Instance {inst.instance_id} reset"})

    async def health(self, request: Request) -> Response:
        inst = self._instance(request, alive=True)
        if isinstance(inst, Response):
            return inst
        return JSONResponse(
            {
                "status": "healthy",
                "service": inst.env.key,
                "timestamp": datetime.now(UTC).isoformat(),
            }
        )

    async def resources(self, request: Request) -> Response:
        inst = self._instance(request, alive=True)
        if isinstance(inst, Response):
            return inst
        return JSONResponse([{"name": "current", "type": "sqlite", "mode": "rw"}])

    async def query(self, request: Request) -> Response:
        inst = self._instance(request, alive=True)
        if isinstance(inst, Response):
            return inst
        if request.path_params["name"] != "current":
            return _error(404, f"Resource '{request.path_params['name']}' not found")
        body = await request.json()
        try:
            cursor = inst.conn.execute(str(body["query"]), body.get("args") or [])
            rows = [list(row) for row in cursor.fetchall()]
        except (KeyError, TypeError) as exc:
            return _error(422, f"Invalid query request: {exc!r}")
        except Exception as exc:  # sqlite errors are answers, as on Fleet
            return JSONResponse({"success": False, "error": str(exc), "message": "query failed"})
        columns = [d[0] for d in cursor.description or ()]
        return JSONResponse(
            {
                "success": True,
                "columns": columns,
                "rows": rows,
                "rows_affected": cursor.rowcount,
                "message": f"{len(rows)} rows",
            }
        )
