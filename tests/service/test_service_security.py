"""The front door: bind check, bearer token, Host check, body limit, read-only SQL."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from click.testing import CliRunner
from pydantic import SecretStr
from service_helpers import LEDGER, Running, running_service, task_record

from fleetroll._internal.guard import check_bind
from fleetroll.cli.main import main
from fleetroll.client import FleetrollClient, ServiceError
from fleetroll.emulator import Emulator
from fleetroll.errors import ConfigError
from fleetroll.telemetry.store import connect

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture(scope="module")
async def guarded(emulator: Emulator) -> AsyncIterator[Running]:
    """A service with a token and a small body limit."""
    settings = {"service_token": TOKEN, "service": {"max_body_bytes": 4096}}
    async with running_service(emulator, **settings) as running:
        yield running


def test_binding_beyond_loopback_without_a_token_refuses_to_start() -> None:
    result = CliRunner(env={"FLEETROLL_SERVICE_TOKEN": None}).invoke(
        main, ["serve", "--host", "0.0.0.0", "--port", "0"]
    )
    assert result.exit_code == 2
    assert "requires a bearer token" in result.output and "FLEETROLL_SERVICE_TOKEN" in result.output
    check_bind("0.0.0.0", SecretStr(TOKEN))  # with a token it may
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(host, None)
    with pytest.raises(ConfigError, match="too short"):
        check_bind("0.0.0.0", SecretStr("short"))


def test_a_blank_or_padded_short_token_refuses_to_start_in_one_line() -> None:
    for token in (" " * 16, "\t\n" * 10, "  short-token  \n  "):
        with pytest.raises(ConfigError, match="blank or too short"):
            check_bind("127.0.0.1", SecretStr(token))
        result = CliRunner(env={"FLEETROLL_SERVICE_TOKEN": token}).invoke(
            main, ["serve", "--host", "127.0.0.1", "--port", "0"]
        )
        assert result.exit_code == 2
        assert [line for line in result.output.splitlines() if line.strip()] == [
            "Error: FLEETROLL_SERVICE_TOKEN is blank or too short: use at least 16 characters"
            " besides surrounding whitespace"
        ]
    check_bind("0.0.0.0", SecretStr(f"  {TOKEN}\n"))  # a stray newline around a good one is fine


async def test_a_missing_or_wrong_token_gets_401_and_healthz_stays_open(
    guarded: Running,
) -> None:
    async with guarded.http() as anonymous, guarded.http(Authorization="Bearer wrong") as wrong:
        with anyio.fail_after(30):
            health = await anonymous.get("/healthz")
            page = await anonymous.get("/dashboard")  # no data in it; it sends the token
            answers = [
                await anonymous.get("/dashboard/data"),
                await anonymous.get("/metrics"),
                await anonymous.get("/openapi.json"),
                await anonymous.post("/v1/batches", json={}),
                await anonymous.post("/mcp", json={}),
                await wrong.get("/v1/batches/x"),
                await wrong.get("/metrics", headers={"Authorization": f"Basic {TOKEN}"}),
            ]
    assert health.status_code == 200 and page.status_code == 200
    assert [a.status_code for a in answers] == [401] * len(answers)
    assert answers[0].headers["www-authenticate"].startswith("Bearer")
    assert all(TOKEN not in a.text for a in answers)


async def test_the_right_token_opens_every_route_and_is_never_echoed(guarded: Running) -> None:
    async with FleetrollClient(guarded.url, token=TOKEN) as client:
        with anyio.fail_after(60):
            results = await client.run_batch(LEDGER[:1]).results()
    async with guarded.http(Authorization=f"Bearer {TOKEN}") as http:
        with anyio.fail_after(30):
            pages = [await http.get("/metrics"), await http.get("/openapi.json")]
    assert results[0].reward == 1.0
    assert all(p.status_code == 200 and TOKEN not in p.text for p in pages)
    assert pages[1].json()["security"] == [{"bearer": []}]
    with pytest.raises(ServiceError) as refused:
        async with FleetrollClient(guarded.url, token="not-it") as client:
            await client.run_batch(LEDGER[:1]).submit()
    assert refused.value.status_code == 401 and TOKEN not in str(refused.value)


async def test_an_oversize_body_gets_413_announced_or_not(guarded: Running) -> None:
    big = {"tasks": [{**task_record(LEDGER[0]), "prompt": "x" * 5000}]}

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b" " * 1000

    async with guarded.http(Authorization=f"Bearer {TOKEN}") as http:
        with anyio.fail_after(30):
            announced = await http.post("/v1/batches", json=big)
            streamed = await http.post(
                "/v1/batches", content=chunks(), headers={"Content-Type": "application/json"}
            )
    assert announced.status_code == 413 and streamed.status_code == 413


async def test_without_a_token_only_loopback_host_names_are_answered(served: Running) -> None:
    async with served.http() as http:
        with anyio.fail_after(30):
            rebound = await http.get("/healthz", headers={"Host": "attacker.example:80"})
            local = await http.get("/healthz", headers={"Host": "localhost:1234"})
    assert rebound.status_code == 421 and local.status_code == 200


def _event(conn: sqlite3.Connection, message: str, **attributes: object) -> None:
    """One event row, as the telemetry store's sink writes it (the columns we need)."""
    row = {
        "start_timestamp": "2026-11-01T00:00:00.000000Z",
        "created_at": "2026-11-01T00:00:00.000000Z",
        "trace_id": "0" * 32,
        "span_id": "0" * 16,
        "kind": "log",
        "level": "info",
        "span_name": message,
        "message": message,
        "service_name": "fleetroll",
        "attributes": json.dumps(attributes),
        "tags": "[]",
        "otel_status_code": "UNSET",
        "is_exception": 0,
    }
    columns = ", ".join(row)
    marks = ", ".join("?" * len(row))
    conn.execute(f"INSERT INTO records ({columns}) VALUES ({marks})", tuple(row.values()))


