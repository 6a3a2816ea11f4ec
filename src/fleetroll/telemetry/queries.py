"""SQL over the local store: ad-hoc queries, per-env statistics, the invariant check.

Used by ``fleetroll query`` and ``fleetroll stats``, and meant for the HTTP
service too: every function takes the store's path and opens its own
read-only connection (``mode=ro`` plus ``PRAGMA query_only``, and an
authorizer that allows reading only), so nothing here can change the store.
The statistics are plain SQL on Logfire's column names; the same queries run
on Logfire cloud.
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from fleetroll.telemetry.store import StoreError, connect

__all__ = [
    "CHECK_SQL",
    "STATS_SQL",
    "CheckResult",
    "QueryError",
    "QueryResult",
    "ReadOnlyError",
    "check",
    "query",
    "stats",
]


class QueryError(StoreError):
    """The SQL failed (syntax, unknown column, time limit...); the message says why."""


class ReadOnlyError(QueryError):
    """The SQL tried to change the store, which is only ever opened for reading."""


@dataclass(frozen=True, slots=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        """The rows as ``{column: value}`` (a later duplicate column name wins)."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


# sqlite3 authorizer action codes that only read.
_READ_ACTIONS: Final = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
# What SQLite says when the authorizer, mode=ro or query_only refuses a write.
_REFUSALS: Final = (
    "not authorized",
    "authorization denied",
    "readonly",
    "read-only",
    "may not be modified",
)


def _only_reads(action: int, table: str | None, *_: object) -> int:
    if action in _READ_ACTIONS:
        return sqlite3.SQLITE_OK
    # SQLite itself asks this while setting up a table-valued function such as
    # json_each (writing the schema is impossible anyway: mode=ro, and PRAGMA
    # writable_schema is denied).
    if action == sqlite3.SQLITE_UPDATE and table == "sqlite_master":
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _open(db: str | os.PathLike[str]) -> sqlite3.Connection:
    conn = connect(db, readonly=True)
    conn.set_authorizer(_only_reads)
    return conn


def query(
    db: str | os.PathLike[str],
    sql: str,
    params: Sequence[Any] | Mapping[str, Any] = (),
    *,
    timeout_s: float | None = 60.0,
) -> QueryResult:
    """Run one SQL statement on the store, read-only.

    Raises:
        StoreError: there is no store at ``db``.
        ReadOnlyError: the statement would write (INSERT, DELETE, DROP, PRAGMA...).
        QueryError: any other SQL error, or the query ran over ``timeout_s``.
    """
    conn = _open(db)
    try:
        if timeout_s is not None:
            deadline = time.monotonic() + timeout_s
            conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        try:
            cursor = conn.execute(sql, params)
            rows = cursor.fetchall()
        except sqlite3.Error as exc:
            text = str(exc)
            if any(refusal in text for refusal in _REFUSALS):
                raise ReadOnlyError(
                    "refused: the telemetry store is opened read-only, so only queries that "
                    f"read (SELECT, WITH ... SELECT) run here (sqlite: {text})"
                ) from None
            if text == "interrupted":
                raise QueryError(f"the query ran over its {timeout_s:g} s limit") from None
            raise QueryError(f"the query failed: {text}") from None
        columns = [d[0] for d in cursor.description or ()]
        return QueryResult(columns, rows)
    finally:
        conn.close()


# -- statistics ------------------------------------------------------------------

_TOOL_ERRORS: Final = ("fleet_mcp_tool_error", "fleet_tool_call_failed")

#: Per env_key/env_version/modality counts; ``{batch}`` is replaced by an
#: optional batch filter.
STATS_SQL: Final = """
SELECT
    attributes->>'env_key' AS env_key,
    attributes->>'env_version' AS env_version,
    attributes->>'modality' AS modality,
    COUNT(*) FILTER (WHERE message = 'fleet_rollout_started') AS started,
    COUNT(*) FILTER (WHERE message = 'fleet_rollout_completed') AS completed,
    COUNT(*) FILTER (
        WHERE message = 'fleet_rollout_completed' AND attributes->>'failure_reason' IS NOT NULL
    ) AS failed,
    AVG(attributes->>'reward') FILTER (
        WHERE message = 'fleet_rollout_completed' AND attributes->>'reward' IS NOT NULL
    ) AS reward_mean,
    COUNT(*) FILTER (
        WHERE message = 'fleet_rollout_completed' AND attributes->>'reward' IS NOT NULL
    ) AS rewarded,
    COUNT(*) FILTER (
        WHERE message IN ('fleet_mcp_tool_error', 'fleet_tool_call_failed')
    ) AS tool_errors,
    COUNT(*) FILTER (WHERE message = 'fleet_verifier_failed') AS verifier_errors
FROM records
WHERE service_name = :service
  AND message IN (
      'fleet_rollout_started', 'fleet_rollout_completed', 'fleet_mcp_tool_error',
      'fleet_tool_call_failed', 'fleet_verifier_failed'
  ){batch}
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3
"""

_REASONS_SQL: Final = """
SELECT
    attributes->>'env_key', attributes->>'env_version', attributes->>'modality',
    attributes->>'failure_reason', COUNT(*)
FROM records
WHERE service_name = :service AND message = 'fleet_rollout_completed'
  AND attributes->>'failure_reason' IS NOT NULL{batch}
GROUP BY 1, 2, 3, 4
"""

