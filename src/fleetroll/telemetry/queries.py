"""SQL over the local store: ad-hoc queries, per-env statistics, the invariant check.

Used by ``fleetroll query``, ``fleetroll stats``, the dashboard and the HTTP
service: every function takes the store's path and opens its own read-only
connection (``mode=ro`` plus ``PRAGMA query_only``, and an authorizer that
allows reading only), so nothing here can change the store, whatever the SQL.
:func:`query` takes Logfire's SQL (PostgreSQL-flavoured: ``::float``,
``date_trunc``, ``now() - interval '5 minutes'``, ``percentile_cont``...) and
runs it through :mod:`fleetroll.telemetry.dialect`. The statistics are plain
SQL on Logfire's column names; the same queries run on Logfire cloud.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from fleetroll.errors import NoSuchBatchError, QueryError, ReadOnlyError
from fleetroll.telemetry import dialect as logfire_sql
from fleetroll.telemetry import writers
from fleetroll.telemetry.sql_functions import percentile
from fleetroll.telemetry.store import COLUMNS, connect

__all__ = [
    "BATCH_COST_SQL",
    "CHECK_SQL",
    "COST_FIELDS",
    "COST_SUMS_SQL",
    "SLOWEST_TOOLS_SQL",
    "STATS_SQL",
    "CheckResult",
    "LostBatch",
    "NoSuchBatchError",
    "QueryError",
    "QueryResult",
    "ReadOnlyError",
    "batch_costs",
    "check",
    "query",
    "schema",
    "slowest_tools",
    "stats",
]


@dataclass(frozen=True, slots=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    #: More rows matched than ``max_rows``/``max_bytes`` let through.
    truncated: bool = False

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


#: Rows fetched from SQLite at a time while the bounds are checked.
_FETCH_ROWS: Final = 512


def _size(value: object) -> int:
    """About how many bytes ``value`` takes in an answer (JSON or a table cell)."""
    if isinstance(value, str | bytes):
        return len(value) + 2
    return 8


def query(
    db: str | os.PathLike[str],
    sql: str,
    params: Sequence[Any] | Mapping[str, Any] = (),
    *,
    timeout_s: float | None = 60.0,
    max_rows: int | None = None,
    max_bytes: int | None = None,
    dialect: Literal["logfire", "sqlite"] = "logfire",
) -> QueryResult:
    """Run one SQL statement on the store, read-only.

    ``dialect="logfire"`` (the default) takes the SQL a Logfire user writes
    and translates it for SQLite first (see :mod:`fleetroll.telemetry.dialect`);
    ``"sqlite"`` runs it as it is. Errors name the problem and where it is in
    ``sql``, never the translated text.

    Rows are fetched a few hundred at a time and fetching stops at ``max_rows``
    rows or ``max_bytes`` bytes of values, whichever comes first
    (``truncated`` is then true), so a query that matches a huge table never
    holds more than about those bounds in memory. With ``max_bytes``, no
    single value the query builds may be longer than that either, and the
    aggregates computed in Python (percentiles, ``array_agg``) hold at most
    that many bytes of values at once.

    Raises:
        StoreError: there is no store at ``db``.
        ReadOnlyError: the statement would write (INSERT, DELETE, DROP, PRAGMA...).
        QueryError: any other SQL error, a value over ``max_bytes``, or the
            query ran over ``timeout_s``.
    """
    text, unreadable = sql, None
    if dialect == "logfire":
        try:
            text = logfire_sql.translate(sql)
        except QueryError as exc:
            # Not PostgreSQL: maybe SQLite's own (ATTACH, a SQLite-only
            # function). SQLite decides; its refusal to write, or our
            # message about the user's SQL, is the answer.
            unreadable = exc
    conn = _open(db)
    try:
        problems = logfire_sql.install(conn, now=datetime.now(UTC), max_bytes=max_bytes)
        if timeout_s is not None:
            deadline = time.monotonic() + timeout_s
            conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        if max_bytes is not None:
            # A single string or blob (json_group_array over everything,
            # zeroblob(...)) is built whole by SQLite before any bound applies.
            conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max(max_bytes, 1024))
        rows: list[tuple[Any, ...]] = []
        truncated = False
        try:
            cursor = conn.execute(text, params)
            size = 0
            while not truncated:
                chunk = cursor.fetchmany(_FETCH_ROWS)
                if not chunk:
                    break
                for row in chunk:
                    if max_rows is not None and len(rows) >= max_rows:
                        truncated = True
                        break
                    size += sum(_size(v) for v in row)
                    if max_bytes is not None and size > max_bytes and rows:
                        truncated = True
                        break
                    rows.append(row)
        except sqlite3.Error as exc:
            message = str(exc)
            if any(refusal in message for refusal in _REFUSALS):
                raise ReadOnlyError(
                    "refused: the telemetry store is opened read-only, so only queries that "
                    f"read (SELECT, WITH ... SELECT) run here (sqlite: {message})"
                ) from None
            if message == "interrupted":
                raise QueryError(f"the query ran over its {timeout_s:g} s limit") from None
            if "too big" in message and max_bytes is not None:
                raise QueryError(
                    f"the query builds a value over the {max_bytes} byte limit (sqlite: {message})"
                ) from None
            if unreadable is not None:
                raise unreadable from None
            raise QueryError(_explain(str(exc), sql, problems)) from None
        except OverflowError as exc:  # a parameter SQLite cannot hold
            raise QueryError(f"a parameter is out of range: {exc} (64-bit integers)") from None
        columns = [d[0] for d in cursor.description or ()]
        return QueryResult(columns, rows, truncated)
    finally:
        conn.close()


_NAMED: Final = re.compile(
    r"^(no such column|no such function|no such table|wrong number of arguments to function"
    r"|misuse of aggregate(?: function)?|ambiguous column name): ([\w.]+?)(?:\(\))?$"
)
_NEAR: Final = re.compile(r'^near "(.+?)": syntax error$')
#: The functions the translation adds, by what the user wrote.
_OURS: Final = re.compile(r"\bFR_(\w+)\b", re.IGNORECASE)


def _explain(message: str, sql: str, problems: Sequence[str]) -> str:
    """SQLite's error on the translated SQL, told in terms of the SQL the user wrote."""
    match = _NAMED.match(message)
    if match is not None:
        problem, name = match.groups()
        where = logfire_sql.locate(sql, name.rsplit(".", 1)[-1])
        hint = {
            "no such column": " (`fleetroll query --schema` lists the columns of records)",
            "no such table": " (the local store has one table: records)",
            "no such function": " (not a function the local store knows)",
        }.get(problem, "")
        return f"{problem}: {name}{where}{hint}"
    near = _NEAR.match(message)
    if near is not None:
        token = near.group(1)
        return (
            f"the local store has no SQL for {token!r}{logfire_sql.locate(sql, token)} "
            "(a PostgreSQL form SQLite lacks; docs/telemetry.md lists what runs)"
        )
    if problems and "user-defined" in message:
        return f"the query failed: {problems[-1]}"
    return f"the query failed: {_OURS.sub(lambda m: m.group(1), message)}"


