from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium; skipped where it is missing, except in CI (which installs it)."""
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed, and CI must run the browser tests")
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")
    return path
