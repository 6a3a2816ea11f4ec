"""Queries on the store: Fleet's dashboard SQL after a chaos batch, stats, the invariant."""

from __future__ import annotations

import sqlite3
from collections import Counter, defaultdict
from pathlib import Path

import anyio
import pytest
from telemetry_helpers import insert_event, local_settings

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry
from fleetroll.telemetry.queries import (
    NoSuchBatchError,
    QueryError,
    ReadOnlyError,
    check,
    query,
    stats,
)
from fleetroll.telemetry.store import StoreError

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)

#: The query Fleet's OpenEnv dashboards run on Logfire, verbatim.
FLEET_DASHBOARD_SQL = (
    "SELECT attributes->>'env_key' AS env, "
    "COUNT(*) FILTER (WHERE message = 'fleet_rollout_started') AS total_rollouts, "
    "COUNT(*) FILTER (WHERE message = 'fleet_rollout_completed') AS completed, "
    "COUNT(*) FILTER (WHERE message = 'fleet_rollout_completed' "
    "AND attributes->>'failure_reason' = 'init_error') AS init_errors "
    "FROM records WHERE service_name = 'fleetroll' GROUP BY 1"
)

CHAOS = FaultProfile(
    seed=5,
    create_latency=Latency(min_s=0.01, max_s=0.1),
    p_create_5xx=0.3,
    p_create_429=0.05,
    retry_after_s=0.02,
    p_tool_error=0.1,
    p_reset_hang=0.05,
    reset_hang_s=3600,
    p_instance_death=0.1,
    death_after=Latency(min_s=0.05, max_s=0.6),
    p_verifier_error=0.1,
)
CHAOS_SETTINGS = {
    "provisioning": {
        "creates_per_second": 1000,
        "max_attempts": 2,  # so that some creates give up: init_error
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.05,
    },
    "timeouts": {"reset_s": 0.5, "call_tool_s": 2.0, "mcp_connect_s": 5.0, "release_s": 5.0},
    "pool": {"concurrency": 12},
}


