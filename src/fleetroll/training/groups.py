"""GRPO groups: the samples of one task in one batch, each group as soon as it is complete.

::

    batch = pool.run_batch(tasks, policy, samples_per_task=8, oversample=2)
    async for group in batch.groups(complete_only=True):  # in the order groups complete
        if not group.uniform:  # same reward everywhere: zero advantage, no signal
            mean, std = group.reward_mean, group.reward_std
            advantages = [(r - mean) / (std + 1e-6) for r in group.rewards]

A group counts its **scored** samples: those with a reward (``reward`` not
null, so ``completed`` and the verifier-scored failures such as
``max_steps``, ``timeout`` or ``stale``).

Which samples a group keeps does not depend on how long they took. Each
rollout has a rank, its ``sample_index``; the group keeps its
``samples_per_task`` lowest-ranked scored samples. The first
``samples_per_task`` ranks are the group's samples; the extras
(``oversample``, ranks ``samples_per_task`` and up) stand in, in rank order,
for samples that ended **unscored** (infrastructure failures), never for slow
ones. So a group is complete once its kept set is decided: when it holds
``samples_per_task`` kept samples (its own, or extras in place of failed
ones), or when none of its rollouts is still running. The extras still
running then are stopped and end as ``superseded``. With no failures, a
group with oversampling keeps exactly the samples it would keep without, so
its mean reward (the GRPO baseline) is the same whether long episodes score
higher or lower.

Whether a result counts is decided once, as the rollout's result is built and
before anyone sees it (:meth:`GroupTracker.settle`): every consumer (the
results, the journal, telemetry, the groups) sees the same outcome. Since
that decision cannot wait, an extra that ends scored while the lower ranks
that could fill the group are still running is decided at once as
``superseded``: it counts only when enough lower ranks have already ended
unscored. So if a lower rank fails *after* such an extra ended, the extra is
not taken back: the slot goes to the next extra still running, or the group
stays short. This keeps the no-failure case exact and bounds what timing can
do to the failure case (a fast extra can lose a slot to a slower one, only
when a sample failed). A rollout that ends after its group was complete is
``superseded`` however far it got: one that had been scored in the meantime
keeps its transcript and ``verifier`` outcome, its reward becomes null, and
its ``error`` says what it had ended as (``it had ended completed with reward
1``). So a group's ``results`` are exactly the batch's results with a reward
in that group.

Rollouts that end with no reward (infrastructure failures: ``init_error``,
``instance_lost``, ``policy_error``...) are not counted, only tallied in
:attr:`Group.failed`; the statistics are over the scored samples. A group that
cannot reach ``samples_per_task`` scored samples is still delivered, with
:attr:`Group.complete` false (and with no scored sample at all,
``reward_mean`` and ``reward_std`` null); ``batch.groups(complete_only=True)``
drops such groups.

Straggler cut-off is by whole groups (``groups_target``): a batch started
with more groups (tasks) than it needs delivers the first ``groups_target``
groups to become complete with ``samples_per_task`` scored samples, and then
stops every rollout of every other group: each ends ``superseded`` (reward
null, its error naming the cut), and those groups are delivered with
``complete`` false and ``cut`` true, so ``groups(complete_only=True)`` yields
exactly the ``groups_target`` kept groups. Within a kept group nothing is
cut (its samples are chosen as above). A result of a cut group that ended
before the cut keeps its reward in the results stream (it was delivered as it
ended); its group still is not complete. The cut's own bias: groups whose
episodes run faster are kept, so tasks with short episodes (and whatever
correlates with that: easy tasks, short answers) are over-represented among
the kept groups, while each group's mean reward is unbiased.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from fleetroll.results import FailureReason, RolloutResult

__all__ = [
    "Group",
    "GroupTracker",
    "Tree",
    "cut_error",
    "groups_of",
    "not_needed_error",
    "superseded_error",
]


def superseded_error(task_key: str, expected: int) -> str:
    """Why a rollout of a complete group ends ``superseded``."""
    return f"its group (task {task_key!r}) had its {expected} scored samples"


def cut_error(task_key: str, target: int) -> str:
    """Why a rollout of a group cut by ``groups_target`` ends ``superseded``."""
    return (
        f"the batch had its {target} complete groups (groups_target) before this one"
        f" (task {task_key!r}): its group was cut"
    )


def not_needed_error(task_key: str, expected: int) -> str:
    """Why a scored extra that could not stand in for a failed sample ends ``superseded``."""
    return (
        f"an extra of its group (task {task_key!r}) counts only in place of a failed sample,"
        f" and at least {expected} lower-ranked samples were scored or still running"
    )


def _ended(result: RolloutResult) -> str:
    """What a rollout had ended as, for the error of a result made ``superseded``."""
    if result.reward is not None:
        return f"{result.failure_reason or 'completed'} with reward {result.reward:g}"
    return f"{result.failure_reason}: {result.error}"


class Group(BaseModel):
    """One complete group: the samples of one task in one batch that count."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    batch_id: str
    task_key: str
    #: ``samples_per_task``: the scored samples a full group has.
    expected: int
    #: The scored samples that count (at most ``expected``): the lowest-ranked
    #: (``sample_index``) scored ones, in the order they ended.
    results: list[RolloutResult] = Field(default_factory=list)
    rewards: list[float] = Field(default_factory=list)
    #: Mean and population standard deviation of ``rewards`` (null when there are none).
    reward_mean: float | None = None
    reward_std: float | None = None
    #: Every counted sample got the same reward: zero advantage, no signal.
    uniform: bool = False
    #: Rollouts of the group that ended without a reward (infrastructure failures).
    failed: int = 0
    #: Oversampled rollouts stopped (or never started) because the group was
    #: complete, or that ended scored while not needed in place of a failed sample.
    superseded: int = 0
    #: It has ``expected`` scored samples; false when failures left it short
    #: (``batch.groups(complete_only=True)`` drops such groups).
    complete: bool = True
    #: The batch had its ``groups_target`` complete groups first: this group's
    #: rollouts still running were stopped (``superseded``). Never ``complete``.
    cut: bool = False

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
        cut: bool = False,
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
            complete=len(rewards) >= expected and not cut,
            cut=cut,
        )


