"""Rollouts of a process killed with -9: lost in ``stats --check`` and on the dashboard."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner
from telemetry_helpers import insert_event
from telemetry_helpers import lost_batch_writer as writer

from fleetroll.cli.main import main
from fleetroll.telemetry.dashboard import snapshot
from fleetroll.telemetry.queries import CheckResult, _lost_batches
from fleetroll.telemetry.queries import check as check_store
from fleetroll.telemetry.writers import process_gone


def check(db: Path, *args: str) -> tuple[int, str]:
    done = CliRunner().invoke(main, ["stats", "--check", "--db", str(db), *args])
    return done.exit_code, done.output


@pytest.mark.slow
async def test_a_killed_process_s_rollouts_are_lost_with_their_batch_not_in_flight(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    async with writer(db, "start") as child:
        # Alive: its two open rollouts are in flight (the invariant does not hold yet).
        code, out = check(db)
        assert code == 1 and "2 started but never completed" in out and "lost" not in out
        live = snapshot(db)
        assert live["unfinished"]["in_flight"] == 2 and live["totals"]["lost"] == 0
        assert live["progress"]["state"] == "running"

        child.kill()  # SIGKILL, to this child only
        with anyio.fail_after(30):
            await child.wait()

    code, out = check(db)
    assert code == 0, out
    assert "2 lost in batch doomed" in out and "doomed-1" in out and "doomed-2" in out
    code, out = check(db, "--json")
    answer = json.loads(out)
    assert answer["ok"] and answer["never_completed"] == []
    assert answer["lost"] == [
        {"rollout_id": "doomed-1", "batch_id": "doomed"},
        {"rollout_id": "doomed-2", "batch_id": "doomed"},
    ]

    data = snapshot(db)
    assert data["totals"]["lost"] == 2 and data["totals"]["in_flight"] == 0
    rows = {r["rollout_id"]: r for r in data["unfinished"]["rows"]}
    assert {r["state"] for r in rows.values()} == {"lost"}
    assert rows["doomed-1"]["phase"] == "acting" and rows["doomed-1"]["instance_id"] == "inst-1"
    assert rows["doomed-2"]["phase"] == "provisioning"
    progress = data["progress"]
    assert (progress["state"], progress["done"], progress["total"], progress["lost"]) == (
        "lost",
        1,
        3,
        2,
    )

    # A resumed run completes them: re-runs after a lost start, nothing lost.
    async with writer(db, "finish") as child:
        with anyio.fail_after(30):
            assert await child.wait() == 0
    code, out = check(db, "--json")
    answer = json.loads(out)
    assert code == 0 and answer["ok"] and answer["lost"] == [] and answer["rerun"] == 2
    assert snapshot(db)["totals"]["lost"] == 0


def test_a_live_process_is_not_gone_and_a_pid_reused_since_is() -> None:
    host = socket.gethostname()
    assert not process_gone(os.getpid(), host, time.time())
    # This process started after 1970: a record from then cannot be its.
    assert process_gone(os.getpid(), host, 0.0)


def test_a_process_on_another_host_or_without_a_pid_is_never_called_gone() -> None:
    assert not process_gone(2**22 + 1, "some-other-host", 0.0)
    assert not process_gone(None, socket.gethostname(), 0.0)


def _start(conn: sqlite3.Connection, rid: str, batch: str, at: str, n: int) -> None:
    # No pid: a writer this host cannot call gone (as one on another host).
    insert_event(conn, "fleet_rollout_started", n=n, at=at, batch_id=batch, rollout_id=rid)


def test_check_live_counts_a_young_start_of_an_open_batch_as_running_and_no_other(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, conn = store
    now = datetime(2026, 1, 1, 1, 0, tzinfo=UTC).timestamp()
    _start(conn, "young", "open", "2026-01-01T00:59:50.000000Z", 1)
    _start(conn, "old", "open", "2026-01-01T00:00:00.000000Z", 2)  # an hour ago
    _start(conn, "after-end", "ended", "2026-01-01T00:59:40.000000Z", 3)
    insert_event(
        conn, "fleet_batch_completed", n=4, at="2026-01-01T00:59:45.000000Z", batch_id="ended"
    )
    conn.commit()
    result = check_store(db, live_max_age_s=1800.0, now=now)
    assert result.running == ["young"]
    assert sorted(result.never_completed) == ["after-end", "old"] and not result.ok
    assert "1 running" in result.describe().splitlines()[0]
    # Not live, as before: every start without a completion is an offence.
    assert sorted(check_store(db).never_completed) == ["after-end", "old", "young"]
    # A batch started again after it ended (a resubmission) is open again.
    _start(conn, "after-end", "ended", "2026-01-01T00:59:50.000000Z", 5)
    insert_event(
        conn,
        "fleet_rollout_completed",
        n=6,
        at="2026-01-01T00:59:46.000000Z",
        batch_id="ended",
        rollout_id="after-end",
    )
    conn.commit()
    assert check_store(db, live_max_age_s=1800.0, now=now).running == ["after-end", "young"]


def test_live_and_max_age_go_with_check_each_in_one_line(
    store: tuple[Path, sqlite3.Connection],
) -> None:
    db, _ = store
    for args, message in (
        (["--live"], "--live and --max-age go with --check"),
        (["--check", "--max-age", "5"], "--max-age goes with --live"),
    ):
        done = CliRunner().invoke(main, ["stats", "--db", str(db), *args])
        assert done.exit_code == 2 and message in done.output, done.output


def test_lost_rollouts_are_grouped_by_batch_with_the_command_that_resumes_each() -> None:
    lost = [("a-1", "a"), ("a-2", "a"), ("b-1", "run-step3"), ("c-1", "served"), ("j-1", "j")]
    resumes = {
        "a": ("fleetroll run /t.jsonl --out /a.jsonl --resume", "/a.jsonl"),
        "j": (None, "/j.jsonl"),  # a job with a journal but no command line (a library's)
        "run": ("fleetroll run /t.jsonl --out /r.jsonl --steps 5 --batch-tasks 2 --resume", None),
    }
    groups = {g.batch_id: g for g in _lost_batches(lost, resumes)}
    assert groups["a"].rollout_ids == ["a-1", "a-2"]
    assert groups["a"].resume == resumes["a"][0]
    assert groups["run-step3"].resume == resumes["run"][0]  # a step: its run resumes it
    assert "same batch_id" in groups["served"].resume  # no job: a service's batch
    assert "--out /j.jsonl --resume" in groups["j"].resume
    text = CheckResult(5, lost=lost, lost_batches=list(groups.values())).describe()
    assert "2 lost in batch a" in text and "    resume: fleetroll run /t.jsonl" in text