# -- the schema -------------------------------------------------------------------

#: Each column of ``records``: its type as a query sees it, and what it holds.
COLUMN_NOTES: Final[Mapping[str, tuple[str, str]]] = {
    "start_timestamp": ("timestamp", "when the span started or the log was emitted (UTC)"),
    "end_timestamp": ("timestamp", "when the span ended; a log's own time"),
    "duration": ("double", "seconds the span took; NULL for logs (every fleetroll event)"),
    "trace_id": ("text", "32 hex digits shared by the spans and logs of one trace"),
    "span_id": ("text", "16 hex digits naming this record"),
    "parent_span_id": ("text", "the enclosing span, NULL at the top"),
    "kind": ("text", "'log' or 'span'"),
    "level": ("level", "'debug', 'info', 'warn', 'error'...; compares by severity"),
    "span_name": ("text", "the message template; for fleetroll events the event name"),
    "message": ("text", "the rendered message; for fleetroll events the event name"),
    "attributes": ("json", "the event's attributes: attributes->>'env_key', ->'counts'"),
    "tags": ("json", "array of tag strings"),
    "otel_status_code": ("text", "'UNSET', 'OK' or 'ERROR'"),
    "otel_status_message": ("text", "the status description, if any"),
    "otel_events": ("json", "array of span events, NULL when none"),
    "otel_links": ("json", "array of span links, NULL when none"),
    "otel_scope_name": ("text", "the instrumentation scope (e.g. 'logfire')"),
    "otel_scope_version": ("text", "its version"),
    "is_exception": ("boolean", "1 when an exception was recorded on the record"),
    "exception_type": ("text", "the exception's class name"),
    "exception_message": ("text", "the exception's message"),
    "exception_stacktrace": ("text", "the formatted traceback"),
    "service_name": ("text", "'fleetroll' for fleetroll's events"),
    "service_version": ("text", "fleetroll's version"),
    "service_namespace": ("text", "OpenTelemetry service namespace"),
    "service_instance_id": ("text", "one id per writing process"),
    "process_pid": ("integer", "the writing process's pid"),
    "deployment_environment": ("text", "telemetry.environment"),
    "telemetry_sdk_name": ("text", "'opentelemetry'"),
    "telemetry_sdk_language": ("text", "'python'"),
    "telemetry_sdk_version": ("text", "the OpenTelemetry SDK's version"),
    "otel_resource_attributes": ("json", "every resource attribute, as an object"),
    "created_at": ("timestamp", "when the row was written to the store"),
}


