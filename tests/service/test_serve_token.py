"""``fleetroll serve`` without ``FLEETROLL_SERVICE_TOKEN`` runs no stranger's code.

It takes its token from ``service.token_file`` (made on first use, readable by
its user only) and prints where it is, never the token: a caller without it
gets 401 on every route that can start a rollout (batches, sessions, MCP), so
no verifier of theirs runs; the owner's task does.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from service_helpers import LEDGER, task_record

from fleetroll.errors import ConfigError
from fleetroll.service.security import token_from_file


def marker_task(key: str, marker: Path) -> dict[str, Any]:
    """A ledger task whose verifier leaves ``marker`` behind when it runs."""
    record = task_record(LEDGER[0]) | {"key": key}
    record["verifier_func"] = (
        "def verify(env, final_answer=None):\n"
        f"    with open({str(marker)!r}, 'w') as f:\n"
        "        f.write('ran')\n"
        "    return 1.0\n"
    )
    return record


@asynccontextmanager
async def serving(token_file: Path) -> AsyncIterator[tuple[str, str]]:
    """``fleetroll serve`` as a user starts it, no token set: its URL and what it said."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "OTEL_"))
    }
    env |= {
        "FLEETROLL_SERVICE__TOKEN_FILE": str(token_file),
        "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
    }
    command = [sys.executable, "-m", "fleetroll", "serve", "--port", "0"]
    async with await anyio.open_process(command, env=env) as process:
        assert process.stderr is not None
        said = b""
        try:
            with anyio.fail_after(60):
                while b"dashboard: " not in said or not said.endswith(b"\n"):
                    said += await process.stderr.receive()
            text = said.decode()
            url = text.split("fleetroll serve: ", 1)[1].split(" ", 1)[0]
            yield url, text
        finally:
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(30):
                await process.wait()


@pytest.mark.slow
async def test_a_tokenless_serve_runs_no_strangers_verifier_and_its_owners_task_runs(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "state" / "service-token"
    stranger, owner = tmp_path / "stranger-ran", tmp_path / "owner-ran"
    strangers = marker_task("stranger", stranger)
    async with serving(token_file) as (url, said):
        async with httpx.AsyncClient(base_url=url, timeout=30) as anonymous:
            with anyio.fail_after(60):
                batch = await anonymous.post(
                    "/v1/batches", json={"tasks": [strangers], "batch_id": "stranger"}
                )
                session = await anonymous.post("/v1/sessions", json={"task": strangers})
                mcp = await anonymous.post(
                    "/mcp",
                    json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                    headers={"Accept": "application/json, text/event-stream"},
                )
                health = await anonymous.get("/healthz")
        assert [r.status_code for r in (batch, session, mcp)] == [401, 401, 401]
        token = token_file.read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
            with anyio.fail_after(120):
                started = await client.post(
                    "/v1/batches",
                    json={"tasks": [marker_task("owner", owner)], "batch_id": "owner"},
                )
                async with client.stream("GET", "/v1/batches/owner/results") as stream:
                    lines = [json.loads(line) async for line in stream.aiter_lines() if line]
    assert health.status_code == 200
    assert started.status_code == 201, started.text
    (result,) = [line["result"] for line in lines if line["type"] == "result"]
    assert result["reward"] == 1.0 and owner.read_text() == "ran"
    # The owner's verifier ran to its end: the stranger's never ran at all.
    assert not stranger.exists()
    # Where the token is was said; the token itself never.
    assert f"token: in {token_file} (made now" in said and token not in said
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700


def test_the_token_file_is_made_once_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "service-token"
    first, made = token_from_file(path)
    again, made_again = token_from_file(path)
    assert made and not made_again
    assert first.get_secret_value() == again.get_secret_value()
    assert len(first.get_secret_value()) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["service-token"]  # no draft left


def test_a_token_file_others_can_read_or_too_short_refuses_to_start_in_one_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "service-token"
    path.write_text("a-long-enough-token-of-ours\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"only you can read .*chmod 600") as readable:
        token_from_file(path)
    path.chmod(0o600)
    path.write_text("short\n")
    with pytest.raises(ConfigError, match="holds a blank or short token") as short:
        token_from_file(path)
    assert "\n" not in str(readable.value) + str(short.value)
    assert "a-long-enough" not in str(readable.value) and "short\n" not in str(short.value)
