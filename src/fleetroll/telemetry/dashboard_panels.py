"""The dashboard's training-run panels: what a person watching a run asks.

Each function reads the store through ``run`` (the snapshot's read-only SQL),
the rollouts' events from ``events`` (the ``rollout_events`` table, or its
columns read from ``records`` on an older store), and answers one panel of
:func:`fleetroll.telemetry.dashboard.read_snapshot` (its types:
:mod:`fleetroll.telemetry.dashboard_models`):

- :func:`progress`: the current batch against its total, with a rate and an
  ETA over a recent window (:func:`eta`), and its state (running, finished,
  lost);
- :func:`throughput`: completions per minute over time;
- :func:`batch_rewards`: the mean reward of each batch, oldest first;
- :func:`uniform_groups`: GRPO groups (the samples of one task in one batch)
  whose scored samples all got the same reward;
- :func:`unfinished_panel`: rollouts stuck (running longer than a threshold,
  with phase, age, instance) and lost (their process is gone);
- :func:`latest_errors`: the most recent failed rollouts;
- :func:`slowest_tools`: the tools with the longest mean call, per environment
  (``fleet_tool_call`` records; empty when ``telemetry.tool_calls`` is off);
- :func:`admission`: each environment version's circuit breaker, from its
  latest ``fleet_env_quarantined``/``fleet_env_recovered`` event, and the
  learnt create rate's latest changes (``fleet_create_rate``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from fleetroll.telemetry.dashboard_models import (
    Admission,
    BatchReward,
    Breaker,
    Bucket,
    FailedRollout,
    Groups,
    Progress,
    RateChange,
    SlowTool,
    ThroughputPoint,
    Unfinished,
    UnfinishedRollout,
    UniformGroup,
)
from fleetroll.telemetry.queries import QueryResult
from fleetroll.telemetry.writers import process_gone, unfinished

__all__ = [
    "LostRollouts",
    "Panels",
    "admission",
    "batch_rewards",
    "eta",
    "latest_errors",
    "progress",
    "slowest_tools",
    "throughput",
    "unfinished_panel",
    "uniform_groups",
]

Run = Callable[[str, Mapping[str, Any]], QueryResult]

_STARTED, _COMPLETED = "fleet_rollout_started", "fleet_rollout_completed"
#: Rows shown at most in the group and stuck/lost tables.
_ROWS: Final = 50
#: Changes of the learnt create rate shown at most (newest first).
RATE_CHANGES: Final = 20


@dataclass(frozen=True, slots=True)
class Panels:
    """The panels' settings (``telemetry.dashboard_*``)."""

    stuck_after_s: float = 600.0
    eta_window_s: float = 300.0
    errors: int = 20


@dataclass(frozen=True, slots=True)
class LostRollouts:
    """What the other panels need to know of the lost rollouts (not shown as such)."""

    #: Lost rollouts per batch id: the progress counts them out of what remains.
    by_batch: Mapping[str | None, int]
    #: When each lost start is last known to have run, and how many there are:
    #: the timeline stops counting them in flight from there.
    starts: Sequence[tuple[str, int]]


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp()


def eta(
    completions: Sequence[float],
    *,
    now: float,
    started: float,
    remaining: int,
    window_s: float,
) -> tuple[float | None, float | None]:
    """``(rate per second, seconds left)`` from the completions of the last ``window_s``.

    The rate is the completions in ``[max(now - window_s, started), now]``
    over that span: recent, so a slow start (instances warming up) or a stall
    an hour ago does not skew it. ``completions`` are epoch seconds. Seconds
    left: ``remaining / rate``; 0 when nothing remains; None when nothing
    completed in the window (no rate to go by).
    """
    begin = max(now - window_s, started)
    span = now - begin
    recent = sum(1 for t in completions if begin <= t <= now)
    rate = recent / span if span > 0 and recent else None
    if remaining <= 0:
        return rate, 0.0
    return rate, (remaining / rate if rate else None)