def schema() -> QueryResult:
    """The columns of ``records`` (``column, type, meaning``), in table order.

    Types are as a query sees them (timestamps compare with ``now() -
    interval '5 minutes'``; ``json`` columns take ``->`` and ``->>``), not
    SQLite's storage classes. Needs no store.
    """
    rows = [(name, *COLUMN_NOTES.get(name, ("text", ""))) for name in COLUMNS]
    return QueryResult(["column", "type", "meaning"], rows)


# -- statistics ------------------------------------------------------------------

_TOOL_ERRORS: Final = ("fleet_mcp_tool_error", "fleet_tool_call_failed")

#: A result's ``cost`` fields, carried as counts on ``fleet_rollout_completed``.
COST_FIELDS: Final = (
    "instance_s",
    "prompt_tokens",
    "completion_tokens",
    "policy_calls",
    "tool_calls",
)


#: One ``SUM`` column per :data:`COST_FIELDS` over completions (0 when none).
COST_SUMS_SQL: Final = ",\n    ".join(
    f"COALESCE(SUM(attributes->>'{name}') FILTER (\n"
    f"        WHERE message = 'fleet_rollout_completed'\n"
    f"    ), 0) AS {name}"
    for name in COST_FIELDS
)

#: Per env_key/env_version/modality counts; ``{batch}`` is replaced by an
#: optional batch filter. A rollout counts once, by its latest result: one
#: re-run after ``--resume`` (started and completed twice) is one rollout, and
#: one cancelled and then run again counts as what its second run became.
#: ``completed`` are the rollouts that ended without a failure (a result's
#: ``status``), ``failed`` those that failed, ``cancelled`` those cancelled,
#: ``rollouts`` all three; the costs are every run's (what was spent).
STATS_SQL: Final = (
    """
WITH latest AS (
    SELECT
        attributes->>'env_key' AS env_key,
        attributes->>'env_version' AS env_version,
        attributes->>'modality' AS modality,
        attributes->>'failure_reason' AS failure_reason,
        attributes->>'reward' AS reward,
        MAX(start_timestamp)
    FROM records
    WHERE service_name = :service AND message = 'fleet_rollout_completed'{batch}
    GROUP BY attributes->>'rollout_id'
),
parts AS (
    SELECT
        env_key, env_version, modality,
        0 AS started,
        COUNT(*) AS rollouts,
        COUNT(*) FILTER (WHERE failure_reason IS NULL) AS completed,
        COUNT(*) FILTER (WHERE failure_reason IS NOT NULL AND failure_reason != 'cancelled')
            AS failed,
        COUNT(*) FILTER (WHERE failure_reason = 'cancelled') AS cancelled,
        SUM(reward) AS reward_sum,
        COUNT(reward) AS rewarded,
        0 AS tool_errors, 0 AS verifier_errors,
        {zeros}
    FROM latest GROUP BY 1, 2, 3
    UNION ALL
    SELECT
        attributes->>'env_key', attributes->>'env_version', attributes->>'modality',
        COUNT(DISTINCT attributes->>'rollout_id') FILTER (
            WHERE message = 'fleet_rollout_started'
        ),
        0, 0, 0, 0, NULL, 0,
        COUNT(*) FILTER (
            WHERE message IN ('fleet_mcp_tool_error', 'fleet_tool_call_failed')
        ),
        COUNT(*) FILTER (WHERE message = 'fleet_verifier_failed'),
        {costs}
    FROM records
    WHERE service_name = :service
      AND message IN (
          'fleet_rollout_started', 'fleet_rollout_completed', 'fleet_mcp_tool_error',
          'fleet_tool_call_failed', 'fleet_verifier_failed'
      ){batch}
    GROUP BY 1, 2, 3
)
SELECT
    env_key, env_version, modality,
    SUM(started) AS started,
    SUM(rollouts) AS rollouts,
    SUM(completed) AS completed,
    SUM(failed) AS failed,
    SUM(cancelled) AS cancelled,
    SUM(reward_sum) / NULLIF(SUM(rewarded), 0) AS reward_mean,
    SUM(rewarded) AS rewarded,
    SUM(tool_errors) AS tool_errors,
    SUM(verifier_errors) AS verifier_errors,
    {sums}
FROM parts
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3
""".replace("{costs}", COST_SUMS_SQL)
    .replace("{zeros}", ", ".join(f"0 AS {name}" for name in COST_FIELDS))
    .replace("{sums}", ", ".join(f"SUM({name}) AS {name}" for name in COST_FIELDS))
)