_PROVISIONING_SQL: Final = """
SELECT
    attributes->>'env_key', attributes->>'env_version', attributes->>'modality',
    attributes->>'provisioning_time_s'
FROM records
WHERE service_name = :service AND message = 'fleet_provisioning_completed'
  AND attributes->>'provisioning_time_s' IS NOT NULL{batch}
"""

_BATCH_FILTER: Final = "\n  AND attributes->>'batch_id' = :batch_id"


def _sql(template: str, batch_id: str | None) -> str:
    return template.replace("{batch}", _BATCH_FILTER if batch_id is not None else "")


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def stats(
    db: str | os.PathLike[str], batch_id: str | None = None, *, service_name: str = "fleetroll"
) -> list[dict[str, Any]]:
    """Rollout statistics per ``(env_key, env_version, modality)``.

    Each row: ``env_key, env_version, modality, started, completed, failed,
    failure_reasons`` (``{reason: count}``), ``reward_mean`` (over rollouts
    with a reward), ``provisioning_p50_s, provisioning_p95_s``,
    ``tool_errors`` (tool errors answered plus calls that failed),
    ``verifier_errors``.

    Raises:
        StoreError: there is no store at ``db``, or it cannot be read.
    """
    params = {"service": service_name, "batch_id": batch_id}
    main = query(db, _sql(STATS_SQL, batch_id), params).dicts()
    reasons: dict[tuple[Any, ...], dict[str, int]] = defaultdict(dict)
    for *key, reason, count in query(db, _sql(_REASONS_SQL, batch_id), params).rows:
        reasons[tuple(key)][str(reason)] = int(count)
    times: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for *key, seconds in query(db, _sql(_PROVISIONING_SQL, batch_id), params).rows:
        if isinstance(seconds, int | float):
            times[tuple(key)].append(float(seconds))
    out = []
    for row in main:
        group = (row["env_key"], row["env_version"], row["modality"])
        ordered = sorted(times.get(group, ()))
        row["failure_reasons"] = dict(sorted(reasons.get(group, {}).items()))
        row["provisioning_p50_s"] = _percentile(ordered, 0.50)
        row["provisioning_p95_s"] = _percentile(ordered, 0.95)
        row.pop("rewarded")
        out.append(row)
    return out


# -- the invariant ------------------------------------------------------------------

#: Rollout ids that break "one started, one completed"; ``{batch}`` as above.
CHECK_SQL: Final = """
SELECT
    attributes->>'rollout_id' AS rollout_id,
    COUNT(*) FILTER (WHERE message = 'fleet_rollout_started') AS started,
    COUNT(*) FILTER (WHERE message = 'fleet_rollout_completed') AS completed
FROM records
WHERE service_name = :service
  AND message IN ('fleet_rollout_started', 'fleet_rollout_completed'){batch}
GROUP BY 1
HAVING started != 1 OR completed != 1
ORDER BY 1
"""

_ROLLOUTS_SQL: Final = """
SELECT COUNT(DISTINCT attributes->>'rollout_id') FROM records
WHERE service_name = :service AND message = 'fleet_rollout_started'{batch}
"""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The invariant of DESIGN.md §8: each rollout id started once and completed once."""

    rollouts: int
    #: Rollout ids with more starts than completions (a telemetry gap).
    never_completed: list[str] = field(default_factory=list)
    #: Rollout ids completed more than once.
    completed_more_than_once: list[str] = field(default_factory=list)
    #: Rollout ids completed without a start (or with fewer starts than completions).
    completed_without_start: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.never_completed or self.completed_more_than_once or self.completed_without_start
        )

    def describe(self) -> str:
        """One line when it holds; otherwise a line per kind of offence, ids included."""
        if self.ok:
            return f"ok: {self.rollouts} rollouts, all started and completed once"
        lines = [f"FAILED: {self.rollouts} rollouts; the started/completed invariant is broken"]
        for label, ids in (
            ("started but never completed", self.never_completed),
            ("completed more than once", self.completed_more_than_once),
            ("completed without being started", self.completed_without_start),
        ):
            if ids:
                more = f" (and {len(ids) - 20} more)" if len(ids) > 20 else ""
                shown = ", ".join(ids[:20]) + more
                lines.append(f"  {len(ids)} {label}: {shown}")
        return "\n".join(lines)


def check(
    db: str | os.PathLike[str], batch_id: str | None = None, *, service_name: str = "fleetroll"
) -> CheckResult:
    """Check that every rollout id has exactly one started and one completed event.

    Raises:
        StoreError: there is no store at ``db``, or it cannot be read.
    """
    params = {"service": service_name, "batch_id": batch_id}
    (rollouts,) = query(db, _sql(_ROLLOUTS_SQL, batch_id), params).rows[0]
    never, twice, orphan = [], [], []
    for rollout_id, started, completed in query(db, _sql(CHECK_SQL, batch_id), params).rows:
        rid = str(rollout_id)
        if started > completed:
            never.append(rid)
        elif completed > started:
            orphan.append(rid)
        if completed > 1:
            twice.append(rid)
    return CheckResult(int(rollouts), never, twice, orphan)
