"""Env-style sessions over HTTP, each run by its own server-side task.

``pool.session(task)`` must be entered and left by one task (it holds an MCP
client whose task group belongs to that task), while HTTP requests arrive
on tasks of their own. So each session is an actor: a task started in the
service's task group enters the session, then serves the requests sent to
it through an unbuffered memory object stream (each with a one-shot reply
stream), one at a time, until it is closed or nobody has spoken to it for
``service.session_idle_s``. Then it leaves the session, which scores the
rollout (the verifier runs if it has not) and releases the instance, and
keeps the result for a late ``DELETE``. A ``done`` request says the episode
is over (:meth:`~fleetroll.rollout.env_session.EnvSession.done`), so the result is
``completed``; a session closed without one is ``abandoned``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from fleetroll.errors import InstanceLostError, ProvisionError
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.rollout.env_session import EnvSession, StepResult
from fleetroll.service.errors import ApiError
from fleetroll.service.metrics import Metrics
from fleetroll.service.models import Observation, SessionOpened, ToolInfo
from fleetroll.settings import ServiceSettings, TimeoutSettings
from fleetroll.tasks import TaskSpec
from fleetroll.tools.session import describe

__all__ = ["SessionRegistry"]

#: Slack on top of the settings' own deadlines for one answer from an actor.
#: Not a setting: a margin over deadlines that are settings already.
_SLACK_S = 30.0

_Kind = Literal["step", "done", "close"]
#: An actor's answer: a step's, the result (close), None (done), or what went wrong.
_Answer = StepResult | RolloutResult | Exception | None


@dataclass
class _Ask:
    """One request to a session's actor, with the stream its answer goes back on."""

    kind: _Kind
    reply: MemoryObjectSendStream[_Answer]
    call: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class _Session:
    session_id: str
    inbox: MemoryObjectSendStream[_Ask]
    ended: anyio.Event = field(default_factory=anyio.Event)
    result: RolloutResult | None = None
    why_ended: str = ""
    opened: bool = False