#: Cost totals per batch (newest first); ``{batch}`` as above. ``completed``
#: counts the batch's rollouts with a result, each once however often it ran.
BATCH_COST_SQL: Final = f"""
SELECT
    attributes->>'batch_id' AS batch_id,
    COUNT(DISTINCT attributes->>'rollout_id') AS completed,
    {COST_SUMS_SQL}
FROM records
WHERE service_name = :service AND message = 'fleet_rollout_completed'
  AND attributes->>'batch_id' IS NOT NULL{{batch}}
GROUP BY 1
ORDER BY MIN(start_timestamp) DESC, 1
"""

#: Failure reasons of each rollout's latest result; ``{batch}`` as above.
_REASONS_SQL: Final = """
SELECT env_key, env_version, modality, failure_reason, COUNT(*) FROM (
    SELECT
        attributes->>'env_key' AS env_key, attributes->>'env_version' AS env_version,
        attributes->>'modality' AS modality, attributes->>'failure_reason' AS failure_reason,
        MAX(start_timestamp)
    FROM records
    WHERE service_name = :service AND message = 'fleet_rollout_completed'{batch}
    GROUP BY attributes->>'rollout_id'
)
WHERE failure_reason IS NOT NULL
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


_BATCH_EXISTS_SQL: Final = """
SELECT 1 FROM records
WHERE service_name = :service AND attributes->>'batch_id' = :batch_id
LIMIT 1
"""

_RECENT_BATCHES_SQL: Final = """
SELECT attributes->>'batch_id' FROM records
WHERE service_name = :service AND message = 'fleet_rollout_started'
  AND attributes->>'batch_id' IS NOT NULL
