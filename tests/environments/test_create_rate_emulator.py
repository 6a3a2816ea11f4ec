"""The learnt create rate against the embedded emulator (real HTTP, real MCP sessions)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
START = {
    "adaptive_creates": True,
    "start_creates_per_second": 4.0,
    "start_concurrent_creates": 4,
    "creates_per_second": 64.0,
    "max_concurrent_creates": 32,
    # Five attempts at most: a 429 that spent one would fail some rollout here.
    "max_attempts": 5,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.5,
}


def pool_for(emu: Emulator, sink: MemorySink, **provisioning: Any) -> RolloutPool:
    settings = load_settings(provisioning={**START, **provisioning})
    return RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink]))


async def test_30_percent_429s_lower_the_learnt_rate_and_no_create_fails_for_it() -> None:
    profile = FaultProfile(
        seed=7, p_create_429=0.3, retry_after_s=0.1, create_latency=Latency(min_s=0.01)
    )
    sink = MemorySink()
    async with Emulator(profile) as emu:
        # A floor of 2 creates a second keeps the test short (it would go lower).
        async with pool_for(emu, sink, min_creates_per_second=2.0) as pool:
            with anyio.fail_after(240):
                results = await pool.run_batch(
                    LEDGER[:8], ScriptedPolicy(), samples_per_task=3
                ).results()
        assert emu.ledger.running == 0
        throttled = emu.ledger.creates_by_outcome["429"]
    assert len(results) == 24
    assert Counter(r.failure_reason for r in results) == Counter({None: 24})
    assert throttled >= 4  # ~30% of the creates were answered 429
    changes = sink.named("fleet_create_rate")
    falls = [e.attributes for e in changes if e.attributes["reason"] == "throttled"]
    assert falls, "a 429 lowers the rate"
    assert min(f["creates_per_second"] for f in falls) < START["start_creates_per_second"]
    assert all(f["retry_after_s"] == 0.1 for f in falls)
    # Every 429 was answered by the gate, none spent an attempt.
    made = sink.named("fleet_provisioning_completed")
    assert len(made) == 24 and all(e.attributes["attempts"] == 1 for e in made)


async def test_an_idle_fleet_raises_the_rate_above_its_start() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(create_latency=Latency(min_s=0.01))) as emu:
        async with pool_for(emu, sink) as pool:
            with anyio.fail_after(240):
                results = await pool.run_batch(
                    LEDGER[:16], ScriptedPolicy(), samples_per_task=2
                ).results()
            state = pool.admission.state()
        assert emu.ledger.running == 0
    assert len(results) == 32 and all(r.reward is not None for r in results)
    assert state.creates_per_second > START["start_creates_per_second"]
    assert state.creates_in_flight_limit > START["start_concurrent_creates"]
    rises = [e.attributes for e in sink.named("fleet_create_rate")]
    assert rises and all(r["reason"] == "fast_answers" for r in rises)
