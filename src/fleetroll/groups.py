"""GRPO groups: the samples of one task in one batch, each group as soon as it is complete.

::

    batch = pool.run_batch(tasks, policy, samples_per_task=8, oversample=2)
    async for group in batch.groups():      # in the order the groups complete
        if not group.uniform:  # same reward everywhere: zero advantage, no signal
            mean, std = group.reward_mean, group.reward_std
            advantages = [(r - mean) / (std + 1e-6) for r in group.rewards]

A group counts its **scored** samples: those with a reward (``reward`` not
null, so ``completed`` and the verifier-scored failures such as
``max_steps``, ``timeout`` or ``stale``). It is complete at its first
``samples_per_task`` scored samples, or when every one of its rollouts has
ended, whichever comes first. With oversampling (``samples_per_task + m``
rollouts per group), the rollouts still running when it completes are
stopped and end as ``superseded``.

Whether a result counts is decided once, as the rollout's result is built and
before anyone sees it (:meth:`GroupTracker.settle`): every consumer (the
results, the journal, telemetry, the groups) sees the same outcome. A rollout
that ends after its group was complete is ``superseded`` however far it got:
one that had been scored in the meantime keeps its transcript and
``verifier`` outcome, its reward becomes null, and its ``error`` says what it
had ended as (``it had ended completed with reward 1``). So a group's
``results`` are exactly the batch's results with a reward in that group.

Rollouts that end with no reward (infrastructure failures: ``init_error``,
``instance_lost``, ``policy_error``...) are not counted, only tallied in
:attr:`Group.failed`; the statistics are over the scored samples, so a group
hit by failures may have fewer than ``samples_per_task`` of them (or none:
then ``reward_mean`` and ``reward_std`` are null).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from fleetroll.results import FailureReason, RolloutResult

__all__ = ["Group", "GroupTracker", "superseded_error"]


def superseded_error(task_key: str, expected: int) -> str:
    """Why a rollout of a complete group ends ``superseded``."""
    return f"its group (task {task_key!r}) had its {expected} scored samples"


class Group(BaseModel):
    """One complete group: the samples of one task in one batch that count."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    batch_id: str
    task_key: str
    #: ``samples_per_task``: the scored samples a full group has.
    expected: int
    #: The scored samples that count (at most ``expected``), in the order they ended.
    results: list[RolloutResult] = Field(default_factory=list)
    rewards: list[float] = Field(default_factory=list)
    #: Mean and population standard deviation of ``rewards`` (null when there are none).
    reward_mean: float | None = None
    reward_std: float | None = None
    #: Every counted sample got the same reward: zero advantage, no signal.
    uniform: bool = False
    #: Rollouts of the group that ended without a reward (infrastructure failures).
    failed: int = 0
    #: Oversampled rollouts stopped (or never started) because the group was complete.
    superseded: int = 0

    @classmethod
    def of(
        cls,
        *,
        group_id: str,
        batch_id: str,
        task_key: str,
        expected: int,
        results: list[RolloutResult],
        failed: int,
        superseded: int,
    ) -> Group:
        rewards = [r.reward for r in results if r.reward is not None]
        return cls(
            group_id=group_id,
            batch_id=batch_id,
            task_key=task_key,
            expected=expected,
            results=results,
            rewards=rewards,
            reward_mean=statistics.fmean(rewards) if rewards else None,
            reward_std=statistics.pstdev(rewards) if rewards else None,
            uniform=bool(rewards) and len(set(rewards)) == 1,
            failed=failed,
            superseded=superseded,
        )


@dataclass
class _Pending:
    task_key: str
    running: set[str]
    counted: list[RolloutResult] = field(default_factory=list)
    failed: int = 0
    superseded: int = 0
    complete: bool = False


#: A group that just became complete, and the rollouts to stop (still running extras).
Completion = tuple[Group, list[str]]


class GroupTracker:
    """Which rollouts belong to which group, and when each group is complete.

    Args:
        batch_id: the batch's id.
        expected: ``samples_per_task``.
        members: per group id, its task key and the ids of its rollouts in this run.
        previous: results of the batch's rollouts that ended in an earlier run
            (a resume): they count in their groups as if delivered first.
    """

    def __init__(
        self,
        batch_id: str,
        expected: int,
        members: Mapping[str, tuple[str, Iterable[str]]],
        previous: Iterable[RolloutResult] = (),
    ) -> None:
        self.batch_id = batch_id
        self.expected = expected
        self._groups = {gid: _Pending(key, set(ids)) for gid, (key, ids) in members.items()}
        for result in previous:
            group = self._groups.get(result.group_id or "")
            if group is not None:
                group.running.discard(result.rollout_id)
                self._count(group, result)

    def __len__(self) -> int:
        return len(self._groups)

    def start(self) -> list[Completion]:
        """Groups complete before anything runs (all their samples were in already)."""
        done = []
        for gid, group in self._groups.items():
            completion = self._complete_if_ready(gid, group)
            if completion is not None:
                done.append(completion)
        return done

    def settle(self, result: RolloutResult) -> tuple[RolloutResult, Completion | None]:
        """Decide, once, what an ended rollout's result is in its group.

        Returns the result as every consumer must see it (``superseded``, with
        no reward, when its group was already complete) and the group it
        completes, if it does. Call it once per result, before passing the
        result on.
        """
        group = self._groups.get(result.group_id or "")
        if group is None or result.rollout_id not in group.running or not group.complete:
            return result, self.add(result)
        group.running.discard(result.rollout_id)
        if result.failure_reason is FailureReason.SUPERSEDED:
            return result, None
        # It ended after its group was complete: the group counted it as superseded.
        if result.reward is not None:
            ended = f"{result.failure_reason or 'completed'} with reward {result.reward:g}"
        else:
            ended = f"{result.failure_reason}: {result.error}"
        error = f"{superseded_error(group.task_key, self.expected)}; it had ended {ended}"
        return result.model_copy(
            update={
                "status": "failed",
                "failure_reason": FailureReason.SUPERSEDED,
                "reward": None,
                "error": error,
            }
        ), None

    def add(self, result: RolloutResult) -> Completion | None:
        """Count one ended rollout, as it was delivered; the group it completes, if it does."""
        group = self._groups.get(result.group_id or "")
        if group is None or result.rollout_id not in group.running:
            return None
        group.running.discard(result.rollout_id)
        if group.complete:
            return None  # an extra ending after its group was delivered
        self._count(group, result)
        return self._complete_if_ready(result.group_id or "", group)

    def _count(self, group: _Pending, result: RolloutResult) -> None:
        if result.reward is not None:
            if len(group.counted) < self.expected:
                group.counted.append(result)
        elif result.failure_reason is FailureReason.SUPERSEDED:
            group.superseded += 1
        else:
            group.failed += 1

    def _complete_if_ready(self, gid: str, group: _Pending) -> Completion | None:
        if group.complete or (len(group.counted) < self.expected and group.running):
            return None
        group.complete = True
        stop = sorted(group.running)
        return (
            Group.of(
                group_id=gid,
                batch_id=self.batch_id,
                task_key=group.task_key,
                expected=self.expected,
                results=group.counted,
                failed=group.failed,
                superseded=group.superseded + len(stop),
            ),
            stop,
        )
