"""`fleetroll query` and `fleetroll stats`, as a user types them."""

from __future__ import annotations

import csv
import io
import json
import re
import sqlite3
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner
from telemetry_helpers import PYTHON, child_env, insert_event, local_settings

import fleetroll
from fleetroll.cli.main import main
from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture
def filled(store: tuple[Path, sqlite3.Connection]) -> Path:
    """A store with two rollouts of one env, one failed."""
    db, conn = store
    base = {"env_key": "ledger", "env_version": "v1", "modality": "tool_use", "batch_id": "b1"}
    for n, (rid, reason) in enumerate([("r1", None), ("r2", "init_error")]):
        insert_event(conn, "fleet_rollout_started", n=3 * n, rollout_id=rid, **base)
        if reason is None:
            insert_event(
                conn,
                "fleet_provisioning_completed",
                n=3 * n + 1,
                rollout_id=rid,
                provisioning_time_s=1.5,
                **base,
            )
        insert_event(
            conn,
            "fleet_rollout_completed",
            n=3 * n + 2,
            rollout_id=rid,
            failure_reason=reason,
            reward=1.0 if reason is None else None,
            **base,
        )
    return db


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM records",
        "INSERT INTO records (message) VALUES ('x')",
        "DROP TABLE records",
        "UPDATE sqlite_master SET sql = ''",
    ],
)
def test_a_query_that_writes_is_refused_with_exit_code_2(filled: Path, sql: str) -> None:
    code, out, err = invoke("query", sql, "--db", str(filled))
    assert code == 2
    assert "read-only" in err and "Traceback" not in err
    code, out, _ = invoke(
        "query", "SELECT COUNT(*) AS n FROM records", "--db", str(filled), "--json"
    )
    assert json.loads(out) == [{"n": 5}]


def test_query_prints_json_csv_and_a_table(filled: Path) -> None:
    sql = (
        "SELECT attributes->>'rollout_id' AS rollout, attributes->>'failure_reason' AS reason "
        "FROM records WHERE message = 'fleet_rollout_completed' ORDER BY 1"
    )
    code, out, _ = invoke("query", sql, "--db", str(filled), "--json")
    assert code == 0
    assert json.loads(out) == [
        {"rollout": "r1", "reason": None},
        {"rollout": "r2", "reason": "init_error"},
    ]
    code, out, _ = invoke("query", sql, "--db", str(filled), "--csv")
    assert code == 0
    assert list(csv.reader(io.StringIO(out))) == [
        ["rollout", "reason"],
        ["r1", ""],
        ["r2", "init_error"],
    ]
    code, out, err = invoke("query", sql, "--db", str(filled))
    assert code == 0 and "init_error" in out and "r2" in out and "2 rows" in err


def test_query_fails_clearly_on_bad_sql_a_missing_store_or_no_read_token(
    filled: Path, tmp_path: Path
) -> None:
    code, _, err = invoke("query", "SELECT nope FROM records", "--db", str(filled))
    assert code == 2 and "no such column: nope" in err
    code, _, err = invoke("query", "SELECT 1", "--db", str(tmp_path / "none.db"))
    assert code == 2 and "no telemetry store at" in err
    code, _, err = invoke("query", "SELECT 1", "--logfire")
    assert code == 2 and "LOGFIRE_READ_TOKEN" in err


def test_stats_prints_a_table_and_json_per_environment(filled: Path) -> None:
    code, out, _ = invoke("stats", "--db", str(filled))
    assert code == 0
    assert "ledger:v1" in out and "init_error" in out and "tool_use" in out
    code, out, _ = invoke("stats", "--db", str(filled), "--json", "--batch", "b1")
    [row] = json.loads(out)
    assert (row["started"], row["rollouts"], row["completed"], row["failed"]) == (2, 2, 1, 1)
    assert row["failure_reasons"] == {"init_error": 1} and row["reward_mean"] == 1.0
    assert row["provisioning_p50_s"] == row["provisioning_p95_s"] == 1.5


def test_stats_check_passes_when_every_rollout_started_and_completed_once(filled: Path) -> None:
    code, out, _ = invoke("stats", "--check", "--db", str(filled))
    assert code == 0 and out.strip() == "ok: 2 rollouts, all started and completed once"


def test_stats_check_fails_on_a_rollout_that_never_completed(
    filled: Path, store: tuple[Path, sqlite3.Connection]
) -> None:
    _, conn = store
    insert_event(conn, "fleet_rollout_started", n=40, rollout_id="r-lost", batch_id="b1")
    code, _, err = invoke("stats", "--check", "--db", str(filled))
    assert code == 1
    assert "started but never completed: r-lost" in err


def test_stats_check_fails_on_a_rollout_completed_twice(
    filled: Path, store: tuple[Path, sqlite3.Connection]
) -> None:
    _, conn = store
    insert_event(conn, "fleet_rollout_completed", n=41, rollout_id="r1", batch_id="b1")
    code, out, _ = invoke("stats", "--check", "--json", "--db", str(filled))
    assert code == 1
    verdict = json.loads(out)
    assert verdict["ok"] is False and verdict["completed_more_than_once"] == ["r1"]


