"""``fleetroll.client``: the HTTP service from Python, shaped like the in-process pool.

A controller switches between in-process and remote by changing one line,
the one that makes the pool::

    async with RolloutPool(settings, api_key=key, base_url=fleet) as pool:   # in-process
    async with FleetrollClient("http://10.0.0.5:8750", token=token) as pool: # remote

        batch = pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=8)
        async for result in batch:          # each result as soon as its rollout ends
            ...
        async with pool.session(task) as env:
            messages = await env.reset()
            step = await env.step({"name": "list_accounts", "arguments": {}})
            env.done()                      # the agent finished: the result is completed
        result = await env.close()

Everything below that line is the same: ``run_batch`` returns an async
iterator of :class:`~fleetroll.results.RolloutResult` (one per rollout), and
``session`` an object with ``reset``/``step``/``done``/``close`` and ``tools``.
Remotely, ``tasks`` may be :class:`~fleetroll.tasks.TaskSpec` objects or task
dicts, and ``policy`` a :class:`~fleetroll.policies.ScriptedPolicy`, a
:class:`~fleetroll.service.models.PolicyConfig` (e.g. for an OpenAI-compatible
endpoint: ``PolicyConfig(kind="openai", base_url=..., model=...)``), a dict
of its fields, or None for the server's configured policy.

A results stream that breaks (a proxy, a network blip, a server restart
behind a load balancer) is reopened on its own with ``?after=<cursor>``:
nothing is lost and nothing arrives twice. Retries are bounded, with
exponential backoff and full jitter (``fleetroll.retrying``, defaults from
``[retries]``); a batch submission is retried safely
because the batch id is chosen here, before the first attempt.

A trainer doing asynchronous RL has the same verbs as in-process, awaited:
``await client.set_policy_version(v)`` after a weight sync, ``async with
client.policy_paused():`` around the swap (a lease the client renews while
the block runs, so a trainer that dies cannot pause the service forever),
and ``batch.groups()`` for each GRPO group as soon as it is complete.

``async for event in client.follow(rollout_id)`` watches one rollout live:
its phases, policy turns and tool calls (timings, redacted previews), then
its end; a cut stream is reopened after the last event's cursor.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from types import TracebackType
from typing import Any, Self

import anyio
import httpx

import fleetroll.retrying as retrying
from fleetroll.env_session import StepResult
from fleetroll.errors import InstanceLostError, ServiceError
from fleetroll.groups import Group
from fleetroll.policies import ScriptedPolicy, ToolCall, ToolSpec
from fleetroll.results import RolloutResult
from fleetroll.retrying import Decision, retry_after_s
from fleetroll.rollout_events import RolloutEvent
from fleetroll.service.models import BatchState, PolicyConfig
from fleetroll.settings import RetrySettings
from fleetroll.tasks import TaskSpec
from fleetroll.tools import ToolResult

__all__ = ["FleetrollClient", "RemoteBatch", "RemoteGroups", "RemoteSession", "ServiceError"]

#: Statuses worth another try: the service's own "later" (busy, full, starting).
#: Narrower than retrying.transient_status: its 502/504 are a session's verdicts.
_RETRY_STATUSES = frozenset({429, 503})
#: How long an idle connection to the service is reused (it keeps them 65 s).
_KEEPALIVE_S = 15.0


class FleetrollClient:
    """An async client of ``fleetroll serve``. Use it as an async context manager.

    Args:
        base_url: the service, e.g. ``http://127.0.0.1:8750``.
        token: the bearer token (the server's ``FLEETROLL_SERVICE_TOKEN``), if it has one.
        timeout_s: deadline of one ordinary request.
        stream_read_timeout_s: longest silence on a results stream before it
            counts as broken (the server sends heartbeats while idle).
        session_timeout_s: deadline of opening and of closing a session
            (provisioning, and the verifier at close, can take a while).
        max_retries: consecutive failed attempts (connection errors, 429, 503,
            broken streams) tolerated before giving up with :class:`ServiceError`
            (default: ``[retries]`` ``client_max_retries``).
        backoff_initial_s, backoff_max_s: full-jitter exponential backoff
            between attempts, or the server's longer Retry-After (defaults:
            ``[retries]`` ``client_backoff_*``). Each retry is a debug record
            on the ``fleetroll.retries`` logger (operation ``client`` or
            ``client_stream``).
        http_client: an ``httpx.AsyncClient`` to use and leave open (tests, proxies).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        stream_read_timeout_s: float = 60.0,
        session_timeout_s: float = 1200.0,
        max_retries: int | None = None,
        backoff_initial_s: float | None = None,
        backoff_max_s: float | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        defaults = RetrySettings()
        if max_retries is None:
            max_retries = defaults.client_max_retries
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, not {max_retries}")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self.stream_read_timeout_s = stream_read_timeout_s
        self.session_timeout_s = session_timeout_s
        self.max_retries = max_retries
        self._budget = retrying.Budget(
            max_retries + 1,
            defaults.client_backoff_initial_s if backoff_initial_s is None else backoff_initial_s,
            defaults.client_backoff_max_s if backoff_max_s is None else backoff_max_s,
        )
        #: How many times an events stream of :meth:`follow` broke (all rollouts); each is reopened.
        self.event_reconnects = 0
        self._owns_client = http_client is None
        self._http = http_client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            # Below the service's idle timeout (65 s), so a request never goes
            # out on a connection the server is closing: a session step, which
            # is not resent, would fail.
            limits=httpx.Limits(
                max_connections=100, max_keepalive_connections=20, keepalive_expiry=_KEEPALIVE_S
            ),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"  # never the token

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client, if this client made it."""
        if self._owns_client:
            await self._http.aclose()

    # -- batches ---------------------------------------------------------------

    def run_batch(
        self,
        tasks: Sequence[TaskSpec | Mapping[str, Any]],
        policy: PolicyConfig | ScriptedPolicy | Mapping[str, Any] | None = None,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        oversample: int | None = None,
    ) -> RemoteBatch:
        """A batch on the service; it is submitted when first iterated (or entered).

        Iterate it for its results. Submitting an identical request under
        the same ``batch_id`` again returns the same batch (so retries and
        controller restarts are safe), and runs again those of its rollouts
        that ended cancelled (after a cancel or a deadline): iterated, it then
        gives one result per rollout, the newest. Different content under the
        id is a 409.

        Raises:
            TypeError: ``policy`` is an in-process policy the service cannot
                rebuild (use a :class:`PolicyConfig`).
        """
        payload: dict[str, Any] = {
            "tasks": [_task_record(t) for t in tasks],
            "samples_per_task": samples_per_task,
            "batch_id": batch_id or uuid.uuid4().hex[:12],
        }
        if policy is not None:
            payload["policy"] = _policy_record(policy)
        if deadline_s is not None:
            payload["deadline_s"] = deadline_s
        if oversample is not None:
            payload["oversample"] = oversample
        return RemoteBatch(self, payload["batch_id"], payload=payload)

    def batch(self, batch_id: str, *, after: int = 0) -> RemoteBatch:
        """An existing batch, its results read from cursor ``after`` on (e.g. after a restart)."""
        return RemoteBatch(self, batch_id, after=after)

    async def follow(self, rollout_id: str, *, after: int = 0) -> AsyncIterator[RolloutEvent]:
        """Each live event of a rollout, from cursor ``after`` on, up to its ``end`` event.

        ``GET /v1/rollouts/{id}/events``: phases, policy turns and tool calls
        (with timings and redacted previews), then the end (status, failure
        reason, reward). A stream that breaks is reopened from the last event's
        cursor (``event.seq``), within the client's retry budget; events the
        server no longer holds (``pool.events_max``) are skipped.

        Raises:
            ServiceError: 404 (no such rollout), 501 (the service runs batches on
                Ray actors), or the stream was lost too many times in a row.
        """
        path = f"/v1/rollouts/{rollout_id}/events"
        cursor = after
        response: httpx.Response | None = None
        lines: AsyncIterator[str] | None = None

        async def disconnect() -> None:
            nonlocal response, lines
            if response is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout_s):
                    await response.aclose()
            response = lines = None

        def decision(exc: BaseException) -> Decision:
            if isinstance(exc, _Cut):
                return Decision(True)
            if isinstance(exc, ServiceError) and exc.status_code in _RETRY_STATUSES:
                return Decision(True, exc.status_code)
            return Decision(False)

        async def next_message() -> dict[str, Any]:
            nonlocal response, lines
            tries = 0
            try:
                async for attempt in retrying.attempts(
                    "client_stream", self._budget, classify=decision
                ):
                    with attempt:
                        tries = attempt.num
                        try:
                            if lines is None:
                                request = self._http.build_request(
                                    "GET",
                                    self._url(path),
                                    params={"after": cursor},
                                    headers={**self._headers, "Accept": "application/x-ndjson"},
                                    timeout=httpx.Timeout(
                                        self.timeout_s, read=self.stream_read_timeout_s
                                    ),
                                )
                                opened = await self._http.send(request, stream=True)
                                if opened.is_error:
                                    await opened.aread()
                                    await opened.aclose()
                                    raise _error("GET", path, opened)
                                response, lines = opened, opened.aiter_lines()
                            line = await anext(lines)
                            message: dict[str, Any] = json.loads(line) if line.strip() else {}
                            return message
                        except (
                            httpx.TransportError,
                            httpx.StreamError,
                            StopAsyncIteration,
                            ValueError,
                        ) as exc:
                            # Cut, a torn line, or no end event: resume from the cursor.
                            self.event_reconnects += 1
                            await disconnect()
                            raise _Cut(_describe(exc)) from exc
            except _Cut as exc:
                raise ServiceError(
                    f"lost the events stream of rollout {rollout_id} {tries} times in a row"
                    f" ({exc}); resume later with client.follow({rollout_id!r}, after={cursor})"
                ) from exc.__cause__
            raise AssertionError("unreachable: attempts either return or raise")

        try:
            while True:
                message = await next_message()
                if message.get("type") != "event":
                    continue  # heartbeat, gap, or a line type this client does not know
                seq = int(message["cursor"])
                if seq <= cursor:
                    continue
                cursor = seq
                fields = dict(message["event"])
                kind, t_s = str(fields.pop("kind")), float(fields.pop("t_s"))
                fields.pop("seq", None)
                yield RolloutEvent(seq, kind, t_s, fields)
                if kind == "end":
                    return
        finally:
            await disconnect()

    # -- the policy (asynchronous RL) --------------------------------------------

    async def policy_version(self) -> int:
        """The policy version the service records on turns.

        Raises:
            ServiceError: 409, the service runs batches on Ray actors.
        """
        return int((await self._call("GET", "/v1/policy"))["version"])

    async def set_policy_version(self, version: int) -> None:
        """Record ``version`` on turns from now on (after a weight sync).

        Raises:
            ServiceError: 409 (batches on Ray actors), 422 (not an int ≥ 0).
        """
        await self._call("PUT", "/v1/policy/version", json={"version": version})

    @asynccontextmanager
    async def policy_paused(self, *, ttl_s: float = 60.0) -> AsyncIterator[None]:
        """Hold the service's new policy calls for the block (a weight swap).

        The pause is a lease of ``ttl_s`` that the client renews while the
        block runs (every third of it) and ends when it leaves; if this
        process dies, the service lets go within ``ttl_s``.

        Raises:
            ServiceError: 409 (batches on Ray actors), 422 (``ttl_s`` over the
                server's ``service.max_pause_ttl_s``), or a renewal failed
                (the pause may have lapsed: the block is cancelled).
        """
        lease = await self._call(
            "POST", "/v1/policy/pauses", json={"ttl_s": ttl_s}, idempotent=False
        )
        path = f"/v1/policy/pauses/{lease['pause_id']}"

        failed: list[ServiceError] = []

        async def renew(scope: anyio.CancelScope) -> None:
            try:
                while True:
                    await anyio.sleep(ttl_s / 3)
                    await self._call("PUT", path, json={"ttl_s": ttl_s})
            except ServiceError as exc:  # the pause may lapse: stop the block
                failed.append(exc)
                scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(renew, tg.cancel_scope)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(self.timeout_s),
                suppress(ServiceError),  # 404: it lapsed already
            ):
                await self._call("DELETE", path)
        if failed:
            raise ServiceError(f"renewing the pause failed: {failed[0]}") from failed[0]

    # -- sessions --------------------------------------------------------------

    @asynccontextmanager
    async def session(
        self,
        task: TaskSpec | Mapping[str, Any],
        *,
        batch_id: str | None = None,
        sample_index: int = 0,
    ) -> AsyncIterator[RemoteSession]:
        """An env-style session on the service (``reset``/``step``/``close``).

        Leaving the block closes it (scored, released), also on error.

        Raises:
            ServiceError: the session could not be opened (422: the task is
                invalid; 502/503: the environment could not be set up).
        """
        body: dict[str, Any] = {"task": _task_record(task), "sample_index": sample_index}
        if batch_id is not None:
            body["batch_id"] = batch_id
        # Not retried once sent: a second attempt could open a second session.
        opened = await self._call(
            "POST",
            "/v1/sessions",
            json=body,
            request_timeout_s=self.session_timeout_s,
            idempotent=False,
        )
        env = RemoteSession(self, opened)
        try:
            yield env
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.session_timeout_s):
                await env.close()

    # -- plumbing --------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self.base_url + path

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        request_timeout_s: float | None = None,
        idempotent: bool = True,
    ) -> Any:
        """One JSON request, retried (if ``idempotent``) on connection errors, 429 and 503."""
        retry_after: float | None = None
        tries = 0

        def decision(exc: BaseException) -> Decision:
            if isinstance(exc, httpx.TransportError):
                # Only a request that never left is safe to resend when not idempotent.
                return Decision(idempotent or isinstance(exc, httpx.ConnectError))
            if isinstance(exc, ServiceError) and exc.status_code in _RETRY_STATUSES:
                return Decision(idempotent, exc.status_code, retry_after)
            return Decision(False)

        try:
            async for attempt in retrying.attempts("client", self._budget, classify=decision):
                with attempt:
                    tries, retry_after = attempt.num, None
                    response = await self._http.request(
                        method,
                        self._url(path),
                        json=json,
                        headers=self._headers,
                        timeout=(
                            httpx.USE_CLIENT_DEFAULT
                            if request_timeout_s is None
                            else request_timeout_s
                        ),
                    )
                    if response.is_error:
                        retry_after = retry_after_s(response.headers)
                        raise _error(method, path, response)
        except httpx.TransportError as exc:
            if not decision(exc).transient:
                raise ServiceError(f"{method} {path}: {_describe(exc)}") from exc
            raise ServiceError(
                f"{method} {path}: gave up after {tries} attempts: {_describe(exc)}"
            ) from exc
        return response.json()


class _Cut(Exception):
    """The results stream broke (its cause says how): reopen it from the cursor."""


class RemoteBatch:
    """A batch on the service: an async iterator of its results (see :meth:`groups`).

    Attributes:
        batch_id: the batch's id (chosen by the client unless given).
        cursor: the cursor of the last result received; resume a batch
            elsewhere with ``client.batch(batch_id, after=cursor)``.
        reconnects: how many times the results stream was reopened.
        rerun: once submitted, how many rollouts of an identical earlier
            batch (the same id) run again because they had ended cancelled;
            read from the start, the batch gives the newest result of each.
    """

    def __init__(
        self,
        client: FleetrollClient,
        batch_id: str,
        *,
        payload: dict[str, Any] | None = None,
        after: int = 0,
    ) -> None:
        self._client = client
        self.batch_id = batch_id
        self._payload = payload
        self.total: int | None = None
        self.rerun = 0
        self.cursor = after
        self.reconnects = 0
        self._response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._ended = False

    #: The NDJSON stream this object reads.
    _stream = "results"

    async def submit(self) -> Self:
        """Submit the batch (once; iterating or entering does it for you).

        Raises:
            ServiceError: 422 (invalid tasks), 409 (the id holds another batch).
        """
        if self._payload is not None:
            created = await self._client._call("POST", "/v1/batches", json=self._payload)
            self.total = int(created["rollouts"])
            self.rerun = int(created.get("rerun", 0))
            self._payload = None
        return self

    async def status(self) -> BatchState:
        """The batch's status and counts."""
        await self.submit()
        return BatchState.model_validate(
            await self._client._call("GET", f"/v1/batches/{self.batch_id}")
        )

    async def cancel(self) -> None:
        """Cancel what is still running; iteration still yields every result."""
        await self.submit()
        await self._client._call("DELETE", f"/v1/batches/{self.batch_id}")

    async def aclose(self) -> None:
        """Cancel the batch (as ``Batch.aclose`` does in-process)."""
        await self.cancel()

    async def results(self) -> list[RolloutResult]:
        """Every (remaining) result, once all rollouts have ended."""
        return [r async for r in self]

    def groups(self, *, after: int = 0) -> RemoteGroups:
        """Each group of the batch as soon as it is complete, from cursor ``after`` on.

        A stream of its own (as ``Batch.groups`` in-process), reopened like the
        results stream when it breaks; iterating it submits the batch first.
        """
        return RemoteGroups(self, after=after)

    async def __aenter__(self) -> Self:
        return await self.submit()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._client.timeout_s):
                if not self._ended:
                    await self.cancel()
        finally:
            await self._disconnect()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RolloutResult:
        if self._ended:
            raise StopAsyncIteration
        await self.submit()
        while True:
            message = await self._next_line()
            kind = message.get("type")
            if kind == "result":
                cursor = int(message["cursor"])
                if cursor <= self.cursor:
                    continue  # already seen (cannot happen with ?after=, but cheap to guard)
                self.cursor = cursor
                return RolloutResult.model_validate(message["result"])
            if kind == "end":
                self._ended = True
                await self._disconnect()
                raise StopAsyncIteration
            # heartbeat, or a line type this client does not know: keep reading

    async def _next_line(self) -> dict[str, Any]:
        """The next line of the results stream; a broken stream is reopened from the cursor.

        Failures in a row are bounded by the client's budget; any line read
        (a heartbeat too) starts the count again.
        """
        cut = False
        tries = 0

        def decision(exc: BaseException) -> Decision:
            if isinstance(exc, _Cut):
                return Decision(True)
            if isinstance(exc, ServiceError) and exc.status_code in _RETRY_STATUSES:
                return Decision(True, exc.status_code)
            return Decision(False)

        try:
            async for attempt in retrying.attempts(
                "client_stream", self._client._budget, classify=decision
            ):
                with attempt:
                    tries = attempt.num
                    if cut:
                        self.reconnects += 1
                        cut = False
                    try:
                        if self._lines is None:
                            await self._connect()
                            assert self._lines is not None
                        line = await anext(self._lines)
                        message: dict[str, Any] = json.loads(line) if line.strip() else {}
                    except (
                        httpx.TransportError,
                        httpx.StreamError,
                        StopAsyncIteration,
                        ValueError,
                    ) as exc:
                        # Cut (a proxy, the network), a torn line, or no end line: resume.
                        await self._disconnect()
                        cut = True
                        raise _Cut(_describe(exc)) from exc
        except _Cut as exc:
            raise ServiceError(
                f"lost the results stream of batch {self.batch_id} {tries} times in a"
                f" row ({exc}); resume later with"
                f" client.batch({self.batch_id!r}, after={self.cursor})"
            ) from exc.__cause__
        return message

    async def _connect(self) -> None:
        c = self._client
        request = c._http.build_request(
            "GET",
            c._url(f"/v1/batches/{self.batch_id}/{self._stream}"),
            params={"after": self.cursor},
            headers={**c._headers, "Accept": "application/x-ndjson"},
            timeout=httpx.Timeout(c.timeout_s, read=c.stream_read_timeout_s),
        )
        response = await c._http.send(request, stream=True)
        if response.is_error:
            await response.aread()
            await response.aclose()
            raise _error("GET", request.url.path, response)
        self._response = response
        self._lines = response.aiter_lines()

    async def _disconnect(self) -> None:
        lines, response = self._lines, self._response
        self._lines = self._response = None
        with anyio.CancelScope(shield=True):
            if lines is not None and hasattr(lines, "aclose"):
                with suppress(Exception):
                    await lines.aclose()
            if response is not None:
                await response.aclose()


