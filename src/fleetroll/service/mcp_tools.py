"""The service's verbs as MCP tools, at ``/mcp`` (streamable HTTP).

==================  =====================================================
``run_rollout``     task (+ policy) → the result; blocks until the end
``start_rollout``   task (+ policy) → ``rollout_id`` at once
``get_state``       phase, steps so far, and the outcome once it is over
``get_messages``    the transcript so far (``after``: skip what you have)
``abort_rollout``   cancel it (its result still comes: ``cancelled``)
``finalize_rollout`` wait for the end → the result
==================  =====================================================

Each started rollout is a batch of its own (id ``mcp-…``) on the pool the
service runs batches on (in this process, or Ray actors with ``serve
--ray``): it shares the pool's limits with every other batch, gets the
pool's exactly-once result delivery, cancellation and orphan sweep for free,
and shows up in ``GET /v1/batches/{id}`` too. The tools read the rollout
only through its batch's :class:`~fleetroll.rollout.machine.RolloutView` (phase,
steps, transcript; on Ray, asked of the actor running it) and its result
once it is over. Results are kept as long as the batch is
(``service.keep_finished_batches``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import BaseModel, Field
from starlette.types import ASGIApp

from fleetroll.results import RolloutResult
from fleetroll.rollout.events import EventPage, RolloutEvent
from fleetroll.rollout.machine import RolloutIds, RolloutView
from fleetroll.service.errors import ApiError
from fleetroll.service.models import PolicyConfig

__all__ = ["RolloutState", "build_mcp_server", "mcp_app"]

_INSTRUCTIONS = (
    "Run RL rollouts of Fleet tasks. A task is a JSON object in Fleet's export format or"
    " the short form (key, prompt, env_key 'name:version', data_key, modality, solution...)."
    " start_rollout returns a rollout_id at once; poll get_state / get_messages while it"
    " runs; finalize_rollout waits for the result (reward null means an infrastructure"
    " failure, never a zero). run_rollout does all of it in one blocking call."
)


class RolloutStarted(BaseModel):
    rollout_id: str
    batch_id: str


class RolloutState(BaseModel):
    rollout_id: str
    batch_id: str
    task_key: str
    phase: str = Field(description="pending, provisioning, waiting, ..., acting, verifying, done")
    steps: int = Field(description="Tool-calling turns so far")
    done: bool
    status: str | None = Field(None, description="completed or failed, once done")
    failure_reason: str | None = None
    reward: float | None = None


class RolloutMessages(BaseModel):
    rollout_id: str
    messages: list[dict[str, Any]]
    next: int = Field(description="Pass as `after` next time to get only newer messages")
    done: bool


def _state(view: RolloutView) -> RolloutState:
    result = view.result
    return RolloutState(
        rollout_id=view.ids.rollout_id,
        batch_id=view.ids.batch_id,
        task_key=view.task_key,
        phase=view.phase.value,
        steps=view.steps,
        done=result is not None,
        status=result.status if result else None,
        failure_reason=result.failure_reason.value if result and result.failure_reason else None,
        reward=result.reward if result else None,
    )


def _tool_error(exc: ApiError) -> ToolError:
    where = ".".join(str(p) for p in exc.loc)
    return ToolError(f"{where}: {exc.detail}" if where else exc.detail)


class RolloutHost(Protocol):
    """What the tools need of the service (``fleetroll.service.app.Service`` is one).

    Each method raises :class:`~fleetroll.service.errors.ApiError` for what
    the caller should hear (an invalid task, an unknown rollout, no answer in time).
    """

    @property
    def rollout_wait_s(self) -> float: ...

    async def start_rollout(
        self, task: Mapping[str, Any], policy: PolicyConfig | None = None
    ) -> RolloutIds: ...

    async def rollout_view(self, rollout_id: str, *, messages: bool = True) -> RolloutView: ...

    def cancel_rollout(self, rollout_id: str) -> None: ...

    async def rollout_events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage: ...

    @property
    def progress_flush_s(self) -> float: ...

    async def finish_rollout(self, rollout_id: str, timeout_s: float) -> RolloutResult: ...


def _progress_message(event: RolloutEvent) -> str:
    """One line for people about one event (a progress notification's ``message``)."""
    d = event.data
    if event.kind == "phase":
        return f"phase {d['phase']}"
    if event.kind == "turn":
        calls = ", ".join(d["tool_calls"]) or "no tool call"
        return f"policy turn ({d['latency_s']:.2f} s): {calls}"
    if event.kind == "tool_call":
        failed = " (error)" if d["is_error"] else ""
        return f"tool {d['name']} ({d['duration_s']:.2f} s){failed}"
    return f"end: {d['status']}" + (f" ({d['failure_reason']})" if d["failure_reason"] else "")


async def _report_progress(service: RolloutHost, rollout_id: str, ctx: Context) -> None:
    """Send an MCP progress notification per event of the rollout until its end.

    ``progress`` is the event's cursor (it only grows); no ``total``. Events
    that cannot be read (its Ray actor is slow) are not reported.
    """
    cursor = 0
    while True:
        try:
            page = await service.rollout_events(
                rollout_id, after=cursor, wait_s=service.progress_flush_s
            )
        except ApiError:
            return
        for event in page.events:
            cursor = event.seq
            await ctx.report_progress(event.seq, message=_progress_message(event))
        if page.ended:
            return


def build_mcp_server(service: RolloutHost) -> MCPServer:
    """An MCP server whose tools drive rollouts on ``service``."""
    server = MCPServer("fleetroll", instructions=_INSTRUCTIONS)

    async def view(rollout_id: str, *, messages: bool = True) -> RolloutView:
        try:
            return await service.rollout_view(rollout_id, messages=messages)
        except ApiError as exc:
            raise _tool_error(exc) from None

    async def start(task: dict[str, Any], policy: PolicyConfig | None) -> RolloutIds:
        try:
            return await service.start_rollout(task, policy)
        except ApiError as exc:
            raise _tool_error(exc) from None

    async def finish(rollout_id: str, timeout_s: float | None) -> RolloutResult:
        wait = min(timeout_s or service.rollout_wait_s, service.rollout_wait_s)
        try:
            return await service.finish_rollout(rollout_id, wait)
        except ApiError as exc:
            raise _tool_error(exc) from None

    @server.tool(
        description="Run one rollout of `task` to its end and return its result. Sends"
        " progress notifications (phases, turns, tool calls) when the caller asks for them."
    )
    async def run_rollout(
        task: dict[str, Any], policy: PolicyConfig | None = None, ctx: Context | None = None
    ) -> RolloutResult:
        ids = await start(task, policy)
        try:
            if ctx is None:
                return await finish(ids.rollout_id, None)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_report_progress, service, ids.rollout_id, ctx)
                result = await finish(ids.rollout_id, None)
                # The events end with the result: the reporter sends the last ones and
                # returns, before the result; a client slow to take them cannot hold
                # the result back for long.
                tg.cancel_scope.deadline = anyio.current_time() + service.progress_flush_s
            return result
        except anyio.get_cancelled_exc_class():
            # The caller went away: nobody will read this result, stop spending on it.
            service.cancel_rollout(ids.rollout_id)
            raise

    @server.tool(description="Start one rollout of `task`; returns its rollout_id at once.")
    async def start_rollout(
        task: dict[str, Any], policy: PolicyConfig | None = None
    ) -> RolloutStarted:
        ids = await start(task, policy)
        return RolloutStarted(rollout_id=ids.rollout_id, batch_id=ids.batch_id)

    @server.tool(description="The rollout's phase and steps so far; its outcome once done.")
    async def get_state(rollout_id: str) -> RolloutState:
        return _state(await view(rollout_id, messages=False))

    @server.tool(description="The rollout's transcript so far, from message number `after`.")
    async def get_messages(rollout_id: str, after: int = 0) -> RolloutMessages:
        seen = await view(rollout_id)  # redacted, as a result would be
        return RolloutMessages(
            rollout_id=rollout_id,
            messages=list(seen.messages[max(after, 0) :]),
            next=len(seen.messages),
            done=seen.result is not None,
        )

    @server.tool(description="Cancel the rollout; finalize_rollout then returns `cancelled`.")
    async def abort_rollout(rollout_id: str) -> RolloutState:
        try:
            service.cancel_rollout(rollout_id)
        except ApiError as exc:
            raise _tool_error(exc) from None
        return _state(await view(rollout_id, messages=False))

    @server.tool(
        description="Wait for the rollout to end (at most timeout_s) and return its result."
    )
    async def finalize_rollout(rollout_id: str, timeout_s: float | None = None) -> RolloutResult:
        return await finish(rollout_id, timeout_s)

    return server


def mcp_app(server: MCPServer) -> ASGIApp:
    """The server's streamable-HTTP app, to mount at ``/mcp``.

    Its session manager must run in the parent's lifespan. DNS-rebinding
    protection is the service's own Guard (Host check, or a bearer token).
    """
    return server.streamable_http_app(
        streamable_http_path="/mcp",
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
