"""Rollouts of a process killed with -9: lost in ``stats --check`` and on the dashboard."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner
from telemetry_helpers import lost_batch_writer as writer

from fleetroll.cli.main import main
from fleetroll.telemetry.dashboard import snapshot
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
