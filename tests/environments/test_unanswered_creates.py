"""A create whose answer never reached us (our deadline passed first) may still
have made an instance, whose id we never learnt: it is released all the same,
by the time the pool (or the provider's background) closes, and sooner when
its batch already ended (the emulator, its answer held back: an instance made
and its answer lost in flight)."""

from __future__ import annotations

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import mixed_provider
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink
from ledger_watch import Changes, creates_sent

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SETTINGS = load_settings()
TASK = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)[0]
FAST = {
    "adaptive_creates": False,
    "creates_per_second": 1000,
    "backoff_initial_s": 0.05,
    "max_attempts": 1,
}
#: The instance is made at once; its answer comes long after the client's deadline.
ANSWER_LOST = FaultProfile(create_answer_delay_s=30.0)


def orphans_released(sink: MemorySink) -> list[str]:
    return [
        e.attributes["instance_id"]
        for e in sink.named("fleet_instance_released")
        if e.attributes.get("orphan")
    ]


@pytest.mark.parametrize("client", ["direct", "sdk"])
async def test_an_instance_made_by_a_create_left_without_an_answer_is_released_at_close(
    client: str,
) -> None:
    # The rollout leaves while its create is in flight; the create then runs out
    # of its own deadline, its instance made but its id never heard of.
    settings = load_settings(
        provisioning={**FAST, "control_client": client}, timeouts={"provision_create_s": 1.0}
    )
    sink = MemorySink()
    async with Emulator(ANSWER_LOST) as emu:
        changes = Changes(emu.ledger)
        events = Events([sink, changes])
        provider = mixed_provider(settings, events, api_key=emu.api_key, base_url=emu.base_url)
        with anyio.fail_after(60):
            async with provider.running():
                async with anyio.create_task_group() as rollout:
                    rollout.start_soon(lambda: provider.provision(TASK, run_id="batch-1"))

                    async def made() -> bool:
                        return emu.ledger.created == 1 and creates_sent(emu.ledger) == 1

                    await changes.until(made)
                    rollout.cancel_scope.cancel()

                async def ended() -> bool:
                    return bool(sink.named("fleet_create_abandoned"))

                await changes.until(ended)
            # Closed: nothing of ours may run on.
            running = emu.ledger.running
        await provider.aclose()
    [abandoned] = sink.named("fleet_create_abandoned")
    assert (abandoned.attributes["outcome"], abandoned.attributes["instance_id"]) == (
        "failed",
        None,
    )
    assert running == 0
    assert len(orphans_released(sink)) == 1


async def test_a_create_still_in_flight_when_its_batch_ends_is_swept_when_it_ends() -> None:
    # The rollout's provisioning budget passes while its create is in flight: the
    # rollout fails (init_error) and its batch ends and sweeps its tag before the
    # instance is made; the create then runs out of its deadline without an answer.
    settings = load_settings(
        provisioning=FAST,
        timeouts={"provision_total_s": 0.5, "provision_create_s": 3.0},
    )
    profile = FaultProfile(create_latency=Latency(min_s=1.5), create_answer_delay_s=30.0)
    sink = MemorySink()
    results: list[RolloutResult] = []
    async with Emulator(profile) as emu:
        changes = Changes(emu.ledger)
        events = Events([sink, changes])
        with anyio.fail_after(60):
            async with RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=events
            ) as pool:
                async for result in pool.run_batch([TASK], ScriptedPolicy()):
                    results.append(result)

                # Released while the pool is open (as a service's pool stays), not
                # only when it closes.
                async def swept() -> bool:
                    return bool(orphans_released(sink))

                await changes.until(swept)
            running = emu.ledger.running
    [result] = results
    assert result.failure_reason is FailureReason.INIT_ERROR
    assert emu.ledger.created == 1
    assert running == 0