async def run_chaos_batch(db: Path) -> list[RolloutResult]:
    settings = local_settings(db, **CHAOS_SETTINGS)
    results: list[RolloutResult] = []
    async with (
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        Emulator(CHAOS) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        batch = pool.run_batch(
            LEDGER, ScriptedPolicy(think_time_s=0.02), samples_per_task=4, batch_id="chaos"
        )
        with anyio.fail_after(120):
            async for result in batch:
                results.append(result)
                if len(results) == batch.total // 2:
                    await batch.aclose()  # cancel the rest, halfway through
    return results


@pytest.mark.slow
async def test_fleets_dashboard_query_counts_a_chaos_batch_cancelled_halfway(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    results = await run_chaos_batch(db)

    assert len(results) == len(LEDGER) * 4
    reasons = Counter(r.failure_reason for r in results)
    assert reasons[FailureReason.INIT_ERROR] > 0 and reasons[FailureReason.CANCELLED] > 0, reasons
    rows = {r["env"]: r for r in query(db, FLEET_DASHBOARD_SQL).dicts()}
    started = {
        rid
        for (rid,) in query(
            db,
            "SELECT attributes->>'rollout_id' FROM records WHERE message = 'fleet_rollout_started'",
        ).rows
    }
    # Rollouts cancelled before they started have a result but, rightly, no events.
    unstarted = [r for r in results if r.rollout_id not in started]
    assert all(r.failure_reason is FailureReason.CANCELLED for r in unstarted)
    assert started <= {r.rollout_id for r in results}
    by_env: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in results:
        if r.rollout_id in started:
            by_env[r.env_key].append(r)
    # Batch events have no env_key: the dashboard query shows them as a row of zeros.
    assert rows.pop(None) == {"env": None, "total_rollouts": 0, "completed": 0, "init_errors": 0}
    assert set(rows) == set(by_env)
    for env, env_results in by_env.items():
        init_errors = sum(1 for r in env_results if r.failure_reason is FailureReason.INIT_ERROR)
        assert rows[env]["total_rollouts"] == len(env_results)
        assert rows[env]["completed"] == len(env_results)
        assert rows[env]["init_errors"] == init_errors

    verdict = check(db, "chaos")
    assert verdict.ok, verdict.describe()
    assert verdict.rollouts == len(started)
    [row] = stats(db, "chaos")
    ran = [r for r in results if r.rollout_id in started]
    assert row["started"] == row["rollouts"] == len(started)
    # As the results say: completed without a failure; failed; cancelled apart.
    assert row["completed"] == sum(1 for r in ran if r.status == "completed")
    assert row["failure_reasons"]["init_error"] == reasons[FailureReason.INIT_ERROR]
    assert row["cancelled"] == sum(1 for r in ran if r.failure_reason is FailureReason.CANCELLED)
    assert row["failed"] == sum(
        1
        for r in ran
        if r.failure_reason is not None and r.failure_reason is not FailureReason.CANCELLED
    )
    assert row["provisioning_p50_s"] <= row["provisioning_p95_s"]
    scored = [r.reward for r in results if r.rollout_id in started and r.reward is not None]
    assert row["reward_mean"] == pytest.approx(sum(scored) / len(scored))
    assert row["tool_errors"] > 0


def test_check_reports_a_rollout_that_started_and_never_completed(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    for n, rid in enumerate(["r1", "r2", "r3"]):
        insert_event(conn, "fleet_rollout_started", n=2 * n, rollout_id=rid, batch_id="b")
        if rid != "r2":
            insert_event(conn, "fleet_rollout_completed", n=2 * n + 1, rollout_id=rid, batch_id="b")
    verdict = check(db)
    assert not verdict.ok
    assert verdict.rollouts == 3 and verdict.never_completed == ["r2"]
    assert "r2" in verdict.describe() and "never completed" in verdict.describe()
    insert_event(conn, "fleet_rollout_started", n=10, rollout_id="o1", batch_id="other")
    insert_event(conn, "fleet_rollout_completed", n=11, rollout_id="o1", batch_id="other")
    other = check(db, batch_id="other")  # another batch's rollouts are not counted
    assert other.ok and other.rollouts == 1


def test_check_reports_a_rollout_completed_twice_and_one_never_started(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_started", n=1, rollout_id="r1")
    insert_event(conn, "fleet_rollout_completed", n=2, rollout_id="r1")
    insert_event(conn, "fleet_rollout_completed", n=3, rollout_id="r1")
    insert_event(conn, "fleet_rollout_completed", n=4, rollout_id="r9")
    verdict = check(db)
    assert verdict.completed_more_than_once == ["r1"]
    assert verdict.completed_without_start == ["r9"]
    assert verdict.never_completed == []


def test_check_passes_when_every_rollout_started_and_completed_once(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    for n in range(5):
        insert_event(conn, "fleet_rollout_started", n=2 * n, rollout_id=f"r{n}")
        insert_event(conn, "fleet_rollout_completed", n=2 * n + 1, rollout_id=f"r{n}")
    verdict = check(db)
    assert verdict.ok and verdict.describe() == "ok: 5 rollouts, all started and completed once"


def test_stats_group_by_env_version_and_modality_with_percentiles(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    base = {"env_key": "ledger", "env_version": "v1", "modality": "tool_use", "batch_id": "b"}
    for n in range(10):
        rid = f"r{n}"
        insert_event(conn, "fleet_rollout_started", n=n, rollout_id=rid, **base)
        insert_event(
            conn,
            "fleet_provisioning_completed",
            n=n,
            rollout_id=rid,
            provisioning_time_s=float(n + 1),
            **base,
        )
        failure = "verifier_error" if n == 0 else ("timeout" if n < 3 else None)
        reward = None if n == 0 else n / 10
        insert_event(
            conn,
            "fleet_rollout_completed",
            n=n,
            rollout_id=rid,
            failure_reason=failure,
            reward=reward,
            **base,
        )
    insert_event(conn, "fleet_verifier_failed", n=0, rollout_id="r0", **base)
    insert_event(conn, "fleet_mcp_tool_error", n=1, rollout_id="r1", **base)
    insert_event(conn, "fleet_tool_call_failed", n=2, rollout_id="r2", **base)
    other = {**base, "env_key": "desktop", "modality": "computer_use"}
    insert_event(conn, "fleet_rollout_started", n=99, rollout_id="d1", **other)

    by_env = {row["env_key"]: row for row in stats(db)}
    ledger = by_env["ledger"]
    assert (ledger["env_version"], ledger["modality"]) == ("v1", "tool_use")
    assert (ledger["started"], ledger["rollouts"]) == (10, 10)
    assert (ledger["completed"], ledger["failed"], ledger["cancelled"]) == (7, 3, 0)
    assert ledger["failure_reasons"] == {"timeout": 2, "verifier_error": 1}
    assert ledger["reward_mean"] == pytest.approx(sum(n / 10 for n in range(1, 10)) / 9)
    assert ledger["provisioning_p50_s"] == pytest.approx(5.5)
    assert ledger["provisioning_p95_s"] == pytest.approx(9.55)
    assert (ledger["tool_errors"], ledger["verifier_errors"]) == (2, 1)
    desktop = by_env["desktop"]
    assert (desktop["started"], desktop["completed"], desktop["reward_mean"]) == (1, 0, None)
    assert desktop["provisioning_p50_s"] is None
    with pytest.raises(NoSuchBatchError, match="no such batch: nope"):
        stats(db, batch_id="nope")


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM records",
        "INSERT INTO records (message) VALUES ('x')",
        "DROP TABLE records",
        "UPDATE records SET message = 'x'",
        "PRAGMA query_only = 0",
        "ATTACH DATABASE 'elsewhere.db' AS other",
        "VACUUM INTO 'copy.db'",
        "CREATE TEMP TABLE t AS SELECT 1",
    ],
)
def test_queries_that_write_are_refused(
    store: tuple[Path, sqlite3.Connection],
    sql: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_started", rollout_id="r1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ReadOnlyError, match="read-only"):
        query(db, sql)
    assert query(db, "SELECT COUNT(*) FROM records").rows == [(1,)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == ["telemetry.db"]


def test_reading_queries_with_json_functions_and_ctes_run(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    insert_event(conn, "fleet_batch_completed", counts={"completed": 3, "timeout": 1})
    result = query(
        db,
        "WITH c AS (SELECT attributes->'counts' AS counts FROM records) "
        "SELECT key, value FROM c, json_each(c.counts) ORDER BY key",
    )
    assert result.columns == ["key", "value"]
    assert result.rows == [("completed", 3), ("timeout", 1)]


def test_a_bad_query_and_a_missing_store_fail_with_a_clear_message(
    store: tuple[Path, sqlite3.Connection], tmp_path: Path
) -> None:
    db, _ = store
    with pytest.raises(QueryError, match="no such column: nope"):
        query(db, "SELECT nope FROM records")
    with pytest.raises(StoreError, match="no telemetry store at"):
        query(tmp_path / "missing.db", "SELECT 1")


def test_check_passes_rollouts_rerun_after_a_resume_and_counts_them(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    """Killed after r1's completion reached telemetry but not the journal: resume re-runs r1."""
    db, conn = store
    n = 0
    for rid in ["r1", "r2", "r1"]:  # the first run, then the resumed one
        insert_event(conn, "fleet_rollout_started", n=n, rollout_id=rid, batch_id="b")
        insert_event(conn, "fleet_rollout_completed", n=n + 1, rollout_id=rid, batch_id="b")
        n += 2
    verdict = check(db, batch_id="b")
    assert verdict.ok, verdict.describe()
    assert (verdict.rollouts, verdict.rerun) == (2, 1)
    assert verdict.describe() == (
        "ok: 2 rollouts, every start completed once (1 re-run after a resume)"
    )
    insert_event(conn, "fleet_rollout_completed", n=n, rollout_id="r2", batch_id="b")
    assert check(db, batch_id="b").completed_more_than_once == ["r2"]


def test_stats_and_check_of_an_unknown_batch_say_so_and_name_recent_batches(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    for n, batch in enumerate(["step-1", "step-2"]):
        insert_event(conn, "fleet_rollout_started", n=n, rollout_id=f"r{n}", batch_id=batch)
    for run in (stats, check):
        with pytest.raises(NoSuchBatchError) as caught:
            run(db, batch_id="nope")
        assert str(caught.value) == "no such batch: nope; recent batches: step-2, step-1"
    assert check(db, batch_id="step-1").rollouts == 1


ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "


def test_a_query_over_endless_rows_stops_at_max_rows_while_fetching(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, _ = store
    result = query(db, ENDLESS + "SELECT i FROM n", max_rows=1000, timeout_s=30)
    assert result.truncated and result.rows == [(i,) for i in range(1, 1001)]
    exact = query(db, "SELECT 1 UNION ALL SELECT 2", max_rows=2)
    assert exact.rows == [(1,), (2,)] and not exact.truncated


def test_a_query_over_endless_big_rows_stops_at_max_bytes_while_fetching(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, _ = store
    sql = ENDLESS + "SELECT hex(zeroblob(5000)) AS big FROM n"  # 10 KB per row, forever
    result = query(db, sql, max_bytes=1_000_000, timeout_s=30)
    assert result.truncated
    assert 90 <= len(result.rows) <= 100
    assert sum(len(big) for (big,) in result.rows) <= 1_000_000


def test_a_single_value_over_max_bytes_is_refused_with_a_clear_message(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, _ = store
    with pytest.raises(QueryError, match="over the 100000 byte limit"):
        query(db, "SELECT zeroblob(200000)", max_bytes=100_000)
    assert query(db, "SELECT length(zeroblob(90000))", max_bytes=100_000).rows == [(90000,)]