@pytest.fixture
async def store(emulator: Emulator, tmp_path: Path) -> AsyncIterator[tuple[Running, Path]]:
    db = tmp_path / "telemetry.db"
    conn = connect(db)  # the telemetry store's own schema
    base = {"batch_id": "b1", "rollout_id": "r1", "env_key": "ledger", "env_version": "v1"}
    _event(conn, "fleet_rollout_started", **base, modality="tool_use")
    _event(conn, "fleet_rollout_completed", **base, modality="tool_use", reward=1.0)
    conn.close()
    settings = {"telemetry": {"db_path": str(db)}, "service": {"query_timeout_s": 0.5}}
    async with running_service(emulator, **settings) as running:
        yield running, db


async def test_query_reads_and_refuses_every_kind_of_write(store: tuple[Running, Path]) -> None:
    served, db = store
    forever = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT max(i) FROM n"
    writes = [
        "DELETE FROM records",
        "INSERT INTO records (message) VALUES ('x')",
        "UPDATE records SET message = 'x'",
        "DROP TABLE records",
        "CREATE TABLE evil (x)",
        f"ATTACH DATABASE '{db.parent / 'other.db'}' AS other",
        "PRAGMA query_only = 0",
    ]
    async with served.http() as http:
        with anyio.fail_after(30):
            read = await http.post(
                "/v1/query",
                json={
                    "sql": "SELECT message, attributes ->> 'reward' AS reward FROM records"
                    " WHERE message = ?",
                    "params": ["fleet_rollout_completed"],
                },
            )
            refused = [await http.post("/v1/query", json={"sql": sql}) for sql in writes]
            slow = await http.post("/v1/query", json={"sql": forever})
            two = await http.post("/v1/query", json={"sql": "SELECT 1; DELETE FROM records"})
            stats = await http.get("/v1/stats", params={"batch_id": "b1"})
    assert read.status_code == 200
    assert read.json() == {
        "columns": ["message", "reward"],
        "rows": [["fleet_rollout_completed", 1.0]],
        "truncated": False,
    }
    assert [r.status_code for r in refused] == [403] * len(writes), [r.text for r in refused]
    assert slow.status_code == 400 and "limit" in slow.json()["detail"]
    assert two.status_code == 400
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM records").fetchone() == (2,)
    conn.close()
    assert not (db.parent / "other.db").exists()
    body = stats.json()
    assert stats.status_code == 200 and body["invariant_ok"] and body["rollouts"] == 1
    assert body["envs"][0]["env_key"] == "ledger" and body["envs"][0]["reward_mean"] == 1.0


async def test_query_bounds_bytes_while_fetching_and_stats_of_an_unknown_batch_is_404(
    store: tuple[Running, Path],
) -> None:
    served, _ = store
    endless = (  # 10 KB rows, without end: only a bound applied while fetching can answer
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
        "SELECT i, hex(zeroblob(5000)) AS big FROM n"
    )
    async with served.http() as http:
        with anyio.fail_after(30):
            big = await http.post("/v1/query", json={"sql": endless})
            many = await http.post("/v1/query", json={"sql": endless, "max_rows": 3})
            unknown = await http.get("/v1/stats", params={"batch_id": "nope"})
    max_bytes = served.service.settings.service.query_max_bytes
    assert big.status_code == 200 and big.json()["truncated"] is True
    assert max_bytes // 2 < len(big.content) < 2 * max_bytes
    assert [row[0] for row in many.json()["rows"]] == [1, 2, 3] and many.json()["truncated"]
    assert unknown.status_code == 404
    assert unknown.json() == {"detail": "no such batch: nope; recent batches: b1"}


