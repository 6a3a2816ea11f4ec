"""Two evaluations side by side (two policy versions): which differences are beyond noise.

:func:`compare` pairs the tasks the two reports share and, at one ``k``:

* **per task**: pass@k of A and of B and their difference; whether the success
  rates differ beyond noise by Fisher's exact test on the two counts
  (successes and failures among each side's scored samples), flagged with
  Holm's correction over the tasks compared, so that among many tasks the
  chance of flagging any task that did not change stays under ``alpha``;
* **per environment and overall**: the mean per-task difference (each task
  weighs the same), a 95% percentile-bootstrap interval over tasks for it, and
  a paired permutation (sign-flip) test over tasks: beyond noise when its
  p-value is below ``alpha`` (default 0.05).

A task without pass@k on one side (fewer than ``k`` scored samples, or not
evaluated there) is not paired; ``unpaired`` lists it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetroll.evaluation.estimators import (
    bootstrap_interval,
    fisher_exact_p,
    holm,
    sign_flip_p,
)
from fleetroll.evaluation.report import EvalReport

__all__ = ["DEFAULT_ALPHA", "METHOD", "Comparison", "SetDifference", "TaskDifference", "compare"]

#: The significance level below which a difference is said to be beyond noise.
DEFAULT_ALPHA = 0.05
#: How differences are judged, said in every comparison.
METHOD = (
    "per task: Fisher's exact test on the success counts, Holm-corrected over the tasks"
    " compared; per environment and overall: a paired sign-flip permutation test over tasks"
    " of the mean pass@k difference (exact up to 14 tasks that differ), with a 95% bootstrap"
    " interval"
)


@dataclass(frozen=True, slots=True)
class TaskDifference:
    task_key: str
    env: str
    a: float
    b: float
    #: Fisher's exact p-value for the two success counts (uncorrected).
    p_value: float
    #: Beyond noise: rejected by Holm's method at ``alpha`` among the tasks compared.
    significant: bool

    @property
    def difference(self) -> float:
        return self.b - self.a

    def to_json(self) -> dict[str, Any]:
        return {
            "task_key": self.task_key,
            "env": self.env,
            "a": self.a,
            "b": self.b,
            "difference": self.difference,
            "p_value": self.p_value,
            "significant": self.significant,
        }


@dataclass(frozen=True, slots=True)
class SetDifference:
    """The mean per-task difference over a set of tasks (an environment's, or all)."""

    name: str
    tasks: int
    a: float | None
    b: float | None
    interval: tuple[float, float] | None
    p_value: float
    significant: bool

    @property
    def difference(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @classmethod
    def of(
        cls, name: str, pairs: Sequence[TaskDifference], alpha: float, seed: int
    ) -> SetDifference:
        diffs = [p.difference for p in pairs]
        p_value = sign_flip_p(diffs, seed=seed)
        return cls(
            name=name,
            tasks=len(pairs),
            a=math.fsum(p.a for p in pairs) / len(pairs) if pairs else None,
            b=math.fsum(p.b for p in pairs) / len(pairs) if pairs else None,
            interval=bootstrap_interval(diffs, seed=seed),
            p_value=p_value,
            significant=bool(pairs) and p_value < alpha,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "a": self.a,
            "b": self.b,
            "difference": self.difference,
            "interval": None if self.interval is None else list(self.interval),
            "p_value": self.p_value,
            "significant": self.significant,
        }


@dataclass(frozen=True, slots=True)
class Comparison:
    k: int
    alpha: float
    tasks: Mapping[str, TaskDifference]
    environments: Mapping[str, SetDifference]
    overall: SetDifference
    #: Tasks without pass@k on both sides.
    unpaired: tuple[str, ...]
    a_version: int | None = None
    b_version: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "alpha": self.alpha,
            "method": METHOD,
            "a_policy_version": self.a_version,
            "b_policy_version": self.b_version,
            "tasks": {key: d.to_json() for key, d in self.tasks.items()},
            "environments": {name: d.to_json() for name, d in self.environments.items()},
            "overall": self.overall.to_json(),
            "unpaired": list(self.unpaired),
        }


def compare(
    a: EvalReport, b: EvalReport, *, k: int = 1, alpha: float = DEFAULT_ALPHA, seed: int = 0
) -> Comparison:
    """B against A at pass@k (see the module docstring for the tests).

    Raises:
        ValueError: ``k`` is below 1, or ``alpha`` not between 0 and 1.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1, not {alpha}")
    keys = sorted(set(a.tasks) | set(b.tasks))
    paired: list[tuple[str, float, float, float]] = []
    unpaired: list[str] = []
    for key in keys:
        ta, tb = a.tasks.get(key), b.tasks.get(key)
        pa = ta.pass_at_k(k) if ta else None
        pb = tb.pass_at_k(k) if tb else None
        if ta is None or tb is None or pa is None or pb is None:
            unpaired.append(key)
            continue
        p = fisher_exact_p(ta.successes, ta.scored, tb.successes, tb.scored)
        paired.append((key, pa, pb, p))
    flags = holm([p for *_, p in paired], alpha)
    tasks = {
        key: TaskDifference(key, b.tasks[key].env, pa, pb, p, flag)
        for (key, pa, pb, p), flag in zip(paired, flags, strict=True)
    }
    by_env: dict[str, list[TaskDifference]] = defaultdict(list)
    for d in tasks.values():
        by_env[d.env].append(d)
    return Comparison(
        k=k,
        alpha=alpha,
        tasks=tasks,
        environments={
            env: SetDifference.of(env, ds, alpha, seed) for env, ds in sorted(by_env.items())
        },
        overall=SetDifference.of("overall", list(tasks.values()), alpha, seed),
        unpaired=tuple(unpaired),
        a_version=a.policy_version,
        b_version=b.policy_version,
    )