def progress(
    run: Run,
    events: str,
    batch: str | None,
    params: Mapping[str, Any],
    *,
    now: float,
    window_s: float,
    lost_by_batch: Mapping[str | None, int],
) -> Progress | None:
    """The current batch (``batch``, or the newest one) against its total.

    The total is the batch's ``fleet_batch_started`` ``total`` (the whole
    batch, resumed runs and shards included); stores written before that
    attribute existed give the ``rollouts`` of its latest start. ``done``
    counts distinct rollout ids completed, so a re-run counts once. The state
    is ``finished`` once ``fleet_batch_completed`` follows its latest start,
    ``lost`` when the process that started it is gone, else ``running``.
    """
    p = {**params, "batch": batch}
    pick = "AND attributes->>'batch_id' = :batch" if batch is not None else ""
    rows = run(
        "SELECT attributes->>'batch_id', MAX(start_timestamp), MIN(start_timestamp), "
        "MAX(attributes->>'total'), attributes->>'rollouts', process_pid, "
        "otel_resource_attributes->>'$.\"host.name\"' FROM records "
        "WHERE message = 'fleet_batch_started' AND service_name = :service "
        f"AND attributes->>'batch_id' IS NOT NULL {pick} "
        "GROUP BY 1 ORDER BY 2 DESC LIMIT 1",
        p,
    ).rows
    if not rows:
        return None
    batch_id, last_start, first_start, total, rollouts, pid, host = rows[0]
    lost = lost_by_batch.get(batch_id, 0)
    p["batch"] = batch_id
    # Each rollout by its latest result (SQLite: the bare column of a MAX() aggregate
    # comes from the row holding the max): one cancelled then re-run is what it became.
    ((done, failed, cancelled),) = run(
        "SELECT COUNT(*), "
        "COUNT(*) FILTER (WHERE failure_reason IS NOT NULL AND failure_reason != 'cancelled'), "
        "COUNT(*) FILTER (WHERE failure_reason = 'cancelled') FROM ("
        f"SELECT failure_reason, MAX(start_timestamp) FROM {events} "
        "WHERE service_name = :service AND batch_id = :batch AND message = :completed "
        "GROUP BY rollout_id)",
        {**p, "completed": _COMPLETED},
    ).rows
    ((finished,),) = run(
        "SELECT COUNT(*) FROM records WHERE service_name = :service "
        "AND attributes->>'batch_id' = :batch AND message = 'fleet_batch_completed' "
        "AND start_timestamp >= :last",
        {**p, "last": last_start},
    ).rows
    recent = [
        _epoch(t)
        for (t,) in run(
            f"SELECT start_timestamp FROM {events} WHERE service_name = :service "
            "AND message = :completed AND batch_id = :batch "
            "AND start_timestamp >= :since",
            {
                **p,
                "completed": _COMPLETED,
                "since": datetime.fromtimestamp(now - window_s, UTC).strftime(
                    "%Y-%m-%dT%H:%M:%S.%fZ"
                ),
            },
        ).rows
    ]
    total = int(total if isinstance(total, int) else rollouts or 0)
    remaining = max(0, total - int(done) - lost)
    rate, left = eta(
        recent, now=now, started=_epoch(last_start), remaining=remaining, window_s=window_s
    )
    state: Literal["running", "finished", "lost"]
    if finished:
        state = "finished"
    elif process_gone(pid if isinstance(pid, int) else None, host, _epoch(last_start)):
        state = "lost"
    else:
        state = "running"
    return Progress(
        batch_id=batch_id,
        total=total,
        done=int(done),
        failed=int(failed),
        cancelled=int(cancelled),
        lost=lost,
        remaining=remaining,
        state=state,
        first_started=first_start,
        started=last_start,
        rate_per_min=rate * 60 if rate is not None else None,
        eta_s=None if state != "running" else left,
        eta_window_s=window_s,
    )


def throughput(buckets: Sequence[Bucket], bucket_s: int) -> list[ThroughputPoint]:
    """Completions per minute in each timeline bucket."""
    return [ThroughputPoint(b.t, b.completed * 60.0 / bucket_s) for b in buckets]


