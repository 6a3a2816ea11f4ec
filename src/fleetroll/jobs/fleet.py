"""The Fleet a job runs on: the embedded emulator unless ``FLEET_API_KEY`` or
``FLEET_BASE_URL`` is set; and what an interrupted run left running on it."""

from __future__ import annotations

from contextlib import AsyncExitStack

from fleetroll.jobs.output import JobOutput
from fleetroll.pool.batch_pool import FleetTarget, release_run
from fleetroll.settings import Settings
from fleetroll.telemetry.events import Events

__all__ = ["FleetTarget", "open_fleet", "release_leftovers"]


async def open_fleet(
    stack: AsyncExitStack, settings: Settings, emulator_profile: str | None = None
) -> FleetTarget:
    """The Fleet to use; starts the embedded emulator (on ``stack``) when none is set.

    Raises:
        ConfigError: an unknown emulator profile.
        EmulatorError: the emulator could not start.
    """
    if settings.uses_emulator:
        from fleetroll.emulator import Emulator

        emu = await stack.enter_async_context(
            Emulator(
                settings.emulator.fault_profile(emulator_profile),
                verifier_limits=settings.emulator.verifier_limits(),
                verifier_max_parallel=settings.emulator.verifier_max_parallel,
                keep_ended_instances=settings.emulator.keep_ended_instances,
                keep_ended_s=settings.emulator.keep_ended_s,
            )
        )
        return FleetTarget(emu.api_key, emu.base_url, f"emulator {emu.base_url}")
    return FleetTarget(
        settings.require_fleet_api_key(),
        settings.fleet_base_url,
        settings.fleet_base_url or "Fleet",
    )


async def release_leftovers(
    settings: Settings, fleet: FleetTarget, run_id: str, events: Events, output: JobOutput
) -> None:
    """Release what an interrupted run of ``run_id`` left running (the journal's
    batch id is the run id; its lock says no live run has it)."""
    left = await release_run(settings, fleet, run_id, events)
    if left:
        output.say(
            f"fleetroll: released {len(left)} instance(s) of run {run_id}"
            " that the interrupted run left running"
        )
