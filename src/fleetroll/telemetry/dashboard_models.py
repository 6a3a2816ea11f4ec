"""What the dashboard shows: the typed answer of ``GET /dashboard/data``.

:func:`fleetroll.telemetry.dashboard.read_snapshot` reads a :class:`Snapshot`
from the store; :meth:`Snapshot.as_json` is what the page
(``dashboard.html``) polls every two seconds: each class below is one JSON
object, its fields its keys, a list a JSON array and a :data:`Bin` a
``[lo, hi, count]`` array. Timestamps are the store's text (UTC, ISO 8601,
``Z``); ``None`` is ``null``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

__all__ = [
    "Admission",
    "BatchReward",
    "BatchSeen",
    "Bin",
    "Breaker",
    "Bucket",
    "Cost",
    "CostPanel",
    "EnvCost",
    "EnvFailures",
    "EnvRewards",
    "FailedRollout",
    "Failures",
    "Groups",
    "Progress",
    "Provisioning",
    "Rewards",
    "SlowRollout",
    "SlowTool",
    "Snapshot",
    "ThroughputPoint",
    "Timeline",
    "Totals",
    "Unfinished",
    "UnfinishedRollout",
    "UniformGroup",
]

#: A histogram bin: ``(lo, hi, count)``, the last bin of a histogram closed.
Bin = tuple[float, float, int]


@dataclass(frozen=True, slots=True)
class BatchSeen:
    """A batch in the store (the batch picker), newest first."""

    batch_id: str
    started: int
    first_seen: str


@dataclass(frozen=True, slots=True)
class Totals:
    """The headline counts of the rollouts in view.

    ``lost`` counts rollouts whose process is gone
    (:mod:`fleetroll.telemetry.writers`), which ``in_flight`` leaves out;
    ``rerun`` those whose lost start ran again to completion (``--resume``
    after a kill -9), neither lost nor in flight, as ``fleetroll stats
    --check`` counts them. ``completed`` counts every completion (each
    rollout's results, whatever they were); ``cancelled`` those that were cancelled
    (not let finish), which ``failed`` and ``failed_pct`` leave out: the
    rate is of the completions that ran to their end.
    """

    started: int = 0
    completed: int = 0
    in_flight: int = 0
    lost: int = 0
    rerun: int = 0
    failed: int = 0
    cancelled: int = 0
    failed_pct: float | None = None
    reward_mean: float | None = None
    rewarded: int = 0


@dataclass(frozen=True, slots=True)
class Bucket:
    """One step of the timeline: starts and completions in it, and running totals."""

    t: str
    started: int
    completed: int
    started_total: int
    completed_total: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class Timeline:
    """Rollouts over time, in buckets of ``bucket_s`` seconds (at most 60 of them)."""

    bucket_s: int
    buckets: list[Bucket]


@dataclass(frozen=True, slots=True)
class EnvFailures:
    """An environment's completions, failed ones, and how many failed for each reason;
    the cancelled ones apart (neither failed nor among the reasons)."""

    env: str
    completed: int
    failed: int
    reasons: dict[str, int]
    cancelled: int = 0


@dataclass(frozen=True, slots=True)
class Failures:
    """Every failure reason seen (sorted), and the failures of each environment."""

    reasons: list[str]
    envs: list[EnvFailures]


@dataclass(frozen=True, slots=True)
class Provisioning:
    """How long instances took to be ready: count, quantiles and a histogram."""

    count: int
    p50_s: float | None
    p95_s: float | None
    max_s: float | None
    bins: list[Bin]


@dataclass(frozen=True, slots=True)
class EnvRewards:
    """An environment's scored rollouts: how many, their mean reward and a histogram."""

    env: str
    count: int
    mean: float
    bins: list[Bin]


@dataclass(frozen=True, slots=True)
class Rewards:
    """The rewards of each environment, binned over one range so they compare."""

    envs: list[EnvRewards]


@dataclass(frozen=True, slots=True)
class SlowTool:
    """A tool of an environment, by its calls' mean duration (``fleet_tool_call``)."""

    tool: str
    env: str | None
    calls: int
    mean_s: float
    max_s: float
    #: Calls answered with an error, or not answered at all.
    not_ok: int


@dataclass(frozen=True, slots=True)
class SlowRollout:
    """One of the slowest completed rollouts."""

    rollout_id: str
    task_key: str | None
    env: str | None
    duration_s: float
    failure_reason: str | None
    reward: float | None
    time: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    """The results' cost, summed: one field per
    :data:`~fleetroll.telemetry.queries.COST_FIELDS`, and the completions counted."""

    completed: int = 0
    instance_s: float = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_calls: int = 0
    tool_calls: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvCost(Cost):
    """An environment's cost."""

    env: str


@dataclass(frozen=True, slots=True)
class CostPanel:
    """The cost of each environment, and the total (of ``batch`` when one is given)."""

    envs: list[EnvCost]
    total: Cost


@dataclass(frozen=True, slots=True)
class Progress:
    """The current batch against its total, with a recent rate and an ETA.

    ``done`` counts its rollouts with a result; ``failed`` and ``cancelled``
    those of them whose latest result failed, or was cancelled (not failed).
    """

    batch_id: str
    total: int
    done: int
    failed: int
    lost: int
    remaining: int
    state: Literal["running", "finished", "lost"]
    first_started: str
    started: str
    rate_per_min: float | None
    eta_s: float | None
    eta_window_s: float
    cancelled: int = 0


@dataclass(frozen=True, slots=True)
class ThroughputPoint:
    """Completions per minute in one timeline bucket."""

    t: str
    per_min: float


@dataclass(frozen=True, slots=True)
class BatchReward:
    """A batch's mean reward over its scored rollouts."""

    batch_id: str
    t: str
    reward_mean: float | None
    rewarded: int
    completed: int


@dataclass(frozen=True, slots=True)
class UniformGroup:
    """A group whose scored samples all got the same reward."""

    batch_id: str | None
    task_key: str | None
    samples: int
    reward: float


@dataclass(frozen=True, slots=True)
class Groups:
    """Groups with two or more scored samples, the uniform ones, and those shown."""

    groups: int
    uniform: int
    rows: list[UniformGroup]


@dataclass(frozen=True, slots=True)
class UnfinishedRollout:
    """A rollout stuck (running over the threshold) or lost (its process gone)."""

    rollout_id: str
    batch_id: str | None
    env: str | None
    task_key: str | None
    phase: str | None
    last_event: str | None
    age_s: float
    instance_id: str | None
    pid: int | None
    state: Literal["lost", "stuck"]


@dataclass(frozen=True, slots=True)
class Unfinished:
    """Lost and stuck rollouts, as ``fleetroll stats --check`` tells them apart."""

    stuck_after_s: float
    lost: int
    rerun: int
    stuck: int
    in_flight: int
    rows: list[UnfinishedRollout]


@dataclass(frozen=True, slots=True)
class FailedRollout:
    """One of the latest failed rollouts (a cancelled one did not fail: never here)."""

    time: str
    rollout_id: str
    batch_id: str | None
    env: str | None
    failure_reason: str
    message: str | None


@dataclass(frozen=True, slots=True)
class Breaker:
    """An environment version's circuit breaker, from its latest event."""

    env: str
    state: Literal["quarantined", "recovered"]
    since: str
    failure_share: float | None
    window: int | None


@dataclass(frozen=True, slots=True)
class RateChange:
    """One change of the learnt create rate (a ``fleet_create_rate`` event)."""

    time: str
    creates_per_second: float | None
    in_flight_limit: int | None
    reason: str | None


@dataclass(frozen=True, slots=True)
class Admission:
    """The breakers, the learnt create rate's latest changes (newest first), and the
    live admission gauges of ``/metrics`` (the service's only)."""

    envs: list[Breaker]
    gauges: dict[str, Any] | None
    rate_changes: list[RateChange] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Everything the page draws, at ``generated_at``.

    ``since`` and ``batch`` are the filters it was read with; ``note`` says
    why there is nothing to show (no store yet), and is left out of the JSON
    otherwise. ``progress`` is of ``batch``, or else of the newest batch
    (None: no batch yet); ``cost.total`` is the batch's cost with ``batch``.
    """

    generated_at: str
    since: str | None
    batch: str | None
    note: str | None = None
    batches: list[BatchSeen]
    totals: Totals
    timeline: Timeline
    failures: Failures
    provisioning: Provisioning
    rewards: Rewards
    slowest: list[SlowRollout]
    slowest_tools: list[SlowTool]
    cost: CostPanel
    progress: Progress | None
    throughput: list[ThroughputPoint]
    batch_rewards: list[BatchReward]
    groups: Groups
    unfinished: Unfinished
    errors: list[FailedRollout]
    admission: Admission

    def as_json(self) -> dict[str, Any]:
        """The snapshot as the page reads it (JSON types only)."""
        answer: dict[str, Any] = _json(self)
        if self.note is None:
            del answer["note"]
        return answer


def _json(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _json(item) for key, item in value.items()}
    return value
