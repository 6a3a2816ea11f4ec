"""A scripted policy whose rollouts each follow a plan: for tests of groups and pauses.

Each rollout's first turn takes its task's next choice from the plan:

* ``"solve"`` plays the task's solution (as :class:`~fleetroll.policies.ScriptedPolicy`);
* ``"zero"`` ends at once with an answer and no tool call (the verifier's
  reward for an undone task, 0.0 on the shipped ones);
* ``"gate"`` waits for :attr:`PlannedPolicy.go`, then solves;
* ``"hold"`` waits for :attr:`PlannedPolicy.release`, then solves.

Unplanned first turns solve. A plan is either a sequence, taken in the order
rollouts make their first policy call (which is not their sample order: their
instances come up in any order), or a mapping from sample index to choice,
read off the rollout's bound event attributes (``sample_index``): use that
when a choice belongs to one sample (an oversampled extra that holds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import anyio

from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.policies.turns import Message
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events

__all__ = ["PlannedPolicy"]


class PlannedPolicy(ScriptedPolicy):
    """Plays each rollout by its task's plan (see the module docstring).

    Args:
        plans: per task key, the choices of its rollouts' first turns, in order.
    """

    def __init__(
        self, plans: Mapping[str, Sequence[str] | Mapping[int, str]] | None = None
    ) -> None:
        super().__init__()
        self._by_sample = {
            key: dict(plan) for key, plan in (plans or {}).items() if isinstance(plan, Mapping)
        }
        self._plans = {
            key: iter(plan) for key, plan in (plans or {}).items() if not isinstance(plan, Mapping)
        }
        self.go = anyio.Event()
        self.release = anyio.Event()
        #: Policy calls made, per task key.
        self.calls: Counter[str] = Counter()

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The next turn, as planned.

        Raises:
            ValueError: a plan holds an unknown choice.
            PolicyError: as :meth:`ScriptedPolicy.act`.
        """
        self.calls[task.key] += 1
        if not any(m.get("role") == "assistant" for m in messages):
            by_sample = self._by_sample.get(task.key)
            if by_sample is not None:
                choice = by_sample.get(Events.bound().get("sample_index", -1), "solve")
            else:
                choice = next(self._plans.get(task.key, iter(())), "solve")
            if choice == "zero":
                return AssistantTurn(content="I give up.")
            if choice == "gate":
                await self.go.wait()
            elif choice == "hold":
                await self.release.wait()
            elif choice != "solve":
                raise ValueError(f"unknown plan choice {choice!r}")
        return await super().act(task, messages, tools)
