"""The service's objects as seen from a client: a batch (its results stream),
its groups, an env-style session, and the connection they share.

:class:`~fleetroll.client.FleetrollClient` makes them; import them from
:mod:`fleetroll.client`. Streams reopen from their cursor when they break;
every request goes through :meth:`ServiceConnection.call`, retried within
the client's budget.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import suppress
from types import TracebackType
from typing import Any, Self

import anyio
import httpx

import fleetroll._internal.retrying as retrying
from fleetroll._internal.retrying import Decision, retry_after_s
from fleetroll.errors import InstanceLostError, ServiceError, ServicePreflightError
from fleetroll.policies.turns import ToolCall, ToolSpec
from fleetroll.results import RolloutResult
from fleetroll.rollout.env_session import StepResult
from fleetroll.service.models import BatchState, TreeState
from fleetroll.tools.session import ToolResult
from fleetroll.training.groups import Group, Tree

__all__ = [
    "RETRY_STATUSES",
    "RemoteBatch",
    "RemoteGroups",
    "RemoteSession",
    "RemoteTree",
    "ServiceConnection",
    "StreamCut",
    "describe_failure",
]

#: Statuses worth another try: the service's own "later" (busy, full, starting).
#: Narrower than retrying.transient_status: its 502/504 are a session's verdicts.
RETRY_STATUSES = frozenset({429, 503})


class ServiceConnection:
    """What every request to one service shares: its address, token, deadlines,
    retry budget and HTTP client. :class:`~fleetroll.client.FleetrollClient`
    makes one; batches, groups and sessions send their requests through it.
    """

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        *,
        timeout_s: float,
        stream_read_timeout_s: float,
        session_timeout_s: float,
        budget: retrying.Budget,
        http: httpx.AsyncClient,
        reconnect_s: float = 0.0,
    ) -> None:
        self.base_url = base_url
        self.headers = dict(headers)
        self.timeout_s = timeout_s
        self.stream_read_timeout_s = stream_read_timeout_s
        self.session_timeout_s = session_timeout_s
        self.budget = budget
        self.http = http
        #: How long an unreachable service (a restart) is waited for, from the
        #: first failure in a row; 0: only ``budget``'s attempts.
        self.reconnect_s = reconnect_s

    def url(self, path: str) -> str:
        """The absolute URL of ``path`` on the service."""
        return self.base_url + path

    def attempts(
        self, operation: retrying.Operation, classify: Callable[[BaseException], Decision]
    ) -> AsyncIterator[retrying.Attempt]:
        """Attempts at one request or stream read, after ``classify``.

        A service that answers "later" (429, 503) has the budget's attempts; a
        service that does not answer at all (refused or cut connections, a cut
        stream: it restarts) is tried again until ``reconnect_s`` has passed,
        or for the budget's attempts when that is longer.
        """
        limit = self.budget.attempts
        failures = 0
        first_failed: float | None = None

        def decision(exc: BaseException) -> Decision:
            nonlocal failures, first_failed
            failures += 1
            now = anyio.current_time()
            first_failed = now if first_failed is None else first_failed
            verdict = classify(exc)
            if not verdict.transient or limit is None or failures < limit:
                return verdict
            # The window, from the first failure in a row, bounds it, not the count.
            if self.reconnect_s > 0 and _unreachable(exc) and now - first_failed < self.reconnect_s:
                return verdict
            return Decision(False, verdict.status_code)

        b = self.budget
        unbounded = retrying.Budget(None, b.backoff_initial_s, b.backoff_max_s)
        return retrying.attempts(
            operation, unbounded if self.reconnect_s > 0 else b, classify=decision
        )

    async def call(
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
            if isinstance(exc, ServiceError) and exc.status_code in RETRY_STATUSES:
                return Decision(idempotent, exc.status_code, retry_after)
            return Decision(False)

        try:
            async for attempt in self.attempts("client", decision):
                with attempt:
                    tries, retry_after = attempt.num, None
                    response = await self.http.request(
                        method,
                        self.url(path),
                        json=json,
                        headers=self.headers,
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
                raise ServiceError(f"{method} {path}: {describe_failure(exc)}") from exc
            raise ServiceError(
                f"{method} {path}: gave up after {tries} attempts: {describe_failure(exc)}"
            ) from exc
        return response.json()

    async def open_stream(
        self, path: str, *, after: int, params: Mapping[str, str] | None = None
    ) -> httpx.Response:
        """An NDJSON stream (``GET path?after=``), read timeout the stream's silence limit.

        ``params`` are further query parameters.

        Raises:
            ServiceError: the service answered an error status.
        """
        request = self.http.build_request(
            "GET",
            self.url(path),
            params={**(params or {}), "after": after},
            headers={**self.headers, "Accept": "application/x-ndjson"},
            timeout=httpx.Timeout(self.timeout_s, read=self.stream_read_timeout_s),
        )
        response = await self.http.send(request, stream=True)
        if response.is_error:
            await response.aread()
            await response.aclose()
            raise _error("GET", request.url.path, response)
        return response


class StreamCut(Exception):
    """A stream (results, groups, a rollout's events) broke (its cause says how): reopen it."""


class RemoteBatch:
    """A batch on the service: an async iterator of its results (see :meth:`groups`).

    Attributes:
        batch_id: the batch's id (chosen by the client unless given).
        cursor: the cursor of the last result received; resume a batch
            elsewhere with ``client.batch(batch_id, after=cursor)``.
        reconnects: how many times the results stream was reopened.
        rerun: once submitted, how many rollouts of an identical earlier
            batch (the same id) run again because they had ended cancelled
            or had no result; read from the start, the batch gives the newest
            result of each.
        resubmits: how many times the stream said the batch was interrupted
            (the service restarted while it ran) and this object submitted it
            again, to run its rollouts without a result.
    """

    def __init__(
        self,
        client: ServiceConnection,
        batch_id: str,
        *,
        payload: dict[str, Any] | None = None,
        after: int = 0,
    ) -> None:
        self._client = client
        self.batch_id = batch_id
        self._payload = payload
        #: The request, kept to submit it again after an interruption.
        self._request = payload
        self._resubmitted_at: int | None = None
        self.total: int | None = None
        self.rerun = 0
        self.resubmits = 0
        self.cursor = after
        self.reconnects = 0
        self._response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._ended = False
        #: The stream's query parameters besides ``after``.
        self._params: Mapping[str, str] = {}

    #: The NDJSON stream this object reads, under ``{_collection}/{id}/``.
    _stream = "results"
    _collection = "/v1/batches"
    #: What it is, for messages.
    _noun = "batch"

    async def submit(self) -> Self:
        """Submit the batch (once; iterating or entering does it for you).

        Raises:
            ServicePreflightError: the service's pre-flight refused the batch
                (a :class:`~fleetroll.errors.PreflightError` too, status 422).
            ServiceError: 422 (invalid tasks), 409 (the id holds another batch).
        """
        if self._payload is not None:
            created = await self._client.call("POST", "/v1/batches", json=self._payload)
            self.total = int(created["rollouts"])
            self.rerun = int(created.get("rerun", 0))
            self._payload = None
        return self

    async def status(self) -> BatchState:
        """The batch's status and counts."""
        await self.submit()
        return BatchState.model_validate(
            await self._client.call("GET", f"/v1/batches/{self.batch_id}")
        )

    async def cancel(self) -> None:
        """Cancel what is still running; iteration still yields every result."""
        await self.submit()
        await self._client.call("DELETE", f"/v1/batches/{self.batch_id}")

    async def aclose(self) -> None:
        """Cancel the batch (as ``Batch.aclose`` does in-process)."""
        await self.cancel()

    async def results(self) -> list[RolloutResult]:
        """Every (remaining) result, once all rollouts have ended."""
        return [r async for r in self]

    def groups(self, *, after: int = 0, complete_only: bool = False) -> RemoteGroups:
        """Each group of the batch as soon as it is complete, from cursor ``after`` on.

        A stream of its own (as ``Batch.groups`` in-process), reopened like the
        results stream when it breaks; iterating it submits the batch first.
        ``complete_only`` drops the groups short of their scored samples
        (``Group.complete`` false), on the service's side.
        """
        return RemoteGroups(self, after=after, complete_only=complete_only)

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
        return RolloutResult.model_validate(await self._next_item("result"))

    async def _next_item(self, kind: str) -> Any:
        """The payload of the stream's next ``kind`` line (``result``, ``group``).

        Raises:
            StopAsyncIteration: the stream said ``end``.
        """
        if self._ended:
            raise StopAsyncIteration
        await self.submit()
        while True:
            message = await self._next_line()
            if message.get("type") == kind:
                cursor = int(message["cursor"])
                if cursor <= self.cursor:
                    continue  # already seen (cannot happen with ?after=, but cheap to guard)
                self.cursor = cursor
                return message[kind]
            if message.get("type") == "end":
                self._ended = True
                await self._disconnect()
                raise StopAsyncIteration
            if message.get("type") == "interrupted":
                await self._disconnect()
                await self._resubmit(int(message.get("missing") or 0))
                continue  # from the cursor: the rollouts that had no result, as they end
            # heartbeat, or a line type this client does not know: keep reading

    def _original(self) -> dict[str, Any] | None:
        """The batch's request, if this object submitted it."""
        return self._request

    async def _resubmit(self, missing: int) -> None:
        """The service stopped while the batch ran: submit it again (once per cursor).

        Raises:
            ServiceError: this object did not submit the batch (it cannot), or
                submitted it again at this cursor already.
        """
        request = self._original()
        if request is None or self._resubmitted_at == self.cursor:
            self._ended = True
            raise ServiceError(
                f"batch {self.batch_id} was interrupted (the service stopped while it ran):"
                f" {missing} rollouts have no result; submit it again to run them, e.g."
                f" client.run_batch(<the same tasks>, batch_id={self.batch_id!r},"
                f" after={self.cursor})"
            )
        self._resubmitted_at = self.cursor
        answer = await self._client.call("POST", "/v1/batches", json=request)
        self.rerun = int(answer.get("rerun", 0))
        self.resubmits += 1

    async def _next_line(self) -> dict[str, Any]:
        """The next line of the results stream; a broken stream is reopened from the cursor.

        Failures in a row are bounded by the client's budget; any line read
        (a heartbeat too) starts the count again.
        """
        cut = False
        tries = 0

        def decision(exc: BaseException) -> Decision:
            if isinstance(exc, StreamCut):
                return Decision(True)
            if isinstance(exc, ServiceError) and exc.status_code in RETRY_STATUSES:
                return Decision(True, exc.status_code)
            return Decision(False)

        try:
            async for attempt in self._client.attempts("client_stream", decision):
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
                        raise StreamCut(describe_failure(exc)) from exc
        except StreamCut as exc:
            raise ServiceError(
                f"lost the results stream of {self._noun} {self.batch_id} {tries} times in a"
                f" row ({exc}); iterate the {self._noun} again to resume from where it stopped"
                f" (FleetrollClient(reconnect_s=...) waits longer for a restart)"
            ) from exc.__cause__
        return message

    async def _connect(self) -> None:
        response = await self._client.open_stream(
            f"{self._collection}/{self.batch_id}/{self._stream}",
            after=self.cursor,
            params=self._params,
        )
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

    def __init__(self, batch: RemoteBatch, *, after: int = 0, complete_only: bool = False) -> None:
        super().__init__(batch._client, batch.batch_id, after=after)
        self._batch = batch
        self._params = {"complete_only": "true"} if complete_only else {}

    async def submit(self) -> Self:
        await self._batch.submit()
        self.total = self._batch.total
        return self

    def _original(self) -> dict[str, Any] | None:
        return self._batch._original()

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
        return Group.model_validate(await self._next_item("group"))


class RemoteTree(RemoteBatch):
    """A rollout tree on the service (``POST /v1/trees``): an async iterator of its
    results, the root first, then each branch as it ends; :meth:`tree` gives the
    whole :class:`~fleetroll.training.groups.Tree`, as ``RolloutPool.run_tree`` does.

    Leaving ``async with tree`` before its end cancels it (as in-process).

    Attributes:
        tree_id: the tree's id (chosen by the client unless given).
        root_batch_id, branches_batch_id: its batches' ids, once submitted.
        cursor, reconnects: as :class:`RemoteBatch`'s.
    """

    _collection = "/v1/trees"
    _noun = "tree"

    def __init__(self, client: ServiceConnection, tree_id: str, payload: dict[str, Any]) -> None:
        super().__init__(client, tree_id, payload=payload)
        self.root_batch_id: str | None = None
        self.branches_batch_id: str | None = None

    @property
    def tree_id(self) -> str:
        return self.batch_id

    async def submit(self) -> Self:
        """Submit the tree (once; iterating or entering does it for you).

        Raises:
            ServicePreflightError: the service's pre-flight refused the task.
            ServiceError: 422 (an invalid task, branch_at or width, an agent
                command), 409 (the id holds another tree).
        """
        if self._payload is not None:
            created = await self._client.call("POST", "/v1/trees", json=self._payload)
            self.total = int(created["rollouts"])
            self.root_batch_id = str(created["root_batch_id"])
            self.branches_batch_id = str(created["branches_batch_id"])
            self._payload = None
        return self

    async def status(self) -> TreeState:  # type: ignore[override]
        """The tree so far: its status, root, branches (and groups once over)."""
        await self.submit()
        return TreeState.model_validate(await self._client.call("GET", f"/v1/trees/{self.tree_id}"))

    async def cancel(self) -> None:
        """Cancel what still runs (no branch starts after it); iteration still yields
        every result."""
        await self.submit()
        await self._client.call("DELETE", f"/v1/trees/{self.tree_id}")

    async def tree(self) -> Tree:
        """The tree once it is over (the rest of its results read first).

        Raises:
            ServiceError: the branches could not start (the service's pool was
                full), as ``run_tree`` raises ``PoolFullError`` in-process.
        """
        async for _ in self:
            pass
        state = await self.status()
        if state.error is not None:
            raise ServiceError(state.error)
        if state.root is None:
            raise ServiceError(f"tree {self.tree_id} ended without its root's result")
        return Tree(root=state.root, branches=state.branches, groups=state.groups)

    def groups(self, *, after: int = 0, complete_only: bool = False) -> RemoteGroups:
        raise NotImplementedError("a tree's groups come with tree() (TreeState.groups)")

    async def _resubmit(self, missing: int) -> None:
        self._ended = True
        raise ServiceError(f"tree {self.tree_id} was interrupted; submit it again to run it anew")


class RemoteSession:
    """An env-style session on the service, like :class:`~fleetroll.EnvSession`."""

    def __init__(self, client: ServiceConnection, opened: Mapping[str, Any]) -> None:
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
            answer = await self._client.call(
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

        As :meth:`fleetroll.rollout.env_session.EnvSession.done` in-process: later steps
        answer "The episode is over.", and without it a session whose task needs
        no final answer ends ``abandoned`` when closed
        (``POST /v1/sessions/{id}/done``).

        Raises:
            ServiceError: the service refused it (410: the session had ended).
        """
        if not self._told_done and not self._closed:
            await self._client.call("POST", f"/v1/sessions/{self.session_id}/done")
            self._told_done = True

    async def close(self) -> RolloutResult | None:
        """End the episode (``abandoned`` if it had not ended, see :meth:`done`); its result.

        Closing twice returns the same result.

        Raises:
            ServiceError: the service could not close the session.
        """
        if not self._closed:
            answer = await self._client.call(
                "DELETE",
                f"/v1/sessions/{self.session_id}",
                request_timeout_s=self._client.session_timeout_s,
            )
            self._result = RolloutResult.model_validate(answer)
            self._closed = True
        return self._result


def _error(method: str, path: str, response: httpx.Response) -> ServiceError:
    try:
        detail: Any = response.json().get("detail", "")
    except (ValueError, AttributeError):
        detail = response.text[:300]
    if isinstance(detail, list):  # a 422: where and what, per problem
        for item in detail:
            if isinstance(item, dict) and item.get("type") == "preflight_error":
                # What a library user gets in-process, so one except serves both.
                return ServicePreflightError(str(item.get("msg", "")))
        detail = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', []))}: {item.get('msg', '')}"
            for item in detail
            if isinstance(item, dict)
        )
    status = response.status_code
    return ServiceError(
        f"{method} {path}: HTTP {status}: {detail}", status_code=status, detail=str(detail)
    )


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the service did not answer (down, restarting, the network)."""
    return isinstance(exc, StreamCut | httpx.TransportError)


def describe_failure(exc: BaseException) -> str:
    """An exception as one line: its type, and its message if it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
