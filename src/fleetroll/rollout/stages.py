"""What a rollout's phases do against its provider.

The state machine (:mod:`fleetroll.rollout.machine`) enters a phase, then calls the
work here: provision an instance, reset it, connect to its tools, score the
episode, report its end (and the attributes all its events carry). Each
records its timing and what went wrong in the rollout's
:class:`~fleetroll.rollout.progress.Progress`; set-up answers a :class:`SetupFailure`
instead of raising, and the rollout decides what comes next.
:class:`RolloutContext` is what all of it needs of the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from fleetroll._internal.deadlines import fail_after
from fleetroll.environments.admission import Admission
from fleetroll.environments.provider import Instance, Provider, Verdict
from fleetroll.errors import (
    ContextOverflowError,
    EnvUnavailableError,
    OperationTimeout,
    PolicyError,
    ProvisionError,
    ToolsError,
)
from fleetroll.policies import AssistantTurn, Policy, ToolSpec
from fleetroll.policies.gate import PolicyGate
from fleetroll.results import SCORED_REASONS, FailureReason, RolloutResult
from fleetroll.rollout.config import RolloutConfig
from fleetroll.rollout.progress import Progress, RolloutIds
from fleetroll.scoring import ScoreInputs, Scorer
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events, Redactor
from fleetroll.tools.routing import COMPUTER_TOOL, ComputerToolMissing, Route
from fleetroll.tools.session import ToolCallFailed, ToolSession, describe

__all__ = [
    "RolloutContext",
    "SetupFailure",
    "ask_policy",
    "connect",
    "event_attributes",
    "first_screenshot",
    "instance_reusable",
    "provision",
    "report_completed",
    "reset",
    "score",
    "session_failed",
    "setup_error",
]


class RolloutContext(Protocol):
    """What a rollout needs of its engine (a :class:`~.engine.RolloutEngine` is one)."""

    #: What rollouts read of the settings.
    config: RolloutConfig
    provider: Provider
    events: Events
    redactor: Redactor
    policy_gate: PolicyGate
    admission: Admission | None
    #: Computes the components of tasks' ``rewards`` (the process's judge).
    scorer: Scorer


@dataclass(frozen=True, slots=True)
class SetupFailure:
    """Why set-up stopped: the result's reason and error, and the exception behind them."""

    reason: FailureReason
    error: str
    exc: Exception


def event_attributes(ids: RolloutIds, task: TaskSpec) -> dict[str, Any]:
    """What every event of the rollout carries (bound for its whole lifecycle)."""
    return {
        "batch_id": ids.batch_id,
        "rollout_id": ids.rollout_id,
        "task_key": task.key,
        "sample_index": ids.sample_index,
        "env_key": task.env_key,
        "env_version": task.env_version,
        "modality": task.modality,
    }


async def provision(
    ctx: RolloutContext, task: TaskSpec, progress: Progress, *, run_id: str | None
) -> Instance | SetupFailure:
    """An instance for ``task`` (the provider retries and bounds it), or why there is none."""
    began = time.monotonic()
    try:
        return await ctx.provider.provision(task, run_id=run_id)
    except EnvUnavailableError as exc:
        return SetupFailure(FailureReason.ENV_UNAVAILABLE, str(exc), exc)
    except ProvisionError as exc:
        return SetupFailure(FailureReason.INIT_ERROR, str(exc), exc)
    finally:
        progress.timings.provision_s = time.monotonic() - began


