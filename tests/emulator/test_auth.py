"""The emulator runs task code: nobody without its key gets in, and it says so as Fleet does."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import httpx
import pytest
from fleet._async.client import AsyncFleet

from fleetroll.emulator import Emulator

CONTROL_PLANE = [
    ("GET", "/v1/env/"),
    ("GET", "/v1/env/ledger"),
    ("GET", "/v1/env/instances"),
    ("POST", "/v1/env/instances"),
    ("DELETE", "/v1/env/instances/batch?run_id=r"),
    ("GET", "/v1/env/runs"),
    ("GET", "/v1/env/instances/abc"),
    ("DELETE", "/v1/env/instances/abc"),
    ("POST", "/v1/env/instances/abc/heartbeat"),
    ("GET", "/v1/account"),
    ("GET", "/v1/verifiers/check?sha256=00"),
    ("POST", "/v1/verifiers/execute"),
    ("GET", "/_emulator/ledger"),
]


async def test_every_control_plane_route_wants_the_key_and_answers_401_as_fleet_does() -> None:
    async with Emulator() as emu, httpx.AsyncClient(base_url=emu.base_url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": "Basic x"}):
            for method, path in CONTROL_PLANE:
                with anyio.fail_after(30):
                    response = await http.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers)
                assert set(response.json()) == {"detail"}
                assert emu.api_key not in response.text
        assert emu.ledger.created == 0


async def test_each_emulator_generates_its_own_key_unless_given_one(sdk) -> None:
    async with Emulator() as first, Emulator() as second, Emulator(api_key="given") as third:
        assert len(first.api_key) >= 32 and first.api_key != second.api_key
        assert third.api_key == "given"
        env = await sdk(first).make("ledger")  # the SDK with the emulator's own key gets in
        await env.close()


@pytest.fixture
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """What the emulator's server and its MCP servers log at ERROR."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "mcp.server.streamable_http")]
    for logger in loggers:
        logger.addHandler(keep)
    yield records
    for logger in loggers:
        logger.removeHandler(keep)


async def test_a_client_that_leaves_before_sending_its_body_is_not_logged_as_an_error(
    server_errors: list[logging.LogRecord],
) -> None:
    async with Emulator() as emu, httpx.AsyncClient(timeout=30) as http:
        env = await AsyncFleet(api_key=emu.api_key, base_url=emu.base_url, httpx_client=http).make(
            "ledger"
        )
        host, port = emu.base_url.removeprefix("http://").rsplit(":", 1)
        for path in (
            "/v1/env/instances",
            "/v1/verifiers/execute",
            f"/instances/{env.instance_id}/mcp",
            f"/instances/{env.instance_id}/api/v1/env/resources/sqlite/current/query",
        ):
            with anyio.fail_after(30):
                stream = await anyio.connect_tcp(host, int(port))
                await stream.send(
                    f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
                    f"Authorization: Bearer {emu.api_key}\r\n"
                    "Content-Type: application/json\r\n"
                    "Accept: application/json, text/event-stream\r\n"
                    'Content-Length: 100\r\n\r\n{"half a body'.encode()
                )
                await stream.aclose()
        # The server has seen every disconnect once it answers the next request.
        with anyio.fail_after(30):
            await env.close()
    assert [r.getMessage() for r in server_errors] == []


def test_the_emulator_key_given_in_the_environment_is_redacted_from_telemetry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fleetroll.settings import load_settings
    from fleetroll.telemetry.events import Redactor

    monkeypatch.setenv("FLEETROLL_EMULATOR_API_KEY", "emu-key-0123456789")
    settings = load_settings()
    assert settings.emulator_api_key is not None
    # Telemetry's redactor knows the secrets its entry point gives it: Settings.secrets().
    redact = Redactor(settings.secrets())
    assert "emu-key-0123456789" not in redact("sent emu-key-0123456789 twice")
