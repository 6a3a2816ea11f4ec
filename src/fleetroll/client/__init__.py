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
nothing is lost and nothing arrives twice; a batch the service's restart
interrupted is submitted again, so its rollouts without a result run. A
service that does not answer at all (a restart) is waited for up to
``reconnect_s`` (120 s) from the first failed attempt; the loop reading the
batch notices nothing. Retries are bounded, with
exponential backoff and full jitter (``fleetroll._internal.retrying``, defaults from
``[retries]``); a batch submission is retried safely
because the batch id is chosen here, before the first attempt.

A trainer doing asynchronous RL has the same verbs as in-process, awaited:
``await client.set_policy_version(v)`` after a weight sync, ``async with
client.policy_paused():`` around the swap (a lease the client renews while
the block runs, so a trainer that dies cannot pause the service forever),
and ``batch.groups()`` for each GRPO group as soon as it is complete, and
``await client.run_eval(tasks, k=8, max_concurrency=16, policy_version=v)``
for pass@k at a known version beside the training batches.

``await client.run_tree(task, policy, branch_at=1, width=4)`` samples a
rollout tree on the service and returns the same ``Tree`` as
``RolloutPool.run_tree`` (``client.start_tree(...)`` streams its results).

``async for event in client.follow(rollout_id)`` watches one rollout live:
its phases, policy turns and tool calls (timings, redacted previews), then
its end; a cut stream is reopened after the last event's cursor.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlencode

import anyio
import httpx

import fleetroll._internal.retrying as retrying
from fleetroll._internal.retrying import Decision
from fleetroll.client.remote import (
    RETRY_STATUSES,
    RemoteBatch,
    RemoteGroups,
    RemoteSession,
    RemoteTree,
    ServiceConnection,
    StreamCut,
    describe_failure,
)
from fleetroll.errors import ServiceError
from fleetroll.evaluation import DEFAULT_SUCCESS_THRESHOLD, EvalReport, eval_batch
from fleetroll.policies import ScriptedPolicy
from fleetroll.rollout.events import RolloutEvent
from fleetroll.service.models import PolicyConfig
from fleetroll.settings import RetrySettings
from fleetroll.tasks import TaskSpec
from fleetroll.training.groups import Tree

__all__ = [
    "FleetrollClient",
    "RemoteBatch",
    "RemoteGroups",
    "RemoteSession",
    "RemoteTree",
    "ServiceError",
]

#: How long an idle connection to the service is reused (it keeps them 65 s).
_KEEPALIVE_S = 15.0


