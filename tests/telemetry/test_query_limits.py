"""Queries cannot hurt the process running them, and answer right or not at all (no emulator).

Regular expressions match in linear time (RE2), the aggregates computed in
Python hold at most ``max_bytes``, bad SQL is one line without the parser's
internals, and the Logfire forms SQLite would answer wrongly answer right or
fail saying why.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from telemetry_helpers import insert_event

from fleetroll.cli.main import main
from fleetroll.telemetry.dashboard import SinceError, parse_since
from fleetroll.telemetry.dialect import translate
from fleetroll.telemetry.queries import QueryError, query

Store = tuple[Path, sqlite3.Connection]

#: Exponential in a backtracking engine on "aaa…a!" (RE2: linear).
BACKTRACKING = r"^([a-z0-9._%-]+)+@[a-z]+\.com$"


def test_a_backtracking_pattern_gives_the_right_answer(store: Store) -> None:
    # Short enough for Python's `re` to finish too (what a backtracking pattern
    # does to a running service is tests/telemetry/test_query_service.py's).
    db, conn = store
    insert_event(conn, "a" * 16 + "!", n=1)
    insert_event(conn, "someone@example.com", n=2)
    sql = "SELECT count(*) FROM records WHERE message ~ ?"
    assert query(db, sql, [BACKTRACKING], timeout_s=5).rows == [(1,)]


def test_case_blind_and_negated_matches_run(store: Store) -> None:
    db, conn = store
    insert_event(conn, "Fleet_Rollout_Completed")
    [row] = query(
        db,
        "SELECT message ~ '^fleet', message ~* '^fleet', message !~* 'ROLLOUT', "
        "message !~ 'x' FROM records",
    ).rows
    assert row == (0, 1, 0, 1)


@pytest.mark.parametrize(
    ("pattern", "said"),
    [
        (r"(a)\1", "no backreferences or lookaround"),
        (r"a(?=b)", "no backreferences or lookaround"),
        ("(a", "missing )"),
    ],
)
def test_a_pattern_re2_cannot_run_is_refused_in_one_line(
    store: Store, pattern: str, said: str
) -> None:
    db, conn = store
    insert_event(conn, "ab")
    with pytest.raises(QueryError) as caught:
        query(db, "SELECT count(*) FROM records WHERE message ~ ?", [pattern])
    message = str(caught.value)
    assert f"regular expression {pattern!r}" in message and said in message
    assert "\n" not in message


def test_percentiles_hold_at_most_max_bytes_of_values_all_aggregates_together(
    store: Store,
) -> None:
    db, _ = store
    numbers = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 400) "
    median = "percentile_cont(0.5) WITHIN GROUP (ORDER BY i)"
    # 400 numbers of 8 bytes: one percentile fits in 4096 bytes, two at once do not.
    assert query(db, f"{numbers} SELECT {median} FROM n", max_bytes=4096).rows == [(200.5,)]
    with pytest.raises(QueryError, match=r"holds over the 4096 byte limit"):
        query(
            db,
            f"{numbers} SELECT {median}, percentile_disc(0.9) WITHIN GROUP (ORDER BY i) FROM n",
            max_bytes=4096,
        )
    # A group gives its share back when it is done: groups one after another fit.
    rows = query(db, f"{numbers} SELECT i % 2, {median} FROM n GROUP BY 1", max_bytes=4096).rows
    assert rows == [(0, 201.0), (1, 200.0)]


def test_array_agg_holds_at_most_max_bytes_and_says_which_setting(store: Store) -> None:
    db, _ = store
    sql = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000) "
        "SELECT array_agg(printf('%050d', i)) FROM n"
    )
    with pytest.raises(QueryError) as caught:
        query(db, sql, max_bytes=16 * 1024)
    assert "array_agg holds over the 16384 byte limit (service.query_max_bytes)" in str(
        caught.value
    )
    [(answer,)] = query(db, sql, max_bytes=1024 * 1024).rows
    assert answer.count(",") == 999


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT " + "(" * 600 + "1" + ")" * 600,
        "SELECT " + "1 + " * 3000 + "1",
        "SELECT " + "NOT " * 3000 + "1",
    ],
)
def test_sql_nested_too_deeply_to_parse_is_refused_in_one_line(sql: str) -> None:
    with pytest.raises(QueryError, match="nested too deeply"):
        translate(sql)


@pytest.mark.parametrize(
    ("sql", "said"),
    [
        ("SELECT (", "line 1, column 8 near '(': something is missing after it"),
        ("SELECT 1 +", "near '+': something is missing after it"),
        ("SELECT * FROM records WHERE", "near 'WHERE': something is missing after it"),
        ("SELECT FROM", "near 'FROM': expected table name"),
    ],
)
def test_syntax_errors_never_show_the_parsers_classes_or_tokens(sql: str, said: str) -> None:
    with pytest.raises(QueryError) as caught:
        translate(sql)
    message = str(caught.value)
    assert said in message
    assert not re.search(r"<class|<token|sqlglot|token_type", message, re.I), message


def test_a_time_out_of_range_is_named_as_such_not_as_a_value_too_big(store: Store) -> None:
    db, _ = store
    with pytest.raises(QueryError, match="out of range: timestamps run from year 1 to 9999"):
        query(db, "SELECT now() - interval '99999999999 days'", max_bytes=1 << 20)


def test_a_json_cast_reads_the_json_and_refuses_text_that_is_not_json(store: Store) -> None:
    db, _ = store
    [row] = query(db, """SELECT '{"a":1}'::jsonb ->> 'a', CAST('{"b": [2]}' AS JSON) -> 'b'""").rows
    assert row == (1, "[2]")
    with pytest.raises(QueryError, match="malformed JSON"):
        query(db, "SELECT CAST('x' AS JSON)")


def test_an_interval_added_to_an_untyped_value_is_time_arithmetic_or_an_error(
    store: Store,
) -> None:
    db, conn = store
    insert_event(conn, "e", at="2026-01-01T10:30:00.000000Z")
    [row] = query(
        db,
        "WITH t AS (SELECT start_timestamp AS at, 90 AS seconds FROM records) "
        "SELECT '2026-01-01T00:00:00Z' - interval '1 hour', at - interval '90 minutes', "
        "interval '30 minutes' + at, seconds - interval '1 minute' FROM t",
    ).rows
    assert row == (
        "2025-12-31T23:00:00.000000Z",
        "2026-01-01T09:00:00.000000Z",
        "2026-01-01T11:00:00.000000Z",
        30,
    )
    with pytest.raises(QueryError, match="'e' is not a timestamp"):
        query(db, "SELECT message - interval '1 hour' FROM records")


def test_a_timestamp_beside_an_untyped_value_is_time_arithmetic_not_its_year(
    store: Store,
) -> None:
    db, conn = store
    insert_event(conn, "e", n=1, at="2026-01-01T10:30:00.000000Z")
    insert_event(conn, "e", n=2, at="2026-01-01T10:31:30.000000Z")
    rows = query(
        db,
        "WITH t AS (SELECT min(start_timestamp) AS first FROM records) "
        "SELECT start_timestamp + 1, 60 + start_timestamp, start_timestamp - 90, "
        "start_timestamp - first, first - start_timestamp, "
        "start_timestamp - lag(start_timestamp) OVER (ORDER BY start_timestamp), "
        "to_timestamp(0) FROM records, t ORDER BY start_timestamp",
    ).rows
    assert rows[1] == (
        "2026-01-01T10:31:31.000000Z",
        "2026-01-01T10:32:30.000000Z",
        "2026-01-01T10:30:00.000000Z",
        90.0,
        -90.0,
        90.0,
        "1970-01-01T00:00:00.000000Z",
    )
    with pytest.raises(QueryError, match="a timestamp plus 'x': add an interval"):
        query(db, "SELECT start_timestamp + 'x' FROM records")


def test_date_bin_bins_from_its_origin_as_postgresql_does(store: Store) -> None:
    db, conn = store
    insert_event(conn, "e", at="2020-02-11T15:44:17.000000Z")
    [row] = query(
        db,
        # PostgreSQL's documented example, then its origin spelt as text, then
        # DataFusion's default origin (the epoch), then a column as the origin.
        "SELECT date_bin('15 minutes', TIMESTAMP '2020-02-11 15:44:17', "
        "TIMESTAMP '2001-01-01 00:02:30'), "
        "date_bin(interval '15 minutes', start_timestamp, '2001-01-01 00:02:30'), "
        "date_bin(interval '15 minutes', start_timestamp), "
        "date_bin(interval '1 hour', end_timestamp, start_timestamp) FROM records",
    ).rows
    assert row == (
        "2020-02-11T15:32:30.000000Z",
        "2020-02-11T15:32:30.000000Z",
        "2020-02-11T15:30:00.000000Z",
        "2020-02-11T15:44:17.000000Z",
    )


@pytest.mark.parametrize("since", ["99999999999d", "0001-01-01T00:00:00+05:00"])
def test_a_since_beyond_the_calendar_is_a_since_error(since: str) -> None:
    with pytest.raises(SinceError, match="before year 1 or after year 9999"):
        parse_since(since)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT " + "(" * 600 + "1" + ")" * 600 + " FROM records",
        "SELECT (",
        "SELECT message ~ '(a)\\1' FROM records",
    ],
)
def test_fleetroll_query_prints_one_line_for_bad_sql(store: Store, sql: str) -> None:
    db, conn = store
    insert_event(conn, "e")
    result = CliRunner().invoke(main, ["query", sql, "--db", str(db)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "Traceback" not in result.stderr and "<class" not in result.stderr


def test_fleetroll_query_logfire_with_a_huge_since_prints_one_line() -> None:
    result = CliRunner().invoke(
        main,
        ["query", "--logfire", "--since", "1e20d", "SELECT 1"],
        env={"LOGFIRE_READ_TOKEN": "not-a-real-token"},
    )
    assert result.exit_code == 2, result.output
    assert "--since '1e20d' reaches back before year 1" in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
