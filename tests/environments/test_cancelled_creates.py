"""A create whose rollout was cancelled while it was in flight keeps its admission
place until it ends, however it ends, and what it made is released at once
(the provider as a pool holds it, on the emulator over loopback)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.environments.admission import AdmissionController, AdmissionState, CreateLimits
from fleetroll.pool.assembly import mixed_provider
from fleetroll.settings import config_dir, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink
from ledger_watch import Changes, creates_sent

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SETTINGS = load_settings()
TASK = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)[0]
FAST = {"adaptive_creates": False, "creates_per_second": 1000, "backoff_initial_s": 0.05}


def held(state: AdmissionState) -> tuple[int, int, int]:
    return state.in_use, state.starting, state.creates_in_flight


@pytest.mark.parametrize(
    ("profile", "timeouts", "outcome", "error_type"),
    [
        # It succeeds after the cancel: its instance is released at once.
        (
            FaultProfile(create_latency=Latency(min_s=2.0), creates_outlive_clients=True),
            {},
            "released",
            None,
        ),
        # Fleet answers it with an error (504) after the cancel.
        (FaultProfile(p_create_hang=1.0, create_hang_s=2.0), {}, "failed", "FleetAPIError"),
        # It runs out of its own deadline (timeouts.provision_create_s).
        (
            FaultProfile(create_latency=Latency(min_s=3600)),
            {"provision_create_s": 2.0},
            "failed",
            "TimeoutError",
        ),
    ],
    ids=["success", "failure", "timeout"],
)
@pytest.mark.parametrize("client", ["direct", "sdk"])
async def test_a_create_in_flight_at_a_cancel_holds_its_place_until_it_ends(
    profile: FaultProfile,
    timeouts: dict[str, Any],
    outcome: str,
    error_type: str | None,
    client: str,
) -> None:
    settings = load_settings(provisioning={**FAST, "control_client": client}, timeouts=timeouts)
    sink = MemorySink()
    async with Emulator(profile) as emu:
        changes = Changes(emu.ledger)
        events = Events([sink, changes])
        admission = AdmissionController(
            settings.admission, CreateLimits.from_settings(settings.provisioning), events
        )
        provider = mixed_provider(
            settings, events, api_key=emu.api_key, base_url=emu.base_url, admission=admission
        )
        async with provider.running():
            with anyio.fail_after(30):
                async with anyio.create_task_group() as rollout:
                    rollout.start_soon(provider.provision, TASK)

                    async def sent() -> bool:
                        return creates_sent(emu.ledger) == 1

                    await changes.until(sent)
                    rollout.cancel_scope.cancel()  # the rollout's cancel returns at once
                during = admission.state()

                async def ended() -> bool:
                    return bool(sink.named("fleet_create_abandoned"))

                await changes.until(ended)
                after = admission.state()
        await provider.aclose()
    assert held(during) == (1, 1, 1)  # the create is still Fleet's: its place is kept
    assert held(after) == (0, 0, 0)
    [event] = sink.named("fleet_create_abandoned")
    assert event.attributes["outcome"] == outcome
    assert event.attributes["reason"] == "cancelled"
    assert event.attributes["error_type"] == error_type
    assert (event.attributes["instance_id"] is None) == (outcome != "released")
    assert emu.ledger.running == 0


async def test_a_pool_closing_waits_for_its_creates_in_flight_then_cuts_them() -> None:
    settings = load_settings(provisioning=FAST, timeouts={"release_s": 0.5})
    sink = MemorySink()
    async with Emulator(FaultProfile(create_latency=Latency(min_s=3600))) as emu:
        changes = Changes(emu.ledger)
        events = Events([sink, changes])
        admission = AdmissionController(
            settings.admission, CreateLimits.from_settings(settings.provisioning), events
        )
        provider = mixed_provider(
            settings, events, api_key=emu.api_key, base_url=emu.base_url, admission=admission
        )
        with anyio.fail_after(30):
            async with provider.running(), anyio.create_task_group() as rollout:
                rollout.start_soon(provider.provision, TASK)

                async def sent() -> bool:
                    return creates_sent(emu.ledger) == 1

                await changes.until(sent)
                rollout.cancel_scope.cancel()
            # Closed: after timeouts.release_s, the create was cut.
            after = admission.state()
        await provider.aclose()
    assert held(after) == (0, 0, 0)
    [event] = sink.named("fleet_create_abandoned")
    assert (event.attributes["outcome"], event.attributes["instance_id"]) == ("cut", None)
    assert event.level == "warn"
