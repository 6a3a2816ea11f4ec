"""The local store: Logfire's columns, batched commits, several writers, crashes."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from telemetry_helpers import PYTHON, child_env, local_settings

from fleetroll.errors import FleetrollError
from fleetroll.telemetry import Telemetry
from fleetroll.telemetry.events import Event
from fleetroll.telemetry.sinks import LogfireSink, StoreSink
from fleetroll.telemetry.store import COLUMNS, SQLiteSpanProcessor, StoreError, connect


def rows(db: Path, sql: str, *params: object) -> list[sqlite3.Row]:
    conn = connect(db, readonly=True)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def test_events_become_records_with_logfire_columns_and_json_attributes(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    settings = local_settings(db, telemetry={"environment": "staging"})
    with Telemetry(
        settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
    ) as telemetry:
        events = telemetry.events
        with events.bind(batch_id="b1", rollout_id="r1", env_key="ledger", modality="tool_use"):
            events.emit("fleet_rollout_started")
            events.emit(
                "fleet_rollout_completed",
                level="warn",
                status="failed",
                failure_reason=None,
                reward=0.25,
                step_count=3,
                counts={"completed": 3, "init_error": 1},
                tools=["a", "b"],
            )
        assert telemetry.flush(30)
        [started, completed] = rows(db, "SELECT * FROM records ORDER BY start_timestamp")

    assert completed["message"] == completed["span_name"] == "fleet_rollout_completed"
    assert (completed["kind"], completed["level"], completed["duration"]) == ("log", "warn", None)
    assert started["level"] == "info"
    assert completed["service_name"] == "fleetroll"
    assert completed["deployment_environment"] == "staging"
    assert len(completed["trace_id"]) == 32 and len(completed["span_id"]) == 16
    assert completed["otel_status_code"] == "UNSET" and completed["is_exception"] == 0
    assert completed["start_timestamp"] >= started["start_timestamp"]
    [[env, reason, reward, init_errors, second_tool, reward_type, where]] = rows(
        db,
        "SELECT attributes->>'env_key', attributes->>'failure_reason', attributes->>'reward',"
        " attributes->'counts'->>'init_error', attributes->'tools'->>1,"
        " json_type(attributes, '$.reward'), attributes->>'$.\"code.filepath\"'"
        " FROM records WHERE message = 'fleet_rollout_completed'",
    )
    assert (env, reason, reward, init_errors, second_tool) == ("ledger", None, 0.25, 1, "b")
    assert reward_type == "real"
    # The code location is where the event was emitted, not the sink inside fleetroll.telemetry.
    assert where.endswith("test_telemetry_store.py")
    # Logfire's own bookkeeping attributes live in columns, not in `attributes`.
    assert not rows(db, "SELECT 1 FROM records WHERE attributes LIKE '%logfire.msg%'")


def test_without_logfire_cloud_an_event_s_row_is_the_row_of_logfire_s_log_of_it(
    tmp_path: Path,
) -> None:
    """The store sink (no span per event) writes what Logfire's log of the event made:
    every column but the ids and times, ``code.*`` where it was emitted, the current
    span as parent."""
    db = tmp_path / "t.db"
    with Telemetry(local_settings(db).telemetry) as telemetry:
        assert telemetry.store is not None
        [through_store] = [s for s in telemetry.events.sinks if isinstance(s, StoreSink)]
        assert not any(isinstance(s, LogfireSink) for s in telemetry.events.sinks)
        through_logfire = LogfireSink(telemetry.logfire)
        attributes = {
            "env_key": "ledger",
            "reward": 0.25,
            "failure_reason": None,
            "ok": True,
            "step_count": 3,
            "counts": {"completed": 3, "init_error": 1},
            "tools": ["a", "b"],
            "note": "naïve ✓",
        }
        for level in ("debug", "info", "warn", "error"):
            event = Event("fleet_rollout_completed", level, attributes)
            for sink in (through_logfire, through_store):
                sink.emit(event)
        with telemetry.logfire.span("batch"):
            for sink in (through_logfire, through_store):
                sink.emit(Event("fleet_rollout_started", "info", {"rollout_id": "r1"}))
        assert telemetry.flush(30)
    records = rows(db, "SELECT * FROM records WHERE kind = 'log' ORDER BY rowid")
    [span] = rows(db, "SELECT * FROM records WHERE kind = 'span'")
    assert len(records) == 10
    differ = {"start_timestamp", "end_timestamp", "span_id", "trace_id", "created_at"}
    for logged, stored in zip(records[::2], records[1::2], strict=True):
        logged_attrs, stored_attrs = (
            json.loads(logged["attributes"]),
            json.loads(stored["attributes"]),
        )
        assert list(stored_attrs.items()) == list(logged_attrs.items())  # code.lineno too
        assert stored_attrs["code.filepath"].endswith("test_telemetry_store.py")
        for column in COLUMNS:
            if column not in differ | {"attributes"}:
                assert stored[column] == logged[column], column
        assert len(stored["trace_id"]) == 32 and len(stored["span_id"]) == 16
    assert records[-1]["trace_id"] == records[-2]["trace_id"] == span["trace_id"]
    assert records[-1]["parent_span_id"] == span["span_id"]
    assert records[0]["trace_id"] != records[2]["trace_id"]  # no span: a trace of its own


def test_spans_and_exceptions_fill_the_span_columns(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with Telemetry(local_settings(db).telemetry) as telemetry:
        lf = telemetry.logfire
        with lf.span("provision {env_key}", env_key="ledger"):
            try:
                raise ValueError("no capacity")
            except ValueError:
                lf.exception("create failed")
        assert telemetry.flush(30)
    [span] = rows(db, "SELECT * FROM records WHERE kind = 'span'")
    [log] = rows(db, "SELECT * FROM records WHERE kind = 'log'")
    assert span["span_name"] == "provision {env_key}" and span["message"] == "provision ledger"
    assert span["duration"] is not None and span["duration"] >= 0
    assert span["end_timestamp"] >= span["start_timestamp"]
    assert log["parent_span_id"] == span["span_id"] and log["trace_id"] == span["trace_id"]
    assert log["is_exception"] == 1 and log["level"] == "error"
    assert (log["exception_type"], log["exception_message"]) == ("ValueError", "no capacity")
    assert "Traceback" in log["exception_stacktrace"]
    assert log["otel_status_code"] == "ERROR"


def test_the_store_is_a_wal_file_with_indexes_and_level_functions(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with Telemetry(local_settings(db).telemetry) as telemetry:
        telemetry.events.emit("fleet_make_retry", level="debug")
        telemetry.events.emit("fleet_tool_call_failed", level="warn")
        telemetry.events.emit("fleet_verifier_failed", level="error")
    conn = connect(db, readonly=True)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {"records_message", "records_rollout_id", "records_start_timestamp"} <= indexes
        plan = " ".join(
            str(r)
            for r in conn.execute(
                "EXPLAIN QUERY PLAN SELECT 1 FROM records WHERE attributes->>'rollout_id' = 'x'"
            )
        )
        assert "records_rollout_id" in plan
        notable = conn.execute(
            "SELECT message FROM records WHERE level_num(level) > level_num('info') ORDER BY 1"
        ).fetchall()
        assert [m for (m,) in notable] == ["fleet_tool_call_failed", "fleet_verifier_failed"]
        assert conn.execute("SELECT level_name(13), level_num('warn')").fetchone() == ("warn", 13)
    finally:
        conn.close()


def test_a_full_queue_drops_records_and_never_blocks_the_caller(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    store = SQLiteSpanProcessor(db, flush_records=5, max_queued=10, busy_timeout_s=0.05)
    provider = TracerProvider()
    provider.add_span_processor(store)
    tracer = provider.get_tracer("test")
    blocker = connect(db)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        for i in range(100):
            with tracer.start_as_current_span(f"s{i}"):
                pass
        assert store.dropped > 0
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    assert store.force_flush(30_000)
    provider.shutdown()
    (count,) = rows(db, "SELECT COUNT(*) FROM records")[0]
    assert count == store.written == 100 - store.dropped


def test_a_flush_is_a_commit_that_every_connection_sees_at_once(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with Telemetry(local_settings(db, telemetry={"flush_interval_s": 3600}).telemetry) as telemetry:
        for i in range(10):
            telemetry.events.emit("fleet_make_retry", i=i)
        assert telemetry.flush(30)
        assert rows(db, "SELECT COUNT(*) FROM records")[0][0] == 10
        assert telemetry.store is not None and telemetry.store.written == 10


def test_a_dev_null_store_path_turns_the_store_off(tmp_path: Path) -> None:
    with Telemetry(local_settings(Path("/dev/null")).telemetry) as telemetry:
        assert telemetry.store is None
        telemetry.events.emit("fleet_make_retry")
        assert telemetry.flush(5)


WRITER = """
import os, signal, sys
from fleetroll.settings import load_settings
from fleetroll.telemetry import Telemetry

