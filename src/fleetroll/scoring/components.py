"""A task's composite reward: each component's value, and their weighted sum.

:class:`Scorer` computes the components of a task's ``rewards`` for one
rollout once its verifier ran (the verifier's reward is given, not asked
for): checks at once, judges concurrently. The reward is
:func:`combine`'d: ``Σ weight × value``, weights taken as declared (not
normalised). A component that cannot be computed (its judge failed) has the
value None, and then so has the reward: never a 0 the policy did not earn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from fleetroll.errors import JudgeError
from fleetroll.scoring.checks import ScoreInputs, check, target_text
from fleetroll.scoring.judge import Judge
from fleetroll.tasks.rewards import RewardSpec

__all__ = ["Scored", "Scorer", "combine", "component_error"]


@dataclass(frozen=True, slots=True)
class Scored:
    """The components of one rollout's reward, and their sum."""

    #: Every component by name, in the task's order; None where it failed.
    values: dict[str, float | None]
    #: The weighted sum; None when a component is None.
    reward: float | None
    #: Why the reward is None (naming the first component that failed), else None.
    error: str | None = None
    #: What the judges cost (judgements answered with a score, their tokens;
    #: cache hits are free).
    judge_calls: int = 0
    judge_prompt_tokens: int = 0
    judge_completion_tokens: int = 0
    #: Each failed component's error, by name.
    errors: dict[str, str] = field(default_factory=dict)


def combine(specs: Sequence[RewardSpec], values: Mapping[str, float | None]) -> float | None:
    """``Σ weight × value`` over ``specs``; None when any value is None or missing."""
    total = 0.0
    for spec in specs:
        value = values.get(spec.name)
        if value is None:
            return None
        total += spec.weight * value
    return total


def component_error(spec: RewardSpec, error: str) -> str:
    """The error of a component that could not be computed, naming it."""
    return f"reward component {spec.name!r} ({spec.kind}) could not be computed: {error}"


class Scorer:
    """Computes reward components; holds the process's :class:`Judge` (its cache, its limit)."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge

    async def aclose(self) -> None:
        await self.judge.aclose()

    async def score(
        self,
        specs: Sequence[RewardSpec],
        inputs: ScoreInputs,
        *,
        verifier: float | None = None,
        skip: Mapping[str, float | None] | None = None,
    ) -> Scored:
        """Every component of ``specs`` for a rollout.

        Args:
            specs: the task's ``rewards``.
            inputs: what checks and judges read.
            verifier: the verifier's reward (for a ``verifier`` component).
            skip: values taken as they are instead of computed, by name.

        Never raises for a component's failure: it is None in :attr:`Scored.values`.
        """
        values: dict[str, float | None] = {spec.name: None for spec in specs}
        errors: dict[str, str] = {}
        cost = [0, 0, 0]

        async def judge(spec: RewardSpec) -> None:
            assert spec.rubric is not None
            text = target_text(spec.on, inputs)
            if text is None:  # nothing to judge: the agent gave no answer
                values[spec.name] = 0.0
                return
            try:
                judgement = await self.judge.judge(spec.rubric, inputs.prompt, text, spec.on)
            except JudgeError as exc:
                errors[spec.name] = component_error(spec, str(exc))
                return
            values[spec.name] = judgement.score
            if not judgement.cached:
                cost[0] += 1
                cost[1] += judgement.prompt_tokens
                cost[2] += judgement.completion_tokens

        async with anyio.create_task_group() as tg:
            for spec in specs:
                if skip is not None and spec.name in skip:
                    values[spec.name] = skip[spec.name]
                elif spec.kind == "verifier":
                    values[spec.name] = verifier
                elif spec.kind == "judge":
                    tg.start_soon(judge, spec)
                else:
                    values[spec.name] = check(spec, inputs)
        reward = combine(specs, values)
        first = next((errors[s.name] for s in specs if s.name in errors), None)
        if reward is None and first is None:
            missing = next(s for s in specs if values[s.name] is None)
            why = "the verifier gave no reward" if missing.kind == "verifier" else "no value"
            first = component_error(missing, why)
        return Scored(
            values=values,
            reward=reward,
            error=first,
            judge_calls=cost[0],
            judge_prompt_tokens=cost[1],
            judge_completion_tokens=cost[2],
            errors=errors,
        )
