"""The local telemetry store: finished spans and logs in SQLite, Logfire's way.

:class:`SQLiteSpanProcessor` is an OpenTelemetry span processor. ``on_end``
only puts the finished span on a bounded queue (it runs on the event loop,
inside ``logfire.log``); one writer thread turns spans into rows and commits
them in batches, one transaction per flush, every ``flush_records`` records or
``flush_interval_s`` seconds, whichever comes first. A flush is a commit, so a
crash loses at most what was not yet flushed; :meth:`force_flush` returns only
after everything queued before it is committed.

The file is in WAL mode with a busy timeout, and writers take the lock at the
start of their transaction (``BEGIN IMMEDIATE``) and retry while another
process holds it, so several fleetroll processes can share one store.

The ``records`` table uses Logfire's column names (see :data:`SCHEMA`), so the
SQL people write for Logfire runs here too: ``attributes`` is JSON text, and
SQLite's ``->>`` reads it (``attributes->>'env_key'``). ``level`` holds
Logfire's level *names* (``'info'``, ``'warn'``, ``'error'``); on connections
opened by :func:`connect` the functions ``level_num(level)`` and
``level_name(number)`` compare them by severity, as Logfire's SQL does.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import format_span_id, format_trace_id

from fleetroll.errors import StoreError

__all__ = [
    "COLUMNS",
    "LEVEL_NAMES",
    "LEVEL_NUMBERS",
    "SCHEMA",
    "EventOrigin",
    "EventRecord",
    "SQLiteSpanProcessor",
    "StoreError",
    "connect",
    "event_to_row",
    "is_disabled",
    "level_name",
    "level_num",
    "span_to_row",
]

_log = logging.getLogger(__name__)

#: Logfire's level numbers (OpenTelemetry severity numbers).
LEVEL_NUMBERS: Final[Mapping[str, int]] = {
    "trace": 1,
    "debug": 5,
    "info": 9,
    "notice": 10,
    "warn": 13,
    "warning": 13,
    "error": 17,
    "fatal": 21,
}
LEVEL_NAMES: Final[Mapping[int, str]] = {
    1: "trace",
    5: "debug",
    9: "info",
    10: "notice",
    13: "warn",
    17: "error",
    21: "fatal",
}

#: Column name → SQLite type, in table order.
COLUMNS: Final[Mapping[str, str]] = {
    "start_timestamp": "TEXT NOT NULL",  # ISO 8601 UTC, microseconds: sorts as text
    "end_timestamp": "TEXT",
    "duration": "REAL",  # seconds; NULL for logs, as in Logfire
    "trace_id": "TEXT NOT NULL",  # 32 hex digits
    "span_id": "TEXT NOT NULL",  # 16 hex digits
    "parent_span_id": "TEXT",
    "kind": "TEXT NOT NULL",  # 'log' | 'span'
    "level": "TEXT NOT NULL",  # 'debug' | 'info' | 'warn' | 'error' | ...
    "span_name": "TEXT NOT NULL",  # the message template
    "message": "TEXT NOT NULL",  # for fleetroll events: the event name
    "attributes": "TEXT NOT NULL",  # JSON object
    "tags": "TEXT NOT NULL",  # JSON array of strings
    "otel_status_code": "TEXT NOT NULL",  # 'UNSET' | 'OK' | 'ERROR'
    "otel_status_message": "TEXT",
    "otel_events": "TEXT",  # JSON array, NULL when none
    "otel_links": "TEXT",  # JSON array, NULL when none
    "otel_scope_name": "TEXT",
    "otel_scope_version": "TEXT",
    "is_exception": "INTEGER NOT NULL",  # 0 | 1
    "exception_type": "TEXT",
    "exception_message": "TEXT",
    "exception_stacktrace": "TEXT",
    "service_name": "TEXT",
    "service_version": "TEXT",
    "service_namespace": "TEXT",
    "service_instance_id": "TEXT",
    "process_pid": "INTEGER",
    "deployment_environment": "TEXT",
    "telemetry_sdk_name": "TEXT",
    "telemetry_sdk_language": "TEXT",
    "telemetry_sdk_version": "TEXT",
    "otel_resource_attributes": "TEXT",  # JSON object
    "created_at": "TEXT NOT NULL",  # when the row was written (Logfire's internal column)
}

#: The events of a rollout's life that the dashboard and ``stats --check`` count.
ROLLOUT_MESSAGES: Final = (
    "fleet_rollout_started",
    "fleet_rollout_completed",
    "fleet_provisioning_completed",
)
#: ``rollout_events``: those records' counted attributes as plain columns, kept
#: by a trigger as records are written, so that aggregates over hundreds of
#: thousands of records read small rows and parse no JSON. Its rows are stored
#: in the order of its key (message, service, time, the record's rowid): the
#: rows one kind of event of one service lie together, in time order, so a
#: query over them reads the table in one sweep. Column → the expression over
#: a ``records`` row that fills it.
ROLLOUT_EVENT_COLUMNS: Final[Mapping[str, str]] = {
    "message": "message",
    "service_name": "COALESCE(service_name, '')",  # a key column: never NULL
    "start_timestamp": "start_timestamp",
    "record_id": "rowid",
    "process_pid": "process_pid",
    "service_instance_id": "service_instance_id",
    **{
        name: f"attributes->>'{name}'"
        for name in (
            "batch_id",
            "rollout_id",
            "task_key",
            "env_key",
            "failure_reason",
            "error_message",
            "reward",
            "duration_s",
            "provisioning_time_s",
            "instance_s",
            "prompt_tokens",
            "completion_tokens",
            "policy_calls",
            "tool_calls",
        )
    },
}
_ROLLOUT_IN: Final = ", ".join(f"'{m}'" for m in ROLLOUT_MESSAGES)
#: The same rows read straight from ``records``: what a query uses on a store
#: written before ``rollout_events`` existed (opened read-only, it cannot be added).
ROLLOUT_EVENTS_FROM_RECORDS: Final = (
    "(SELECT "
    + ", ".join(f"{expr} AS {name}" for name, expr in ROLLOUT_EVENT_COLUMNS.items())
    + f" FROM records WHERE message IN ({_ROLLOUT_IN}))"
)
_ROLLOUT_KEY: Final = ("message", "service_name", "start_timestamp", "record_id")

SCHEMA_VERSION: Final = 2
SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS records (\n    "
    + ",\n    ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
    + "\n);\n"
    "CREATE INDEX IF NOT EXISTS records_start_timestamp ON records (start_timestamp);\n"
    "CREATE INDEX IF NOT EXISTS records_message ON records (message);\n"
    "CREATE INDEX IF NOT EXISTS records_rollout_id ON records (attributes->>'rollout_id');\n"
    "CREATE INDEX IF NOT EXISTS records_batch_id ON records (attributes->>'batch_id', message);\n"
    "CREATE TABLE IF NOT EXISTS rollout_events (\n    "
    + ",\n    ".join(
        f"{name} NOT NULL" if name in _ROLLOUT_KEY else name for name in ROLLOUT_EVENT_COLUMNS
    )
    + f",\n    PRIMARY KEY ({', '.join(_ROLLOUT_KEY)})\n) WITHOUT ROWID;\n"
    "CREATE INDEX IF NOT EXISTS rollout_events_batch ON rollout_events (batch_id, message);\n"
    # Ranks provisioning times (the dashboard's p50 and p95).
    "CREATE INDEX IF NOT EXISTS rollout_events_provisioning"
    " ON rollout_events (message, service_name, provisioning_time_s);\n"
    # Covers the GRPO groups' reward spread (the dashboard's uniform groups).
    "CREATE INDEX IF NOT EXISTS rollout_events_groups"
    " ON rollout_events (message, service_name, batch_id, task_key, reward);\n"
    # With the key, covers the count of starts and completions per rollout
    # (lost, re-run, in flight).
    "CREATE INDEX IF NOT EXISTS rollout_events_rollout ON rollout_events (rollout_id);\n"
    "CREATE TRIGGER IF NOT EXISTS records_rollout_events AFTER INSERT ON records\n"
    f"WHEN NEW.message IN ({_ROLLOUT_IN}) BEGIN\n"
    f"    INSERT INTO rollout_events ({', '.join(ROLLOUT_EVENT_COLUMNS)}) VALUES ("
    + ", ".join(
        expr.replace("service_name", "NEW.service_name") if "(" in expr else f"NEW.{expr}"
        for expr in ROLLOUT_EVENT_COLUMNS.values()
    )
    + ");\nEND;\n"
)
#: Fills ``rollout_events`` from the records of a store made before it existed.
_BACKFILL: Final = (
    f"INSERT INTO rollout_events ({', '.join(ROLLOUT_EVENT_COLUMNS)}) "
    f"SELECT {', '.join(ROLLOUT_EVENT_COLUMNS.values())} "
    f"FROM records WHERE message IN ({_ROLLOUT_IN})"
)
_INSERT: Final = (
    f"INSERT INTO records ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
)

# Logfire attributes that become columns (or only steer the SDK): not kept
# in `attributes`, as in Logfire's own table.
_COLUMN_ATTRIBUTES: Final = frozenset(
    {
        "logfire.msg",
        "logfire.msg_template",
        "logfire.level_num",
        "logfire.span_type",
        "logfire.tags",
        "logfire.json_schema",
        "logfire.disable_console_log",
    }
)


def is_disabled(path: str | os.PathLike[str]) -> bool:
    """A store path of ``/dev/null`` (``os.devnull``) turns the local store off."""
    return os.fspath(path) in (os.devnull, "")


def level_num(level: str | int | None) -> int | None:
    """Severity number of a level name (numbers pass through)."""
    if level is None or isinstance(level, int):
        return level
    return LEVEL_NUMBERS.get(str(level).lower())


def level_name(number: int | str | None) -> str | None:
    """Level name of a severity number: the nearest named level at or below it."""
    if number is None or isinstance(number, str):
        return number
    exact = LEVEL_NAMES.get(number)
    if exact is not None:
        return exact
    name = "trace"
    for num, candidate in LEVEL_NAMES.items():
        if number >= num:
            name = candidate
    return name


def connect(
    path: str | os.PathLike[str],
    *,
    readonly: bool = False,
    busy_timeout_s: float = 10.0,
) -> sqlite3.Connection:
    """Open the store: read-write (creating it and its schema), or read-only.

    A read-only connection is opened with ``mode=ro`` and ``PRAGMA
    query_only``, so SQLite itself refuses any write. Both kinds get the SQL
    functions ``level_num`` and ``level_name``.

    Raises:
        StoreError: the file does not exist (read-only) or cannot be opened.
    """
    path = Path(path)
    try:
        if readonly:
            if not path.is_file():
                raise StoreError(f"no telemetry store at {path}")
            uri = f"{path.resolve().as_uri()}?mode=ro"
            conn = sqlite3.connect(
                uri, uri=True, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA query_only = 1")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            _retry_busy(lambda: _prepare(conn), busy_timeout_s)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(
            f"cannot open the telemetry store {path}: {exc} "
            "(set telemetry.db_path, or /dev/null to turn the store off)"
        ) from exc
    conn.create_function("level_num", 1, level_num, deterministic=True)
    conn.create_function("level_name", 1, level_name, deterministic=True)
    return conn


def _prepare(conn: sqlite3.Connection) -> None:
    # WAL lets readers and one writer at a time work at once, across processes;
    # synchronous=NORMAL keeps every commit across a process crash (only a
    # power loss can take the last commits back).
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version < SCHEMA_VERSION:
        # Idempotent statements in one transaction: two processes creating
        # the store at once both succeed, one after the other.
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read again under the lock: another process may have done it meanwhile.
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version < SCHEMA_VERSION:
                for statement in _statements(SCHEMA):
                    conn.execute(statement)
                if version >= 1:  # records written before rollout_events existed
                    conn.execute(_BACKFILL)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def _statements(script: str) -> Iterator[str]:
    """The statements of ``script``, whole (a trigger's body holds semicolons too)."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            yield statement
            statement = ""


def _is_busy(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _retry_busy(action: Callable[[], None], budget_s: float) -> None:
    """Run ``action``; while another process holds the lock, retry with backoff."""
    deadline = time.monotonic() + budget_s
    delay = 0.005
    while True:
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


# -- spans to rows -------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _iso_seconds(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    seconds, rest = divmod(ns, 1_000_000_000)
    return f"{_iso_seconds(seconds)}.{rest // 1000:06d}Z"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def _plain(value: Any) -> Any:
    # OpenTelemetry attribute values: str, bool, int, float, or tuples of them.
    return list(value) if isinstance(value, tuple) else value


@functools.lru_cache(maxsize=1024)
def _json_keys(raw_schema: str) -> frozenset[str]:
    """Keys whose values logfire JSON-encoded (dicts, lists, None...), from its schema."""
    try:
        properties = json.loads(raw_schema).get("properties", {})
    except (ValueError, AttributeError):
        return frozenset()
    return frozenset(key for key, schema in properties.items() if schema)


def _attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes as Logfire shows them: JSON-encoded values decoded again."""
    raw_schema = attrs.get("logfire.json_schema")
    encoded = _json_keys(raw_schema) if isinstance(raw_schema, str) else frozenset()
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if key in _COLUMN_ATTRIBUTES:
            continue
        if key in encoded and isinstance(value, str):
            # logfire serialised a dict/list/None/... as JSON: store the value itself.
            try:
                out[key] = json.loads(value)
                continue
            except ValueError:
                pass
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


_resource_cache: dict[int, tuple[Resource, tuple[Any, ...]]] = {}


def _resource_columns(resource: Resource) -> tuple[Any, ...]:
    cached = _resource_cache.get(id(resource))
    if cached is not None and cached[0] is resource:
        return cached[1]
    r = resource.attributes
    env = r.get("deployment.environment.name", r.get("deployment.environment"))
    pid = r.get("process.pid")
    columns = (
        r.get("service.name"),
        r.get("service.version"),
        r.get("service.namespace"),
        r.get("service.instance.id"),
        int(pid) if isinstance(pid, int | str) and str(pid).isdigit() else None,
        env,
        r.get("telemetry.sdk.name"),
        r.get("telemetry.sdk.language"),
        r.get("telemetry.sdk.version"),
        _json({k: _plain(v) for k, v in r.items()}),
    )
    if len(_resource_cache) > 64:
        _resource_cache.clear()
    _resource_cache[id(resource)] = (resource, columns)
    return columns


def span_to_row(span: ReadableSpan, *, created_at: str | None = None) -> tuple[Any, ...]:
    """One ``records`` row (values in :data:`COLUMNS` order) for a finished span."""
    # One plain copy: reading OpenTelemetry's BoundedAttributes key by key is slow.
    attrs: dict[str, Any] = dict(span.attributes or {})
    ctx = span.get_span_context()
    if ctx is None:
        raise ValueError(f"span {span.name!r} has no context")
    span_type = str(attrs.get("logfire.span_type", "span"))
    kind = "log" if span_type == "log" else "span"
    status = span.status
    level_number = attrs.get("logfire.level_num")
    if isinstance(level_number, int):
        level = level_name(level_number) or "info"
    else:
        level = "error" if status.status_code.name == "ERROR" else "info"
    duration: float | None = None
    if kind != "log" and span.start_time is not None and span.end_time is not None:
        duration = (span.end_time - span.start_time) / 1e9
    events = [
        {
            "name": e.name,
            "timestamp": _iso(e.timestamp),
            "attributes": {k: _plain(v) for k, v in (e.attributes or {}).items()},
        }
        for e in span.events
    ]
    exception: Mapping[str, Any] | None = next(
        (e.attributes or {} for e in span.events if e.name == "exception"), None
    )
    links = [
        {
            "trace_id": format_trace_id(link.context.trace_id),
            "span_id": format_span_id(link.context.span_id),
            "attributes": {k: _plain(v) for k, v in (link.attributes or {}).items()},
        }
        for link in span.links
    ]
    scope = span.instrumentation_scope
    start = _iso(span.start_time)
    tags = attrs.get("logfire.tags") or ()
    message = attrs.get("logfire.msg", span.name)
    return (
        start,
        start if span.end_time == span.start_time else _iso(span.end_time),
        duration,
        format_trace_id(ctx.trace_id),
        format_span_id(ctx.span_id),
        format_span_id(span.parent.span_id) if span.parent is not None else None,
        kind,
        level,
        str(attrs.get("logfire.msg_template", span.name)),
        str(message),
        _json(_attributes(attrs)),
        _json(list(tags) if isinstance(tags, tuple | list) else [str(tags)]),
        status.status_code.name,
        status.description,
        _json(events) if events else None,
        _json(links) if links else None,
        scope.name if scope else None,
        scope.version if scope else None,
        1 if exception is not None else 0,
        exception.get("exception.type") if exception else None,
        exception.get("exception.message") if exception else None,
        exception.get("exception.stacktrace") if exception else None,
        *_resource_columns(span.resource),
        created_at or _iso(time.time_ns()),
    )


@dataclass(frozen=True, slots=True)
class EventOrigin:
    """What every event record of one Logfire set-up shares: its resource and its
    logs' instrumentation scope."""

    resource: Resource
    scope_name: str | None
    scope_version: str | None


@dataclass(frozen=True, slots=True)
class EventRecord:
    """An event to store as the row Logfire's log of it would make, with no span made
    (:class:`fleetroll.telemetry.sinks.StoreSink`)."""

    time_ns: int
    trace_id: int
    span_id: int
    parent_span_id: int | None
    level: str
    name: str
    attributes: Mapping[str, Any]  # ``code.*`` first, then the event's
    origin: EventOrigin


def event_to_row(record: EventRecord, *, created_at: str | None = None) -> tuple[Any, ...]:
    """One ``records`` row (values in :data:`COLUMNS` order) for an event record:
    the row :func:`span_to_row` makes of Logfire's log of the same event."""
    start = _iso(record.time_ns)
    parent = record.parent_span_id
    return (
        start,
        start,
        None,
        format_trace_id(record.trace_id),
        format_span_id(record.span_id),
        format_span_id(parent) if parent is not None else None,
        "log",
        record.level,
        record.name,
        record.name,
        _json({k: _plain(v) for k, v in record.attributes.items()}),
        "[]",
        # Logfire marks a log at error level or above as an error span too.
        "ERROR" if (level_num(record.level) or 0) >= LEVEL_NUMBERS["error"] else "UNSET",
        None,
        None,
        None,
        record.origin.scope_name,
        record.origin.scope_version,
        0,
        None,
        None,
        None,
        *_resource_columns(record.origin.resource),
        created_at or _iso(time.time_ns()),
    )


# -- the writer ----------------------------------------------------------------


@dataclass(slots=True)
class _Flush:
    done: threading.Event
    failed_before: int


_STOP: Final = object()


class SQLiteSpanProcessor(SpanProcessor):
    """Writes every finished span/log into the store, batched, off the caller's thread.

    ``on_end`` never blocks: when the queue (``max_queued`` spans) is full the
    span is counted in :attr:`dropped` and let go, so a stalled disk slows
    nothing down. Several processes may write the same file at once.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flush_interval_s: float = 0.2,
        flush_records: int = 512,
        max_queued: int = 100_000,
        busy_timeout_s: float = 10.0,
        shutdown_timeout_s: float = 10.0,
    ) -> None:
        """Open (or create) the store and start its writer thread.

        Raises:
            StoreError: the file cannot be opened or created.
        """
        self.path = Path(path)
        self._interval = flush_interval_s
        self._batch = max(1, flush_records)
        self._busy_timeout = busy_timeout_s
        self._shutdown_timeout = shutdown_timeout_s
        self._conn = connect(self.path, busy_timeout_s=busy_timeout_s)
        # A SimpleQueue (no lock and condition around each put, as Queue has):
        # records are put from the event loop's thread, one per event.
        self._queue: queue.SimpleQueue[ReadableSpan | EventRecord | _Flush | object] = (
            queue.SimpleQueue()
        )
        self._max_queued = max_queued
        self._closed = False
        self._lock = threading.Lock()
        #: Spans let go because the queue was full.
        self.dropped = 0
        #: Spans lost because a batch could not be written (logged).
        self.failed = 0
        #: Rows committed.
        self.written = 0
        self._thread = threading.Thread(
            target=self._run, name=f"fleetroll-telemetry-writer:{self.path.name}", daemon=True
        )
        self._thread.start()

    # SpanProcessor -----------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._closed:
            return
        if (span.attributes or {}).get("logfire.span_type") == "pending_span":
            return
        self._put(span)

    def record(self, event: EventRecord) -> None:
        """Store an event record; never blocks (a full queue drops it, as ``on_end``)."""
        if not self._closed:
            self._put(event)

    def _put(self, item: ReadableSpan | EventRecord) -> None:
        if self._queue.qsize() >= self._max_queued:
            self.dropped += 1
        else:
            self._queue.put(item)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Commit everything queued so far.

        Returns True once it is committed; False if that took over
        ``timeout_millis``, or if some of it could not be written.
        """
        if self._closed or not self._thread.is_alive():
            return not self._thread.is_alive() and self._queue.empty()
        marker = _Flush(threading.Event(), self.failed)
        deadline = time.monotonic() + timeout_millis / 1000
        self._queue.put(marker)  # a control marker is never dropped
        done = marker.done.wait(max(0.0, deadline - time.monotonic()))
        return done and self.failed == marker.failed_before

    def shutdown(self) -> None:
        """Commit what is queued, stop the writer and close the file (bounded in time)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join(self._shutdown_timeout)
        if self._thread.is_alive():
            _log.warning(
                "telemetry store %s: writer did not finish within %g s; unflushed records are lost",
                self.path,
                self._shutdown_timeout,
            )

    # the writer thread -------------------------------------------------------

    def _run(self) -> None:
        pending: list[ReadableSpan | EventRecord] = []
        waiters: list[_Flush] = []
        due = 0.0
        stop = False
        try:
            while not stop:
                timeout = max(0.0, due - time.monotonic()) if pending else None
                try:
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    item = None
                while item is not None:
                    if item is _STOP:
                        stop = True
                    elif isinstance(item, _Flush):
                        waiters.append(item)
                    elif isinstance(item, ReadableSpan | EventRecord):
                        if not pending:
                            due = time.monotonic() + self._interval
                        pending.append(item)
                    if stop or waiters or len(pending) >= self._batch:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
                if pending and (
                    stop or waiters or len(pending) >= self._batch or time.monotonic() >= due
                ):
                    self._write(pending)
                    pending = []
                for waiter in waiters:
                    waiter.done.set()
                waiters = []
        finally:
            self._conn.close()

    def _write(self, spans: Sequence[ReadableSpan | EventRecord]) -> None:
        created = _iso(time.time_ns())
        rows = list(self._rows(spans, created))
        if not rows:
            return

        def commit() -> None:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(_INSERT, rows)
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

        try:
            _retry_busy(commit, self._busy_timeout * 3)
        except Exception as exc:  # the writer thread must outlive a bad batch
            self.failed += len(rows)
            _log.error("telemetry store %s: %d records lost: %s", self.path, len(rows), exc)
        else:
            self.written += len(rows)

    def _rows(
        self, spans: Iterable[ReadableSpan | EventRecord], created: str | None
    ) -> Iterator[tuple[Any, ...]]:
        for span in spans:
            try:
                if isinstance(span, EventRecord):
                    yield event_to_row(span, created_at=created)
                else:
                    yield span_to_row(span, created_at=created)
            except Exception:  # one malformed span must not cost the batch
                self.failed += 1
                _log.exception("telemetry store %s: cannot store span %r", self.path, span.name)
