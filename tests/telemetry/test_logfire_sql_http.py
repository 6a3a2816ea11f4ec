"""``POST /v1/query`` takes Logfire's SQL too: it goes through the same ``queries.query``."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from telemetry_helpers import insert_event

from fleetroll.emulator import Emulator
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.service import Service, create_app
from fleetroll.settings import load_settings

#: Integration tests (the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture
async def http(
    emulator: Emulator, store: tuple[Path, sqlite3.Connection]
) -> AsyncIterator[httpx.AsyncClient]:
    db, conn = store
    for n, (env, seconds) in enumerate([("ledger", 1.0), ("ledger", 3.0), ("desktop", 10.0)]):
        insert_event(conn, "fleet_rollout_completed", n=n, env_key=env, duration_s=seconds)
    settings = load_settings(telemetry={"db_path": str(db), "send_to_logfire": False})
    async with RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool:
        app = create_app(Service(pool, settings))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


async def test_v1_query_answers_logfire_sql(http: httpx.AsyncClient) -> None:
    sql = (
        "SELECT attributes->>'env_key' AS env, percentile_cont(0.5) WITHIN GROUP "
        "(ORDER BY (attributes->>'duration_s')::float) AS p50 FROM records "
        "WHERE message ILIKE 'FLEET_ROLLOUT_COMPLETED' "
        "AND start_timestamp >= '2025-12-31'::timestamp + interval '1 day' GROUP BY 1 ORDER BY 1"
    )
    with anyio.fail_after(30):
        answer = await http.post("/v1/query", json={"sql": sql})
    assert answer.status_code == 200, answer.text
    assert answer.json()["rows"] == [["desktop", 10.0], ["ledger", 2.0]]


async def test_v1_query_says_where_the_sql_is_wrong(http: httpx.AsyncClient) -> None:
    with anyio.fail_after(30):
        bad = await http.post("/v1/query", json={"sql": "SELECT durration::float FROM records"})
        refused = await http.post(
            "/v1/query", json={"sql": "DELETE FROM records WHERE start_timestamp < now()"}
        )
    assert bad.status_code == 400
    assert "no such column: durration at line 1, column 8" in bad.json()["detail"]
    assert refused.status_code == 403 and "read-only" in refused.json()["detail"]
