"""The dashboard: one self-contained page over the local telemetry store.

Two routes, mountable in any Starlette app (the HTTP service adds
:func:`dashboard_routes` to its own; ``fleetroll dashboard`` serves
:func:`dashboard_app` alone):

- ``GET /dashboard``: the page (``dashboard.html``, shipped in this package:
  inline CSS and vanilla JS drawing SVG charts, no network beyond this server);
- ``GET /dashboard/data?since=&batch=``: a JSON snapshot the page polls every
  two seconds (see :func:`snapshot` for its shape).

- ``GET /dashboard/login?token=``: behind a service token, sets the cookie
  the data requests carry (:mod:`fleetroll.telemetry.dashboard_auth`).

Behind a bearer token (the service's :class:`~fleetroll._guard.Guard`)
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
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
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
from fleetroll.telemetry.dashboard_panels import Panels
from fleetroll.telemetry.queries import COST_FIELDS, QueryError, QueryResult, query
from fleetroll.telemetry.store import ROLLOUT_EVENTS_FROM_RECORDS, StoreError

if TYPE_CHECKING:
    from pydantic import SecretStr

    from fleetroll.settings import Settings

__all__ = [
    "DEFAULT_QUERY_TIMEOUT_S",
    "PAGE_PATHS",
    "SinceError",
    "dashboard_app",
    "dashboard_panels",
    "dashboard_routes",
    "parse_since",
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


def _where(since: str | None, batch: str | None) -> str:
    clauses = ["service_name = :service"]
    if since is not None:
        clauses.append("start_timestamp >= :since")
    if batch is not None:
        clauses.append("batch_id = :batch")
    return " AND ".join(clauses)


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def _histogram(values: Sequence[float], lo: float, hi: float, bins: int) -> list[list[float]]:
    """``[[lo, hi], ...]`` edges and counts: ``bins`` equal bins, the last one closed."""
    width = (hi - lo) / bins if hi > lo else 1.0
    counts = [0] * bins
    for value in values:
        index = min(bins - 1, max(0, int((value - lo) / width)))
        counts[index] += 1
    return [[lo + i * width, lo + (i + 1) * width, counts[i]] for i in range(bins)]


def _timeline(
    run: Callable[[str, Mapping[str, Any]], QueryResult],
    events: str,
    where: str,
    params: Mapping[str, Any],
    since: str | None,
) -> tuple[int, list[dict[str, Any]]]:
    # One MIN or MAX per event name: each a step down rollout_events' key, where
    # the two names at once would read every row.
    ends = " UNION ALL ".join(
        f"SELECT {f}(start_timestamp) AS t FROM {events} WHERE message = '{m}' AND {where}"
        for m in (_STARTED, _COMPLETED)
        for f in ("MIN", "MAX")
    )
    (first, last), *_ = run(f"SELECT MIN(t), MAX(t) FROM ({ends})", params).rows
    if first is None:
        return 1, []
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
    if since is not None:
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
            {
                "t": _iso(bucket * width),
                "started": s,
                "completed": c,
                "started_total": started,
                "completed_total": completed,
                "in_flight": max(0, in_flight),
            }
        )
    return width, buckets


def snapshot(
    db: str | os.PathLike[str],
    *,
    since: str | None = None,
    batch: str | None = None,
    service_name: str = "fleetroll",
    timeout_s: float | None = DEFAULT_QUERY_TIMEOUT_S,
    panels: Panels = DEFAULT_PANELS,
    gauges: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Everything the page draws, from the store at ``db`` (blocking: run it in a thread).

    ``since`` is a store timestamp (see :func:`parse_since`); ``batch`` a batch
    id. The answer::

        {"generated_at": iso, "since": iso|null, "batch": str|null,
         "batches": [{"batch_id", "started", "first_seen"}],      # newest first
         "totals": {"started", "completed", "in_flight", "lost", "rerun", "failed",
                    "failed_pct", "reward_mean", "rewarded"},
         "timeline": {"bucket_s", "buckets": [{"t", "started", "completed",
                      "started_total", "completed_total", "in_flight"}]},
         "failures": {"reasons": [str], "envs": [{"env", "completed", "failed",
                      "reasons": {reason: n}}]},
         "provisioning": {"count", "p50_s", "p95_s", "max_s", "bins": [[lo, hi, n]]},
         "rewards": {"envs": [{"env", "count", "mean", "bins": [[lo, hi, n]]}]},
         "slowest": [{"rollout_id", "task_key", "env", "duration_s",
                      "failure_reason", "reward", "time"}],
         "cost": {"envs": [{"env", "completed", "instance_s", "prompt_tokens",
                            "completion_tokens", "policy_calls", "tool_calls"}],
                  "total": {the same but "env"}},   # the results' cost, summed
         "progress": {"batch_id", "total", "done", "failed", "lost", "remaining",
                      "state": "running"|"finished"|"lost", "first_started", "started",
                      "rate_per_min", "eta_s", "eta_window_s"} | null,
         "throughput": [{"t", "per_min"}],                 # the timeline's buckets
         "batch_rewards": [{"batch_id", "t", "reward_mean", "rewarded", "completed"}],
         "groups": {"groups", "uniform", "rows": [{"batch_id", "task_key", "samples",
                    "reward"}]},                          # uniform-reward groups
         "unfinished": {"stuck_after_s", "lost", "rerun", "stuck", "in_flight",
                        "rows": [{"rollout_id", "batch_id", "env", "task_key", "phase",
                                  "last_event", "age_s", "instance_id", "pid",
                                  "state": "lost"|"stuck"}]},
         "errors": [{"time", "rollout_id", "batch_id", "env", "failure_reason", "message"}],
         "admission": {"envs": [{"env", "state", "since", "failure_share", "window"}],
                       "gauges": {"limit", "in_use", ...} | null}}

    A batch's cost totals are ``cost.total`` with ``batch`` given. The
    progress is of ``batch``, or else of the newest batch; ``totals.lost``
    counts rollouts whose process is gone (:mod:`fleetroll.telemetry.writers`),
    which ``totals.in_flight`` leaves out; ``totals.rerun`` those whose lost
    start ran again to completion (``--resume`` after a kill -9), neither
    lost nor in flight, as ``fleetroll stats --check`` counts them. ``now``
    (epoch seconds) is for tests.

    Raises:
        StoreError: there is no store at ``db``, or it cannot be read.
        QueryError: a query failed or ran over ``timeout_s``.
    """
    run = partial(query, db, timeout_s=timeout_s, dialect="sqlite")  # its own SQL, as written
    where = _where(since, batch)
    params: dict[str, Any] = {"service": service_name, "since": since, "batch": batch}
    # The rollouts' events as small rows (no JSON to parse), unless the store
    # predates that table: then the same columns, read from records.
    events = (
        "rollout_events"
        if run(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'rollout_events'", {}
        ).rows
        else ROLLOUT_EVENTS_FROM_RECORDS
    )

    batches = [
        {"batch_id": b, "started": int(n), "first_seen": first}
        for b, n, first in run(
            f"SELECT batch_id, COUNT(*), MIN(start_timestamp) FROM {events} "
            f"WHERE message = '{_STARTED}' AND service_name = :service "
            "AND batch_id IS NOT NULL GROUP BY 1 ORDER BY 3 DESC LIMIT 50",
            params,
        ).rows
    ]
    bucket_s, buckets = _timeline(run, events, where, params, since)

    # Failures, rewards (binned as if in [0, 1]) and costs per env in one sweep
    # over the completions.
    reasons: set[str] = set()
    envs: dict[str, dict[str, Any]] = {}
    costs: dict[str, dict[str, Any]] = {}
    rewarded: dict[str, list[float]] = {}  # env → [count, sum, min, max]
    unit_bins: dict[str, list[int]] = defaultdict(lambda: [0] * _REWARD_BINS)
    for row in run(
        f"SELECT COALESCE(env_key, '?') AS env, failure_reason, {_BIN} AS bin, COUNT(*) AS n, "
        f"COUNT({_REWARD}) AS r_n, SUM({_REWARD}) AS r_sum, MIN({_REWARD}) AS r_lo, "
        f"MAX({_REWARD}) AS r_hi, {_COST_SUMS} FROM {events} "
        f"WHERE message = '{_COMPLETED}' AND {where} GROUP BY 1, 2, 3 ORDER BY 1",
        {**params, "bins": _REWARD_BINS, "lo": 0.0, "width": 1.0 / _REWARD_BINS},
    ).dicts():
        env, reason, n = row["env"], row["failure_reason"], row["n"]
        entry = envs.setdefault(env, {"env": env, "completed": 0, "failed": 0, "reasons": {}})
        entry["completed"] += n
        if reason is not None:
            entry["failed"] += n
            entry["reasons"][reason] = entry["reasons"].get(reason, 0) + n
            reasons.add(reason)
        if row["bin"] is not None:
            unit_bins[env][row["bin"]] += row["r_n"]
        cost = costs.setdefault(env, {"env": env, "completed": 0, **dict.fromkeys(COST_FIELDS, 0)})
        cost["completed"] += n
        for name in COST_FIELDS:
            cost[name] += row[name]
        if row["r_n"]:
            seen = rewarded.setdefault(env, [0, 0.0, row["r_lo"], row["r_hi"]])
            seen[0] += row["r_n"]
            seen[1] += row["r_sum"]
            seen[2], seen[3] = min(seen[2], row["r_lo"]), max(seen[3], row["r_hi"])

    provisioning = _provisioning(run, events, where, params)
    # Rewards are usually in [0, 1]: keep that range so envs and polls compare.
    r_lo = float(min([0.0, *(seen[2] for seen in rewarded.values())]))
    r_hi = float(max([1.0, *(seen[3] for seen in rewarded.values())]))
    r_width = (r_hi - r_lo) / _REWARD_BINS
    reward_bins = {env: unit_bins[env] for env in rewarded}
    if (r_lo, r_hi) != (0.0, 1.0):  # rewards beyond [0, 1]: bin them again over their range
        reward_bins = {env: [0] * _REWARD_BINS for env in rewarded}
        for env, index, n in run(
            f"SELECT COALESCE(env_key, '?'), {_BIN}, COUNT(*) FROM {events} "
            f"WHERE message = '{_COMPLETED}' AND {where} AND {_REWARD} IS NOT NULL GROUP BY 1, 2",
            {**params, "bins": _REWARD_BINS, "lo": r_lo, "width": r_width},
        ).rows:
            reward_bins[env][index] = n
    rewarded_n = sum(int(seen[0]) for seen in rewarded.values())

    slowest = [
        {
            "rollout_id": rid,
            "task_key": task,
            "env": env,
            "duration_s": duration,
            "failure_reason": reason,
            "reward": reward,
            "time": time,
        }
        for rid, task, env, duration, reason, reward, time in run(
            "SELECT rollout_id, task_key, env_key, duration_s AS d, failure_reason, reward, "
            f"start_timestamp FROM {events} "
            f"WHERE message = '{_COMPLETED}' AND {where} AND d IS NOT NULL "
            "ORDER BY d DESC LIMIT :limit",
            {**params, "limit": _SLOWEST},
        ).rows
    ]

    cost_envs = [costs[env] for env in sorted(costs)]

    started = sum(b["started"] for b in buckets)
    completed = sum(e["completed"] for e in envs.values())
    failed = sum(e["failed"] for e in envs.values())
    at = datetime.now(UTC).timestamp() if now is None else now
    gaps = panel.unfinished_panel(
        run, events, batch, service_name, now=at, stuck_after_s=panels.stuck_after_s
    )
    lost_by_batch = gaps.pop("lost_by_batch")
    _forget_lost_starts(buckets, bucket_s, gaps.pop("lost_starts"))
    live = {
        "progress": panel.progress(
            run,
            events,
            batch,
            params,
            now=at,
            window_s=panels.eta_window_s,
            lost_by_batch=lost_by_batch,
        ),
        "throughput": panel.throughput(buckets, bucket_s),
        "batch_rewards": panel.batch_rewards(run, events, params, since),
        "groups": panel.uniform_groups(run, events, where, params),
        "unfinished": gaps,
        "errors": panel.latest_errors(run, events, where, params, panels.errors),
        "admission": panel.admission(run, params, gauges),
    }
    return {
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "since": since,
        "batch": batch,
        "batches": batches,
        "totals": {
            "started": started,
            "completed": completed,
            "in_flight": gaps["in_flight"],
            "lost": gaps["lost"],
            "rerun": gaps["rerun"],
            "failed": failed,
            "failed_pct": 100.0 * failed / completed if completed else None,
            "reward_mean": sum(seen[1] for seen in rewarded.values()) / rewarded_n
            if rewarded_n
            else None,
            "rewarded": rewarded_n,
        },
        "timeline": {"bucket_s": bucket_s, "buckets": buckets},
        "failures": {"reasons": sorted(reasons), "envs": list(envs.values())},
        "provisioning": provisioning,
        "rewards": {
            "envs": [
                {
                    "env": env,
                    "count": int(count),
                    "mean": total / count,
                    "bins": [
                        [r_lo + i * r_width, r_lo + (i + 1) * r_width, n]
                        for i, n in enumerate(reward_bins[env])
                    ],
                }
                for env, (count, total, _, _) in sorted(rewarded.items())
            ]
        },
        "slowest": slowest,
        "cost": {"envs": cost_envs, "total": _cost_total(cost_envs)},
        **live,
    }