async def reset(
    ctx: RolloutContext, instance: Instance, task: TaskSpec, progress: Progress
) -> SetupFailure | None:
    """Reset the instance to ``task``'s start (its ``seed`` and ``timestamp``, if
    any). A failure is only logged where the instance is fresh anyway
    (a Fleet instance); where the reset is what makes it fresh
    (:attr:`~fleetroll.environments.provider.Instance.reset_required`, a shared server),
    it is why set-up stopped (``reset_failed``): never scored on a state left by
    another rollout."""
    timeout = ctx.config.timeouts.reset_s
    began = time.monotonic()
    try:
        await ctx.provider.reset(instance, task)
    except Exception as exc:  # the provider's error, whatever it is, is the news
        ctx.events.emit(
            "fleet_env_reset_failed",
            level="error" if instance.reset_required else "warn",
            timeout_s=timeout,
            error_type=type(exc).__name__,
            error_message=str(exc)[:500],
        )
        if instance.reset_required:
            error = f"{str(exc) or describe(exc)}; not scored: the state is not the task's start"
            return SetupFailure(FailureReason.RESET_FAILED, error, exc)
    finally:
        progress.timings.reset_s = time.monotonic() - began
    return None


async def connect(
    ctx: RolloutContext,
    instance: Instance,
    route: Route,
    stack: AsyncExitStack,
    progress: Progress,
) -> tuple[ToolSession, list[ToolSpec]] | SetupFailure:
    """Open the instance's MCP session (closed by ``stack``) and choose the route's tools.

    Both waits are the platform's (:meth:`Progress.platform_wait`).
    """
    session: ToolSession | None = None
    try:
        with progress.platform_wait(f"connecting to the MCP endpoint {route.url}"):
            session = await stack.enter_async_context(ctx.provider.open_tools(instance, route))
        with progress.platform_wait(f"listing the tools of {route.url}"):
            available = await session.list_tools()
        return session, route.select(available)
    except ComputerToolMissing as exc:
        return SetupFailure(FailureReason.COMPUTER_TOOL_MISSING, str(exc), exc)
    except (ToolsError, OperationTimeout, TimeoutError) as exc:
        # OperationTimeout: the connect or the listing passed its deadline.
        lost = not await ctx.provider.is_alive(instance)
        doing = "connecting to" if session is None else "listing the tools of"
        detail = str(exc) or f"{doing} the MCP endpoint {route.url} timed out"
        error = f"instance {instance.instance_id} is gone: {detail}" if lost else detail
        return SetupFailure(_tools_reason(lost, opened=session is not None), error, exc)


async def first_screenshot(
    ctx: RolloutContext, session: ToolSession, route: Route
) -> tuple[str, ...]:
    """The screen before the first action, for a computer modality's first observation
    (as the reference does); none for API tools. Best effort: a failed screenshot
    leaves the prompt alone (the agent can ask for one)."""
    if route.tools != "computer":
        return ()
    try:
        shot = await session.call(COMPUTER_TOOL, {"action": "screenshot"})
    except ToolCallFailed as exc:
        ctx.events.emit(
            "fleet_tool_call_failed",
            level="warn",
            tool_name=COMPUTER_TOOL,
            step_count=0,
            error_type=type(exc.__cause__ or exc).__name__,
            error_message=f"the initial screenshot: {exc}"[:500],
        )
        return ()
    return () if shot.is_error else shot.images


def setup_error(failure: SetupFailure | None, error: str | None) -> Exception:
    """What a session's caller gets when set-up failed: the provider's or the tools' own
    error, else a :class:`~fleetroll.errors.ToolsError` saying why (``error``)."""
    if failure is not None and isinstance(failure.exc, ProvisionError | ToolsError):
        return failure.exc
    return ToolsError(error or "the environment could not be set up", operation="setup")


async def session_failed(
    ctx: RolloutContext,
    instance: Instance | None,
    progress: Progress,
    exc: Exception,
    *,
    opened: bool,
) -> None:
    """The MCP session failed under the rollout (``opened``: it had opened): record why."""
    if progress.reason is not None or progress.finished or instance is None:
        # The episode had ended already: only closing failed, which costs nothing.
        ctx.events.emit(
            "fleet_tool_call_failed",
            level="warn",
            tool_name=None,
            step_count=progress.steps,
            error_type=type(exc).__name__,
            error_message=f"closing the MCP session: {describe(exc)}"[:500],
        )
        return
    lost = not await ctx.provider.is_alive(instance)
    progress.fail(_tools_reason(lost, opened=opened), f"the MCP session failed: {describe(exc)}")