@pytest.mark.parametrize("check", [False, True])
def test_stats_of_an_unknown_batch_says_no_such_batch_with_exit_code_2(
    filled: Path, check: bool
) -> None:
    code, out, err = invoke("stats", "--batch", "nope", "--db", str(filled), *["--check"] * check)
    assert code == 2 and out == ""
    assert err.strip() == "Error: no such batch: nope; recent batches: b1"


def test_query_stops_at_max_rows_and_says_the_answer_was_truncated(filled: Path) -> None:
    endless = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT i FROM n"
    code, out, err = invoke("query", endless, "--max-rows", "50", "--json", "--db", str(filled))
    assert code == 0
    assert [row["i"] for row in json.loads(out)] == list(range(1, 51))
    assert err.startswith("truncated: only the first 50 rows")


def readme_query_sql() -> str:
    """The SQL of the README's ``fleetroll query "..."`` example, as written there."""
    readme = Path(fleetroll.__file__).resolve().parents[2] / "README.md"
    found = re.search(r'^fleetroll query "(.+?)"', readme.read_text(), re.MULTILINE | re.DOTALL)
    assert found, "the README has no fleetroll query example"
    return found.group(1)


async def test_the_readme_query_runs_after_a_run_with_one_row_per_env(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.db"
    settings = local_settings(db)
    tasks = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)[:2]
    async with (
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        Emulator() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        with anyio.fail_after(60):
            results = [r async for r in pool.run_batch(tasks, ScriptedPolicy(), batch_id="b")]
    code, out, err = invoke("query", readme_query_sql(), "--db", str(db), "--json")
    assert code == 0, err
    assert json.loads(out) == [
        {"env": "ledger", "total_rollouts": 2, "completed": 2, "init_errors": 0}
    ], results


@pytest.mark.slow
def test_fleetroll_run_records_every_rollout_in_the_store(tmp_path: Path) -> None:
    db = tmp_path / "store" / "telemetry.db"
    env = {**child_env(), "FLEETROLL_TELEMETRY__DB_PATH": str(db)}
    tasks = config_dir() / "tasks" / "ledger.jsonl"
    count = sum(1 for line in tasks.read_text().splitlines() if line.strip())

    def fleetroll(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "fleetroll", *args],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
            env=env,
        )

    done = fleetroll("run", str(tasks), "--samples", "2")
    assert done.returncode == 0, done.stderr
    check = fleetroll("stats", "--check")
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == f"ok: {2 * count} rollouts, all started and completed once"
    sql = "SELECT COUNT(*) AS n FROM records WHERE message = 'fleet_rollout_completed'"
    answer = fleetroll("query", sql, "--json")
    assert json.loads(answer.stdout) == [{"n": 2 * count}]


class FakeLogfireCloud:
    """Stands in for Logfire's query API (the edge): records what it was asked."""

    def __init__(self, fail: str | None = None) -> None:
        self.asked: list[tuple[str, datetime]] = []
        self.fail = fail

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from logfire.query_client import AsyncLogfireQueryClient

        async def query_json_rows(client: object, sql: str, *, min_timestamp: datetime) -> Any:
            return await self.query_json_rows(sql, min_timestamp=min_timestamp)

        monkeypatch.setattr(AsyncLogfireQueryClient, "query_json_rows", query_json_rows)

    async def query_json_rows(self, sql: str, *, min_timestamp: datetime) -> Any:
        self.asked.append((sql, min_timestamp))
        if self.fail:
            raise RuntimeError(self.fail)
        return {
            "columns": [{"name": "env", "datatype": "Utf8", "nullable": True}],
            "rows": [{"env": "ledger"}, {"env": None}],
        }


def test_query_on_logfire_sends_the_same_sql_with_the_read_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cloud = FakeLogfireCloud()
    cloud.install(monkeypatch)
    monkeypatch.setenv("LOGFIRE_READ_TOKEN", "read-token-1234")
    sql = "SELECT attributes->>'env_key' AS env FROM records GROUP BY 1"
    code, out, err = invoke("query", sql, "--logfire", "--since", "6h", "--json")
    assert code == 0, err
    assert json.loads(out) == [{"env": "ledger"}, {"env": None}]
    [(asked, since)] = cloud.asked
    assert asked == sql
    assert timedelta(hours=5.9) < datetime.now(UTC) - since < timedelta(hours=6.1)


def test_a_failed_logfire_query_says_why_without_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cloud = FakeLogfireCloud(fail="401: token read-token-1234 is not valid")
    cloud.install(monkeypatch)
    monkeypatch.setenv("LOGFIRE_READ_TOKEN", "read-token-1234")
    code, _, err = invoke("query", "SELECT 1", "--logfire")
    assert code == 2 and "the Logfire query failed" in err and "401" in err
    assert "read-token-1234" not in err