def batch_rewards(
    run: Run, events: str, params: Mapping[str, Any], since: str | None
) -> list[BatchReward]:
    """Each batch's mean reward over its scored rollouts, oldest batch first (at most 50)."""
    after = "AND start_timestamp >= :since" if since is not None else ""
    rows = run(
        "SELECT batch_id, MIN(start_timestamp) AS first, "
        f"AVG(reward), COUNT(reward), COUNT(*) FROM {events} "
        f"WHERE message = '{_COMPLETED}' AND service_name = :service {after} "
        "AND batch_id IS NOT NULL GROUP BY 1 ORDER BY first DESC LIMIT 50",
        params,
    ).rows
    return [
        BatchReward(batch_id=b, t=first, reward_mean=mean, rewarded=int(n), completed=int(c))
        for b, first, mean, n, c in reversed(rows)
    ]


def uniform_groups(run: Run, events: str, where: str, params: Mapping[str, Any]) -> Groups:
    """Groups with two or more scored samples, and those whose rewards are all equal.

    A group is the samples of one task in one batch (its ``group_id`` is
    derived from both: :func:`fleetroll.pool.batch.group_id`), as in
    :mod:`fleetroll.training.groups`: only scored samples (a reward) count.
    """
    # Counted in SQL: a long run has tens of thousands of groups, few of them uniform.
    rows = run(
        "SELECT b, t, n, lo, COUNT(*) OVER (), COALESCE(SUM(lo = hi) OVER (), 0) FROM ("
        "SELECT batch_id AS b, task_key AS t, COUNT(*) AS n, "
        "MIN(reward) AS lo, MAX(reward) AS hi, MAX(start_timestamp) AS last "
        f"FROM {events} WHERE message = '{_COMPLETED}' AND {where} AND reward IS NOT NULL "
        "GROUP BY 1, 2 HAVING n >= 2) ORDER BY lo = hi DESC, last DESC LIMIT :rows",
        {**params, "rows": _ROWS},
    ).rows
    groups = int(rows[0][4]) if rows else 0
    uniform = int(rows[0][5]) if rows else 0
    shown = [
        UniformGroup(batch_id=b, task_key=t, samples=int(n), reward=lo)
        for b, t, n, lo, *_ in rows[:uniform]
    ]
    return Groups(groups=groups, uniform=uniform, rows=shown)


def unfinished_panel(
    run: Run,
    events: str,
    batch: str | None,
    service_name: str,
    *,
    now: float,
    stuck_after_s: float,
) -> tuple[Unfinished, LostRollouts]:
    """Lost rollouts (process gone) and stuck ones (running over ``stuck_after_s``).

    As ``fleetroll stats --check`` tells them apart: a rollout whose lost
    start was run again to completion (``--resume`` after a kill -9) is a
    re-run, neither lost nor in flight, and not in the table; ``rerun``
    counts the rollouts started more than once, as ``--check`` does.
    """
    gaps = unfinished(
        lambda sql, p: run(sql, p).rows, batch_id=batch, service_name=service_name, events=events
    )
    rerun = [g for g in gaps if g.lost and g.completed]
    lost = [g for g in gaps if g.lost and not g.completed]
    rows = [
        UnfinishedRollout(
            rollout_id=g.rollout_id,
            batch_id=g.batch_id,
            env=g.env_key,
            task_key=g.task_key,
            phase=g.phase,
            last_event=g.last_event,
            age_s=max(0.0, now - _epoch(g.started_at)),
            instance_id=g.instance_id,
            pid=g.writer.pid,
            state="lost" if g.lost else "stuck",
        )
        for g in gaps
        if (g.lost and not g.completed)
        or (not g.lost and now - _epoch(g.started_at) >= stuck_after_s)
    ]
    by_batch: dict[str | None, int] = {}
    for g in lost:
        by_batch[g.batch_id] = by_batch.get(g.batch_id, 0) + 1
    shown = Unfinished(
        stuck_after_s=stuck_after_s,
        lost=len(lost),
        rerun=_reruns(run, events, batch, service_name),
        stuck=sum(1 for r in rows if r.state == "stuck"),
        in_flight=sum(1 for g in gaps if not g.lost),
        rows=sorted(rows, key=lambda r: (r.state != "lost", -r.age_s))[:_ROWS],
    )
    starts = [(g.started_at, g.started - g.completed) for g in (*lost, *rerun)]
    return shown, LostRollouts(by_batch=by_batch, starts=starts)


