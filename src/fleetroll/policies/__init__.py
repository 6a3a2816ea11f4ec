"""Policies: what decides the agent's next move.

A :class:`Policy` is stateless with respect to rollouts: it gets the task, the
transcript so far (OpenAI chat format, the single source of truth) and the
tools the agent may use, and answers one :class:`AssistantTurn`. A turn with
no tool calls ends the episode.

Two policies ship:

- :class:`ScriptedPolicy` plays a task's known solution, one call per turn
  (smoke tests, benchmarks of the orchestrator itself);
- :class:`OpenAIChatPolicy` asks an OpenAI-compatible ``/chat/completions``
  endpoint (OpenAI, vLLM, SGLang, a proxy in front of a trainer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import anyio

from fleetroll.errors import PolicyError
from fleetroll.policies.openai import ChatPolicyConfig, OpenAIChatPolicy
from fleetroll.policies.turns import (
    AssistantTurn,
    EncodedMessages,
    Message,
    ToolCall,
    ToolSpec,
    TurnData,
)
from fleetroll.tasks import TaskSpec

__all__ = [
    "AssistantTurn",
    "ChatPolicyConfig",
    "EncodedMessages",
    "OpenAIChatPolicy",
    "Policy",
    "ScriptedPolicy",
    "ToolCall",
    "ToolSpec",
    "TurnData",
    "policy_from_config",
]

_OPERATION = "policy"


@runtime_checkable
class Policy(Protocol):
    """Decides the next turn of a rollout."""

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The next turn.

        Raises:
            PolicyError: the policy could not answer (endpoint down, garbage).
        """
        ...

    async def aclose(self) -> None:
        """Release what the policy holds (HTTP clients)."""
        ...


def policy_from_config(config: ChatPolicyConfig) -> ScriptedPolicy | OpenAIChatPolicy:
    """The policy ``config.policy.kind`` names, configured from ``config``
    (:func:`fleetroll.pool.assembly.policy_from_settings` builds it from settings)."""
    if config.policy.kind == "openai":
        return OpenAIChatPolicy.from_config(config)
    return ScriptedPolicy(think_time_s=config.policy.think_time_s)


class ScriptedPolicy:
    """Plays ``task.solution``, one tool call per turn, then says ``"done"``.

    Where it is in the solution is read off the transcript, so one instance
    serves any number of concurrent rollouts. A step whose answer the
    transcript flags as an error (:class:`~fleetroll.policies.turns.ToolErrorFlags`:
    the tool's own error flag, never the answer's text) is played again, up
    to ``max_attempts`` times in all, as an agent would retry a transient
    error; after that the policy goes on with the next step. Messages that
    carry no flags (a plain list) replay nothing.

    Args:
        think_time_s: seconds to wait before each turn, standing in for a
            model's latency in benchmarks.
        max_attempts: how many times one step is played at most.

    Raises:
        ValueError: ``think_time_s`` is negative or ``max_attempts`` < 1.
    """

    def __init__(self, think_time_s: float = 0.0, max_attempts: int = 3) -> None:
        if think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, not {think_time_s}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        self.think_time_s = think_time_s
        self.max_attempts = max_attempts

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The solution's next step as a tool call, or ``"done"`` after the last.

        Raises:
            PolicyError: the task has no solution (never transient).
        """
        if task.solution is None:
            raise PolicyError(
                f"task {task.key!r} has no solution, so the scripted policy cannot play it;"
                " give the task a 'solution' or use policy kind 'openai'",
                operation=_OPERATION,
                transient=False,
            )
        await anyio.sleep(self.think_time_s)
        step_index = self._next_step(messages)
        if step_index >= len(task.solution):
            return AssistantTurn(content="done")
        step = task.solution[step_index]
        turn = sum(1 for message in messages if message.get("role") == "assistant")
        call = ToolCall(id=f"call_{turn}", name=step.name, arguments=dict(step.arguments))
        return AssistantTurn(tool_calls=(call,))

    def _next_step(self, messages: Sequence[Message]) -> int:
        """The index of the solution step to play next."""
        # The method, not isinstance against the runtime Protocol: that check walks
        # the protocol's members at every turn (a few % of a rollout's own CPU).
        is_error_answer = getattr(messages, "is_error_answer", None)
        step_index = attempt = 0
        for index, message in enumerate(messages):
            if message.get("role") != "tool":
                continue
            failed = is_error_answer is not None and bool(is_error_answer(index))
            attempt += 1
            if not failed or attempt >= self.max_attempts:
                step_index, attempt = step_index + 1, 0
        return step_index

    async def aclose(self) -> None:
        """Nothing to release."""
