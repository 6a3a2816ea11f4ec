"""An evaluation's figures from its results: per task, per environment, overall.

:func:`evaluate` turns rollout results (K samples per task: an evaluation
batch, a journal, a results stream) into an :class:`EvalReport`:

* A **success** is a sample whose ``reward`` is at least ``success_threshold``
  (default 1.0). The verifier's ``success`` flag is not used: it says that the
  verifier *ran*, not that the task was solved (docs/results.md).
* A sample without a reward (``reward: null``: an infrastructure failure, a
  policy endpoint that failed, a cancel) is **unscored**: counted apart, per
  failure reason, and never as a failure of the policy. A task's figures come
  from its ``n`` scored samples: pass@j exists for ``j <= n`` (null above),
  so a task that lost samples to the platform keeps an unbiased estimate from
  the rest, with ``n`` recorded beside it.
* Per task: successes of ``n``, pass@1 … pass@K (the unbiased estimator), the
  mean reward of the scored samples, and Wilson's 95% interval for the
  success rate (pass@1).
* Per environment and overall: each task weighs the same; pass@j is the mean
  over the tasks where it exists (``counted`` says how many), with a 95%
  percentile-bootstrap interval over those tasks (seeded, so reproducible)
  for pass@1 and pass@K (null for the j between: each costs a bootstrap).
"""

from __future__ import annotations

import math
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetroll.evaluation.estimators import (
    BOOTSTRAP_RESAMPLES,
    CONFIDENCE,
    bootstrap_interval,
    pass_at_ks,
    wilson_interval,
)
from fleetroll.results import RolloutResult

__all__ = [
    "DEFAULT_SUCCESS_THRESHOLD",
    "INTERVALS",
    "EvalReport",
    "Summary",
    "TaskScore",
    "env_name",
    "eval_batch",
    "evaluate",
]

#: The reward at or above which a sample counts as a success.
DEFAULT_SUCCESS_THRESHOLD = 1.0
#: What the intervals of a report are, said in every report.
INTERVALS = (
    f"{CONFIDENCE:.0%} intervals: per task, Wilson's score interval for the success rate"
    f" (pass@1) over its scored samples; per environment and overall, a percentile"
    f" bootstrap over tasks ({BOOTSTRAP_RESAMPLES} resamples, seeded) of the mean pass@1"
    f" and pass@K"
)


def env_name(result: RolloutResult) -> str:
    """The environment a result ran on, as reports name it (``key:version``)."""
    return f"{result.env_key}:{result.env_version}" if result.env_version else result.env_key


def _key(j: int) -> str:
    return f"pass@{j}"


def _interval(pair: tuple[float, float] | None) -> list[float] | None:
    return None if pair is None else [pair[0], pair[1]]


def _pair(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))


#: The counts a task and a set of tasks both report, as JSON names them.
_COUNTS = ("samples", "scored", "successes", "unscored_reasons", "mean_reward")


def _counts_json(figures: TaskScore | Summary) -> dict[str, Any]:
    return {
        "samples": figures.samples,
        "scored": figures.scored,
        "successes": figures.successes,
        "unscored": figures.unscored,
        "unscored_reasons": dict(figures.unscored_reasons),
        "mean_reward": figures.mean_reward,
    }


def _counts_of(record: Mapping[str, Any]) -> dict[str, Any]:
    return {name: record[name] for name in _COUNTS}


@dataclass(frozen=True, slots=True)
class TaskScore:
    """One task's figures. ``pass_at[j-1]`` is pass@j; None where ``j > scored``."""

    task_key: str
    env: str
    #: Results of the task (scored or not).
    samples: int
    #: Results with a reward: the ``n`` of the estimator.
    scored: int
    successes: int
    #: Unscored results per failure reason.
    unscored_reasons: Mapping[str, int]
    mean_reward: float | None
    pass_at: tuple[float | None, ...]
    #: Wilson's interval for the success rate; None without a scored sample.
    interval: tuple[float, float] | None

    @property
    def unscored(self) -> int:
        return self.samples - self.scored

    def pass_at_k(self, k: int) -> float | None:
        """pass@k, or None when the task has fewer than ``k`` scored samples (or k > K)."""
        return self.pass_at[k - 1] if 1 <= k <= len(self.pass_at) else None

    def to_json(self) -> dict[str, Any]:
        record = {"task_key": self.task_key, "env": self.env, **_counts_json(self)}
        record |= {_key(j): value for j, value in enumerate(self.pass_at, start=1)}
        record["pass@1_interval"] = _interval(self.interval)
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any], k: int) -> TaskScore:
        return cls(
            task_key=record["task_key"],
            env=record["env"],
            **_counts_of(record),
            pass_at=tuple(record[_key(j)] for j in range(1, k + 1)),
            interval=_pair(record["pass@1_interval"]),
        )