GROUP BY 1
ORDER BY MAX(start_timestamp) DESC
LIMIT 5
"""


def _run(db: str | os.PathLike[str], sql: str, params: Mapping[str, Any]) -> QueryResult:
    """Our own SQL, already SQLite's (and Logfire's: no translation needed)."""
    return query(db, sql, params, dialect="sqlite")


def _require_batch(db: str | os.PathLike[str], batch_id: str | None, service_name: str) -> None:
    """Raise :class:`NoSuchBatchError` when ``batch_id`` is given but has no record."""
    if batch_id is None:
        return
    params = {"service": service_name, "batch_id": batch_id}
    if _run(db, _BATCH_EXISTS_SQL, params).rows:
        return
    recent = [str(b) for (b,) in _run(db, _RECENT_BATCHES_SQL, params).rows]
    raise NoSuchBatchError(batch_id, recent)


def stats(
    db: str | os.PathLike[str], batch_id: str | None = None, *, service_name: str = "fleetroll"
) -> list[dict[str, Any]]:
    """Rollout statistics per ``(env_key, env_version, modality)``.

    Each row: ``env_key, env_version, modality, started, rollouts`` (with a
    result), ``completed, failed, cancelled`` (by each rollout's latest
    result: a re-run counts once), ``failure_reasons`` (``{reason: count}``,
    ``cancelled`` included), ``reward_mean`` (over rollouts with a reward),
    ``provisioning_p50_s, provisioning_p95_s``,
    ``tool_errors`` (tool errors answered plus calls that failed),
    ``verifier_errors``, and the sums of the results' ``cost``:
    ``instance_s, prompt_tokens, completion_tokens, policy_calls, tool_calls``.

    Raises:
        NoSuchBatchError: ``batch_id`` names no batch in the store.
        StoreError: there is no store at ``db``, or it cannot be read.
    """
    _require_batch(db, batch_id, service_name)
    params = {"service": service_name, "batch_id": batch_id}
    main = _run(db, _sql(STATS_SQL, batch_id), params).dicts()
    reasons: dict[tuple[Any, ...], dict[str, int]] = defaultdict(dict)
    for *key, reason, count in _run(db, _sql(_REASONS_SQL, batch_id), params).rows:
        reasons[tuple(key)][str(reason)] = int(count)
    times: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for *key, seconds in _run(db, _sql(_PROVISIONING_SQL, batch_id), params).rows:
        if isinstance(seconds, int | float):
            times[tuple(key)].append(float(seconds))
    out = []
    for row in main:
        group = (row["env_key"], row["env_version"], row["modality"])
        ordered = sorted(times.get(group, ()))
        row["failure_reasons"] = dict(sorted(reasons.get(group, {}).items()))
        row["provisioning_p50_s"] = percentile(ordered, 0.50)
        row["provisioning_p95_s"] = percentile(ordered, 0.95)
        row.pop("rewarded")
        out.append(row)
    return out


def batch_costs(
    db: str | os.PathLike[str], batch_id: str | None = None, *, service_name: str = "fleetroll"
) -> list[dict[str, Any]]:
    """The results' ``cost`` summed per batch, newest batch first.

    Each row: ``batch_id, completed`` (rollouts), ``instance_s,
    prompt_tokens, completion_tokens, policy_calls, tool_calls``.

    Raises:
        NoSuchBatchError: ``batch_id`` names no batch in the store.
        StoreError: there is no store at ``db``, or it cannot be read.
    """
    _require_batch(db, batch_id, service_name)
    params = {"service": service_name, "batch_id": batch_id}
    return _run(db, _sql(BATCH_COST_SQL, batch_id), params).dicts()


#: Each tool of each environment by its mean duration, slowest first
#: (``fleet_tool_call`` records); ``{batch}`` as above.
SLOWEST_TOOLS_SQL: Final = """
SELECT
    attributes->>'tool_name' AS tool,
    attributes->>'env_key' AS env_key,
    COUNT(*) AS calls,
    AVG(attributes->>'duration_s') AS mean_s,
    MAX(attributes->>'duration_s') AS max_s,
    COUNT(*) FILTER (WHERE attributes->>'outcome' != 'ok') AS not_ok
