"""`fleetroll query` on a hand-filled store: Logfire's SQL, --schema, errors, wide results."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from telemetry_helpers import insert_event

from fleetroll.cli.main import main
from fleetroll.telemetry.store import COLUMNS

Store = tuple[Path, sqlite3.Connection]
LONG = "x" * 5000


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def filled(store: Store) -> Path:
    db, conn = store
    for n in range(3):
        insert_event(
            conn,
            "fleet_rollout_completed",
            n=n,
            rollout_id=f"r{n}",
            env_key="ledger",
            reward=n / 2,
            error_message=LONG + "\nsecond line",
        )
    return db


def test_schema_lists_every_column_with_its_type_and_what_it_holds(tmp_path: Path) -> None:
    code, out, _ = invoke("query", "--schema", "--json", "--db", str(tmp_path / "none.db"))
    assert code == 0
    rows = json.loads(out)
    assert [r["column"] for r in rows] == list(COLUMNS)
    assert all(r["type"] and r["meaning"] for r in rows), rows
    by_name = {r["column"]: r for r in rows}
    assert by_name["start_timestamp"]["type"] == "timestamp"
    assert by_name["attributes"]["type"] == "json"
    code, out, _ = invoke("query", "--schema")
    assert code == 0 and "start_timestamp" in out and "otel_status_code" in out


def test_query_without_sql_or_schema_fails_with_one_line_and_exit_code_2() -> None:
    code, out, err = invoke("query")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "--schema" in err


def test_logfire_sql_runs_unchanged_from_the_command_line(filled: Path) -> None:
    sql = (
        "SELECT date_trunc('minute', start_timestamp) AS minute, "
        "avg((attributes->>'reward')::float) AS reward, "
        "percentile_cont(0.5) WITHIN GROUP (ORDER BY (attributes->>'reward')::float) AS p50 "
        "FROM records WHERE message ILIKE 'FLEET_ROLLOUT_%' "
        "AND start_timestamp < now() + interval '1 hour' GROUP BY 1"
    )
    code, out, err = invoke("query", sql, "--db", str(filled), "--json")
    assert code == 0, err
    assert json.loads(out) == [{"minute": "2026-01-01T00:00:00.000000Z", "reward": 0.5, "p50": 0.5}]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT count(*)\nFORM records", "line 2"),
        ("SELECT rewrd::float FROM records", "no such column: rewrd at line 1, column 8"),
        ("SELECT 'unclosed FROM records", "a string opened at line 1, column 8 is never closed"),
        ("SELECT now() - interval '1 month' FROM records", "no fixed length"),
        ("DELETE FROM records WHERE level ILIKE 'info'", "read-only"),
    ],
)
def test_a_bad_query_fails_with_one_line_saying_what_and_where(
    filled: Path, sql: str, expected: str
) -> None:
    code, out, err = invoke("query", sql, "--db", str(filled))
    assert code == 2 and out == ""
    assert expected in err
    assert err.strip().count("\n") == 0, err
    assert "Traceback" not in err and "FR_" not in err


def test_a_wide_result_shows_each_row_as_lines_of_column_and_value(filled: Path) -> None:
    code, out, _ = invoke("query", "SELECT * FROM records LIMIT 2", "--db", str(filled))
    assert code == 0
    lines = out.splitlines()
    assert all(len(line) <= 200 for line in lines), max(map(len, lines))
    assert sum(1 for line in lines if line.startswith("row ")) == 2
    for name in COLUMNS:
        assert any(line.startswith(f"{name} ") for line in lines), name
    [attributes, _] = [line for line in lines if line.startswith("attributes ")]
    assert attributes.rstrip().endswith("…")


def test_long_values_are_cut_in_the_table_and_whole_in_json_and_csv(filled: Path) -> None:
    sql = (
        "SELECT attributes->>'rollout_id' AS rid, attributes->>'error_message' AS error "
        "FROM records ORDER BY 1"
    )
    code, out, _ = invoke("query", sql, "--db", str(filled))
    assert code == 0
    lines = out.splitlines()
    assert all(len(line) <= 200 for line in lines)
    assert sum(1 for line in lines if "…" in line) == 3
    assert "second line" not in out  # one line per row
    code, out, _ = invoke("query", sql, "--db", str(filled), "--json")
    assert [r["error"] for r in json.loads(out)] == [LONG + "\nsecond line"] * 3
    code, out, _ = invoke("query", sql, "--db", str(filled), "--csv")
    assert out.count(LONG) == 3