class RemoteGroups(RemoteBatch):
    """A batch's complete groups on the service: an async iterator of :class:`Group`.

    Attributes:
        cursor: the cursor of the last group received.
    """

    _stream = "groups"

    def __init__(self, batch: RemoteBatch, *, after: int = 0) -> None:
        super().__init__(batch._client, batch.batch_id, after=after)
        self._batch = batch

    async def submit(self) -> Self:
        await self._batch.submit()
        self.total = self._batch.total
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._disconnect()  # the batch is the caller's to cancel

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Group:  # type: ignore[override]
        if self._ended:
            raise StopAsyncIteration
        await self.submit()
        while True:
            message = await self._next_line()
            kind = message.get("type")
            if kind == "group":
                cursor = int(message["cursor"])
                if cursor <= self.cursor:
                    continue
                self.cursor = cursor
                return Group.model_validate(message["group"])
            if kind == "end":
                self._ended = True
                await self._disconnect()
                raise StopAsyncIteration


class RemoteSession:
    """An env-style session on the service, like :class:`~fleetroll.env_session.EnvSession`."""

    def __init__(self, client: FleetrollClient, opened: Mapping[str, Any]) -> None:
        self._client = client
        self.session_id: str = opened["session_id"]
        self._messages: list[dict[str, Any]] = list(opened["messages"])
        self.tools = [
            ToolSpec(name=t["name"], description=t["description"], input_schema=t["input_schema"])
            for t in opened["tools"]
        ]
        self._result: RolloutResult | None = None
        self._closed = False
        self._told_done = False  # done() reached the service

    async def reset(self) -> list[dict[str, Any]]:
        """The opening messages (the task prompt). The instance is fresh already."""
        return list(self._messages)

    async def step(self, call: ToolCall | Mapping[str, Any]) -> StepResult:
        """Run one tool call; ``done`` once the episode is over.

        Raises:
            InstanceLostError: the instance is gone (the session has ended).
            ServiceError: the service refused or failed the step.
        """
        if isinstance(call, ToolCall):
            body: dict[str, Any] = {"name": call.name, "arguments": dict(call.arguments)}
            body["id"] = call.id
        else:
            body = {"name": str(call["name"]), "arguments": dict(call.get("arguments") or {})}
            if call.get("id"):
                body["id"] = str(call["id"])
        try:
            answer = await self._client._call(
                "POST", f"/v1/sessions/{self.session_id}/step", json=body, idempotent=False
            )
        except ServiceError as exc:
            if exc.status_code == 502:
                raise InstanceLostError(
                    exc.detail or str(exc), operation="step", rollout_id=None
                ) from exc
            raise
        observation = ToolResult(text=answer["text"], is_error=bool(answer["is_error"]))
        return StepResult(observation, bool(answer["done"]), tuple(answer["messages"]))

    async def done(self) -> None:
        """Say the episode is over (the agent finished): the result will be ``completed``.

        As :meth:`fleetroll.env_session.EnvSession.done` in-process: later steps
        answer "The episode is over.", and without it a session whose task needs
        no final answer ends ``abandoned`` when closed
        (``POST /v1/sessions/{id}/done``).

        Raises:
            ServiceError: the service refused it (410: the session had ended).
        """
        if not self._told_done and not self._closed:
            await self._client._call("POST", f"/v1/sessions/{self.session_id}/done")
            self._told_done = True

    async def close(self) -> RolloutResult | None:
        """End the episode (``abandoned`` if it had not ended, see :meth:`done`); its result.

        Closing twice returns the same result.

        Raises:
            ServiceError: the service could not close the session.
        """
        if not self._closed:
            answer = await self._client._call(
                "DELETE",
                f"/v1/sessions/{self.session_id}",
                request_timeout_s=self._client.session_timeout_s,
            )
            self._result = RolloutResult.model_validate(answer)
            self._closed = True
        return self._result


