"""Logfire's SQL on the local store: the translation and the functions behind it (no emulator)."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from telemetry_helpers import insert_event

from fleetroll.telemetry.dialect import (
    fr_date_bin,
    fr_date_trunc,
    fr_extract,
    interval_seconds,
    translate,
)
from fleetroll.telemetry.queries import QueryError, ReadOnlyError, query

Store = tuple[Path, sqlite3.Connection]


def _ts(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5 minutes", 300),
        ("1 hour 30 minutes", 5400),
        ("90 seconds", 90),
        ("1.5 hours", 5400),
        ("2 days", 172800),
        ("1 week", 604800),
        ("250 milliseconds", 0.25),
        ("1 min", 60),
    ],
)
def test_interval_literals_are_counted_in_seconds(text: str, seconds: float) -> None:
    assert interval_seconds(text) == pytest.approx(seconds)


def test_an_interval_in_months_is_refused_with_a_reason() -> None:
    with pytest.raises(QueryError, match=r"(?i)'month' has no fixed length"):
        translate("SELECT now() - interval '1 month'")


def test_date_trunc_and_time_bucket_give_the_store_timestamp_text() -> None:
    ts = "2026-03-04T05:06:07.891011Z"
    assert fr_date_trunc("minute", ts) == "2026-03-04T05:06:00.000000Z"
    assert fr_date_trunc("hour", ts) == "2026-03-04T05:00:00.000000Z"
    assert fr_date_trunc("day", ts) == "2026-03-04T00:00:00.000000Z"
    assert fr_date_trunc("week", ts) == "2026-03-02T00:00:00.000000Z"  # a Monday
    assert fr_date_trunc("month", ts) == "2026-03-01T00:00:00.000000Z"
    assert fr_date_bin(300, ts) == "2026-03-04T05:05:00.000000Z"
    assert fr_extract("hour", ts) == 5
    assert fr_extract("second", ts) == pytest.approx(7.891011)


def test_json_keys_are_kept_as_written_so_dotted_keys_and_the_store_indexes_work() -> None:
    sql = translate(
        "SELECT attributes->>'gen_ai.request.model', attributes->'counts'->>'timeout' "
        "FROM records WHERE attributes->>'batch_id' = 'b'"
    )
    assert "attributes ->> 'gen_ai.request.model'" in sql
    assert "attributes -> 'counts' ->> 'timeout'" in sql
    assert "attributes ->> 'batch_id' = 'b'" in sql


def test_a_filter_on_batch_id_in_logfires_syntax_uses_the_stores_index(store: Store) -> None:
    _, conn = store
    insert_event(conn, "fleet_rollout_started", batch_id="b")
    sql = translate(
        "SELECT count(*) FROM records WHERE attributes->>'batch_id' = 'b' "
        "AND message = 'fleet_rollout_started'"
    )
    plan = " ".join(str(row[-1]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
    assert "records_batch_id" in plan


def test_a_cast_after_an_arrow_casts_the_value_not_the_key(store: Store) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_completed", reward="0.75")
    rows = query(db, "SELECT attributes->>'reward'::float AS r FROM records").rows
    assert rows == [(0.75,)]


def test_now_minus_an_interval_selects_the_recent_records(store: Store) -> None:
    db, conn = store
    now = datetime.now(UTC)
    for n, age in enumerate((timedelta(hours=2), timedelta(minutes=10), timedelta(seconds=30))):
        insert_event(conn, "fleet_rollout_started", n=n, at=_ts(now - age), rollout_id=f"r{n}")
    sql = (
        "SELECT attributes->>'rollout_id' FROM records "
        "WHERE start_timestamp > now() - interval '{}' ORDER BY 1"
    )
    assert query(db, sql.format("5 minutes")).rows == [("r2",)]
    assert query(db, sql.format("1 hour")).rows == [("r1",), ("r2",)]
    assert query(db, sql.format("1 day")).rows == [("r0",), ("r1",), ("r2",)]


def test_timestamp_literals_compare_as_times_whatever_their_spelling(store: Store) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_started", at="2026-01-01T09:30:00.000000Z")
    insert_event(conn, "fleet_rollout_started", at="2026-01-01T10:30:00.000000Z")
    for literal in ("'2026-01-01 10:00:00'", "'2026-01-01T10:00:00Z'", "'2026-01-01 11:00+01:00'"):
        sql = f"SELECT count(*) FROM records WHERE start_timestamp >= {literal}"
        assert query(db, sql).rows == [(1,)], literal
        sql = f"SELECT count(*) FROM records WHERE start_timestamp >= {literal}::timestamp"
        assert query(db, sql).rows == [(1,)], literal


def test_the_difference_of_two_timestamps_is_seconds_for_extract_epoch(store: Store) -> None:
    db, conn = store
    insert_event(conn, "a", at="2026-01-01T10:00:00.000000Z")
    insert_event(conn, "b", at="2026-01-01T10:02:30.500000Z")
    rows = query(
        db,
        "SELECT extract(epoch from max(start_timestamp) - min(start_timestamp)), "
        "max(start_timestamp) - min(start_timestamp) > interval '2 minutes', "
        "extract(epoch from min(start_timestamp)) FROM records",
    ).rows
    assert rows == [(150.5, 1, 1767261600.0)]


def test_levels_compare_by_severity_as_on_logfire(store: Store) -> None:
    db, conn = store
    for n, level in enumerate(("debug", "info", "warn", "error", "fatal")):
        insert_event(conn, "e", n=n, level=level)
    assert query(db, "SELECT count(*) FROM records WHERE level > 'info'").rows == [(3,)]
    sql = "SELECT count(*) FROM records WHERE level >= level_num('error')"
    assert query(db, sql).rows == [(2,)]
    assert query(db, "SELECT count(*) FROM records WHERE level = 'warn'").rows == [(1,)]


def test_percentiles_interpolate_and_follow_the_order(store: Store) -> None:
    db, conn = store
    for n in range(1, 11):
        insert_event(conn, "fleet_rollout_completed", n=n, duration_s=float(n))
    x = "(attributes->>'duration_s')::float"
    [row] = query(
        db,
        f"SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY {x}), "
        f"percentile_cont(0.05) WITHIN GROUP (ORDER BY {x} DESC), "
        f"percentile_disc(0.5) WITHIN GROUP (ORDER BY {x}), "
        f"approx_percentile_cont({x}, 0.5), "
        f"approx_percentile_cont(0.5) WITHIN GROUP (ORDER BY {x}), "
        f"median({x}), approx_median({x}) FROM records",
    ).rows
    assert row == pytest.approx((9.55, 9.55, 5.0, 5.5, 5.5, 5.5, 5.5))


def test_ilike_count_with_no_argument_and_stddev_run(store: Store) -> None:
    db, conn = store
    for n, value in enumerate((2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0)):
        insert_event(conn, "Fleet_Rollout_Completed", n=n, reward=value)
    [row] = query(
        db,
        "SELECT COUNT(), stddev_pop((attributes->>'reward')::float), "
        "count(*) FILTER (WHERE message ILIKE '%rollout_completed') FROM records",
    ).rows
    assert row == (8, pytest.approx(2.0), 8)


def test_a_syntax_error_names_the_line_column_and_token() -> None:
    with pytest.raises(QueryError, match=r"line 2, column 6 near 'records'"):
        translate("SELECT count(*)\nFORM records")


def test_an_unknown_column_is_named_with_where_it_is_in_the_users_sql(store: Store) -> None:
    db, _ = store
    with pytest.raises(QueryError) as caught:
        query(db, "SELECT date_trunc('minute', start_timestamp),\n  rewrd::float FROM records")
    assert str(caught.value).startswith("no such column: rewrd at line 2, column 3")
    assert "fleetroll query --schema" in str(caught.value)
    assert "FR_" not in str(caught.value) and "fr_" not in str(caught.value)


def test_an_unknown_function_is_named_with_where_it_is(store: Store) -> None:
    db, _ = store
    with pytest.raises(QueryError, match="no such function: FROBNICATE at line 1, column 8"):
        query(db, "SELECT frobnicate(duration) FROM records")


def test_a_bad_value_for_a_time_function_says_what_is_wrong(store: Store) -> None:
    db, conn = store
    insert_event(conn, "e")
    with pytest.raises(QueryError, match="'yesterday' is not a timestamp"):
        query(db, "SELECT date_trunc('hour', 'yesterday') FROM records")


def test_two_statements_are_refused_before_anything_runs(store: Store) -> None:
    db, _ = store
    with pytest.raises(QueryError, match="exactly one SQL statement"):
        query(db, "SELECT 1; DELETE FROM records")


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM records WHERE start_timestamp < now() - interval '1 day'",
        "UPDATE records SET level = 'info' WHERE level ILIKE 'ERROR'",
        "INSERT INTO records (message) SELECT message::text FROM records",
    ],
)
def test_writes_in_logfires_syntax_are_refused_after_translation(store: Store, sql: str) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_started", level="error")
    with pytest.raises(ReadOnlyError, match="read-only"):
        query(db, sql)
    assert query(db, "SELECT count(*), min(level) FROM records").rows == [(1, "error")]


def test_sqlite_functions_written_before_still_answer_as_sqlite_does(store: Store) -> None:
    db, conn = store
    insert_event(conn, "e", at="2026-01-01T10:30:00.000000Z", env_key="ledger")
    [row] = query(
        db,
        "SELECT json_extract(attributes, '$.env_key'), attributes->'env_key', "
        "strftime('%H', start_timestamp), json_each.value "
        "FROM records, json_each(records.attributes)",
    ).rows
    assert row == ("ledger", '"ledger"', "10", "ledger")


def test_parameters_and_sqlite_datetimes_compare_with_timestamps_as_times(store: Store) -> None:
    db, conn = store
    insert_event(conn, "e", at="2026-01-01T10:30:00.000000Z")
    sql = "SELECT count(*) FROM records WHERE start_timestamp >= :since"
    assert query(db, sql, {"since": "2026-01-01 10:00:00"}).rows == [(1,)]
    assert query(db, sql, {"since": "2026-01-01T11:00:00Z"}).rows == [(0,)]
    sql = "SELECT count(*) FROM records WHERE start_timestamp < datetime('2026-01-01 11:00:00')"
    assert query(db, sql).rows == [(1,)]


def test_a_query_answers_while_another_process_holds_the_write_lock(store: Store) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_started", n=1)
    conn.execute("BEGIN IMMEDIATE")  # a writer mid-transaction, as another process would be
    try:
        insert_event(conn, "fleet_rollout_started", n=2)
        sql = "SELECT count(*) FROM records WHERE start_timestamp > now() - interval '3650 days'"
        assert query(db, sql, timeout_s=5).rows == [(1,)]  # committed rows only, no wait
    finally:
        conn.execute("COMMIT")
    assert query(db, sql).rows == [(2,)]


def test_postgresql_that_sqlite_cannot_run_is_named_with_where_it_is(store: Store) -> None:
    db, _ = store
    with pytest.raises(QueryError) as caught:
        query(db, "SELECT message FROM records\nWHERE message SIMILAR TO 'fleet%'")
    assert str(caught.value).startswith(
        "the local store has no SQL for 'SIMILAR' at line 2, column 15"
    )


def test_an_alias_cast_to_timestamp_takes_interval_arithmetic(store: Store) -> None:
    db, conn = store
    insert_event(conn, "e", at="2026-01-01T10:30:00.000000Z")
    sql = (
        "WITH t AS (SELECT start_timestamp AS at FROM records) "
        "SELECT at::timestamp - interval '90 minutes' AS earlier FROM t"
    )
    assert query(db, sql).rows == [("2026-01-01T09:00:00.000000Z",)]


def test_the_rest_of_the_documented_functions_answer_as_postgresql_does(store: Store) -> None:
    db, conn = store
    for n, (env, value) in enumerate([("ledger", 1.0), ("desktop", 2.0), ("ledger", 4.0)]):
        insert_event(conn, "e", at=f"2026-01-0{n + 1}T0{n}:00:00.000000Z", env_key=env, v=value)
    [row] = query(
        db,
        "SELECT array_agg(attributes->>'env_key') AS envs, "
        "count(*) FILTER (WHERE attributes->>'env_key' ~ '^led') AS led, "
        "var_pop((attributes->>'v')::float) AS var_pop, "
        "variance((attributes->>'v')::float) AS var, "
        "max(date_part('hour', start_timestamp)) AS hour, "
        "min(start_timestamp) < current_date AS past, "
        "max(extract(doy from start_timestamp)) AS doy FROM records",
    ).dicts()
    assert row == {
        "envs": '["ledger", "desktop", "ledger"]',
        "led": 2,
        "var_pop": pytest.approx(14 / 9),
        "var": pytest.approx(7 / 3),
        "hour": 2,
        "past": 1,
        "doy": 3,
    }
