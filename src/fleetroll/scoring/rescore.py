"""Re-scoring stored results: ``fleetroll rescore`` (README, "Composite rewards").

The components of a task's ``rewards`` that depend only on what a result
holds (judges and checks: its transcript, final answer and steps) are
computed again with the current settings; a ``verifier`` component keeps its
stored value (the environment is gone). The reward is summed again. Only
results that were scored with components are touched: a result of a task
without ``rewards``, or one that was never scored (``init_error``,
``verifier_error``...), is kept as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio

from fleetroll.results import REWARD_ERROR_SEPARATOR, SCORED_REASONS, FailureReason, RolloutResult
from fleetroll.scoring.checks import ScoreInputs
from fleetroll.scoring.components import Scorer
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.verifier_results import verifier_reward

__all__ = ["rescorable", "rescore_all", "rescore_result"]

#: The reasons a rollout was scored with (or failed only in scoring).
_RESCORED_REASONS = frozenset({*SCORED_REASONS, FailureReason.REWARD_ERROR})


def rescorable(result: RolloutResult, task: TaskSpec) -> bool:
    """Whether ``result`` was scored with ``task``'s components, so they can be redone."""
    return (
        task.rewards is not None
        and result.rewards is not None
        and (result.failure_reason is None or result.failure_reason in _RESCORED_REASONS)
    )


async def rescore_result(
    result: RolloutResult, task: TaskSpec, scorer: Scorer, *, redact: Callable[[str], str]
) -> RolloutResult:
    """``result`` with its judges and checks computed again (see the module's docstring).

    Its ``cost.judge_*`` become what this re-scoring spent. A component that
    cannot be computed leaves the reward null (``reward_error`` for a
    rollout that had ended well); one that can now be clears that.
    """
    if not rescorable(result, task):
        return result
    assert task.rewards is not None and result.rewards is not None
    stored = result.rewards
    kept = {
        spec.name: _stored_verifier(stored.get(spec.name))
        for spec in task.rewards
        if spec.kind == "verifier"
    }
    inputs = ScoreInputs(
        prompt=task.prompt,
        transcript=result.transcript,
        final_answer=result.final_answer,
        steps=result.steps,
    )
    scored = await scorer.score(task.rewards, inputs, skip=kept)
    reason = result.failure_reason
    # A rollout that had ended otherwise (max_steps...) keeps its own error.
    own = None if reason in (None, FailureReason.REWARD_ERROR) else result.error
    if own is not None:
        own = own.split(REWARD_ERROR_SEPARATOR, 1)[0]
    if scored.reward is not None:
        if reason is FailureReason.REWARD_ERROR:
            reason = None
        error = own
    else:
        problem = redact(scored.error or "a reward component could not be computed")
        if reason is None or reason is FailureReason.REWARD_ERROR:
            reason, error = FailureReason.REWARD_ERROR, problem
        else:
            error = f"{own}{REWARD_ERROR_SEPARATOR}{problem}" if own else problem
    cost = result.cost.model_copy(
        update={
            "judge_calls": scored.judge_calls,
            "judge_prompt_tokens": scored.judge_prompt_tokens,
            "judge_completion_tokens": scored.judge_completion_tokens,
        }
    )
    return result.model_copy(
        update={
            "rewards": scored.values,
            "reward": scored.reward,
            "failure_reason": reason,
            "status": "completed" if reason is None else "failed",
            "error": error,
            "cost": cost,
        }
    )


def _stored_verifier(value: float | None) -> float | None:
    """A stored verifier value, read as the rollout read it (a hand-edited or
    corrupted one, NaN say, is no reward: the sum is then null, with the reason)."""
    if value is None:
        return None
    try:
        return verifier_reward(value)
    except ValueError:
        return None


async def rescore_all(
    results: Sequence[RolloutResult],
    tasks: Mapping[str, TaskSpec],
    scorer: Scorer,
    *,
    redact: Callable[[str], str],
    concurrency: int,
) -> list[RolloutResult]:
    """Every result re-scored (:func:`rescore_result`), in the same order.

    ``tasks`` maps each result's ``task_key`` to its task; at most
    ``concurrency`` results are scored at once.

    Raises:
        KeyError: a result's task is not in ``tasks``.
    """
    out: list[RolloutResult | None] = [None] * len(results)
    # Taken before a task starts, given back when it ends: no more tasks exist
    # at once than may run (a results file may hold 100k results).
    slots = anyio.Semaphore(concurrency)

    async def one(index: int, result: RolloutResult, task: TaskSpec) -> None:
        try:
            out[index] = await rescore_result(result, task, scorer, redact=redact)
        finally:
            slots.release()

    async with anyio.create_task_group() as tg:
        for index, result in enumerate(results):
            task = tasks[result.task_key]
            if not rescorable(result, task):
                out[index] = result
                continue
            await slots.acquire()
            tg.start_soon(one, index, result, task)
    return [r for r in out if r is not None]
