"""The dashboard inside `serve`: its snapshots never take the SQL queries' slots."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from service_helpers import running_service

from fleetroll.emulator import Emulator
from fleetroll.telemetry import dashboard
from fleetroll.telemetry.store import connect

pytestmark = pytest.mark.slow


async def test_v1_query_answers_while_a_dashboard_snapshot_is_being_computed(
    emulator: Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "telemetry.db"
    connect(db).close()
    inside, release = threading.Event(), threading.Event()
    real = dashboard.snapshot

    def slow_snapshot(*args: Any, **kwargs: Any) -> dict[str, Any]:
        # A snapshot of a huge store, held until the query has been answered.
        inside.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(dashboard, "snapshot", slow_snapshot)
    settings = {"telemetry": {"db_path": str(db)}, "service": {"max_concurrent_queries": 1}}
    async with running_service(emulator, **settings) as served, served.http() as http:
        answers: list[int] = []

        async def poll_dashboard() -> None:
            answers.append((await http.get("/dashboard/data")).status_code)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(poll_dashboard)
                with anyio.fail_after(10):
                    await anyio.to_thread.run_sync(inside.wait, 10)
                assert inside.is_set()
                with anyio.fail_after(5):  # the one query slot is free
                    query = await http.post("/v1/query", json={"sql": "SELECT 1 AS one"})
                release.set()
        finally:
            release.set()
    assert query.status_code == 200 and query.json()["rows"] == [[1]]
    assert answers == [200]