def _task_record(task: TaskSpec | Mapping[str, Any]) -> dict[str, Any]:
    """A task as the service takes it (short form for a TaskSpec)."""
    if not isinstance(task, TaskSpec):
        return dict(task)
    record: dict[str, Any] = {
        "key": task.key,
        "prompt": task.prompt,
        "env_key": task.env_spec,
        "data_key": task.data_spec,
        "modality": task.modality,
        "verifier_func": task.verifier_func,
        "max_steps": task.max_steps,
        "env_variables": task.env_variables,
        "solution": [s.model_dump() for s in task.solution] if task.solution else None,
        "requires_final_answer": task.requires_final_answer or None,
        "metadata": task.metadata or None,
    }
    return {k: v for k, v in record.items() if v is not None}


def _policy_record(policy: PolicyConfig | ScriptedPolicy | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(policy, ScriptedPolicy):
        return {"kind": "scripted", "think_time_s": policy.think_time_s}
    if isinstance(policy, PolicyConfig):
        record = policy.model_dump(exclude_none=True, exclude={"api_key"})
        if policy.api_key is not None:
            record["api_key"] = policy.api_key.get_secret_value()
        return record
    if isinstance(policy, Mapping):
        return dict(policy)
    raise TypeError(
        f"a {type(policy).__name__} runs in this process only; describe the policy for the"
        " service with PolicyConfig(kind='openai', base_url=..., model=...)"
    )


def _error(method: str, path: str, response: httpx.Response) -> ServiceError:
    try:
        detail: Any = response.json().get("detail", "")
    except (ValueError, AttributeError):
        detail = response.text[:300]
    if isinstance(detail, list):  # a 422: where and what, per problem
        detail = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', []))}: {item.get('msg', '')}"
            for item in detail
            if isinstance(item, dict)
        )
    status = response.status_code
    return ServiceError(
        f"{method} {path}: HTTP {status}: {detail}", status_code=status, detail=str(detail)
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
