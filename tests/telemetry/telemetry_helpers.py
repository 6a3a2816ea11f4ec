"""Helpers shared by the telemetry tests (import: ``from telemetry_helpers import ...``)."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

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
