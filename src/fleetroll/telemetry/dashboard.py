"""The dashboard: one self-contained page over the local telemetry store.

Two routes, mountable in any Starlette app (the HTTP service adds
:func:`dashboard_routes` to its own; ``fleetroll dashboard`` serves
:func:`dashboard_app` alone):

- ``GET /dashboard``: the page (``dashboard.html``, shipped in this package:
  inline CSS and vanilla JS drawing SVG charts, no network beyond this server);
- ``GET /dashboard/data?since=&batch=``: a JSON snapshot the page polls every
  two seconds (its shape: :class:`~fleetroll.telemetry.dashboard_models.Snapshot`).

- ``GET /dashboard/login?token=``: behind a service token, sets the cookie
  the data requests carry (:mod:`fleetroll.telemetry.dashboard_auth`).

Behind a bearer token (the service's :class:`~fleetroll._internal.guard.Guard`)
the page itself holds no data and stays open (:data:`PAGE_PATHS`); the data
needs the token: the login URL's cookie, or a bearer header the page sends
when opened as ``/dashboard#token=...``. The training-run panels (progress
and ETA, throughput, rewards per batch, uniform groups, stuck and lost
rollouts, errors, admission) are :mod:`fleetroll.telemetry.dashboard_panels`.

Every snapshot is a handful of read-only SQL queries (:func:`queries.query`:
``mode=ro``, an authorizer that allows reading only, a time limit), run in a
worker thread under a :class:`anyio.CapacityLimiter`, so a slow store never
blocks the event loop and a dozen open tabs cannot queue up unbounded work.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cache, partial
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from fleetroll.telemetry import dashboard_panels as panel
from fleetroll.telemetry.dashboard_auth import LOGIN_PATH, login_route
from fleetroll.telemetry.dashboard_models import (
    Admission,
    BatchSeen,
    Bucket,
    Cost,
    CostPanel,
    EnvCost,
    EnvFailures,
    EnvRewards,
    Failures,
    Groups,
    Provisioning,
    Rewards,
    SlowRollout,
    Snapshot,
    Timeline,
    Totals,
    Unfinished,
)
from fleetroll.telemetry.dashboard_panels import Panels, Run
from fleetroll.telemetry.queries import COST_FIELDS, QueryError, query
from fleetroll.telemetry.store import ROLLOUT_EVENTS_FROM_RECORDS, StoreError

if TYPE_CHECKING:
    from pydantic import SecretStr

    from fleetroll.settings import TelemetrySettings

__all__ = [
    "DEFAULT_QUERY_TIMEOUT_S",
    "PAGE_PATHS",
    "SinceError",
    "dashboard_app",
    "dashboard_panels",
    "dashboard_routes",
    "empty_snapshot",
    "parse_since",
    "read_snapshot",
    "snapshot",
]

#: Time limit of each SQL query behind one snapshot (callers pass their setting).
DEFAULT_QUERY_TIMEOUT_S: Final = 10.0
#: The panels' settings when a caller gives none (the shipped defaults).
DEFAULT_PANELS: Final = Panels()
#: At most this many time buckets in the timeline.
_MAX_BUCKETS: Final = 60
#: Bucket widths the timeline picks from, in seconds.
_BUCKET_WIDTHS: Final = (
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
)  # fmt: skip
_SLOWEST: Final = 12
_PROVISIONING_BINS: Final = 20
_REWARD_BINS: Final = 10
_STARTED, _COMPLETED = "fleet_rollout_started", "fleet_rollout_completed"
#: The cost sums of :data:`queries.COST_SUMS_SQL`, over ``rollout_events``' columns.
_COST_SUMS: Final = ", ".join(f"COALESCE(SUM({name}), 0) AS {name}" for name in COST_FIELDS)
#: A reward that is a number (a result's reward is a number or null).
_REWARD: Final = "(CASE WHEN typeof(reward) IN ('integer', 'real') THEN reward END)"
#: A provisioning time that is a number.
_PROVISIONED: Final = (
    "(CASE WHEN typeof(provisioning_time_s) IN ('integer', 'real') THEN provisioning_time_s END)"
)
#: Its histogram bin: ``:bins`` bins of ``:width`` from ``:lo`` (the last one closed).
_BIN: Final = f"MIN(:bins - 1, MAX(0, CAST(({_REWARD} - :lo) / :width AS INTEGER)))"
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNITS: Final = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class SinceError(ValueError):
    """A ``since`` value that is neither a duration (``15m``) nor an ISO 8601 time."""


def parse_since(text: str, *, now: datetime | None = None) -> str:
    """``since`` as the store's timestamp text (UTC, microseconds, ``Z``).

    Accepts a duration back from now (``90s``, ``15m``, ``6h``, ``7d``) or an
    ISO 8601 time (without an offset: UTC).

    Raises:
        SinceError: neither; the message says what is accepted.
    """
    match = _RELATIVE.match(text)
    try:
        if match:
            amount, unit = float(match.group(1)), _UNITS[match.group(2)]
            when = (now or datetime.now(UTC)) - timedelta(**{unit: amount})
        else:
            try:
                when = datetime.fromisoformat(text.strip())
            except ValueError:
                raise SinceError(
                    f"since={text!r} is not a time: give a duration back from now "
                    "(90s, 15m, 6h, 7d) or an ISO 8601 time (2026-01-01T12:00:00Z)"
                ) from None
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
        return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    except OverflowError:  # 99999999999d, or 0001-01-01T00:00+05:00 in UTC
        raise SinceError(
            f"since={text!r} is before year 1 or after year 9999: give a shorter duration"
        ) from None


# -- the snapshot ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Scope:
    """What one snapshot reads: the rollouts' events table, and which of its rows."""

    run: Run
    #: ``rollout_events``, or the same columns read from ``records`` (an older store).
    events: str
    #: The SQL condition picking the rows in view (service, ``since``, ``batch``).
    where: str
    params: Mapping[str, Any]
    since: str | None

    @property
    def completions(self) -> str:
        """The rows of the completions in view (``FROM`` ...)."""
        return f"{self.events} WHERE message = '{_COMPLETED}' AND {self.where}"


