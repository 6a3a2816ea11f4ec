"""``rollout_events``: the rollouts' counted attributes as small rows, kept by a trigger."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from telemetry_helpers import insert_event

from fleetroll.telemetry.dashboard import snapshot
from fleetroll.telemetry.sql_functions import percentile
from fleetroll.telemetry.store import SCHEMA_VERSION, connect


def _fill(conn: sqlite3.Connection) -> None:
    for i in range(6):
        base = {"batch_id": "b1", "rollout_id": f"r{i}", "env_key": "ledger", "task_key": "t"}
        insert_event(conn, "fleet_batch_started", n=0, batch_id="b1", rollouts=6, total=6)
        insert_event(conn, "fleet_rollout_started", n=2 * i + 1, **base)
        insert_event(
            conn, "fleet_provisioning_completed", n=2 * i + 1, **base, provisioning_time_s=i + 0.5
        )
        if i < 5:
            failed = i == 4
            insert_event(
                conn,
                "fleet_rollout_completed",
                n=2 * i + 2,
                **base,
                reward=None if failed else (1.5 if i == 3 else float(i % 2)),
                failure_reason="tool_failure" if failed else None,
                error_message="the tool failed" if failed else None,
                duration_s=i + 1.0,
                instance_s=2.0,
                prompt_tokens=10,
            )


def _comparable(view: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in view.items() if k != "generated_at"}


def test_a_store_from_before_rollout_events_is_read_alike_and_filled_when_opened_to_write(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    conn = connect(db)
    # The schema of version 1: records and its indexes only.
    conn.execute("DROP TRIGGER records_rollout_events")
    conn.execute("DROP TABLE rollout_events")
    conn.execute("PRAGMA user_version = 1")
    _fill(conn)
    conn.close()
    now = 1767225700.0  # 2026-01-01T00:01:40Z

    before = snapshot(db, now=now)  # read-only: the same columns, read from records
    conn = connect(db)  # a writer brings it up to date
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    (kept,) = conn.execute("SELECT COUNT(*) FROM rollout_events").fetchone()
    conn.close()
    after = snapshot(db, now=now)

    assert version == SCHEMA_VERSION and kept == 6 + 6 + 5
    assert _comparable(after) == _comparable(before)
    assert after["totals"]["completed"] == 5 and after["totals"]["failed"] == 1
    assert after["cost"]["total"]["instance_s"] == 10.0
    assert after["errors"][0]["message"] == "the tool failed"
    # Ranked and binned in SQL as percentile() and the histogram did in Python.
    times = after["provisioning"]  # 0.5, 1.5, ... 5.5 s
    assert (times["count"], times["max_s"]) == (6, 5.5)
    assert times["p50_s"] == percentile([i + 0.5 for i in range(6)], 0.5) == 3.0
    assert times["p95_s"] == percentile([i + 0.5 for i in range(6)], 0.95) == 5.25
    assert sum(n for _, _, n in times["bins"]) == 6 and times["bins"][-1][1] >= 5.5


def test_records_written_to_a_new_store_reach_rollout_events_at_once(tmp_path: Path) -> None:
    conn = connect(tmp_path / "telemetry.db")
    _fill(conn)
    insert_event(conn, "fleet_env_created", n=50, rollout_id="r0")  # not counted there
    rows = conn.execute(
        "SELECT message, rollout_id, reward, provisioning_time_s FROM rollout_events "
        "WHERE rollout_id = 'r1' ORDER BY start_timestamp, message"
    ).fetchall()
    conn.close()
    assert rows == [
        ("fleet_provisioning_completed", "r1", None, 1.5),
        ("fleet_rollout_started", "r1", None, None),
        ("fleet_rollout_completed", "r1", 1.0, None),
    ]