@dataclass
class _Pending:
    task_key: str
    running: set[str]
    #: Rank (``sample_index``) of each of its rollouts in this run.
    ranks: dict[str, int] = field(default_factory=dict)
    counted: list[RolloutResult] = field(default_factory=list)
    failed: int = 0
    superseded: int = 0
    complete: bool = False
    #: Stopped because the batch had its ``groups_target`` complete groups.
    cut: bool = False


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
        ranks: the ``sample_index`` of each rollout id of ``members``:
            :meth:`settle` keeps a scored extra only in place of a failed
            lower-ranked sample. A rollout without one is not ranked (as a
            tracker that only :meth:`add` s results already settled needs).
        target: ``groups_target``: once this many groups are complete, every
            other group is cut (:meth:`cut`). None: no cut.
        full: groups of the batch complete elsewhere (not in ``members``),
            counted toward ``target``.
    """

    def __init__(
        self,
        batch_id: str,
        expected: int,
        members: Mapping[str, tuple[str, Iterable[str]]],
        previous: Iterable[RolloutResult] = (),
        *,
        ranks: Mapping[str, int] | None = None,
        target: int | None = None,
        full: int = 0,
    ) -> None:
        self.batch_id = batch_id
        self.expected = expected
        self.target = target
        self._full = full  # groups complete with `expected` scored samples
        self._cut = False
        ranks = ranks or {}
        self._groups = {
            gid: _Pending(key, set(ids), {rid: ranks[rid] for rid in ids if rid in ranks})
            for gid, (key, ids) in members.items()
        }
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
        no reward, when its group was already complete, or when it is a scored
        extra not needed in place of a failed lower-ranked sample) and the
        group it completes, if it does. Call it once per result, before
        passing the result on.
        """
        group = self._groups.get(result.group_id or "")
        if group is None or result.rollout_id not in group.running:
            return result, self.add(result)
        if group.cut and result.failure_reason is not FailureReason.SUPERSEDED:
            # It ended after its group was cut (the stop came too late): not kept.
            assert self.target is not None
            result = _superseded(result, cut_error(group.task_key, self.target))
            return result, self.add(result)
        if not group.complete:
            if result.reward is not None and self._not_needed(group, result):
                error = not_needed_error(group.task_key, self.expected)
                result = _superseded(result, error)
            return result, self.add(result)
        group.running.discard(result.rollout_id)
        if result.failure_reason is FailureReason.SUPERSEDED:
            return result, None
        # It ended after its group was complete: the group counted it as superseded.
        return _superseded(result, superseded_error(group.task_key, self.expected)), None

    def _not_needed(self, group: _Pending, result: RolloutResult) -> bool:
        """Whether a scored result would take a place lower ranks may still fill.

        It counts only if, even were every lower-ranked rollout still running
        to end scored, the lower ranks would not fill the group.
        """
        rank = group.ranks.get(result.rollout_id)
        if rank is None or rank < self.expected:
            return False  # one of the group's own samples (or unranked): always kept
        lower = sum(1 for r in group.counted if r.sample_index < rank)
        lower += sum(1 for rid in group.running if group.ranks.get(rid, rank) < rank)
        return lower >= self.expected

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

    def cut(self) -> list[tuple[str, str]]:
        """Once ``target`` groups are complete: cut every other group, once.

        Returns the rollouts to stop (still running, or not started) with why;
        each group cut is delivered, once its rollouts ended, with ``cut`` true.
        """
        if self._cut or self.target is None or self._full < self.target:
            return []
        self._cut = True
        stop = []
        for group in self._groups.values():
            if not group.complete:
                group.cut = True
                why = cut_error(group.task_key, self.target)
                stop += [(rid, why) for rid in sorted(group.running)]
        return stop

    def _complete_if_ready(self, gid: str, group: _Pending) -> Completion | None:
        if group.complete or (len(group.counted) < self.expected and group.running):
            return None
        group.complete = True
        if len(group.counted) >= self.expected and not group.cut:
            self._full += 1
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
                cut=group.cut,
            ),
            stop,
        )