@dataclass(frozen=True, slots=True)
class Summary:
    """Figures over a set of tasks (an environment's, or all): each task weighs the same."""

    name: str
    tasks: int
    #: Tasks with at least one scored sample.
    tasks_scored: int
    samples: int
    scored: int
    successes: int
    unscored_reasons: Mapping[str, int]
    #: The mean over tasks of each task's mean reward.
    mean_reward: float | None
    #: ``pass_at[j-1]``: the mean pass@j over the ``counted[j-1]`` tasks where it exists.
    pass_at: tuple[float | None, ...]
    counted: tuple[int, ...]
    intervals: tuple[tuple[float, float] | None, ...]

    @property
    def unscored(self) -> int:
        return self.samples - self.scored

    def pass_at_k(self, k: int) -> float | None:
        return self.pass_at[k - 1] if 1 <= k <= len(self.pass_at) else None

    @classmethod
    def of(cls, name: str, scores: Sequence[TaskScore], k: int, seed: int = 0) -> Summary:
        reasons: Counter[str] = Counter()
        for s in scores:
            reasons.update(s.unscored_reasons)
        means = [s.mean_reward for s in scores if s.mean_reward is not None]
        pass_at: list[float | None] = []
        counted: list[int] = []
        intervals: list[tuple[float, float] | None] = []
        for j in range(1, k + 1):
            values = [v for s in scores if (v := s.pass_at_k(j)) is not None]
            counted.append(len(values))
            pass_at.append(math.fsum(values) / len(values) if values else None)
            # Intervals of the figures a report shows (a bootstrap costs as much per j).
            shown = j in (1, k)
            intervals.append(bootstrap_interval(values, seed=seed + j) if shown else None)
        return cls(
            name=name,
            tasks=len(scores),
            tasks_scored=sum(s.scored > 0 for s in scores),
            samples=sum(s.samples for s in scores),
            scored=sum(s.scored for s in scores),
            successes=sum(s.successes for s in scores),
            unscored_reasons=dict(sorted(reasons.items())),
            mean_reward=math.fsum(means) / len(means) if means else None,
            pass_at=tuple(pass_at),
            counted=tuple(counted),
            intervals=tuple(intervals),
        )

    def to_json(self) -> dict[str, Any]:
        record = {"tasks": self.tasks, "tasks_scored": self.tasks_scored, **_counts_json(self)}
        k = len(self.pass_at)
        record |= {_key(j): self.pass_at[j - 1] for j in range(1, k + 1)}
        record["intervals"] = {_key(j): _interval(self.intervals[j - 1]) for j in range(1, k + 1)}
        record["counted"] = {_key(j): self.counted[j - 1] for j in range(1, k + 1)}
        return record

    @classmethod
    def from_json(cls, name: str, record: Mapping[str, Any], k: int) -> Summary:
        keys = [_key(j) for j in range(1, k + 1)]
        return cls(
            name=name,
            tasks=record["tasks"],
            tasks_scored=record["tasks_scored"],
            **_counts_of(record),
            pass_at=tuple(record[key] for key in keys),
            counted=tuple(record["counted"][key] for key in keys),
            intervals=tuple(_pair(record["intervals"][key]) for key in keys),
        )


