"""The env-style session API: ``reset()``, ``step(call)``, ``done()``, ``close()``.

For controllers that drive the model themselves (``RolloutPool.session``,
the HTTP service's sessions): the rollout's state machine still owns the
instance, the deadlines, scoring and release; a session only steps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from fleetroll.errors import InstanceLostError
from fleetroll.policies import AssistantTurn, ToolCall, ToolSpec
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.dispatch import StepResult
from fleetroll.rollout.machine import Rollout
from fleetroll.tools.session import ToolResult

__all__ = ["EnvSession", "StepResult"]


class EnvSession:
    """The env-style API: ``reset()``, ``step(call)``, ``done()``, ``close()``.

    The episode ends when the agent submits the task's final answer (a
    ``submit_final_answer`` step), when the controller calls :meth:`done`,
    or on a failure (deadline, step budget, a lost instance...). An episode
    that ended so is ``completed`` and scored; closing the session before
    that is ``abandoned`` (still scored).
    """

    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout
        self._count = 0

    @property
    def tools(self) -> list[ToolSpec]:
        return list(self._rollout.tools)

    @property
    def instance_id(self) -> str | None:
        inst = self._rollout.instance
        return inst.instance_id if inst else None

    async def reset(self) -> list[dict[str, Any]]:
        """The opening messages (the task prompt). The instance is fresh already."""
        return list(self._rollout.progress.transcript.messages)

    async def step(self, call: ToolCall | Mapping[str, Any]) -> StepResult:
        """Run one tool call; ``done`` once the episode is over.

        The rollout's state machine stays in ACTING meanwhile: this checks the
        episode's limits (deadline, step budget), records the call in the
        transcript and runs it through :meth:`Rollout.call_tool`.

        Raises:
            InstanceLostError: the instance is gone.
        """
        r = self._rollout
        if isinstance(call, Mapping):
            self._count += 1
            call = ToolCall(
                id=str(call.get("id") or f"call_{self._count}"),
                name=str(call["name"]),
                arguments=dict(call.get("arguments") or {}),
            )
        over = None
        if r.finished:
            over = "The episode is over."
        elif anyio.current_time() >= r.deadline:
            r.time_out()
            over = "The rollout's deadline passed."
        elif r.progress.steps >= r.max_steps:
            r.fail(FailureReason.MAX_STEPS, f"the step budget of {r.max_steps} ran out")
            over = "The step budget ran out."
        if over is not None:
            return StepResult(ToolResult(text=over, is_error=True), True)
        before = len(r.progress.transcript)
        r.progress.transcript.add_turn(AssistantTurn(tool_calls=(call,)))
        r.notify()
        r.progress.steps += 1
        result: ToolResult | None = None
        with anyio.CancelScope(deadline=r.deadline) as scope:
            result = await r.call_tool(call)
        if scope.cancelled_caught or result is None:
            r.time_out()
            result = ToolResult(text="The rollout's deadline passed.", is_error=True)
        if r.progress.reason is FailureReason.INSTANCE_LOST:
            raise InstanceLostError(
                r.progress.error or "the instance is gone",
                operation="step",
                rollout_id=r.ids.rollout_id,
            )
        return StepResult(result, r.finished, r.progress.transcript.since(before))

    async def done(self) -> None:
        """Say the episode is over: the agent finished the task.

        Async, like the HTTP client's session, so a controller's code is the
        same for both. The result is then ``completed`` (the verifier decides
        the reward);
        later steps answer "The episode is over.". Without it, a session
        whose task needs no final answer ends ``abandoned`` when closed.
        """
        if not self._rollout.finished:
            self._rollout.progress.finished = True

    async def close(self) -> RolloutResult | None:
        """End the episode (``abandoned`` if it had not ended, see :meth:`done`).

        The rollout is scored and its instance released when the session's
        ``async with`` block exits; called after the block, this returns the
        result, inside it None.
        """
        self._rollout.abandon()
        return self._rollout.result
