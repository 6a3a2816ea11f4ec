"""`fleetroll stats` and `query --json` on a store with re-runs and cancellations."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from click.testing import CliRunner
from telemetry_helpers import insert_event

from fleetroll.cli.main import main
from fleetroll.telemetry.queries import batch_costs, stats

Store = tuple[Path, sqlite3.Connection]


def _runs(conn: sqlite3.Connection) -> None:
    """Four rollouts of batch b: one re-run after a resume, one cancelled then run
    again, one cancelled for good, one failed: six runs."""
    n = 0
    for rid, outcomes in {
        "r1": [None, None],
        "r2": ["cancelled", None],
        "r3": ["cancelled"],
        "r4": ["tool_failure"],
    }.items():
        for reason in outcomes:
            base = {"batch_id": "b", "rollout_id": rid, "env_key": "ledger", "env_version": "v1"}
            insert_event(conn, "fleet_rollout_started", n=n, **base)
            insert_event(
                conn,
                "fleet_rollout_completed",
                n=n + 1,
                **base,
                failure_reason=reason,
                reward=1.0 if reason is None else None,
                instance_s=1.0,
            )
            n += 2


def test_stats_count_each_rollout_once_by_its_latest_result_and_cancelled_apart(
    store: Store,
) -> None:
    db, conn = store
    _runs(conn)
    [row] = stats(db, "b")
    assert (row["started"], row["rollouts"], row["completed"]) == (4, 4, 2)
    assert (row["failed"], row["cancelled"]) == (1, 1)
    assert row["failure_reasons"] == {"cancelled": 1, "tool_failure": 1}
    assert row["reward_mean"] == 1.0
    assert row["instance_s"] == 6.0  # every run's cost: all of it was spent
    [batch] = batch_costs(db)
    assert batch["completed"] == 4 and batch["instance_s"] == 6.0


def test_the_cost_by_batch_table_shows_the_batch_s_rollouts_not_its_runs(store: Store) -> None:
    db, conn = store
    _runs(conn)
    result = CliRunner().invoke(main, ["stats", "--db", str(db)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    by_batch = result.stdout[result.stdout.index("cost by batch") :]
    row = next(line for line in by_batch.splitlines() if "│ b " in line)
    assert [cell.strip() for cell in row.split("│")[1:3]] == ["b", "4"], by_batch


def test_query_json_gives_attributes_as_an_object(store: Store) -> None:
    db, conn = store
    insert_event(conn, "fleet_rollout_completed", n=1, rollout_id="r1", reward=0.5)
    result = CliRunner().invoke(
        main,
        ["query", "SELECT attributes, tags, message FROM records", "--db", str(db), "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    [record] = json.loads(result.stdout)
    assert record == {
        "attributes": {"rollout_id": "r1", "reward": 0.5},
        "tags": [],
        "message": "fleet_rollout_completed",
    }