@dataclass(frozen=True, slots=True)
class EvalReport:
    """An evaluation: per task (by ``task_key``), per environment, overall.

    ``results`` are the results it was computed from (empty when read back
    from JSON).
    """

    k: int
    success_threshold: float
    #: The policy version the evaluation was tagged with, if any.
    policy_version: int | None
    tasks: Mapping[str, TaskScore]
    environments: Mapping[str, Summary]
    overall: Summary
    batch_ids: tuple[str, ...] = ()
    results: Sequence[RolloutResult] = field(default=(), repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """As JSON: ``tasks`` keyed by ``task_key``, each with ``pass@1`` … ``pass@K``."""
        return {
            "k": self.k,
            "success_threshold": self.success_threshold,
            "policy_version": self.policy_version,
            "batch_ids": list(self.batch_ids),
            "intervals": INTERVALS,
            "tasks": {key: score.to_json() for key, score in self.tasks.items()},
            "environments": {name: s.to_json() for name, s in self.environments.items()},
            "overall": self.overall.to_json(),
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> EvalReport:
        """A report read back from :meth:`to_json` (its ``results`` are not in it).

        Raises:
            KeyError, TypeError, ValueError: ``record`` is not a report.
        """
        k = int(record["k"])
        return cls(
            k=k,
            success_threshold=float(record["success_threshold"]),
            policy_version=record["policy_version"],
            batch_ids=tuple(record["batch_ids"]),
            tasks={key: TaskScore.from_json(t, k) for key, t in record["tasks"].items()},
            environments={
                name: Summary.from_json(name, s, k) for name, s in record["environments"].items()
            },
            overall=Summary.from_json("overall", record["overall"], k),
        )


def _score(
    key: str, env: str, results: Sequence[RolloutResult], k: int, threshold: float
) -> TaskScore:
    rewards = [r.reward for r in results if r.reward is not None]
    n = len(rewards)
    c = sum(reward >= threshold for reward in rewards)
    reasons = Counter(
        r.failure_reason.value if r.failure_reason else "no reward"
        for r in results
        if r.reward is None
    )
    return TaskScore(
        task_key=key,
        env=env,
        samples=len(results),
        scored=n,
        successes=c,
        unscored_reasons=dict(sorted(reasons.items())),
        mean_reward=math.fsum(rewards) / n if n else None,
        pass_at=(*(pass_at_ks(n, c, min(n, k)) if n else ()), *(None,) * max(0, k - n)),
        interval=wilson_interval(c, n) if n else None,
    )


def evaluate(
    results: Iterable[RolloutResult],
    *,
    k: int | None = None,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    policy_version: int | None = None,
) -> EvalReport:
    """The evaluation of ``results`` (see the module docstring for what counts how).

    Args:
        k: the largest j of pass@j to report (default and at most: the most
            results any task has). A task with more scored samples than ``k``
            uses them all.
        success_threshold: the reward at or above which a sample is a success.
        policy_version: the version to report; default: the one every result
            is tagged with (``RolloutResult.policy_version``), if they agree.

    Raises:
        ValueError: ``k`` is below 1 or above the most results of a task, or
            there are no results and no ``k``.
    """
    latest: dict[str, RolloutResult] = {}
    for r in results:  # a journal may hold a rollout twice: its last line counts
        latest.pop(r.rollout_id, None)
        latest[r.rollout_id] = r
    by_task: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in latest.values():
        by_task[r.task_key].append(r)
    if k is None:
        if not by_task:
            raise ValueError("no results to evaluate")
        k = max(len(rs) for rs in by_task.values())
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    most = max((len(rs) for rs in by_task.values()), default=k)
    if k > most:
        raise ValueError(f"pass@{k} needs {k} samples of a task; no task has more than {most}")
    scores = {
        key: _score(key, env_name(rs[0]), rs, k, success_threshold)
        for key, rs in sorted(by_task.items())
    }
    by_env: dict[str, list[TaskScore]] = defaultdict(list)
    for score in scores.values():
        by_env[score.env].append(score)
    if policy_version is None:
        versions = {r.policy_version for r in latest.values()}
        policy_version = versions.pop() if len(versions) == 1 else None
    return EvalReport(
        k=k,
        success_threshold=success_threshold,
        policy_version=policy_version,
        tasks=scores,
        environments={env: Summary.of(env, s, k) for env, s in sorted(by_env.items())},
        overall=Summary.of("overall", list(scores.values()), k),
        batch_ids=tuple(sorted({r.batch_id for r in latest.values()})),
        results=list(latest.values()),
    )


def eval_batch(
    k: int,
    max_concurrency: int | None = None,
    policy_version: int | None = None,
    batch_id: str | None = None,
    deadline_s: float | None = None,
) -> dict[str, Any]:
    """The ``run_batch`` arguments of an evaluation, in-process or remote: ``k``
    samples per task and none extra (a sample the platform fails is counted
    apart, not replaced), its share of the pool and its tag.

    Raises:
        ValueError: ``k`` is below 1.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    return {
        "samples_per_task": k,
        "batch_id": batch_id or f"eval-{uuid.uuid4().hex[:12]}",
        "deadline_s": deadline_s,
        "oversample": 0,
        "max_in_flight": max_concurrency,
        "policy_version": policy_version,
    }