def _tools_reason(lost: bool, *, opened: bool) -> FailureReason:
    """Why the tools failed: the instance is gone, or never set up, or its session broke."""
    if lost:
        return FailureReason.INSTANCE_LOST
    # A session that never opened means the environment was not set up.
    return FailureReason.TOOLS_ERROR if opened else FailureReason.INIT_ERROR


async def score(
    ctx: RolloutContext, instance: Instance, task: TaskSpec, progress: Progress
) -> None:
    """Run the verifier and the task's other reward components; record the reward,
    or why there is none.

    A task without ``rewards`` is scored by its verifier alone. With them, the
    verifier runs when a component names it, then the others are computed from
    what the result will hold (:mod:`fleetroll.scoring`) and the reward is their
    weighted sum; one that cannot be computed leaves no reward (``reward_error``).
    """
    began = time.monotonic()
    verified: float | None = None
    if task.runs_verifier:
        # The verifier has its own deadline, outside the rollout's: a rollout
        # that timed out is still scored (docs/results.md).
        verdict = await ctx.provider.verify(instance, task, progress.final_answer)
        progress.timings.verify_s = time.monotonic() - began
        progress.verifier = verdict.outcome
        if not verdict.ok:
            if task.rewards is not None:
                progress.rewards = {spec.name: None for spec in task.rewards}
            await _verifier_failed(ctx, instance, progress, verdict)
            return
        verified = verdict.reward
    if task.rewards is None:
        progress.reward = verified
        return
    try:
        await _components(ctx, task, progress, verified)
    finally:  # the judges' time is scoring time too
        progress.timings.verify_s = time.monotonic() - began


async def _verifier_failed(
    ctx: RolloutContext, instance: Instance, progress: Progress, verdict: Verdict
) -> None:
    ctx.events.emit(
        "fleet_verifier_failed",
        level="error",
        error_type=verdict.error_type,
        error_message=(verdict.outcome.error or "")[:500],
    )
    if progress.reason is None:
        lost = not await ctx.provider.is_alive(instance)
        progress.fail(
            FailureReason.INSTANCE_LOST if lost else FailureReason.VERIFIER_ERROR,
            f"the verifier gave no reward: {verdict.outcome.error}",
        )


async def _components(
    ctx: RolloutContext, task: TaskSpec, progress: Progress, verified: float | None
) -> None:
    """The components of ``task.rewards`` other than the verifier's, read from what
    the result holds (redacted, images as kept), so a re-scoring reads the same."""
    assert task.rewards is not None
    redact = ctx.redactor
    answer = progress.final_answer
    inputs = ScoreInputs(
        prompt=task.prompt,
        transcript=progress.transcript.export(
            redact, keep_images=ctx.config.pool.transcript_images
        ),
        final_answer=None if answer is None else redact(answer),
        steps=progress.steps,
    )
    scored = await ctx.scorer.score(task.rewards, inputs, verifier=verified)
    progress.rewards = scored.values
    progress.cost.judge_calls += scored.judge_calls
    progress.cost.judge_prompt_tokens += scored.judge_prompt_tokens
    progress.cost.judge_completion_tokens += scored.judge_completion_tokens
    if scored.reward is not None:
        progress.reward = scored.reward
        return
    error = scored.error or "a reward component could not be computed"
    ctx.events.emit(
        "fleet_verifier_failed",
        level="error",
        error_type="JudgeError",
        error_message=error[:500],
    )
    progress.reward_failed(error)


#: Ends after which the instance is as sound as it was given: the episode ran to
#: an end of the agent's (or the policy's) making, no call of ours was cut
#: short, and the verifier ran. A reset makes it the next rollout's.
_REUSABLE_ENDS = SCORED_REASONS | {FailureReason.POLICY_ERROR}