FROM records
WHERE service_name = :service AND message = 'fleet_tool_call'{batch}
GROUP BY 1, 2
ORDER BY mean_s DESC, calls DESC
LIMIT :limit
"""


def slowest_tools(
    db: str | os.PathLike[str],
    batch_id: str | None = None,
    *,
    service_name: str = "fleetroll",
    limit: int = 10,
) -> list[dict[str, Any]]:
    """The ``limit`` slowest tools, by their calls' mean duration (``fleet_tool_call``).

    Each row: ``tool, env_key, calls, mean_s, max_s`` and ``not_ok`` (calls
    answered with an error or not answered at all). Empty when
    ``telemetry.tool_calls`` was off.

    Raises:
        NoSuchBatchError: ``batch_id`` names no batch in the store.
        StoreError: there is no store at ``db``, or it cannot be read.
    """
    _require_batch(db, batch_id, service_name)
    params = {"service": service_name, "batch_id": batch_id, "limit": limit}
    return _run(db, _sql(SLOWEST_TOOLS_SQL, batch_id), params).dicts()


# -- the invariant ------------------------------------------------------------------

#: Rollout ids whose starts and completions do not pair up; ``{batch}`` as above.
#: A rollout re-run after ``--resume`` (its first completion reached telemetry
#: but not the journal) starts and completes twice: that is not an offence.
CHECK_SQL: Final = """
SELECT
    attributes->>'rollout_id' AS rollout_id,
    COUNT(*) FILTER (WHERE message = 'fleet_rollout_started') AS started,
    COUNT(*) FILTER (WHERE message = 'fleet_rollout_completed') AS completed
FROM records
WHERE service_name = :service
  AND message IN ('fleet_rollout_started', 'fleet_rollout_completed'){batch}
GROUP BY 1
HAVING started != completed
ORDER BY 1
"""

#: :data:`CHECK_SQL` for every rollout, the ones that hold too.
_EVERY_ROLLOUT_SQL: Final = CHECK_SQL.replace("HAVING started != completed\n", "")

#: The batches that ended (``fleet_batch_completed``), each at its latest end.
_BATCHES_ENDED_SQL: Final = """
SELECT attributes->>'batch_id', MAX(start_timestamp) FROM records
WHERE service_name = :service AND message = 'fleet_batch_completed'
  AND attributes->>'batch_id' IS NOT NULL{batch}
GROUP BY 1
"""

#: Between a run of steps' id and a step's number in the step's batch id
#: (``fleetroll.pool.journal.step_batch_id``, a layer above this one).
_STEP: Final = "-step"

#: How each batch's latest job can be resumed (``fleet_job_started``).
_RESUMES_SQL: Final = """
SELECT attributes->>'batch_id', attributes->>'resume_command', attributes->>'journal',
    MAX(start_timestamp)
FROM records
WHERE service_name = :service AND message = 'fleet_job_started'
  AND attributes->>'batch_id' IS NOT NULL
