"""One rollout's lifecycle, as an explicit state machine.

::

    PENDING → PROVISIONING → (WAITING) → RESETTING → CONNECTING → ACTING → VERIFYING → DONE
                   │              (a failed reset is logged; fatal only where
                   │               the reset makes the state fresh)
                   └── any phase may end early; RELEASING always runs

Every operation runs under its own deadline, and everything after the
instance is ready runs under the rollout's (``timeouts.rollout_s``: the
agent's clock starts when its instance is ready and it holds an acting slot,
and stops while a trainer pauses policy calls). When that deadline passes,
what the rollout was waiting on decides its end: the platform (a reset, the
MCP connect, the tool listing, a tool call) makes it ``platform_timeout``,
not scored; the policy (its calls, or the turns between them) ``timeout``,
scored. Whatever happens — an error, a timeout, cancellation — the instance
is released (shielded and bounded), ``fleet_rollout_completed`` is emitted
exactly once, and :attr:`Rollout.result` holds a result with the right
``failure_reason``.

Around it: what rollouts share is the engine (:mod:`fleetroll.rollout.engine`); what
each phase does (provision, reset, connect, one policy call, score, the
completed event) is :mod:`fleetroll.rollout.stages`; the phases, their transitions
and the read model are :mod:`fleetroll.rollout.phases`; when a rollout is too far
behind the trainer's policy is :mod:`fleetroll.rollout.staleness`; one tool call and
what it means is :mod:`fleetroll.rollout.dispatch`; the mutable state and the
(redacted) result are :mod:`fleetroll.rollout.progress`; the transcript is
:mod:`fleetroll.rollout.transcript`; the env-style session API is
:mod:`fleetroll.rollout.env_session`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    asynccontextmanager,
    nullcontext,
)
from dataclasses import replace
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio

import fleetroll.rollout.dispatch as dispatch
import fleetroll.rollout.stages as stages
import fleetroll.rollout.staleness as staleness
from fleetroll._internal.retrying import reporting as report_retries
from fleetroll.environments.provider import Instance
from fleetroll.policies import AssistantTurn, Policy, ToolCall, ToolSpec
from fleetroll.policies.gate import gate_of_rollout
from fleetroll.policies.servers import sticky
from fleetroll.results import FailureReason, RolloutResult, writable_result
from fleetroll.rollout.branching import BranchPolicy, Prefix, first_difference
from fleetroll.rollout.events import EventPage, RolloutEventLog
from fleetroll.rollout.phases import NEXT, Phase, RolloutView, crash_reason, view_of
from fleetroll.rollout.progress import Progress, RolloutIds
from fleetroll.rollout.stages import RolloutContext, SetupFailure
from fleetroll.rollout.transcript import Transcript
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events, Redactor
from fleetroll.telemetry.retries import retry_emitter
from fleetroll.tools.routing import Route
from fleetroll.tools.session import ToolResult, ToolSession, describe

T = TypeVar("T")
_log = logging.getLogger(__name__)


@runtime_checkable
class Agent(Protocol):
    """Acts for a rollout by itself (:class:`fleetroll.rollout.agent_command.CommandAgent`):
    given to :meth:`Rollout.run` in place of a policy, it runs the acting phase."""

    async def drive(self, rollout: Rollout) -> None:
        """Act until done; record each policy call with :meth:`Rollout.record_call`."""
        ...


__all__ = ["Agent", "Phase", "Rollout", "RolloutIds", "RolloutView"]


class Rollout:
    """One rollout: its phase, its progress, and (at the end) its result."""

    def __init__(
        self,
        engine: RolloutContext,
        task: TaskSpec,
        ids: RolloutIds,
        *,
        run_id: str | None,
        gate: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
        hold: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
    ) -> None:
        self.engine = engine
        self._gate = gate
        self._hold = hold
        self.task = task
        self.ids = ids
        self.run_id = run_id
        self.phase = Phase.PENDING
        #: Called (synchronously) after every change of phase or transcript.
        self.observers: list[Callable[[Rollout], None]] = []
        #: What it does, live (``GET /v1/rollouts/{id}/events``): bounded, redacted.
        self.live = RolloutEventLog(
            cap=engine.config.pool.events_max,
            preview_chars=engine.config.pool.events_preview_chars,
            redact=engine.redactor,
        )
        self.observers.append(self.live.observe)
        self._changed: anyio.Event | None = None
        self.result: RolloutResult | None = None
        self._started = time.monotonic()
        #: Entered around the whole run by :meth:`execute`; :meth:`stop` cancels it.
        #: Made when it starts, and None again once it returned (a scope keeps the
        #: task it ran in): a batch's waiting and finished rollouts have none.
        self.stop_scope: anyio.CancelScope | None = None
        self._stop: tuple[FailureReason, str] | None = None
        #: The owner's last word on the result as it is built, before anyone
        #: sees it (a batch: whether it counts in its group, :mod:`fleetroll.training.groups`).
        self.settle: Callable[[RolloutResult], RolloutResult] | None = None
        self.max_steps = task.max_steps or engine.config.pool.max_steps
        self._new_attempt(Progress())

    @property
    def deadline(self) -> float:
        """When the rollout's clock runs out (``anyio.current_time()``), once ready."""
        return self.progress.deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        self.progress.deadline = value

    def _new_attempt(self, progress: Progress) -> None:
        """Start an attempt afresh: no instance, no session, ``progress`` as the state."""
        self.instance: Instance | None = None
        self.route: Route | None = None
        self.tools: list[ToolSpec] = []
        self.session: ToolSession | None = None
        self._setup_failure: SetupFailure | None = None
        self._deadline_scope: anyio.CancelScope | None = None
        self._provisioned_at: float | None = None
        self._closing_at: float | None = None
        #: The mutable state (only the rollout's own task, or its session, touches it).
        self.progress = progress
        self.progress.transcript.max_images = self.engine.config.policy.max_images

    # -- the whole rollout --------------------------------------------------

    async def run(self, policy: Policy) -> RolloutResult:
        """Provision, act with ``policy``, verify, release. Returns the result.

        On cancellation the result (``cancelled``) is still recorded in
        :attr:`result` and the completed event emitted before re-raising.
        A stale rollout (``pool.max_staleness``) with ``staleness_action =
        "restart"`` runs again from scratch on a fresh instance, inside this
        one call: still one started and one completed event, one result.
        """
        pool = self.engine.config.pool
        restarts = pool.max_stale_restarts if pool.staleness_action == "restart" else 0
        restarted = 0
        while True:
            async with self.lifecycle(
                enforce_deadline=True, may_restart=restarted < restarts, restarted=restarted
            ) as ready:
                if ready:
                    await self._guarded(self._act(policy))
            if self.result is not None:
                return self.result
            restarted += 1

    async def execute(self, policy: Policy) -> None:
        """Run it to its end as a pool's rollout (:class:`fleetroll.pool.executor.RolloutHandle`).

        :meth:`run`, under :attr:`stop_scope` and the ``hold`` it was made
        with; on return :attr:`result` is set, even if :meth:`stop` came
        before it started or :meth:`run` itself failed (a fleetroll bug).
        """
        self.stop_scope = anyio.CancelScope()
        if self._stop is not None:  # stopped before it started
            self.stop_scope.cancel()
        try:
            # stop() (its group is complete) cancels just this rollout.
            with self.stop_scope:
                async with self._hold() if self._hold else nullcontext():
                    await self.run(policy)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # the rollout's own boundary failed: still one result
            if self.result is None:
                self.never_started(FailureReason.INIT_ERROR, f"fleetroll bug: {exc!r}")
        finally:
            self.stop_scope = None
        if self.result is None:  # stopped while it waited for an instance slot
            reason, error = self._stop or (
                FailureReason.CANCELLED,
                "the rollout was cancelled before it started",
            )
            self.never_started(reason, error)

    @asynccontextmanager
    async def lifecycle(
        self, *, enforce_deadline: bool = False, may_restart: bool = False, restarted: int = 0
    ) -> AsyncIterator[bool]:
        """Set up (provision, reset, connect, discover), yield, score, tear down.

        Yields whether the rollout is ready to act. With ``enforce_deadline``,
        the block is cancelled when the rollout's deadline passes (and the
        rollout ends as ``timeout``, still scored, or as ``platform_timeout``
        if it was waiting on the platform then: see :meth:`time_out`).
        Failures of set-up and scoring become the result's ``failure_reason``;
        an exception from the caller's own block is recorded (``abandoned``)
        and re-raised.

        With ``may_restart``, a stale rollout is released without a result
        (:attr:`result` stays None) for the caller to run again; ``restarted``
        says how many times it already was (its started event is not repeated).
        """
        if not restarted:
            self._started = time.monotonic()
        caller_error: Exception | None = None
        restart = yielded = False
        with (
            Events.bind(**stages.event_attributes(self.ids, self.task)),
            report_retries(retry_emitter(self.engine.events)),
        ):
            if not restarted:
                self.engine.events.emit("fleet_rollout_started")
            try:
                # One scope spans set-up and the block, so that the MCP session
                # opened inside nests properly; its deadline is set once the
                # instance is ready (the agent's clock starts then).
                with anyio.CancelScope() as deadline:
                    try:
                        async with AsyncExitStack() as stack:
                            stack.callback(self._session_closed)  # runs last
                            try:
                                ready = await self._guarded(
                                    self._set_up(stack, deadline if enforce_deadline else None),
                                    default=False,
                                )
                            finally:  # also when the deadline cut set-up short
                                stack.callback(self._session_closing)  # runs first
                            try:
                                yielded = True
                                yield bool(ready)
                            except Exception as exc:
                                # Scored as abandoned, then raised again outside the
                                # MCP session (whose task group would wrap it).
                                self.abandon()
                                caller_error = exc
                    except Exception as exc:
                        # The MCP session failed under us (its transport task
                        # died and cancelled what we were doing, or closing it
                        # failed): whatever we were doing did not finish.
                        opened = self.session is not None
                        await stages.session_failed(
                            self.engine, self.instance, self.progress, exc, opened=opened
                        )
                if deadline.cancelled_caught:
                    self.time_out()
                # Whether to restart a stale rollout (see fleetroll.rollout.staleness.check).
                limit, now = (
                    self.engine.config.pool.max_staleness,
                    self.engine.policy_gate.version,
                )
                restart = staleness.check(self.progress, limit, now, may_restart=may_restart)
                if not restart:
                    token_limit = self.engine.config.policy.max_token_staleness
                    staleness.check_tokens(self.progress, token_limit, now)
                    await self._guarded(self._score())
            except anyio.get_cancelled_exc_class():
                reason, error = self._stop or (FailureReason.CANCELLED, "the rollout was cancelled")
                self.fail(reason, error, force=True)
                raise
            finally:
                await self._tear_down(restart=restart, restarted=restarted)
        if not yielded:
            # The deadline passed during set-up: the rollout has its result,
            # and the caller's block has nothing to act on.
            yield False
        if caller_error is not None:
            raise caller_error

    def _session_closing(self) -> None:
        self._closing_at = time.monotonic()

    def _session_closed(self) -> None:
        """Closing the MCP session is part of letting the instance go: ``release_s``."""
        if self._closing_at is not None:
            self.progress.timings.release_s += time.monotonic() - self._closing_at
            self._closing_at = None

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase`` (checked against the transition table) and notify."""
        if phase not in NEXT[self.phase]:
            raise RuntimeError(f"a rollout cannot go from {self.phase} to {phase}")
        self.phase = phase
        self.notify()

    def notify(self) -> None:
        """Tell the observers and :meth:`wait_until` that something changed."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for observer in tuple(self.observers):
            observer(self)

    async def wait_until(self, condition: Callable[[Rollout], bool]) -> None:
        """Return once ``condition(rollout)`` holds, checked at each change (no polling)."""
        while not condition(self):
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    async def _guarded(self, work: Awaitable[T], default: T | None = None) -> T | None:
        """Await our own work; a crash becomes this rollout's failure, not an exception."""
        try:
            return await work
        except Exception as exc:  # the boundary: one rollout's bug must not escape
            self.fail(
                crash_reason(self.phase), f"unexpected error in {self.phase}: {describe(exc)}"
            )
            return default

    async def _set_up(self, stack: AsyncExitStack, deadline: anyio.CancelScope | None) -> bool:
        e = self.engine
        self._enter(Phase.PROVISIONING)
        instance = await stages.provision(e, self.task, self.progress, run_id=self.run_id)
        if isinstance(instance, SetupFailure):
            return self._set_up_failed(instance)
        self.instance = instance
        self.task = self.task.with_placeholders(instance.placeholders)  # {workdir} in solution
        self._provisioned_at = time.monotonic()
        if self._gate is not None:
            self._enter(Phase.WAITING)
            began = time.monotonic()
            try:
                await stack.enter_async_context(self._gate())
            finally:
                self.progress.timings.slot_wait_s += time.monotonic() - began
        self.deadline = anyio.current_time() + e.config.timeouts.rollout_s
        self._deadline_scope = deadline
        if deadline is not None:
            deadline.deadline = self.deadline
        stack.enter_context(Events.bind(instance_id=instance.instance_id))

        self._enter(Phase.RESETTING)
        with self.progress.platform_wait("resetting the instance"):
            failed = await stages.reset(e, instance, self.task, self.progress)
        if failed is not None:
            return self._set_up_failed(failed)

        self._enter(Phase.CONNECTING)
        began = time.monotonic()
        try:
            self.route = e.provider.route(instance, self.task)
            connected = await stages.connect(e, instance, self.route, stack, self.progress)
            if isinstance(connected, SetupFailure):
                return self._set_up_failed(connected)
            self.session, self.tools = connected
            with self.progress.platform_wait("the initial screenshot"):
                shot = await stages.first_screenshot(e, self.session, self.route)
        finally:
            self.progress.timings.connect_s += time.monotonic() - began
        self.progress.transcript.add_prompt(self.task.prompt, shot)
        self._enter(Phase.ACTING)
        return True

    def _set_up_failed(self, failure: SetupFailure) -> bool:
        """Record why set-up stopped (kept for :meth:`setup_error`); the rollout is not ready."""
        self._setup_failure = failure
        self.fail(failure.reason, failure.error)
        return False

    # -- acting -------------------------------------------------------------

    async def _act(self, policy: Policy) -> None:
        # The rollout's calls go to one policy server (fleetroll.policies.servers).
        with sticky():
            if isinstance(policy, Agent):  # an agent of its own acts (--agent-command)
                await policy.drive(self)
            else:
                # An aborted call waits on the rollout's gate before it resumes.
                with gate_of_rollout(self.engine.policy_gate):
                    await self._act_turns(policy)

    async def _act_turns(self, policy: Policy) -> None:
        config = self.engine.config
        if isinstance(policy, BranchPolicy) and not await self._replay(policy.prefix):
            return
        timeout = config.timeouts.policy_s
        max_context = config.policy.max_context_tokens
        while not self.progress.finished and self.progress.reason is None:
            if self.progress.steps >= self.max_steps:
                self.fail(FailureReason.MAX_STEPS, f"the step budget of {self.max_steps} ran out")
                return
            if (
                max_context is not None
                and (estimate := self.progress.context_estimate()) > max_context
            ):
                self.fail(
                    FailureReason.CONTEXT_OVERFLOW,
                    f"the next prompt would hold about {estimate} tokens, over"
                    f" policy.max_context_tokens = {max_context}",
                )
                return
            version = await self.admit_policy_call()
            asked = await stages.ask_policy(
                policy,
                self.task,
                self.progress,
                self.tools,
                timeout_s=timeout,
                policy_version=version,
                gate=self.engine.policy_gate,
            )
            if asked is None:
                return
            turn, latency = asked
            self.live.turn(turn, latency_s=latency, policy_version=version)
            await self.apply(turn)

    async def _replay(self, prefix: Prefix) -> bool:
        """Apply the prefix's turns again, checking each step's answers against
        the prefix's (:mod:`fleetroll.rollout.branching`); whether it replayed equal.

        A difference ends the rollout as ``replay_diverged`` (not scored).
        """
        p = self.progress
        p.branch = prefix
        redact, keep = self.engine.redactor, self.engine.config.pool.transcript_images
        for number, (turn, want) in enumerate(zip(prefix.turns, prefix.answers, strict=True), 1):
            start = len(p.transcript)
            await self.apply(turn)
            if p.reason is not None:  # a tool failure, the deadline: its own end
                return False
            got = p.transcript.export(redact, keep_images=keep)[start + 1 :]
            if (where := first_difference(got, want)) is not None:
                self.fail(
                    FailureReason.REPLAY_DIVERGED,
                    f"replaying step {number} of the shared prefix (rollout"
                    f" {prefix.parent_rollout_id}'s), the environment answered otherwise:"
                    f" {where}. Its state after a reset is not the prefix's (a task"
                    " without a seed or timestamp, or a nondeterministic environment)",
                )
                return False
        return not p.finished

    async def admit_policy_call(self) -> int:
        """Wait while the policy is paused; the policy version to record on the call.

        A trainer's pause (pool.policy_paused) is charged to no deadline of the
        rollout's: neither its own nor policy_s (counted from the return on).
        """
        gate = self.engine.policy_gate
        if not gate.paused:  # admitted at once, with no await: no deadline to lift
            version, _ = await gate.admit()
        else:
            with stages.deadline_lifted(self._deadline_scope, lambda: self.deadline):
                version, waited_s = await gate.admit()
                self.deadline += waited_s
                self.progress.timings.paused_s += waited_s
        if self.progress.first_policy_version is None:
            self.progress.first_policy_version = version
        return version

    def record_call(
        self,
        turn: AssistantTurn,
        *,
        policy_version: int,
        latency_s: float,
        observations: Sequence[Mapping[str, Any]] = (),
        others: Sequence[AssistantTurn] = (),
    ) -> None:
        """Record a policy call an agent of its own made (its tools it runs itself).

        ``observations``: what the agent sent after its previous assistant message
        (the tool answers it got over MCP), added to the transcript before the turn.
        ``others``: the call's other choices (it asked for ``n`` > 1), each a turn
        of its own after ``turn`` (choice 1, 2, …); the transcript holds ``turn``'s
        message. The call is a step when any choice calls tools.
        """
        p = self.progress
        p.record_turn(turn, policy_version=policy_version, latency_s=latency_s)
        for choice, other in enumerate(others, start=1):
            p.record_turn(other, policy_version=policy_version, latency_s=latency_s, choice=choice)
        self.live.turn(turn, latency_s=latency_s, policy_version=policy_version)
        p.transcript.add_observations(observations)
        p.transcript.add_turn(turn)
        if turn.tool_calls or any(other.tool_calls for other in others):
            p.steps += 1
        self.notify()

    async def apply(self, turn: AssistantTurn) -> None:
        """Record an assistant turn and run its tool calls."""
        self.progress.transcript.add_turn(turn)
        self.notify()
        if not turn.tool_calls:
            self.progress.finished = True
            return
        self.progress.steps += 1
        for call in turn.tool_calls:
            if self.progress.finished or self.progress.reason is not None:
                return
            await self.call_tool(call)
            self.notify()  # the tool's answer is in the transcript

    async def call_tool(self, call: ToolCall) -> ToolResult:
        """Run one tool call and record its answer (see :func:`~.dispatch.call_tool`)."""
        with self.progress.platform_wait(f"the tool call {call.name}"):
            return await dispatch.call_tool(self, call)

    # -- the end ------------------------------------------------------------

    async def _score(self) -> None:
        """Run the verifier when the outcome calls for a reward."""
        if self.instance is None or not self.progress.to_score:
            return
        self.progress.scored = True
        self._enter(Phase.VERIFYING)
        await stages.score(self.engine, self.instance, self.task, self.progress)

    def stop(self, reason: FailureReason, error: str) -> None:
        """End the rollout early, from another task: it ends as ``reason``.

        Cancels :attr:`stop_scope`; its instance is released as on any path.
        """
        if self._stop is None:
            self._stop = (reason, error)
        if self.stop_scope is not None:
            self.stop_scope.cancel()

    @property
    def stop_reason(self) -> tuple[FailureReason, str] | None:
        """Why :meth:`stop` was called, if it was."""
        return self._stop

    async def _tear_down(self, *, restart: bool = False, restarted: int = 0) -> None:
        self._enter(Phase.RELEASING)
        # Not needed once released, and a finished batch keeps its rollouts: a
        # listing of thousands of tools (and its closed session) is let go.
        self.tools, self.session = [], None
        if self.instance is not None:
            began = time.monotonic()
            try:
                reuse = not restart and stages.instance_reusable(self.progress)
                await self.engine.provider.release(self.instance, reuse=reuse)
            finally:
                self.progress.timings.release_s += time.monotonic() - began
        if self._provisioned_at is not None:
            # Summed: a restarted rollout paid for its stale attempt's instance too.
            self.progress.cost.instance_s += time.monotonic() - self._provisioned_at
        if restart:
            # Forget the stale attempt (its instance is released; its cost stays) and say so.
            p = self.progress
            staleness.report_restart(
                self.engine.events,
                self.instance,
                restarts=restarted + 1,
                first_policy_version=p.first_policy_version,
                policy_version=self.engine.policy_gate.version,
            )
            # Its time is summed too, so that the timings still add up to total_s.
            self._new_attempt(Progress(cost=p.cost, timings=p.timings))
            return
        self._enter(Phase.DONE)
        result = self._conclude()
        stages.report_completed(self.engine.events, result)
        if self.engine.admission is not None:  # the environment's circuit breaker
            self.engine.admission.record(self.task.env_spec, result.failure_reason)

    def fail(self, reason: FailureReason, error: str, *, force: bool = False) -> None:
        """Record the first failure (``force``: cancellation overrides)."""
        self.progress.fail(reason, error, force=force)

    def setup_error(self) -> Exception:
        """Why set-up failed, for session callers."""
        return stages.setup_error(self._setup_failure, self.progress.error)

    def _conclude(self) -> RolloutResult:
        """Build and keep the result, and end the live event log with it."""
        self.progress.timings.close(time.monotonic() - self._started)
        result = self.progress.result(
            self.ids,
            self.task,
            self.instance.instance_id if self.instance else None,
            instance_uses=self.instance.uses if self.instance else None,
            redact=self.engine.redactor,
            keep_images=self.engine.config.pool.transcript_images,
            trajectory=self.engine.config.policy.trajectory,
        )
        # One result every view serves: one JSON cannot hold is its stand-in
        # (result_error), here, before its group, the stream, the events, telemetry
        # and the journal see it.
        if (kept := writable_result(result)) is not result:
            _log.warning(
                "rollout %s: %s; kept as %s",
                kept.rollout_id,
                kept.error,
                FailureReason.RESULT_ERROR.value,
            )
            result = kept
        self.result = result if self.settle is None else self.settle(result)
        self.live.end(self.result)
        self._let_go()
        return self.result

    def _let_go(self) -> None:
        """Keep only what the result and the read model need, once the result is built.

        A batch holds its rollouts until it is forgotten (10,000 at once for a
        large one), so a finished rollout drops what produced its result: the
        provider's object for the instance (the SDK's, with its parsed
        answers), the route, the live transcript (the result holds its
        export) with its encodings, the turns' token data (in the result too),
        the verifier's outcome, the deadline's cancel scope and the limits'
        callables (closures over the pool's context).
        """
        assert self.result is not None
        if self.instance is not None:
            self.instance = replace(self.instance, handle=None)
        self.route = None
        self._deadline_scope = None
        self._gate = self._hold = None
        p = self.progress
        p.transcript = Transcript(p.transcript.max_images)
        p.turns = []
        p.verifier = None
        # The result holds copies of both, and nothing changes them any more.
        p.timings, p.cost = self.result.timings, self.result.cost

    def never_started(self, reason: FailureReason, error: str) -> RolloutResult:
        """The result of a rollout that ended before it started (no events).

        Also the pool's last resort when :meth:`run` itself raised (a bug)
        after the rollout left PENDING: it then passes through RELEASING to
        DONE instead of refusing the transition; an instance it may hold
        carries the batch's run_id, so the batch's sweep releases it.
        """
        self.fail(reason, error)
        if self.phase is not Phase.DONE:
            if Phase.DONE not in NEXT[self.phase]:
                self._enter(Phase.RELEASING)  # every phase before DONE may release
            self._enter(Phase.DONE)
        return self._conclude()

    # -- session support ----------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.progress.finished or self.progress.reason is not None

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The transcript: the live one, or once the rollout has ended its result's
        (redacted) export (the live one is let go then)."""
        if self.result is not None:
            return list(self.result.transcript)
        return self.progress.transcript.messages

    def view(self, *, messages: bool = True) -> RolloutView:
        """What the rollout is doing, for others to read (see :class:`RolloutView`).

        ``messages=False``: without the transcript (the view's ``messages`` is
        empty), so a caller that wants only the phase and counts does not pay
        for exporting and redacting every message.
        """
        ids, key, engine = self.ids, self.task.key, self.engine
        return view_of(ids, key, self.phase, self.progress, self.result, engine, messages=messages)

    async def read_view(self, *, messages: bool = True) -> RolloutView:
        """:meth:`view`, as a pool reads it (:class:`fleetroll.pool.executor.RolloutHandle`)."""
        return self.view(messages=messages)

    async def events(self, after: int, wait_s: float) -> EventPage:
        """Its live events after cursor ``after``, waiting up to ``wait_s`` for one."""
        return await self.live.page(after, wait_s)

    @property
    def redactor(self) -> Redactor:
        return self.engine.redactor

    def abandon(self) -> None:
        if not self.finished:
            self.fail(FailureReason.ABANDONED, "the session was closed before the episode ended")

    def time_out(self) -> None:
        """The rollout's deadline passed: whose time ran out decides the reason.

        If it passed while the rollout waited on the platform
        (:meth:`Progress.platform_wait`), the rollout is ``platform_timeout``,
        never scored (the agent could not act, and what a half-done platform
        operation left is unknown); otherwise the policy had the turn: ``timeout``.
        """
        limit = self.engine.config.timeouts.rollout_s
        if (overrun := self.progress.overrun) is not None:
            what, waited = overrun
            self.fail(
                FailureReason.PLATFORM_TIMEOUT,
                f"the rollout's {limit:g} s deadline (timeouts.rollout_s) passed"
                f" {waited:.1f} s into a wait on the platform ({what}): not the"
                " policy's time, so not scored",
            )
            return
        self.fail(FailureReason.TIMEOUT, f"the rollout passed its {limit:g} s deadline")
