"""Helpers shared by the telemetry tests (import: ``from telemetry_helpers import ...``)."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from fleetroll.settings import Settings, load_settings
from fleetroll.telemetry.store import COLUMNS

PYTHON = sys.executable


def local_settings(db: Path, **overrides: Any) -> Settings:
    """Settings that write telemetry to ``db`` and never to Logfire cloud."""
    telemetry = {"db_path": str(db), "send_to_logfire": False, **overrides.pop("telemetry", {})}
    return load_settings(telemetry=telemetry, **overrides)


def insert_event(
    conn: sqlite3.Connection,
    message: str,
    *,
    n: int = 0,
    at: str | None = None,
    level: str = "info",
    **attributes: Any,
) -> None:
    """A hand-made fleetroll record (for stores with defects a real run never makes).

    ``at`` is its timestamp (store text); by default second ``n`` of 2026.
    """
    row = dict.fromkeys(COLUMNS)
    timestamp = at or f"2026-01-01T00:00:{n % 60:02d}.000000Z"
    row.update(
        start_timestamp=timestamp,
        end_timestamp=timestamp,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        kind="log",
        level=level,
        span_name=message,
        message=message,
        attributes=json.dumps(attributes),
        tags="[]",
        otel_status_code="UNSET",
        is_exception=0,
        service_name="fleetroll",
        created_at="2026-01-01T00:00:00.000000Z",
    )
    names = ", ".join(row)
    conn.execute(
        f"INSERT INTO records ({names}) VALUES ({', '.join('?' * len(row))})", list(row.values())
    )


def child_env() -> dict[str, str]:
    """The environment for a child process: no secrets, no fleetroll settings."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "OTEL_"))
    }


#: A small fleetroll process writing a batch to the store: three rollouts started,
#: one completed, one with its instance; then it waits (for its kill) or, with
#: ``finish``, completes the other two and exits.
LOST_BATCH_WRITER = """
import sys
from fleetroll.settings import load_settings
from fleetroll.telemetry import Telemetry
from fleetroll.telemetry.events import Events

db, mode = sys.argv[1], sys.argv[2]
telemetry = {"db_path": db, "send_to_logfire": False, "console_level": "error"}
settings = load_settings(telemetry=telemetry)
telemetry = Telemetry(settings.telemetry, secrets=settings.secrets())
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
async def lost_batch_writer(db: Path, mode: str) -> AsyncIterator[Process]:
    """The writer child, once its records are in the store."""
    async with await anyio.open_process(
        [PYTHON, "-c", LOST_BATCH_WRITER, str(db), mode], env=child_env()
    ) as child:
        assert child.stdout is not None
        with anyio.fail_after(60):
            line = b""
            while b"\n" not in line:
                line += await child.stdout.receive()
        assert line.strip() == b"ready", line
        yield child