GROUP BY 1
"""


@dataclass(frozen=True, slots=True)
class LostBatch:
    """The lost rollouts of one batch, and how to run them again."""

    batch_id: str | None
    rollout_ids: list[str]
    #: The command that resumes the batch (its job's ``--resume``), or what to do.
    resume: str


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The invariant of docs/telemetry.md: each start of a rollout id has one completion.

    A rollout started and completed once, or re-run after a resume (started
    twice, completed twice), passes; so does one whose process died before it
    completed (:attr:`lost`: that process could emit nothing more), and one
    re-run to completion after such a lost start. Checked ``live``, a rollout
    still running (:attr:`running`: its process alive, its batch not ended,
    started less than ``max_age_s`` ago) passes too.
    """

    rollouts: int
    #: Rollout ids with more starts than completions (a telemetry gap).
    never_completed: list[str] = field(default_factory=list)
    #: Rollout ids with more completions than starts (started at least once).
    completed_more_than_once: list[str] = field(default_factory=list)
    #: Rollout ids completed without ever being started.
    completed_without_start: list[str] = field(default_factory=list)
    #: Rollouts started more than once, each start completed (re-runs after a resume).
    rerun: int = 0
    #: ``(rollout_id, batch_id)`` of rollouts never completed whose process is
    #: gone (killed): lost, not in flight; they do not break the invariant.
    lost: list[tuple[str, str | None]] = field(default_factory=list)
    #: Checked live: rollouts started, not completed, and still running.
    running: list[str] = field(default_factory=list)
    #: The lost rollouts by batch, each with the command that resumes it.
    lost_batches: list[LostBatch] = field(default_factory=list)
    #: Checked live: how old a start may be and still be running (None: not live).
    max_age_s: float | None = None

    @property
    def ok(self) -> bool:
        return not (
            self.never_completed or self.completed_more_than_once or self.completed_without_start
        )

    def describe(self) -> str:
        """One line when it holds; otherwise a count per kind of offence, ids included."""
        if self.ok:
            if self.rerun:
                head = (
                    f"ok: {self.rollouts} rollouts, every start completed once"
                    f" ({self.rerun} re-run after a resume)"
                )
            else:
                head = f"ok: {self.rollouts} rollouts, all started and completed once"
            if self.lost:
                head = f"ok: {self.rollouts} rollouts, every start completed once or lost"
            if self.running:
                head += f"; {len(self.running)} running"
            return "\n".join([head, *self._describe_lost()])
        lines = [f"FAILED: {self.rollouts} rollouts; the started/completed invariant is broken"]
        if self.running:
            lines[0] += f" ({len(self.running)} running)"
        lines += self._describe_lost()
        never = "started but never completed"
        if self.max_age_s is not None:
            never += (
                f" (their process alive, yet their batch ended or they started over"
                f" {self.max_age_s:g} s ago)"
            )
        for label, ids in (
            (never, self.never_completed),
            ("completed more than once", self.completed_more_than_once),
            ("completed without being started", self.completed_without_start),
        ):
            if ids:
                more = f" (and {len(ids) - 20} more)" if len(ids) > 20 else ""
                shown = ", ".join(ids[:20]) + more
                lines.append(f"  {len(ids)} {label}: {shown}")
        return "\n".join(lines)

    def _describe_lost(self) -> list[str]:
        lines = []
        for group in self.lost_batches:
            ids = group.rollout_ids
            more = f" (and {len(ids) - 5} more)" if len(ids) > 5 else ""
            lines.append(
                f"  {len(ids)} lost in batch {group.batch_id or '?'} (started, never completed,"
                f" their process is gone): {', '.join(ids[:5])}{more}"
            )
            lines.append(f"    resume: {group.resume}")
        return lines