db, tag, count, then = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
settings = load_settings(telemetry={
    "db_path": db, "send_to_logfire": False, "console_level": "error", "flush_records": 100,
})
telemetry = Telemetry(settings.telemetry, secrets=settings.secrets())
if then == "close":  # start together: wait for the parent's go
    print("ready", flush=True)
    sys.stdin.readline()
for i in range(count):
    telemetry.events.emit("fleet_make_retry", writer=tag, i=i)
if then == "close":
    telemetry.close()
else:
    assert telemetry.flush(60), "the flush did not finish"
    print("flushed", flush=True)
    for i in range(count, count + 500):
        telemetry.events.emit("fleet_make_retry", writer=tag, i=i)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def writer(db: Path, tag: str, count: int, then: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-c", WRITER, str(db), tag, str(count), then],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_processes_writing_one_store_at_once_lose_nothing(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    children = [writer(db, tag, 2000, "close") for tag in ("a", "b")]
    for child in children:  # both have the store open...
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    for child in children:  # ...and now write at once
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert "lost" not in err and "Traceback" not in err, err
    counts = dict(
        rows(
            db,
            "SELECT attributes->>'writer', COUNT(DISTINCT attributes->>'i') FROM records"
            " WHERE message = 'fleet_make_retry' GROUP BY 1",
        )
    )
    assert counts == {"a": 2000, "b": 2000}
    assert rows(db, "SELECT COUNT(*) FROM records")[0][0] == 4000
    # The writers' commits interleaved: each committed while the other was committing.
    spans = dict(
        (tag, (first, last))
        for tag, first, last in rows(
            db,
            "SELECT attributes->>'writer', MIN(created_at), MAX(created_at) FROM records"
            " GROUP BY 1",
        )
    )
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1], spans


@pytest.mark.slow
def test_records_flushed_before_a_kill_9_are_all_in_the_file(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    child = writer(db, "c", 2000, "flush-then-kill")
    out, err = child.communicate(timeout=120)
    assert out.strip() == "flushed", err
    assert child.returncode == -9
    kept = {i for (i,) in rows(db, "SELECT attributes->>'i' FROM records")}
    assert set(range(2000)) <= kept


def test_force_flush_waits_for_a_batch_in_progress_in_another_thread(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with Telemetry(local_settings(db).telemetry) as telemetry:
        done = threading.Event()

        def emit_many() -> None:
            for i in range(500):
                telemetry.events.emit("fleet_make_retry", i=i)
            done.set()

        thread = threading.Thread(target=emit_many)
        thread.start()
        thread.join(60)
        assert done.is_set()
        assert telemetry.flush(30)
        assert rows(db, "SELECT COUNT(*) FROM records")[0][0] == 500


def test_a_store_that_cannot_be_created_is_a_clear_fleetroll_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot open the telemetry store"):
        Telemetry(local_settings(blocker / "telemetry.db").telemetry)
    assert issubclass(StoreError, FleetrollError)  # so entry points exit 2 with one line