def _reruns(run: Run, events: str, batch: str | None, service_name: str) -> int:
    whole = events == "rollout_events" and batch is None  # as in writers.unfinished
    source = f"{events} INDEXED BY rollout_events_rollout" if whole else events
    pick = "AND batch_id = :batch" if batch is not None else ""
    ((n,),) = run(
        f"SELECT COUNT(*) FROM (SELECT 1 FROM {source} WHERE service_name = :service "
        f"AND message = '{_STARTED}' {pick} GROUP BY rollout_id HAVING COUNT(*) > 1)",
        {"service": service_name, "batch": batch},
    ).rows
    return int(n)


def latest_errors(
    run: Run, events: str, where: str, params: Mapping[str, Any], n: int
) -> list[FailedRollout]:
    """The ``n`` most recent failed rollouts (newest first); cancelled ones did not fail."""
    rows = run(
        "SELECT start_timestamp AS time, rollout_id, batch_id, env_key AS env, "
        f"failure_reason, error_message AS message FROM {events} "
        f"WHERE message = '{_COMPLETED}' AND {where} "
        "AND failure_reason IS NOT NULL AND failure_reason != 'cancelled' "
        "ORDER BY start_timestamp DESC LIMIT :errors",
        {**params, "errors": n},
    ).rows
    return [FailedRollout(*row) for row in rows]


#: Tools shown at most in the slowest-tools panel.
SLOWEST_TOOLS: Final = 10


def slowest_tools(run: Run, params: Mapping[str, Any]) -> list[SlowTool]:
    """The tools whose calls took longest on average (per environment), slowest first.

    ``params`` are the snapshot's (``service``, ``since``, ``batch``; None: any)."""
    where = ["service_name = :service", "message = 'fleet_tool_call'"]
    if params.get("since") is not None:
        where.append("start_timestamp >= :since")
    if params.get("batch") is not None:
        where.append("attributes->>'batch_id' = :batch")
    rows = run(
        "SELECT attributes->>'tool_name' AS tool, attributes->>'env_key' AS env, COUNT(*), "
        "AVG(attributes->>'duration_s') AS mean_s, MAX(attributes->>'duration_s'), "
        "COUNT(*) FILTER (WHERE attributes->>'outcome' != 'ok') "
        f"FROM records WHERE {' AND '.join(where)} "
        "GROUP BY 1, 2 ORDER BY mean_s DESC LIMIT :tools",
        {**params, "tools": SLOWEST_TOOLS},
    ).rows
    return [
        SlowTool(str(tool), env, int(n), float(mean or 0.0), float(top or 0.0), int(bad))
        for tool, env, n, mean, top, bad in rows
    ]


def admission(run: Run, params: Mapping[str, Any], gauges: Mapping[str, Any] | None) -> Admission:
    """Each environment version's breaker (its latest event), the create rate's
    latest changes, and the live gauges if any."""
    # SQLite: the bare columns of a MAX() aggregate come from the row holding the max.
    rows = run(
        "SELECT attributes->>'env_key', attributes->>'env_version', MAX(start_timestamp), "
        "message, attributes->>'failure_share', attributes->>'window' FROM records "
        "WHERE message IN ('fleet_env_quarantined', 'fleet_env_recovered') "
        "AND service_name = :service GROUP BY 1, 2 ORDER BY 3 DESC",
        params,
    ).rows
    envs = [
        Breaker(
            env=f"{key}:{version}" if version else key,
            state="quarantined" if message == "fleet_env_quarantined" else "recovered",
            since=at,
            failure_share=share,
            window=window,
        )
        for key, version, at, message, share, window in rows
    ]
    changes = run(
        "SELECT start_timestamp, attributes->>'creates_per_second', "
        "attributes->>'creates_in_flight_limit', attributes->>'reason' FROM records "
        "WHERE message = 'fleet_create_rate' AND service_name = :service "
        f"ORDER BY start_timestamp DESC LIMIT {RATE_CHANGES}",
        params,
    ).rows
    return Admission(
        envs=envs,
        gauges=dict(gauges) if gauges is not None else None,
        rate_changes=[RateChange(*row) for row in changes],
    )