def groups_of(batch_id: str, expected: int, results: Iterable[RolloutResult]) -> list[Group]:
    """The groups of a batch that has ended, from its results (a journal's, say).

    The same groups the batch delivered: its results were settled as they
    ended, so a group's scored results are exactly those it kept. In the
    order of each group's first result; ``expected`` is ``samples_per_task``.
    """
    results = list(results)
    members: dict[str, tuple[str, list[str]]] = {}
    for result in results:
        if result.group_id is not None:
            members.setdefault(result.group_id, (result.task_key, []))[1].append(result.rollout_id)
    return [group for group, _ in GroupTracker(batch_id, expected, members, results).start()]


def _superseded(result: RolloutResult, why: str) -> RolloutResult:
    """``result`` as ``superseded``: no reward, and its error says what it had ended as."""
    return result.model_copy(
        update={
            "status": "failed",
            "failure_reason": FailureReason.SUPERSEDED,
            "reward": None,
            "error": f"{why}; it had ended {_ended(result)}",
        }
    )


@dataclass(frozen=True, slots=True)
class Tree:
    """A rollout tree (:meth:`fleetroll.pool.rollout_pool.RolloutPool.run_tree`, or
    ``FleetrollClient.run_tree`` over HTTP): a root cut at its branch
    point and the branches that replayed its prefix and sampled on.

    ``groups`` holds one group per branch point (the ``width`` branches of one
    point), for step-level advantages; empty when the root did not reach the
    branch point (it ended sooner: nothing to branch from).
    """

    #: The root: the prefix's rollout, stopped at the branch point
    #: (``max_steps``, scored on the state it reached); or ended sooner.
    root: RolloutResult
    #: The branches, in the order they ended (each with ``parent_rollout_id``).
    branches: list[RolloutResult] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
