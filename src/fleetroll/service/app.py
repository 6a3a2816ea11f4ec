"""The HTTP service: what its routes call, over one shared :class:`RolloutPool`.

::

    async with RolloutPool(settings, api_key=..., base_url=...) as pool:
        service = Service(pool, settings)
        async with serve_app(create_app(service), "127.0.0.1", 8750) as url:
            ...

The service holds one pool, whatever runs its rollouts: with ``serve --ray``
(:func:`fleetroll.pool.batch_pool.open_batch_pool`) batches and the MCP tools'
rollouts run on Ray actors, while sessions, each held by one task of this
process for its whole life, run in this process; both under the pool's one
admission, policy gate and limits.

The routes are declared once, in :data:`fleetroll.service.routes.ROUTES`
(method, path, handler, models, error statuses, token or not); the ASGI
app (:func:`fleetroll.service.asgi.create_app`), ``/openapi.json`` and the
paths open without a token come from it.
``/mcp`` serves the same verbs as MCP tools.

Every await a route makes on a rollout, a session or the pool is bounded.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import anyio

from fleetroll.errors import OperationTimeout
from fleetroll.policies import Policy
from fleetroll.policies.gateway import Gateway
from fleetroll.pool.assembly import chat_policy_config, policy_from_settings
from fleetroll.pool.batch_pool import RunningBatch
from fleetroll.pool.rollout_pool import RolloutPool, group_id, rollout_id
from fleetroll.results import RolloutResult
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.rollout.agent_process import AgentRecords
from fleetroll.rollout.events import EventPage
from fleetroll.rollout.machine import RolloutIds, RolloutView
from fleetroll.service.batch_record import BatchRecord
from fleetroll.service.batches import BatchRegistry
from fleetroll.service.errors import ApiError
from fleetroll.service.guards import refuse_host_commands
from fleetroll.service.metrics import Metrics
from fleetroll.service.models import PolicyConfig, PolicyState
from fleetroll.service.preflight import BatchPreflight
from fleetroll.service.requests import parse_one, request_policy
from fleetroll.service.sessions import SessionRegistry
from fleetroll.service.state import BatchStore
from fleetroll.service.training import PauseLeases
from fleetroll.service.trees import TreeRegistry
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Redactor

__all__ = ["ServerPolicies", "Service", "build_policy", "request_settings"]

#: Slack over ``timeouts.release_s`` for cancelling every batch at shutdown, and
#: over the sum of a rollout's deadlines for waiting on its result. Not
#: settings: margins over deadlines that are settings already.
_SLACK_S = 5.0
_WAIT_SLACK_S = 30.0


class Service:
    """What the routes (and the MCP tools) share: the pool, batches, trees, sessions.

    Run it with :meth:`running` (the app's lifespan does): its task group
    holds one consumer task per batch and per tree, and one actor task per session.

    Args:
        pool: runs the batches of ``POST /v1/batches``, the trees of
            ``POST /v1/trees``, the MCP tools' rollouts
            and the sessions (these in this process, whatever its executor).
        store: where batches and their results are kept across restarts
            (:func:`fleetroll.service.state.open_store`; default: memory only).
        agent_records: where batches' agent commands are noted, opened by the
            caller for longer than the pool runs (``fleetroll serve``'s are in
            ``service.state_dir/agents``), so a start ends what a killed one left.
        metrics: what ``GET /metrics`` reads (default: a new one); give the one
            that is also a sink of the pool's events, so it times tool calls.
    """

    def __init__(
        self,
        pool: RolloutPool,
        settings: Settings,
        *,
        store: BatchStore | None = None,
        agent_records: AgentRecords | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics or Metrics(settings.service.metrics_label_values)
        self.redact = Redactor(settings.secrets())
        preflight = BatchPreflight(
            pool,
            service=settings.service,
            timeouts=settings.timeouts,
            judge=settings.judge,
            policy=settings.policy,
            openai_api_key=settings.openai_api_key,
        )
        policies = ServerPolicies(settings)
        self.batches = BatchRegistry(
            pool,
            self.metrics,
            preflight=preflight,
            policies=policies,
            service=settings.service,
            pool_settings=settings.pool,
            timeouts=settings.timeouts,
            modalities=settings.modalities,
            store=store,
        )
        self.batches.agent_records = agent_records
        #: Rollout trees (``POST /v1/trees``), refused while the batches' store fails.
        self.trees = TreeRegistry(
            pool,
            self.metrics,
            preflight=preflight,
            policies=policies,
            service=settings.service,
            refusing=lambda: self.batches.store_error,
        )
        self.sessions = SessionRegistry(
            pool, self.metrics, self.redact, service=settings.service, timeouts=settings.timeouts
        )
        #: MCP rollouts: rollout id → the id of its one-rollout batch, and back.
        self.rollouts: dict[str, str] = {}
        self._rollout_of: dict[str, str] = {}
        self.batches.on_forget.append(self._forget_rollouts)
        #: The worker threads of ``/v1/query`` and ``/v1/stats``.
        self.queries = anyio.CapacityLimiter(settings.service.max_concurrent_queries)
        #: Pauses of policy calls held for trainers (leases).
        self.pauses = PauseLeases(pool, settings.service.max_pause_ttl_s)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if self.settings.service.allow_command_tasks:
                # Batches' agent commands talk to it; it outlives their consumers.
                gateway = Gateway(max_request_bytes=self.settings.policy.agent_max_request_bytes)
                self.batches.gateway = await stack.enter_async_context(gateway)
            async with self._running():
                yield

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self.batches.tg = tg
            self.trees.tg = tg
            self.sessions.tg = tg
            self.pauses.tg = tg
            try:
                yield
            finally:
                self.stop()
                # Let each batch's consumer see its batch to the end (the pool answers
                # a cancelled batch at once), so nothing is left half-read.
                wait_s = self.settings.timeouts.release_s + _SLACK_S
                with anyio.CancelScope(shield=True):
                    async with anyio.create_task_group() as ending:
                        ending.start_soon(self.trees.cancel_all, wait_s)
                        ending.start_soon(self.batches.cancel_all, wait_s)
                tg.cancel_scope.cancel()

    def stop(self) -> None:
        """End every results stream (the server is about to stop)."""
        self.batches.stop()
        self.trees.stop()

    def policy_state(self) -> PolicyState:
        """The policy version and pauses (on Ray too: the pool's gate is mirrored
        onto its actors)."""
        gate = self.pool.policy_gate
        return PolicyState(version=gate.version, paused=gate.paused, pauses=len(self.pauses))

    # -- one-rollout batches, for the MCP tools --------------------------------

    async def start_rollout(
        self, task: Mapping[str, Any], policy: PolicyConfig | None = None
    ) -> RolloutIds:
        """Start one rollout as a batch of its own (on the pool); its ids.

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
            ApiError: 404 (no such rollout), 504 (still running after ``timeout_s``),
                503 (its result could not be written to ``service.state_dir``).
        """
        record = self._record_of(rollout_id)
        with anyio.move_on_after(timeout_s):
            await record.wait_done()
        if record.error is not None and not record.results:  # it could not be kept
            raise ApiError(503, record.error)
        if not record.results:
            raise ApiError(504, f"rollout {rollout_id} is still running after {timeout_s:g} s")
        return record.results[0]

    async def rollout_events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        """A rollout's live events after cursor ``after`` (waiting up to ``wait_s`` for one),
        of any batch, tree or MCP rollout, wherever it runs (this process, or a Ray actor).

        Raises:
            ApiError: 404 (no such rollout), 504 (its Ray actor did not answer in time).
        """
        mcp = self.rollouts.get(rollout_id)
        records = [self.batches.get(mcp)] if mcp is not None else list(self.batches)
        batches: list[RunningBatch] = [record.batch for record in records]
        if mcp is None:  # a tree's rollouts too (its root's batch, then its branches')
            batches += [batch for tree in self.trees for batch in tree.run.batches]
        for batch in batches:
            try:
                return await batch.events(rollout_id, after=after, wait_s=wait_s)
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


def request_settings(config: PolicyConfig | None, settings: Settings) -> Settings:
    """``settings`` with a request's policy in place of the server's ``[policy]``
    (:func:`fleetroll.service.requests.request_policy`)."""
    policy, api_key = request_policy(config, settings.policy, settings.openai_api_key)
    return settings.model_copy(update={"policy": policy, "openai_api_key": api_key})


def build_policy(config: PolicyConfig | None, settings: Settings) -> Policy:
    """The policy a request asks for (:func:`request_settings`), built as
    ``fleetroll run`` builds its own (:func:`~fleetroll.pool.assembly.policy_from_settings`)."""
    return policy_from_settings(request_settings(config, settings))


class ServerPolicies:
    """The service's :class:`~fleetroll.service.batches.RequestPolicies`: a
    request's policy over the server's settings."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    def kind(self, config: PolicyConfig | None) -> str:
        return request_settings(config, self._settings).policy.kind

    def build(self, config: PolicyConfig | None) -> Policy:
        return build_policy(config, self._settings)

    def agent(
        self,
        command: Sequence[str],
        config: PolicyConfig | None,
        *,
        gateway: Gateway,
        records: AgentRecords | None,
    ) -> Policy:
        settings = request_settings(config, self._settings)
        return CommandAgent.from_config(
            command, chat_policy_config(settings), gateway=gateway, records=records
        )
