"""Rollouts of a process killed with -9: lost in ``stats --check`` and on the dashboard."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process
from click.testing import CliRunner
from telemetry_helpers import PYTHON, child_env

from fleetroll.cli import main
from fleetroll.telemetry.dashboard import snapshot
from fleetroll.telemetry.writers import process_gone

#: A small fleetroll process writing a batch to the store: three rollouts started,
#: one completed, one with its instance; then it waits (for its kill) or, with
#: ``finish``, completes the other two and exits.
WRITER = """
import sys
from fleetroll.settings import load_settings
from fleetroll.telemetry import Telemetry
from fleetroll.telemetry.events import Events

db, mode = sys.argv[1], sys.argv[2]
telemetry = {"db_path": db, "send_to_logfire": False, "console_level": "error"}
settings = load_settings(telemetry=telemetry)
telemetry = Telemetry(settings)
events = telemetry.events
ids = ["doomed-0", "doomed-1", "doomed-2"]
events.emit("fleet_batch_started", batch_id="doomed", rollouts=3, total=3, concurrency=3)
for i, rid in enumerate(ids if mode == "start" else ids[1:]):
    with Events.bind(batch_id="doomed", rollout_id=rid, task_key=f"t{i}", env_key="ledger"):
        events.emit("fleet_rollout_started")
        if rid == "doomed-1":
            events.emit("fleet_provisioning_completed", instance_id="inst-1")
        if rid == "doomed-0" or mode == "finish":
            events.emit("fleet_rollout_completed", status="completed", reward=1.0)
assert telemetry.flush(60), "the flush did not finish"
print("ready", flush=True)
if mode == "start":
    sys.stdin.readline()  # until the parent kills this process
telemetry.close()
"""


@asynccontextmanager
async def writer(db: Path, mode: str) -> AsyncIterator[Process]:
    """The writer child, once its records are in the store."""
    async with await anyio.open_process(
        [PYTHON, "-c", WRITER, str(db), mode], env=child_env()
    ) as child:
        assert child.stdout is not None
        with anyio.fail_after(60):
            line = b""
            while b"\n" not in line:
                line += await child.stdout.receive()
        assert line.strip() == b"ready", line
        yield child


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