def _lost_batches(
    lost: Sequence[tuple[str, str | None]], resumes: Mapping[str, tuple[str | None, str | None]]
) -> list[LostBatch]:
    """``lost`` grouped by batch, with how each batch resumes (``resumes``: by batch id,
    its job's resume command and journal)."""
    by_batch: dict[str | None, list[str]] = defaultdict(list)
    for rid, batch in lost:
        by_batch[batch].append(rid)
    groups = []
    for batch, ids in by_batch.items():
        command, journal = resumes.get(batch or "", (None, None))
        if command is None and batch is not None:
            # A step of a run of steps (``<run>-step-<n>``): the run resumes it.
            run = next((b for b in resumes if batch.startswith(f"{b}{_STEP}")), None)
            if run is not None:
                command, journal = resumes[run]
        if command is not None:
            resume = command
        elif journal is not None:
            resume = (
                f"its journal is {journal}: `fleetroll run` with the same tasks and"
                f" options, --out {journal} --resume, runs them"
            )
        else:
            resume = (
                "resubmit it with the same batch_id (fleetroll serve: POST /v1/batches, or"
                " FleetrollClient.run_batch(..., batch_id=...)); a `fleetroll run` without"
                " --out kept no journal: run it again"
            )
        groups.append(LostBatch(batch, ids, resume))
    return groups


def check(
    db: str | os.PathLike[str],
    batch_id: str | None = None,
    *,
    service_name: str = "fleetroll",
    live_max_age_s: float | None = None,
    now: float | None = None,
) -> CheckResult:
    """Check that every start of each rollout id has exactly one completion.

    With ``live_max_age_s`` (a running service's health check), a rollout
    started and not completed whose process is not known to be gone is
    ``running``, not an offence, unless its batch ended
    (``fleet_batch_completed`` after its start) or it started more than
    ``live_max_age_s`` before ``now`` (epoch seconds; default: the clock).

    Raises:
        NoSuchBatchError: ``batch_id`` names no batch in the store.
        StoreError: there is no store at ``db``, or it cannot be read.
    """
    _require_batch(db, batch_id, service_name)
    params = {"service": service_name, "batch_id": batch_id}
    # One query, so the counts agree with each other while another process
    # writes the store (two reads could see a flush land between them).
    counted = _run(db, _sql(_EVERY_ROLLOUT_SQL, batch_id), params).rows
    rollouts = sum(1 for _, started, _ in counted if started > 0)
    rerun = sum(1 for _, started, _ in counted if started > 1)
    never, twice, orphan = [], [], []
    for rollout_id, started, completed in counted:
        if started == completed:
            continue
        rid = str(rollout_id)
        if started > completed:
            never.append(rid)
        elif started == 0:
            orphan.append(rid)
        else:
            twice.append(rid)
    lost: list[tuple[str, str | None]] = []
    running: list[str] = []
    resumes: dict[str, tuple[str | None, str | None]] = {}
    if never:  # which of them lost their process (killed) rather than being in flight
        gaps = writers.unfinished(
            lambda sql, p: _run(db, sql, p).rows, batch_id=batch_id, service_name=service_name
        )
        # A lost start re-run to completion counts as a re-run (started twice).
        explained = {gap.rollout_id: gap for gap in gaps if gap.lost}
        lost = [
            (rid, explained[rid].batch_id)
            for rid in never
            if rid in explained and not explained[rid].completed
        ]
        never = [rid for rid in never if rid not in explained]
        if live_max_age_s is not None and never:
            at = time.time() if now is None else now
            ended = dict(_run(db, _sql(_BATCHES_ENDED_SQL, batch_id), params).rows)
            alive = {gap.rollout_id: gap for gap in gaps if not gap.lost}
            for rid in never:
                gap = alive.get(rid)
                if gap is None:
                    continue
                batch_end = ended.get(gap.batch_id)
                if (batch_end is None or batch_end < gap.started_at) and at - _epoch(
                    gap.started_at
                ) <= live_max_age_s:
                    running.append(rid)
            never = [rid for rid in never if rid not in set(running)]
        if lost:
            for bid, command, journal, _ in _run(db, _RESUMES_SQL, params).rows:
                resumes[str(bid)] = (command, journal)
    lost.sort()
    return CheckResult(
        int(rollouts),
        never,
        twice,
        orphan,
        int(rerun),
        lost,
        running,
        _lost_batches(lost, resumes),
        live_max_age_s,
    )


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp()