class FleetrollClient:
    """An async client of ``fleetroll serve``. Use it as an async context manager.

    Args:
        base_url: the service, e.g. ``http://127.0.0.1:8750``.
        token: the bearer token: the server's ``FLEETROLL_SERVICE_TOKEN``, or the
            one ``fleetroll serve`` made in ``service.token_file`` without it.
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
        reconnect_s: how long a service that does not answer at all (refused
            connections, cut streams: a ``serve`` restart, a network outage) is
            waited for, from the first failure in a row, before giving up;
            batches, groups and event streams then resume from their cursor,
            each result delivered once. Longer than ``max_retries`` allows
            on its own; 0 leaves only ``max_retries``.
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
        reconnect_s: float = 120.0,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        defaults = RetrySettings()
        if max_retries is None:
            max_retries = defaults.client_max_retries
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, not {max_retries}")
        if reconnect_s < 0:
            raise ValueError(f"reconnect_s must be >= 0, not {reconnect_s}")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self.stream_read_timeout_s = stream_read_timeout_s
        self.session_timeout_s = session_timeout_s
        self.max_retries = max_retries
        self.reconnect_s = reconnect_s
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
        self._service = ServiceConnection(
            self.base_url,
            self._headers,
            timeout_s=timeout_s,
            stream_read_timeout_s=stream_read_timeout_s,
            session_timeout_s=session_timeout_s,
            budget=self._budget,
            http=self._http,
            reconnect_s=reconnect_s,
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
        after: int = 0,
        agent_command: str | Sequence[str] | None = None,
        groups_target: int | None = None,
        max_in_flight: int | None = None,
        policy_version: int | None = None,
    ) -> RemoteBatch:
        """A batch on the service; it is submitted when first iterated (or entered).

        Iterate it for its results. Submitting an identical request under
        the same ``batch_id`` again returns the same batch (so retries and
        controller restarts are safe), and runs again those of its rollouts
        that ended cancelled (after a cancel or a deadline) or have no result
        (the service restarted while they ran): iterated, it then gives one
        result per rollout, the newest, or, with ``after`` (the cursor a
        controller had), only the results after it. ``agent_command`` runs
        that command as each rollout's agent on the service's host, as
        ``fleetroll run --agent-command`` does (an openai ``policy``; the
        service refuses it with a 422 unless ``service.allow_command_tasks``).
        ``groups_target``: straggler cut-off by whole groups, as in-process.
        Different content under the id is a 409. A batch the service's pre-flight refuses raises, on
        submission, :class:`~fleetroll.errors.ServicePreflightError` (a
        ``PreflightError``, as in-process, and a ``ServiceError``, 422).

        If the service restarts while the batch runs, the stream is reopened
        from the cursor; when it says the batch was interrupted, the batch is
        submitted again (``batch.resubmits``) and the rollouts that had no
        result run: each rollout still arrives once.

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
        for name, value in (
            ("oversample", oversample),
            ("groups_target", groups_target),
            ("max_in_flight", max_in_flight),
            ("policy_version", policy_version),
        ):
            if value is not None:
                payload[name] = value
        if agent_command is not None:
            payload["agent_command"] = (
                agent_command if isinstance(agent_command, str) else list(agent_command)
            )
        return RemoteBatch(self._service, payload["batch_id"], payload=payload, after=after)

    async def run_eval(
        self,
        tasks: Sequence[TaskSpec | Mapping[str, Any]],
        policy: PolicyConfig | ScriptedPolicy | Mapping[str, Any] | None = None,
        *,
        k: int,
        max_concurrency: int | None = None,
        policy_version: int | None = None,
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        batch_id: str | None = None,
        deadline_s: float | None = None,
    ) -> EvalReport:
        """Evaluate a policy on the service, as ``RolloutPool.run_eval`` in-process.

        A batch of ``k`` samples per task without oversampling, with its share
        of the service's pool (``max_concurrency``, the batch's
        ``max_in_flight``) and its ``policy_version`` tag, read to its end;
        then ``GET /v1/batches/{id}/eval``. The report holds the results too.

        Raises:
            ServiceError: the service refused the batch or the evaluation.
            TypeError: as :meth:`run_batch`.
            ValueError: ``k`` is below 1.
        """
        options = eval_batch(k, max_concurrency, policy_version, batch_id, deadline_s)
        batch = self.run_batch(tasks, policy, **options)
        results = [r async for r in batch]
        query = urlencode({"k": k, "success_threshold": success_threshold})
        record = await self._call("GET", f"/v1/batches/{batch.batch_id}/eval?{query}")
        return replace(EvalReport.from_json(record), results=results)

    def start_tree(
        self,
        task: TaskSpec | Mapping[str, Any],
        policy: PolicyConfig | ScriptedPolicy | Mapping[str, Any] | None = None,
        *,
        branch_at: int,
        width: int,
        tree_id: str | None = None,
        deadline_s: float | None = None,
    ) -> RemoteTree:
        """A rollout tree on the service (``POST /v1/trees``), as
        ``RolloutPool.start_tree`` in-process; it is submitted when first iterated
        (or entered). Iterate it for the root's result, then each branch's as it
        ends; ``await tree.tree()`` for the whole :class:`~fleetroll.training.groups.Tree`.

        Submitting an identical request under the same ``tree_id`` again returns
        the same tree (retries are safe: the id is chosen here); different
        content under it is a 409. The service keeps trees in memory: after its
        restart the tree is unknown (404), submit it again to run it anew.

        Raises:
            TypeError: as :meth:`run_batch`.
        """
        payload: dict[str, Any] = {
            "task": _task_record(task),
            "branch_at": branch_at,
            "width": width,
            "tree_id": tree_id or uuid.uuid4().hex[:12],
        }
        if policy is not None:
            payload["policy"] = _policy_record(policy)
        if deadline_s is not None:
            payload["deadline_s"] = deadline_s
        return RemoteTree(self._service, payload["tree_id"], payload)

    async def run_tree(
        self,
        task: TaskSpec | Mapping[str, Any],
        policy: PolicyConfig | ScriptedPolicy | Mapping[str, Any] | None = None,
        *,
        branch_at: int,
        width: int,
        tree_id: str | None = None,
        deadline_s: float | None = None,
    ) -> Tree:
        """Sample a tree on the service, as ``RolloutPool.run_tree`` in-process: one
        rollout to step ``branch_at``, then ``width`` branches that replay its prefix
        and sample on. Returns the same :class:`~fleetroll.training.groups.Tree`
        (``root``, ``branches`` in the order they ended, ``groups``) once every
        branch has ended; cancelled on the service if this call is.

        Raises:
            ServicePreflightError: the service's pre-flight refused the task.
            ServiceError: 422 (``branch_at`` or ``width`` below 1, an invalid
                task), 409 (``tree_id`` holds another tree), or the branches
                could not start (the service's pool was full).
            TypeError: as :meth:`run_batch`.
        """
        tree = self.start_tree(
            task, policy, branch_at=branch_at, width=width, tree_id=tree_id, deadline_s=deadline_s
        )
        async with tree:
            return await tree.tree()

    def batch(self, batch_id: str, *, after: int = 0) -> RemoteBatch:
        """An existing batch, its results read from cursor ``after`` on (e.g. after a restart).

        Not having its request, it cannot submit it again: if the service says
        the batch was interrupted, iterating raises :class:`ServiceError` (use
        ``run_batch(..., batch_id=batch_id, after=cursor)``).
        """
        return RemoteBatch(self._service, batch_id, after=after)

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
            if isinstance(exc, StreamCut):
                return Decision(True)
            if isinstance(exc, ServiceError) and exc.status_code in RETRY_STATUSES:
                return Decision(True, exc.status_code)
            return Decision(False)

        async def next_message() -> dict[str, Any]:
            nonlocal response, lines
            tries = 0
            try:
                async for attempt in self._service.attempts("client_stream", decision):
                    with attempt:
                        tries = attempt.num
                        try:
                            if lines is None:
                                opened = await self._service.open_stream(path, after=cursor)
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
                            raise StreamCut(describe_failure(exc)) from exc
            except StreamCut as exc:
                raise ServiceError(
                    f"lost the events stream of rollout {rollout_id} {tries} times in a row"
                    f" ({exc}); resume with client.follow({rollout_id!r}, after={cursor})"
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
        """The policy version the service records on turns."""
        return int((await self._call("GET", "/v1/policy"))["version"])

    async def set_policy_version(self, version: int) -> None:
        """Record ``version`` on turns from now on (after a weight sync): every
        policy call made after this returns records it (on ``serve --ray``, every
        actor has it by then).

        Raises:
            ServiceError: 422 (not an int ≥ 0), 504 (a Ray actor did not confirm
                it within the service's ``timeouts.ray_call_s``; it is set).
        """
        await self._call("PUT", "/v1/policy/version", json={"version": version})

    @asynccontextmanager
    async def policy_paused(self, *, ttl_s: float = 60.0) -> AsyncIterator[None]:
        """Hold the service's new policy calls for the block (a weight swap).

        The pause is a lease of ``ttl_s`` that the client renews while the
        block runs (every third of it) and ends when it leaves; if this
        process dies, the service lets go within ``ttl_s``.

        Raises:
            ServiceError: 422 (``ttl_s`` over the server's
                ``service.max_pause_ttl_s``), or a renewal failed
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
        env = RemoteSession(self._service, opened)
        try:
            yield env
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.session_timeout_s):
                await env.close()

    # -- plumbing --------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        request_timeout_s: float | None = None,
        idempotent: bool = True,
    ) -> Any:
        """One JSON request through the connection (see :meth:`ServiceConnection.call`)."""
        return await self._service.call(
            method, path, json=json, request_timeout_s=request_timeout_s, idempotent=idempotent
        )


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
        "ttl_seconds": task.ttl_seconds,
        "seed": task.seed,
        "timestamp": task.timestamp,
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
