"""One tool call of a rollout, and what it means for the rollout.

* ``submit_final_answer`` (offered by the route) records the answer and ends
  the episode;
* a call with bad arguments or an unknown tool is answered with an error
  the agent sees (``tool_errors``);
* otherwise the call goes to the environment: an error it *answers* is
  feedback (``tool_errors``, ``fleet_mcp_tool_error``); a call that gets no
  answer (deadline, transport, instance gone) is a ``tool_failure``
  (``fleet_tool_call_failed``), which ends the rollout unless
  ``pool.on_tool_failure = "continue"`` (``instance_lost`` when the instance
  died).

Every call that goes to the environment is one ``fleet_tool_call`` record
(tool, duration, outcome ``ok``/``error``/``failed``; the environment and
modality are the rollout's bound attributes), unless ``telemetry.tool_calls``
is false: :func:`record_tool_call`, which the MCP relay of an agent of its own
uses too.

A call driven from outside (the env-style API) answers a :class:`StepResult`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from fleetroll.environments.provider import Instance, Provider
from fleetroll.policies import ToolCall, ToolSpec
from fleetroll.results import FailureReason
from fleetroll.rollout.events import RolloutEventLog
from fleetroll.rollout.progress import Progress
from fleetroll.rollout.stages import RolloutContext
from fleetroll.telemetry.events import Events
from fleetroll.tools.routing import SUBMIT_FINAL_ANSWER, Route
from fleetroll.tools.session import ToolCallFailed, ToolResult, ToolSession

__all__ = ["StepResult", "dispatch", "record_tool_call", "tool_call_failed"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What :meth:`EnvSession.step` answers: one tool call's answer, driven from outside."""

    observation: ToolResult
    done: bool
    messages: tuple[dict[str, Any], ...] = ()


async def dispatch(
    call: ToolCall,
    *,
    progress: Progress,
    provider: Provider,
    events: Events,
    stop_on_failure: bool,
    route: Route | None,
    tools: list[ToolSpec],
    session: ToolSession | None,
    instance: Instance | None,
) -> ToolResult:
    """Run one tool call and record its answer in ``progress`` (a failure may end it).

    ``stop_on_failure`` is ``pool.on_tool_failure == "fail"``.
    """
    if call.name == SUBMIT_FINAL_ANSWER.name and route and route.offers_final_answer:
        answer = call.arguments.get("answer")
        progress.final_answer = answer if isinstance(answer, str) else json.dumps(answer)
        progress.finished = True
        result = ToolResult(text="Final answer recorded.")
        progress.transcript.add_answer(call, result)
        return result
    if call.arguments_error:
        result = ToolResult(text=f"Error: {call.arguments_error}", is_error=True)
    elif not any(t.name == call.name for t in tools):
        allowed = sorted({t.name for t in tools})
        result = ToolResult(
            text=f"Error: unknown tool {call.name!r}; available: {', '.join(allowed)}",
            is_error=True,
        )
    else:
        assert session is not None and instance is not None
        began = time.monotonic()
        try:
            result = await session.call(call.name, call.arguments)
        except ToolCallFailed as exc:
            record_tool_call(events, call.name, time.monotonic() - began, "failed")
            await tool_call_failed(
                call.name,
                exc,
                progress=progress,
                provider=provider,
                events=events,
                stop_on_failure=stop_on_failure,
                instance=instance,
            )
            result = ToolResult(text=f"Error: the tool call failed: {exc}", is_error=True)
            progress.transcript.add_answer(call, result)
            return result
        finally:
            progress.timings.tools_s += time.monotonic() - began
        outcome = "error" if result.is_error else "ok"
        record_tool_call(events, call.name, time.monotonic() - began, outcome)
        if result.is_error:
            events.emit(
                "fleet_mcp_tool_error",
                level="warn",
                tool_name=call.name,
                step_count=progress.steps,
                error_message=result.text[:500],
            )
    if result.is_error:
        progress.tool_errors += 1
    progress.transcript.add_answer(call, result)
    return result


def record_tool_call(events: Events, name: str, duration_s: float, outcome: str) -> None:
    """One ``fleet_tool_call`` record (cheap: no record at all when turned off).

    ``outcome``: ``ok``, ``error`` (answered with an error) or ``failed`` (no
    answer). The built-in loop's and the MCP relay's of an agent of its own
    (:mod:`fleetroll.rollout.agent_link`).
    """
    if events.enabled("fleet_tool_call"):
        events.emit(
            "fleet_tool_call",
            tool_name=name,
            duration_s=round(duration_s, 6),
            outcome=outcome,
        )


async def tool_call_failed(
    name: str,
    exc: Exception,
    *,
    progress: Progress,
    provider: Provider,
    events: Events,
    stop_on_failure: bool,
    instance: Instance,
) -> None:
    """A tool call that got no answer (``exc``: its deadline, its transport, the
    instance gone): an infrastructure failure, not feedback. Counted and reported;
    it ends the rollout as ``instance_lost`` when the instance is gone, else as
    ``tool_failure`` when ``stop_on_failure``. The built-in loop's and the MCP
    relay's of an agent of its own (:mod:`fleetroll.rollout.agent_link`)."""
    progress.tool_failures += 1
    events.emit(
        "fleet_tool_call_failed",
        level="warn",
        tool_name=name,
        step_count=progress.steps,
        error_type=type(exc.__cause__ or exc).__name__,
        error_message=str(exc)[:500],
    )
    if not await provider.is_alive(instance):
        progress.fail(
            FailureReason.INSTANCE_LOST,
            f"instance {instance.instance_id} is gone ({exc})",
        )
    elif stop_on_failure:
        progress.fail(
            FailureReason.TOOL_FAILURE,
            f'the tool call {name} failed: {exc} (pool.on_tool_failure = "continue" would go on)',
        )


class ToolCaller(Protocol):
    """What :func:`call_tool` needs of a rollout (a :class:`~.machine.Rollout` has it)."""

    engine: RolloutContext
    progress: Progress
    live: RolloutEventLog
    route: Route | None
    tools: list[ToolSpec]
    session: ToolSession | None
    instance: Instance | None


async def call_tool(rollout: ToolCaller, call: ToolCall) -> ToolResult:
    """Run one tool call of ``rollout`` and record its answer (a failure may end the rollout).

    Counts it in the rollout's cost and shows it in its live event log.
    """
    e = rollout.engine
    rollout.progress.cost.tool_calls += 1
    began = time.monotonic()
    result = await dispatch(
        call,
        progress=rollout.progress,
        provider=e.provider,
        events=e.events,
        stop_on_failure=e.config.pool.on_tool_failure == "fail",
        route=rollout.route,
        tools=rollout.tools,
        session=rollout.session,
        instance=rollout.instance,
    )
    duration_s = time.monotonic() - began
    # A large answer is redacted now, off the loop, for the result to reuse.
    await rollout.progress.transcript.redact_ahead(e.redactor)
    rollout.live.tool_call(call, result, duration_s=duration_s)
    return result