def _provisioning(
    run: Callable[[str, Mapping[str, Any]], QueryResult],
    events: str,
    where: str,
    params: Mapping[str, Any],
) -> dict[str, Any]:
    """How long instances took to be ready: count, p50, p95, max and a histogram.

    Counted, ranked and binned in SQL: a long run has a provisioning time per
    rollout, too many to carry into Python at every poll.
    """
    of = f"FROM {events} WHERE message = 'fleet_provisioning_completed' AND {where}"
    ((count, high),) = run(f"SELECT COUNT({_PROVISIONED}), MAX({_PROVISIONED}) {of}", params).rows
    if not count:
        return {"count": 0, "p50_s": None, "p95_s": None, "max_s": None, "bins": []}
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
    width = bins * step / bins  # as _histogram() divides its range
    counts = [0] * bins
    for index, n in run(
        f"SELECT MIN(:bins - 1, MAX(0, CAST({_PROVISIONED} / :width AS INTEGER))), COUNT(*) "
        f"{of} AND {_PROVISIONED} IS NOT NULL GROUP BY 1",
        {**params, "bins": bins, "width": width},
    ).rows:
        counts[index] = n
    return {
        "count": count,
        "p50_s": float(quantiles[0.50]),
        "p95_s": float(quantiles[0.95]),
        "max_s": float(high),
        "bins": [[i * width, (i + 1) * width, n] for i, n in enumerate(counts)],
    }


