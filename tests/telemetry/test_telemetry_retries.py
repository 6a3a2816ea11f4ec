"""stamina's retries, for a program that uses fleetroll as a library: logging, not stdout."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import pytest
import stamina.instrumentation

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks


@pytest.fixture
def stamina_defaults() -> Iterator[None]:
    """stamina's hooks as a fresh process has them (structlog's default: stdout)."""
    before = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks(None)
    try:
        yield
    finally:
        stamina.instrumentation.set_on_retry_hooks(before)


async def test_a_pool_without_telemetry_logs_retries_at_debug_and_prints_nothing_on_stdout(
    stamina_defaults: None, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(
        provisioning={"max_attempts": 2, "backoff_initial_s": 0.01, "backoff_max_s": 0.02}
    )
    [task] = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)[:1]
    caplog.set_level(logging.DEBUG, logger="fleetroll.retries")
    async with (
        Emulator(FaultProfile(p_create_5xx=1.0)) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
    ):
        with anyio.fail_after(60):
            [result] = [r async for r in pool.run_batch([task], ScriptedPolicy())]
    assert result.failure_reason is FailureReason.INIT_ERROR  # one create, one retry, given up
    out, _ = capfd.readouterr()
    assert out == ""
    retries = [r for r in caplog.records if r.name == "fleetroll.retries"]
    assert [r.levelno for r in retries] == [logging.DEBUG]
    assert retries[0].getMessage().startswith("retry of make after attempt 1 in ")