class SessionRegistry:
    """Open sessions by id, and recently ended ones. Needs ``tg`` before use."""

    def __init__(
        self,
        pool: RolloutPool,
        metrics: Metrics,
        redact: Callable[[str], str],
        *,
        service: ServiceSettings,
        timeouts: TimeoutSettings,
    ) -> None:
        self._pool = pool
        self._service = service
        self._metrics = metrics
        self._redact = redact
        self._live: dict[str, _Session] = {}
        self._ended: OrderedDict[str, _Session] = OrderedDict()
        self.tg: TaskGroup | None = None
        t = timeouts
        self._open_s = t.provision_total_s + t.reset_s + t.mcp_connect_s + t.list_tools_s + _SLACK_S
        self._step_s = 2 * t.call_tool_s + t.release_s + _SLACK_S
        self._close_s = t.call_tool_s + t.verifier_s + t.release_s + _SLACK_S

    @property
    def open_count(self) -> int:
        return len(self._live)

    async def open(
        self, task: TaskSpec, *, batch_id: str | None = None, sample_index: int = 0
    ) -> SessionOpened:
        """Provision an instance and open a session on it.

        Raises:
            ApiError: 422 (the platform refuses the task's environment), 503
                (a transient failure, or the pool stayed full), 502 (the
                environment could not be set up).
        """
        if self.tg is None:
            raise RuntimeError("the service is not running")
        session_id = uuid.uuid4().hex
        send, receive = anyio.create_memory_object_stream[_Ask](0)
        session = _Session(session_id, send)
        ready_send, ready = anyio.create_memory_object_stream[SessionOpened | Exception](1)
        # Registered before the actor starts, so that its end always unregisters it.
        self._live[session_id] = session
        self.tg.start_soon(self._run, session, receive, ready_send, task, batch_id, sample_index)
        with ready:
            try:
                with anyio.fail_after(self._open_s):
                    outcome = await ready.receive()
            except TimeoutError:
                self._live.pop(session_id, None)  # the actor closes itself once it sees that
                raise ApiError(
                    503,
                    f"no instance within {self._open_s:g} s (the pool may be full); try again",
                    headers={"Retry-After": "5"},
                ) from None
            except anyio.EndOfStream:  # the actor was cancelled (shutdown)
                raise ApiError(503, "the service is shutting down") from None
        if isinstance(outcome, Exception):
            raise self._setup_failure(outcome)
        return outcome

    async def step(self, session_id: str, call: Mapping[str, Any]) -> Observation:
        """Run one tool call in the session.

        Raises:
            ApiError: 404 (no such session), 410 (it ended), 502 (the instance
                is gone: the session has ended), 504 (no answer in time).
        """
        outcome = await self._ask(session_id, "step", call, self._step_s)
        if isinstance(outcome, InstanceLostError):
            raise ApiError(502, f"the session ended: {self._redact(str(outcome))}")
        if isinstance(outcome, Exception):
            raise ApiError(502, f"the step failed: {self._redact(describe(outcome))}")
        assert isinstance(outcome, StepResult)
        return Observation(
            text=outcome.observation.text,
            is_error=outcome.observation.is_error,
            done=outcome.done,
            messages=list(outcome.messages),
        )

    async def done(self, session_id: str) -> None:
        """Say the episode is over: the session's result will be ``completed``.

        Raises:
            ApiError: 404 (no such session), 410 (it ended), 504 (no answer in time).
        """
        outcome = await self._ask(session_id, "done", {}, self._step_s)
        if isinstance(outcome, Exception):
            raise ApiError(502, f"ending the episode failed: {self._redact(str(outcome))}")

    async def close(self, session_id: str) -> RolloutResult:
        """End the session (scored, released) and return its result.

        A session that already ended (idle, or closed before) answers with its
        result as long as it is remembered (``service.keep_ended_sessions``).

        Raises:
            ApiError: 404 (no such session), 504 (no answer in time).
        """
        ended = self._ended.get(session_id)
        if ended is not None and ended.result is not None:
            return ended.result
        outcome = await self._ask(session_id, "close", {}, self._close_s)
        if isinstance(outcome, RolloutResult):
            return outcome
        raise ApiError(502, f"closing the session failed: {self._redact(str(outcome))}")

    async def wait_ended(self, session_id: str) -> RolloutResult | None:
        """Wait until the session has ended (closed, expired or lost); its result."""
        session = self._live.get(session_id) or self._ended.get(session_id)
        if session is None:
            raise ApiError(404, f"no session {session_id!r}")
        await session.ended.wait()
        return session.result

    def _find(self, session_id: str) -> _Session:
        session = self._live.get(session_id)
        if session is not None:
            return session
        ended = self._ended.get(session_id)
        if ended is not None:
            raise ApiError(
                410, f"the session has ended ({ended.why_ended}); DELETE it for its result"
            )
        raise ApiError(404, f"no session {session_id!r} (unknown, or ended long ago)")

    async def _ask(
        self,
        session_id: str,
        kind: _Kind,
        call: Mapping[str, Any],
        wait_s: float,
    ) -> _Answer:
        session = self._find(session_id)
        reply_send, reply = anyio.create_memory_object_stream[_Answer](1)
        with reply, reply_send:  # the actor closes reply_send too, once it answered
            try:
                with anyio.fail_after(wait_s):
                    try:
                        await session.inbox.send(_Ask(kind, reply_send, call))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        if kind == "close" and session.result is not None:
                            return session.result
                        self._find(session_id)  # 410 with the reason it ended
                        raise ApiError(410, "the session has ended") from None
                    return await reply.receive()
            except TimeoutError:
                self._live.pop(session_id, None)  # the actor closes itself once it sees that
                raise ApiError(504, f"the session did not answer within {wait_s:g} s") from None
            except anyio.EndOfStream:  # the actor ended without answering (shutdown)
                if kind == "close" and session.result is not None:
                    return session.result
                raise ApiError(410, "the session has ended") from None

    # -- the actor ------------------------------------------------------------

    async def _run(
        self,
        session: _Session,
        inbox: MemoryObjectReceiveStream[_Ask],
        ready: MemoryObjectSendStream[SessionOpened | Exception],
        task: TaskSpec,
        batch_id: str | None,
        sample_index: int,
    ) -> None:
        closer: _Ask | None = None
        env: EnvSession | None = None
        try:
            try:
                async with self._pool.session(
                    task, batch_id=batch_id, sample_index=sample_index
                ) as env:
                    opened = SessionOpened(
                        session_id=session.session_id,
                        messages=await env.reset(),
                        tools=[
                            ToolInfo(
                                name=t.name,
                                description=t.description,
                                input_schema=dict(t.input_schema),
                            )
                            for t in env.tools
                        ],
                    )
                    try:
                        ready.send_nowait(opened)
                        session.opened = True
                    except anyio.BrokenResourceError:  # the opener gave up waiting
                        session.why_ended = "nobody waited for it to open"
                    else:
                        closer = await self._serve(session, env, inbox)
            except Exception as exc:  # the actor's boundary: set-up failed, or a bug
                if env is None:
                    with contextlib.suppress(anyio.BrokenResourceError):
                        ready.send_nowait(exc)
                else:  # the rollout recorded it (abandoned) and was scored anyway
                    session.why_ended = f"it failed: {describe(exc)}"
            if env is not None:
                session.result = await env.close()
        finally:
            # Closed only now, with the result known: a request that arrived
            # while the session was being scored gets the result or a 410.
            inbox.close()
            session.inbox.close()  # senders waiting on it get ClosedResourceError: a 410
            ready.close()
            if self._live.pop(session.session_id, None) is not None and session.opened:
                self._remember(session)
            if session.result is not None:
                self._metrics.observe(session.result)
            session.ended.set()
        if closer is not None and session.result is not None:
            with (
                closer.reply,
                contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError),
            ):
                closer.reply.send_nowait(session.result)

    async def _serve(
        self, session: _Session, env: EnvSession, inbox: MemoryObjectReceiveStream[_Ask]
    ) -> _Ask | None:
        """Answer requests until a close (returned, answered once scored) or idleness."""
        idle_s = self._service.session_idle_s
        while True:
            ask: _Ask | None = None
            with anyio.move_on_after(idle_s):
                ask = await inbox.receive()
            if ask is None:
                session.why_ended = f"idle for {idle_s:g} s"
                return None
            if ask.kind == "close":
                session.why_ended = "closed"
                return ask
            if ask.kind == "done":
                await env.done()
                with (
                    ask.reply,
                    contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError),
                ):
                    ask.reply.send_nowait(None)
                continue
            with ask.reply:
                try:
                    outcome: StepResult | Exception = await env.step(ask.call)
                except InstanceLostError as exc:
                    outcome = exc
                    session.why_ended = "its instance is gone"
                except Exception as exc:  # one session's bug ends it, not the service
                    outcome = exc
                    session.why_ended = f"a step failed: {describe(exc)}"
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    ask.reply.send_nowait(outcome)  # unless the caller gave up
            if isinstance(outcome, Exception):
                return None

    def _remember(self, session: _Session) -> None:
        self._ended[session.session_id] = session
        while len(self._ended) > self._service.keep_ended_sessions:
            self._ended.popitem(last=False)

    def _setup_failure(self, exc: Exception) -> ApiError:
        message = f"the environment could not be set up: {self._redact(str(exc))}"
        if isinstance(exc, ProvisionError):
            if exc.transient:
                return ApiError(503, message, headers={"Retry-After": "5"})
            if exc.status_code in (400, 404, 422):
                # The platform refused what the task names (env, version, data).
                return ApiError(422, message, loc=["body", "task", "env_key"])
        return ApiError(502, message)
