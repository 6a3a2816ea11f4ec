"""The Fleet a job runs on: the embedded emulator unless ``FLEET_API_KEY`` or
``FLEET_BASE_URL`` is set; its pre-flight; and what an interrupted run left running on it."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from contextlib import AsyncExitStack

import anyio

from fleetroll.jobs.output import JobOutput
from fleetroll.pool.batch_pool import FleetTarget, release_run
from fleetroll.pool.preflight import check_policy, preflight
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events

__all__ = ["FleetTarget", "open_fleet", "preflight_fleet", "release_leftovers"]


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


async def preflight_fleet(
    settings: Settings, fleet: FleetTarget, tasks: Sequence[TaskSpec]
) -> None:
    """:func:`~fleetroll.pool.preflight.preflight` with a provider of its own for
    ``fleet`` (and mcp tasks), closed after.

    Raises:
        PreflightError: any check found a problem.
    """
    from fleetroll.pool.assembly import mixed_provider

    # The provider the pool builds: Fleet for Fleet tasks, the mcp one for the others.
    provider = mixed_provider(settings, Events(), api_key=fleet.api_key, base_url=fleet.base_url)

    def policy() -> Awaitable[list[str]]:
        return check_policy(
            settings.policy,
            api_key=settings.openai_api_key,
            timeout_s=settings.timeouts.preflight_s,
        )

    try:
        await preflight(provider, tasks, policy)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(settings.timeouts.release_s):
            await provider.aclose()