def instance_reusable(progress: Progress) -> bool:
    """Whether the rollout's instance may serve another rollout once reset: its
    rollout ended without an infrastructure failure and without a tool call whose
    answer never came (a call cut short could still land after the reset)."""
    ended_well = progress.reason is None or progress.reason in _REUSABLE_ENDS
    return ended_well and progress.tool_failures == 0 and progress.overrun is None


def report_completed(events: Events, result: RolloutResult) -> None:
    """Emit ``fleet_rollout_completed`` for ``result`` (once per rollout)."""
    events.emit(
        "fleet_rollout_completed",
        level="info" if result.status == "completed" else "warn",
        instance_id=result.instance_id,
        status=result.status,
        failure_reason=result.failure_reason.value if result.failure_reason else None,
        reward=result.reward,
        step_count=result.steps,
        duration_s=round(result.timings.total_s, 4),
        tool_errors=result.tool_errors,
        tool_failures=result.tool_failures,
        error_message=(result.error or "")[:500] or None,
        # The cost, as counts (``fleetroll stats`` sums them); never token data.
        instance_s=round(result.cost.instance_s, 4),
        prompt_tokens=result.cost.prompt_tokens,
        completion_tokens=result.cost.completion_tokens,
        policy_calls=result.cost.policy_calls,
        tool_calls=result.cost.tool_calls,
        # The judge's share, for tasks with composite rewards (not summed by stats).
        judge_calls=result.cost.judge_calls,
        judge_prompt_tokens=result.cost.judge_prompt_tokens,
        judge_completion_tokens=result.cost.judge_completion_tokens,
    )


async def ask_policy(
    policy: Policy,
    task: TaskSpec,
    progress: Progress,
    tools: Sequence[ToolSpec],
    *,
    timeout_s: float,
    policy_version: int,
    gate: PolicyGate | None = None,
) -> tuple[AssistantTurn, float] | None:
    """One policy call of the acting phase, timed and recorded on ``progress``.

    Returns the turn and the call's latency (s), or None when the call failed:
    the failure is recorded (``context_overflow``, or ``policy_error`` for an
    error, a timeout or a bug of the policy's: the policy is an adapter, its
    bugs are its failures). ``gate``: the rollout's; with ``policy.weight_update
    = "in_flight"``, a call during which an update began or the version changed
    records no version for tokens its server did not tag.
    """
    before = (gate.updates, gate.version) if gate is not None else None
    began = time.monotonic()
    try:
        with fail_after(timeout_s):
            turn = await policy.act(task, progress.transcript.messages, tools)
    except ContextOverflowError as exc:
        progress.fail(FailureReason.CONTEXT_OVERFLOW, str(exc))
        return None
    except TimeoutError:
        progress.fail(FailureReason.POLICY_ERROR, f"the policy took over {timeout_s:g} s")
        return None
    except PolicyError as exc:
        progress.fail(FailureReason.POLICY_ERROR, str(exc))
        return None
    except Exception as exc:  # the policy is an adapter: its bugs are its failures
        progress.fail(FailureReason.POLICY_ERROR, f"the policy raised {describe(exc)}")
        return None
    finally:
        latency = time.monotonic() - began
        progress.timings.policy_s += latency
    proven = gate is None or gate.mode != "in_flight" or before == (gate.updates, gate.version)
    progress.record_turn(turn, policy_version=policy_version, latency_s=latency, proven=proven)
    return turn, latency


@contextmanager
def deadline_lifted(scope: anyio.CancelScope | None, after: Callable[[], float]) -> Iterator[None]:
    """The rollout's deadline (``scope``'s) cannot pass during the block; after
    it, it is ``after()`` again (the rollout's deadline, which the block may
    have moved). No scope (a deadline not enforced): nothing to lift."""
    if scope is None:
        yield
        return
    scope.deadline = math.inf
    try:
        yield
    finally:
        scope.deadline = after()