def _scope(run: Run, since: str | None, batch: str | None, service_name: str) -> _Scope:
    """The rows of ``service_name`` since ``since`` in ``batch`` (None: any)."""
    clauses = ["service_name = :service"]
    if since is not None:
        clauses.append("start_timestamp >= :since")
    if batch is not None:
        clauses.append("batch_id = :batch")
    # The rollouts' events as small rows (no JSON to parse), unless the store
    # predates that table: then the same columns, read from records.
    events = (
        "rollout_events"
        if run(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'rollout_events'", {}
        ).rows
        else ROLLOUT_EVENTS_FROM_RECORDS
    )
    params = {"service": service_name, "since": since, "batch": batch}
    return _Scope(run, events, " AND ".join(clauses), params, since)


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp()


def _nice_step(span: float, bins: int) -> float:
    """A round bin width (1, 2 or 5 times a power of ten) giving at most ``bins`` bins."""
    if span <= 0:
        return 1.0
    raw = span / bins
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return float(factor * power)
    return float(10 * power)  # pragma: no cover - the loop always returns


def read_snapshot(
    db: str | os.PathLike[str],
    *,
    since: str | None = None,
    batch: str | None = None,
    service_name: str = "fleetroll",
    timeout_s: float | None = DEFAULT_QUERY_TIMEOUT_S,
    panels: Panels = DEFAULT_PANELS,
    gauges: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> Snapshot:
    """Everything the page draws, from the store at ``db`` (blocking: run it in a thread).

    ``since`` is a store timestamp (see :func:`parse_since`); ``batch`` a batch
    id; ``gauges`` the live admission gauges (the service's). ``now`` (epoch
    seconds) is for tests. What each panel holds: :class:`Snapshot`.

    Raises:
        StoreError: there is no store at ``db``, or it cannot be read.
        QueryError: a query failed or ran over ``timeout_s``.
    """
    run = partial(query, db, timeout_s=timeout_s, dialect="sqlite")  # its own SQL, as written
    scope = _scope(run, since, batch, service_name)
    at = datetime.now(UTC).timestamp() if now is None else now
    unfinished, lost = panel.unfinished_panel(
        run, scope.events, batch, service_name, now=at, stuck_after_s=panels.stuck_after_s
    )
    timeline = _forget_lost_starts(_timeline(scope), lost.starts)
    by_env = _completions(scope)
    return Snapshot(
        generated_at=_now(),
        since=since,
        batch=batch,
        batches=_batches(scope),
        totals=_totals(timeline, by_env, unfinished),
        timeline=timeline,
        failures=Failures(
            reasons=sorted({reason for env in by_env.values() for reason in env.reasons}),
            envs=[env.failures() for env in by_env.values()],
        ),
        provisioning=_provisioning(scope),
        rewards=_rewards(scope, by_env),
        slowest=_slowest(scope),
        slowest_tools=panel.slowest_tools(run, scope.params),
        cost=_cost([by_env[env].cost() for env in sorted(by_env)]),
        progress=panel.progress(
            run,
            scope.events,
            batch,
            scope.params,
            now=at,
            window_s=panels.eta_window_s,
            lost_by_batch=lost.by_batch,
        ),
        throughput=panel.throughput(timeline.buckets, timeline.bucket_s),
        batch_rewards=panel.batch_rewards(run, scope.events, scope.params, since),
        groups=panel.uniform_groups(run, scope.events, scope.where, scope.params),
        unfinished=unfinished,
        errors=panel.latest_errors(run, scope.events, scope.where, scope.params, panels.errors),
        admission=panel.admission(run, scope.params, gauges),
    )


def snapshot(db: str | os.PathLike[str], **options: Any) -> dict[str, Any]:
    """``read_snapshot(db, **options)`` as JSON: what ``GET /dashboard/data`` answers.

    Raises:
        StoreError: there is no store at ``db``, or it cannot be read.
        QueryError: a query failed or ran over ``timeout_s``.
    """
    return read_snapshot(db, **options).as_json()


def _batches(scope: _Scope) -> list[BatchSeen]:
    """The batches of the service (all of them, whatever the filters), newest 50 first."""
    return [
        BatchSeen(batch_id=b, started=int(n), first_seen=first)
        for b, n, first in scope.run(
            f"SELECT batch_id, COUNT(*), MIN(start_timestamp) FROM {scope.events} "
            f"WHERE message = '{_STARTED}' AND service_name = :service "
            "AND batch_id IS NOT NULL GROUP BY 1 ORDER BY 3 DESC LIMIT 50",
            scope.params,
        ).rows
    ]


def _timeline(scope: _Scope) -> Timeline:
    """Starts, completions and rollouts in flight over time, in at most 60 buckets."""
    run, events, where, params = scope.run, scope.events, scope.where, scope.params
    # One MIN or MAX per event name: each a step down rollout_events' key, where
    # the two names at once would read every row.
    ends = " UNION ALL ".join(
        f"SELECT {f}(start_timestamp) AS t FROM {events} WHERE message = '{m}' AND {where}"
        for m in (_STARTED, _COMPLETED)
        for f in ("MIN", "MAX")
    )
    (first, last), *_ = run(f"SELECT MIN(t), MAX(t) FROM ({ends})", params).rows
    if first is None:
        return Timeline(bucket_s=1, buckets=[])
    start, end = _epoch(first), _epoch(last)
    width = next(
        (w for w in _BUCKET_WIDTHS if (end - start) / w < _MAX_BUCKETS), _BUCKET_WIDTHS[-1]
    )
    rows = run(
        f"""
        SELECT CAST((julianday(start_timestamp) - 2440587.5) * 86400.0 / :width AS INTEGER),
            COUNT(*) FILTER (WHERE message = '{_STARTED}'),
            COUNT(*) FILTER (WHERE message = '{_COMPLETED}')
        FROM {events} WHERE message IN ('{_STARTED}', '{_COMPLETED}') AND {where}
        GROUP BY 1 ORDER BY 1
        """,
        {**params, "width": width},
    ).rows
    # Rollouts started before the window and still running are in flight in it too.
    in_flight = 0
    if scope.since is not None:
        before = where.replace("start_timestamp >= :since", "start_timestamp < :since")
        ((in_flight,),) = run(
            f"SELECT COUNT(*) FILTER (WHERE message = '{_STARTED}') "
            f"- COUNT(*) FILTER (WHERE message = '{_COMPLETED}') "
            f"FROM {events} WHERE message IN ('{_STARTED}', '{_COMPLETED}') AND {before}",
            params,
        ).rows
    counts = {int(bucket): (int(s), int(c)) for bucket, s, c in rows}
    buckets, started, completed = [], 0, 0
    for bucket in range(min(counts), max(counts) + 1):
        s, c = counts.get(bucket, (0, 0))
        started, completed, in_flight = started + s, completed + c, in_flight + s - c
        buckets.append(
            Bucket(
                t=_iso(bucket * width),
                started=s,
                completed=c,
                started_total=started,
                completed_total=completed,
                in_flight=max(0, in_flight),
            )
        )
    return Timeline(bucket_s=width, buckets=buckets)


def _forget_lost_starts(timeline: Timeline, lost_starts: Sequence[tuple[str, int]]) -> Timeline:
    """Take lost starts out of the timeline's in-flight counts, from when each was last seen.

    A start whose process is gone never gets its completion: without this,
    every rollout of a killed run stays in flight on the chart for good.
    """
    buckets, bucket_s = timeline.buckets, timeline.bucket_s
    if not buckets:
        return timeline
    first = int(_epoch(buckets[0].t) // bucket_s)
    drop = [0] * len(buckets)
    for started_at, n in lost_starts:
        index = max(0, int(_epoch(started_at) // bucket_s) - first)
        if index < len(buckets):
            drop[index] += n
    kept, gone = [], 0
    for bucket, n in zip(buckets, drop, strict=True):
        gone += n
        kept.append(replace(bucket, in_flight=max(0, bucket.in_flight - gone)))
    return Timeline(bucket_s=bucket_s, buckets=kept)


@dataclass(slots=True)
class _EnvCompletions:
    """One environment's completions, as the sweep of :func:`_completions` adds them up."""

    env: str
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    costs: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COST_FIELDS, 0))
    #: Scored rollouts per tenth of [0, 1] (rewards beyond it: the first or last).
    unit_bins: list[int] = field(default_factory=lambda: [0] * _REWARD_BINS)
    #: Its numeric rewards: how many, their sum, the lowest and the highest.
    scored: int = 0
    reward_sum: float = 0.0
    reward_lo: float = math.inf
    reward_hi: float = -math.inf

    def add(self, row: Mapping[str, Any]) -> None:
        """Count one row of the sweep (one failure reason and reward bin)."""
        n, reason = row["n"], row["failure_reason"]
        self.completed += n
        if reason == "cancelled":
            self.cancelled += n  # not let finish: it did not fail
        elif reason is not None:
            self.failed += n
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        if row["bin"] is not None:
            self.unit_bins[row["bin"]] += row["r_n"]
        for name in COST_FIELDS:
            self.costs[name] += row[name]
        if row["r_n"]:
            self.scored += row["r_n"]
            self.reward_sum += row["r_sum"]
            self.reward_lo = min(self.reward_lo, row["r_lo"])
            self.reward_hi = max(self.reward_hi, row["r_hi"])

    def failures(self) -> EnvFailures:
        return EnvFailures(
            env=self.env,
            completed=self.completed,
            failed=self.failed,
            reasons=self.reasons,
            cancelled=self.cancelled,
        )

    def cost(self) -> EnvCost:
        return EnvCost(env=self.env, completed=self.completed, **self.costs)


def _completions(scope: _Scope) -> dict[str, _EnvCompletions]:
    """Failures, rewards (binned as if in [0, 1]) and costs per env, in one sweep over
    the completions; the envs in order."""
    by_env: dict[str, _EnvCompletions] = {}
    for row in scope.run(
        f"SELECT COALESCE(env_key, '?') AS env, failure_reason, {_BIN} AS bin, COUNT(*) AS n, "
        f"COUNT({_REWARD}) AS r_n, SUM({_REWARD}) AS r_sum, MIN({_REWARD}) AS r_lo, "
        f"MAX({_REWARD}) AS r_hi, {_COST_SUMS} FROM {scope.completions} "
        "GROUP BY 1, 2, 3 ORDER BY 1",
        {**scope.params, "bins": _REWARD_BINS, "lo": 0.0, "width": 1.0 / _REWARD_BINS},
    ).dicts():
        by_env.setdefault(row["env"], _EnvCompletions(row["env"])).add(row)
    return by_env


def _totals(
    timeline: Timeline, by_env: Mapping[str, _EnvCompletions], unfinished: Unfinished
) -> Totals:
    completed = sum(env.completed for env in by_env.values())
    failed = sum(env.failed for env in by_env.values())
    cancelled = sum(env.cancelled for env in by_env.values())
    ran = completed - cancelled  # those let finish: the failure rate's base
    scored = sum(env.scored for env in by_env.values())
    return Totals(
        started=sum(b.started for b in timeline.buckets),
        completed=completed,
        in_flight=unfinished.in_flight,
        lost=unfinished.lost,
        rerun=unfinished.rerun,
        failed=failed,
        cancelled=cancelled,
        failed_pct=100.0 * failed / ran if ran else None,
        reward_mean=sum(env.reward_sum for env in by_env.values()) / scored if scored else None,
        rewarded=scored,
    )


def _rewards(scope: _Scope, by_env: Mapping[str, _EnvCompletions]) -> Rewards:
    """Each env's scored rollouts, binned over [0, 1] or, beyond it, over all their range."""
    scored = {name: env for name, env in sorted(by_env.items()) if env.scored}
    # Rewards are usually in [0, 1]: keep that range so envs and polls compare.
    lo = float(min([0.0, *(env.reward_lo for env in scored.values())]))
    hi = float(max([1.0, *(env.reward_hi for env in scored.values())]))
    width = (hi - lo) / _REWARD_BINS
    bins = {name: env.unit_bins for name, env in scored.items()}
    if (lo, hi) != (0.0, 1.0):  # rewards beyond [0, 1]: bin them again over their range
        bins = {name: [0] * _REWARD_BINS for name in scored}
        for name, index, n in scope.run(
            f"SELECT COALESCE(env_key, '?'), {_BIN}, COUNT(*) FROM {scope.completions} "
            f"AND {_REWARD} IS NOT NULL GROUP BY 1, 2",
            {**scope.params, "bins": _REWARD_BINS, "lo": lo, "width": width},
        ).rows:
            bins[name][index] = n
    return Rewards(
        envs=[
            EnvRewards(
                env=name,
                count=env.scored,
                mean=env.reward_sum / env.scored,
                bins=[(lo + i * width, lo + (i + 1) * width, n) for i, n in enumerate(bins[name])],
            )
            for name, env in scored.items()
        ]
    )


def _slowest(scope: _Scope) -> list[SlowRollout]:
    return [
        SlowRollout(*row)
        for row in scope.run(
            "SELECT rollout_id, task_key, env_key, duration_s AS d, failure_reason, reward, "
            f"start_timestamp FROM {scope.completions} AND d IS NOT NULL "
            "ORDER BY d DESC LIMIT :limit",
            {**scope.params, "limit": _SLOWEST},
        ).rows
    ]


def _cost(envs: list[EnvCost]) -> CostPanel:
    total = {name: sum(getattr(env, name) for env in envs) for name in ("completed", *COST_FIELDS)}
    return CostPanel(envs=envs, total=Cost(**total))


def _provisioning(scope: _Scope) -> Provisioning:
    """How long instances took to be ready: count, p50, p95, max and a histogram.

    Counted, ranked and binned in SQL: a long run has a provisioning time per
    rollout, too many to carry into Python at every poll.
    """
    run, params = scope.run, scope.params
    of = f"FROM {scope.events} WHERE message = 'fleet_provisioning_completed' AND {scope.where}"
    ((count, high),) = run(f"SELECT COUNT({_PROVISIONED}), MAX({_PROVISIONED}) {of}", params).rows
    if not count:
        return Provisioning(count=0, p50_s=None, p95_s=None, max_s=None, bins=[])
    # As percentile(): linear interpolation between the two closest ranks.
    ranks = {}
    for q in (0.50, 0.95):
        position = (count - 1) * q
        ranks[q] = (position, math.floor(position), math.ceil(position))
    numbers = "typeof(provisioning_time_s) IN ('integer', 'real')"
    at: dict[int, float] = {}
    for _, low, up in ranks.values():  # a walk down the index to each rank
        values = run(
            f"SELECT provisioning_time_s {of} AND {numbers} "
            "ORDER BY provisioning_time_s LIMIT :n OFFSET :low",
            {**params, "n": up - low + 1, "low": low},
        ).rows
        at |= {low + i: v for i, (v,) in enumerate(values)}
    quantiles = {
        q: at[low] + (at[up] - at[low]) * (position - low)
        for q, (position, low, up) in ranks.items()
    }
    step = _nice_step(high, _PROVISIONING_BINS)
    bins = math.ceil(high / step) if high > 0 else 1
    width = bins * step / bins  # the bins' range split in equal parts, as drawn
    counts = [0] * bins
    for index, n in run(
        f"SELECT MIN(:bins - 1, MAX(0, CAST({_PROVISIONED} / :width AS INTEGER))), COUNT(*) "
        f"{of} AND {_PROVISIONED} IS NOT NULL GROUP BY 1",
        {**params, "bins": bins, "width": width},
    ).rows:
        counts[index] = n
    return Provisioning(
        count=count,
        p50_s=float(quantiles[0.50]),
        p95_s=float(quantiles[0.95]),
        max_s=float(high),
        bins=[(i * width, (i + 1) * width, n) for i, n in enumerate(counts)],
    )


def empty_snapshot(
    since: str | None,
    batch: str | None,
    note: str,
    panels: Panels,
    gauges: Mapping[str, Any] | None = None,
) -> Snapshot:
    """The snapshot of a store with nothing in it (or none at all), saying why in ``note``."""
    return Snapshot(
        generated_at=_now(),
        since=since,
        batch=batch,
        note=note,
        batches=[],
        totals=Totals(),
        timeline=Timeline(bucket_s=1, buckets=[]),
        failures=Failures(reasons=[], envs=[]),
        provisioning=Provisioning(count=0, p50_s=None, p95_s=None, max_s=None, bins=[]),
        rewards=Rewards(envs=[]),
        slowest=[],
        slowest_tools=[],
        cost=CostPanel(envs=[], total=Cost()),
        progress=None,
        throughput=[],
        batch_rewards=[],
        groups=Groups(groups=0, uniform=0, rows=[]),
        unfinished=Unfinished(
            stuck_after_s=panels.stuck_after_s, lost=0, rerun=0, stuck=0, in_flight=0, rows=[]
        ),
        errors=[],
        admission=Admission(envs=[], gauges=dict(gauges) if gauges is not None else None),
    )


# -- routes ----------------------------------------------------------------------------


def dashboard_panels(t: TelemetrySettings) -> Panels:
    """The panels' settings from ``telemetry.dashboard_*``."""
    return Panels(
        stuck_after_s=t.dashboard_stuck_after_s,
        eta_window_s=t.dashboard_eta_window_s,
        errors=t.dashboard_errors,
    )


@cache
def page() -> str:
    """The dashboard page (a package resource)."""
    return (files("fleetroll.telemetry") / "dashboard.html").read_text(encoding="utf-8")


def _invalid(loc: list[str], message: str) -> JSONResponse:
    # The service's validation error shape, so clients handle one kind of 422.
    return JSONResponse({"detail": [{"loc": loc, "msg": message, "type": "value_error"}]}, 422)


#: Paths that serve no telemetry (the page, and ``/`` leading to it): a browser
#: opens them without an Authorization header, so a token guard lets them through.
PAGE_PATHS: Final = frozenset({"/", "/dashboard", LOGIN_PATH})


def dashboard_routes(
    db_path: str | os.PathLike[str],
    *,
    service_name: str = "fleetroll",
    query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
    limiter: anyio.CapacityLimiter | None = None,
    panels: Panels = DEFAULT_PANELS,
    gauges: Callable[[], Mapping[str, Any]] | None = None,
    token: SecretStr | None = None,
) -> list[Route]:
    """``GET /dashboard``, ``/dashboard/data`` and ``/dashboard/login``, for a Starlette app.

    Args:
        db_path: the telemetry store (it may not exist yet: the page says "no data yet").
        service_name: whose records to show.
        query_timeout_s: time limit of each SQL query.
        limiter: bounds the worker threads running queries (default: two, for these routes).
        panels: the training-run panels' settings (``telemetry.dashboard_*``).
        gauges: the admission gauges of ``/metrics``, read at each snapshot
            (the service's; None elsewhere).
        token: the service token the login URL checks (see
            :mod:`fleetroll.telemetry.dashboard_auth`); the guard in front must
            accept :func:`~fleetroll.telemetry.dashboard_auth.cookie_authorizer`'s cookie.
    """
    db = Path(db_path)
    store_readers = limiter or anyio.CapacityLimiter(2)

    async def dashboard(request: Request) -> Response:
        return HTMLResponse(page(), headers={"Cache-Control": "no-store"})

    async def data(request: Request) -> Response:
        live = gauges() if gauges is not None else None
        raw_since = request.query_params.get("since") or None
        batch = request.query_params.get("batch") or None
        since = None
        if raw_since is not None:
            try:
                since = parse_since(raw_since)
            except SinceError as exc:
                return _invalid(["query", "since"], str(exc))
        try:
            answer = await anyio.to_thread.run_sync(
                partial(
                    snapshot,
                    db,
                    since=since,
                    batch=batch,
                    service_name=service_name,
                    timeout_s=query_timeout_s,
                    panels=panels,
                    gauges=live,
                ),
                limiter=store_readers,
            )
        except QueryError as exc:
            return JSONResponse({"detail": str(exc)}, 503)
        except StoreError as exc:
            # No store yet (nothing has run): an empty dashboard, with the reason.
            answer = empty_snapshot(since, batch, str(exc), panels, live).as_json()
        return JSONResponse(answer, headers={"Cache-Control": "no-store"})

    return [
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/data", data, methods=["GET"]),
        login_route(token),
    ]


def dashboard_app(
    db_path: str | os.PathLike[str],
    *,
    service_name: str = "fleetroll",
    query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
    panels: Panels = DEFAULT_PANELS,
    token: SecretStr | None = None,
) -> Starlette:
    """The dashboard alone (``fleetroll dashboard``): its routes, and ``/`` leading to it."""

    async def root(request: Request) -> Response:
        return RedirectResponse("dashboard")

    routes = dashboard_routes(
        db_path,
        service_name=service_name,
        query_timeout_s=query_timeout_s,
        panels=panels,
        token=token,
    )
    return Starlette(routes=[Route("/", root, methods=["GET"]), *routes])
