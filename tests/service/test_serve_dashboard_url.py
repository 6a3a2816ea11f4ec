"""``fleetroll serve`` with a token prints the dashboard's login URL: its shape, never the token."""

from __future__ import annotations

import os
import signal
import sys

import anyio
import pytest

TOKEN = "a-serve-token-of-32-characters-xyz"


@pytest.mark.slow
async def test_fleetroll_serve_with_a_token_prints_the_login_url_shape_not_the_token() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "OTEL_"))
    }
    env |= {"FLEETROLL_SERVICE_TOKEN": TOKEN, "FLEETROLL_TELEMETRY__DB_PATH": os.devnull}
    command = [sys.executable, "-m", "fleetroll", "serve", "--port", "0"]
    async with await anyio.open_process(command, env=env) as process:
        assert process.stderr is not None
        said = b""
        with anyio.fail_after(60):
            while b"dashboard: " not in said or not said.endswith(b"\n"):
                said += await process.stderr.receive()
            process.send_signal(signal.SIGINT)
            await process.wait()
    text = said.decode()
    assert TOKEN not in text
    (line,) = [line for line in text.splitlines() if "dashboard: " in line]
    assert line.strip().startswith("dashboard: http://127.0.0.1:")
    assert line.strip().endswith("/dashboard/login?token=<FLEETROLL_SERVICE_TOKEN>")
