"""Instance reuse (``provisioning.reuse``) on the emulator: real instances, real resets.

The ledger tasks' verifiers check the whole state exactly (every balance, and
exactly the task's own new transactions), so a verifier that saw another
rollout's changes would give 0.0 where a fresh instance gives 1.0.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink

pytestmark = pytest.mark.slow

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
#: Tasks that write to the ledger, each something else.
WRITERS = [t for t in LEDGER if t.key in {"ledger-001", "ledger-002", "ledger-003", "ledger-004"}]
FAST = {"creates_per_second": 1000, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}


def pool_for(emu: Any, sink: MemorySink, **provisioning: Any) -> RolloutPool:
    settings = load_settings(provisioning={**FAST, **provisioning}, pool={"concurrency": 1})
    return RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink]))


def by_id(results: list[RolloutResult]) -> dict[str, RolloutResult]:
    return {r.rollout_id: r for r in results}


async def test_a_reused_instance_s_verifier_sees_only_its_own_rollout_s_changes() -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        async with pool_for(emu, sink, reuse=True) as pool:
            results: list[RolloutResult] = []
            for task in WRITERS:  # in sequence: each takes the last one's instance
                with anyio.fail_after(60):
                    results += await pool.run_batch([task], ScriptedPolicy()).results()
        assert emu.ledger.running == 0
        assert emu.ledger.created == 1
    assert [r.instance_uses for r in results] == [1, 2, 3, 4]
    assert len({r.instance_id for r in results}) == 1
    # Each verifier checks every balance and exactly its own transactions.
    assert [r.reward for r in results] == [1.0] * len(WRITERS)


async def test_an_instance_whose_reset_fails_is_released_not_reused() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_reset_error=1.0)) as emu:
        async with pool_for(emu, sink, reuse=True) as pool:
            results = []
            for task in WRITERS[:3]:
                with anyio.fail_after(60):
                    results += await pool.run_batch([task], ScriptedPolicy()).results()
        assert emu.ledger.running == 0
        assert emu.ledger.created == 3
    assert [r.instance_uses for r in results] == [1, 1, 1]
    assert [r.reward for r in results] == [1.0] * 3
    released = [e.attributes for e in sink.named("fleet_instance_recycled")]
    assert [a.get("reason") for a in released if a["outcome"] == "released"] == ["reset_failed"] * 3


async def test_an_instance_serves_at_most_one_plus_max_reuses_rollouts() -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        async with pool_for(emu, sink, reuse=True, max_reuses=1) as pool:
            results = []
            for task in WRITERS + WRITERS[:1]:
                with anyio.fail_after(60):
                    results += await pool.run_batch([task], ScriptedPolicy()).results()
        assert emu.ledger.running == 0
    assert [r.instance_uses for r in results] == [1, 2, 1, 2, 1]
    assert len({r.instance_id for r in results}) == 3
    assert all(r.reward == 1.0 for r in results)


async def test_idle_instances_stay_between_batches_and_none_is_left_after_close() -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        async with pool_for(emu, sink, reuse=True, warm_instances=2, warm_idle_s=600) as pool:
            with anyio.fail_after(60):
                await pool.run_batch(WRITERS[:2], ScriptedPolicy(), samples_per_task=2).results()
            # The batch is over and swept: its instances wait for the next one.
            assert emu.ledger.running >= 1
            with anyio.fail_after(60):
                second = await pool.run_batch(WRITERS[2:], ScriptedPolicy()).results()
        assert emu.ledger.running == 0
    assert all(r.instance_uses and r.instance_uses > 1 for r in second)
    assert all(r.reward == 1.0 for r in second)


async def test_rewards_are_the_same_with_and_without_reuse_on_the_same_actions() -> None:
    tasks = LEDGER[:8]
    runs: dict[bool, dict[str, RolloutResult]] = {}
    for reuse in (False, True):
        sink = MemorySink()
        async with Emulator() as emu:
            settings = load_settings(provisioning={**FAST, "reuse": reuse}, pool={"concurrency": 4})
            async with RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink])
            ) as pool:
                with anyio.fail_after(120):
                    results = await pool.run_batch(
                        tasks, ScriptedPolicy(), samples_per_task=4, batch_id="same"
                    ).results()
            assert emu.ledger.running == 0
        runs[reuse] = by_id(results)
    fresh, reused = runs[False], runs[True]
    assert set(fresh) == set(reused)
    assert {rid: r.reward for rid, r in reused.items()} == {
        rid: r.reward for rid, r in fresh.items()
    }
    assert Counter(r.instance_uses for r in fresh.values()) == {1: len(fresh)}
    assert max(r.instance_uses or 0 for r in reused.values()) > 1
