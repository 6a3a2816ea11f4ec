"""Retries on the emulator's injected faults show up in the telemetry store as fleet_retry."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry
from fleetroll.telemetry.store import connect

#: Integration tests (the emulator over loopback, real MCP sessions): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


def retries_in(db: Path) -> list[dict[str, object]]:
    conn = connect(db, readonly=True)
    try:
        rows = conn.execute("SELECT attributes FROM records WHERE message = 'fleet_retry'")
        return [json.loads(attributes) for (attributes,) in rows]
    finally:
        conn.close()


async def test_mcp_connect_and_verifier_retries_are_fleet_retry_records_of_their_rollout(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    settings = load_settings(
        telemetry={"db_path": str(db), "send_to_logfire": False},
        retries={
            "mcp_connect_backoff_initial_s": 0.2,
            "mcp_connect_backoff_max_s": 0.2,
            "verifier_attempts": 2,
            "verifier_backoff_initial_s": 0.0,
            "verifier_backoff_max_s": 0.0,
        },
    )
    task = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)[0]
    # MCP answers 503 for 2 s after each create (long enough that a loaded machine's
    # first request still meets it); every verifier run fails on the platform.
    faults = FaultProfile(mcp_warmup_s=2.0, p_verifier_error=1.0)
    async with (
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        Emulator(faults) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as p,
    ):
        with anyio.fail_after(60):
            (result,) = await p.run_batch([task], ScriptedPolicy()).results()
    assert result.failure_reason == FailureReason.VERIFIER_ERROR

    retries = retries_in(db)
    by_operation = {str(r["operation"]) for r in retries}
    assert by_operation == {"mcp_connect", "verify"}, retries
    for retry in retries:
        assert retry["rollout_id"] == result.rollout_id
        assert isinstance(retry["attempt"], int) and retry["attempt"] >= 1
        assert retry["error_type"] and "retry_delay_s" in retry
    (verify,) = [r for r in retries if r["operation"] == "verify"]
    assert verify["attempt"] == 1 and verify["status_code"] == 503