async def test_the_openapi_document_lists_every_route_with_its_schemas(served: Running) -> None:
    async with served.http() as http:
        with anyio.fail_after(30):
            doc = (await http.get("/openapi.json")).json()
    operations = {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert operations == {
        ("GET", "/healthz"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches/{batch_id}"),
        ("DELETE", "/v1/batches/{batch_id}"),
        ("GET", "/v1/batches/{batch_id}/results"),
        ("GET", "/v1/batches/{batch_id}/groups"),
        ("GET", "/v1/batches/{batch_id}/eval"),
        ("GET", "/v1/rollouts/{rollout_id}/events"),
        ("GET", "/v1/policy"),
        ("PUT", "/v1/policy/version"),
        ("POST", "/v1/policy/pauses"),
        ("PUT", "/v1/policy/pauses/{pause_id}"),
        ("DELETE", "/v1/policy/pauses/{pause_id}"),
        ("POST", "/v1/sessions"),
        ("POST", "/v1/sessions/{session_id}/step"),
        ("POST", "/v1/sessions/{session_id}/done"),
        ("DELETE", "/v1/sessions/{session_id}"),
        ("POST", "/v1/query"),
        ("GET", "/v1/stats"),
        ("POST", "/v1/trees"),
        ("GET", "/v1/trees/{tree_id}"),
        ("DELETE", "/v1/trees/{tree_id}"),
        ("GET", "/v1/trees/{tree_id}/results"),
    }
    schemas = doc["components"]["schemas"]
    assert {"BatchRequest", "RolloutResult", "StreamLine", "ValidationErrorBody"} <= set(schemas)
    assert schemas["PolicyConfig"]["properties"]["api_key"]["anyOf"][0]["writeOnly"] is True


async def test_metrics_count_rollouts_and_provisioning_in_prometheus_text(
    served: Running,
) -> None:
    async with FleetrollClient(served.url) as client:
        with anyio.fail_after(60):
            await client.run_batch(LEDGER[:2]).results()
    async with httpx.AsyncClient(base_url=served.url) as http:
        text = (await http.get("/metrics")).text
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    completed = 'fleetroll_rollouts_total{status="completed",reason="",environment="ledger"}'
    assert int(samples[completed]) >= 2
    assert int(samples["fleetroll_provision_seconds_count"]) >= 2
    assert (
        samples['fleetroll_provision_seconds_bucket{le="+Inf"}']
        == (samples["fleetroll_provision_seconds_count"])
    )
    assert "fleetroll_rollouts_in_flight 0" in text
    # Admission's gauges: no account limit on the emulator, nothing held at the end.
    assert samples["fleetroll_admission_limit"] == "-1"
    assert samples["fleetroll_admission_in_use"] == samples["fleetroll_admission_queued"] == "0"
    assert samples["fleetroll_admission_open_breakers"] == "0"


async def test_the_dashboard_is_served_by_the_service(served: Running) -> None:
    async with served.http() as client:
        page = await client.get("/dashboard")
        data = await client.get("/dashboard/data")
    assert page.status_code == 200 and "<svg" in page.text
    assert data.status_code == 200 and "totals" in data.json()


async def test_the_dashboard_login_cookie_opens_its_data_with_the_gauges_and_nothing_else(
    guarded: Running,
) -> None:
    async with guarded.http() as browser:
        with anyio.fail_after(30):
            refused = await browser.get("/dashboard/login", params={"token": "not-it"})
            login = await browser.get("/dashboard/login", params={"token": TOKEN})
            data = await browser.get("/dashboard/data")
            metrics = await browser.get("/metrics")  # the cookie opens the dashboard only
    assert refused.status_code == 401 and "not-it" not in refused.text
    assert login.status_code == 303 and TOKEN not in login.headers["set-cookie"]
    assert data.status_code == 200 and metrics.status_code == 401
    gauges = data.json()["admission"]["gauges"]
    assert set(gauges) == {
        "limit",
        "in_use",
        "starting",
        "queued",
        "open_breakers",
        "creates_per_second",
        "creates_in_flight_limit",
        "creates_in_flight",
    }