def _forget_lost_starts(
    buckets: list[dict[str, Any]], bucket_s: int, lost_starts: Sequence[tuple[str, int]]
) -> None:
    """Take lost starts out of the timeline's in-flight counts, from when each was last seen.

    A start whose process is gone never gets its completion: without this,
    every rollout of a killed run stays in flight on the chart for good.
    """
    if not buckets:
        return
    first = int(_epoch(buckets[0]["t"]) // bucket_s)
    drop = [0] * len(buckets)
    for started_at, n in lost_starts:
        index = max(0, int(_epoch(started_at) // bucket_s) - first)
        if index < len(buckets):
            drop[index] += n
    gone = 0
    for bucket, n in zip(buckets, drop, strict=True):
        gone += n
        bucket["in_flight"] = max(0, bucket["in_flight"] - gone)


def _cost_total(envs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {name: sum(e[name] for e in envs) for name in ("completed", *COST_FIELDS)}


def _empty(since: str | None, batch: str | None, note: str, panels: Panels) -> dict[str, Any]:
    return {
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "since": since,
        "batch": batch,
        "note": note,
        "batches": [],
        "totals": {
            "started": 0,
            "completed": 0,
            "in_flight": 0,
            "lost": 0,
            "rerun": 0,
            "failed": 0,
            "failed_pct": None,
            "reward_mean": None,
            "rewarded": 0,
        },
        "timeline": {"bucket_s": 1, "buckets": []},
        "failures": {"reasons": [], "envs": []},
        "provisioning": {"count": 0, "p50_s": None, "p95_s": None, "max_s": None, "bins": []},
        "rewards": {"envs": []},
        "slowest": [],
        "cost": {"envs": [], "total": _cost_total([])},
        **panel.empty(panels),
    }


# -- routes ----------------------------------------------------------------------------


def dashboard_panels(settings: Settings) -> Panels:
    """The panels' settings from ``telemetry.dashboard_*``."""
    t = settings.telemetry
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
            answer = _empty(since, batch, str(exc), panels)
            answer["admission"]["gauges"] = live
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
