from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetroll.telemetry.store import connect


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real secret or user config leaks into these tests (nor out of them)."""
    for name in list(os.environ):
        if name.startswith(("FLEETROLL_", "LOGFIRE_", "OTEL_")) or name in (
            "FLEET_API_KEY",
            "FLEET_BASE_URL",
            "OPENAI_API_KEY",
        ):
            monkeypatch.delenv(name)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Path, sqlite3.Connection]]:
    """An empty store, and a read-write connection to fill it by hand."""
    db = tmp_path / "telemetry.db"
    conn = connect(db)
    try:
        yield db, conn
    finally:
        conn.close()
