"""A command's job (``fleetroll run``, ``fleetroll eval``): :func:`run_job` with
telemetry, the policy of the settings (or an agent command's gateway) and the
signals, all opened here and closed once the job has ended."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from fleetroll.jobs.job import run_job
from fleetroll.jobs.output import JobOutput
from fleetroll.jobs.report import JobReport
from fleetroll.jobs.steps import Steps
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec

if TYPE_CHECKING:
    from fleetroll.rollout.agent_process import AgentRecords

__all__ = ["run_policy_job"]


async def run_policy_job(
    settings: Settings,
    tasks: Sequence[TaskSpec],
    *,
    samples: int,
    out: Path | None,
    resume: bool,
    profile: str | None,
    preflight: bool,
    output: JobOutput,
    agent_command: str | None = None,
    ray_address: str | None = None,
    ray_actors: int | None = None,
    groups_target: int | None = None,
    steps: Steps | None = None,
    policy_version: int | None = None,
    command: Sequence[str] | None = None,
) -> JobReport:
    """:func:`run_job` with telemetry, the policy of the settings (or
    ``agent_command``'s gateway) and the signals.

    Raises:
        FleetrollError: as :func:`run_job` (a failed pre-flight, a journal in use).
    """
    from fleetroll.pool.assembly import chat_policy_config, policy_from_settings
    from fleetroll.telemetry import open_telemetry

    # Signals are ours until telemetry is flushed: a Ctrl-C during the
    # shutdown is then one more notice, never a KeyboardInterrupt half-way.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events:
            policy: Any
            records: AgentRecords | None = None
            if agent_command is not None:
                from fleetroll.rollout.agent_command import CommandAgent
                from fleetroll.rollout.agent_process import AgentRecords

                if out is not None:
                    # Beside the journal: a start on it ends the agents a killed
                    # run on it left (the journal's own lock is taken later).
                    records = AgentRecords(out.parent / f"{out.name}.agents")
                    await anyio.to_thread.run_sync(records.open)
                # Its gateway serves while the batch runs; closing it closes its policy.
                policy = CommandAgent.from_config(
                    agent_command, chat_policy_config(settings), records=records
                )
                try:
                    await policy.__aenter__()
                except BaseException:
                    if records is not None:
                        records.close()
                    raise
            else:
                policy = policy_from_settings(settings)
            try:
                return await run_job(
                    settings,
                    tasks,
                    policy,
                    samples=samples,
                    out=out,
                    resume=resume,
                    events=events,
                    emulator_profile=profile,
                    output=output,
                    ray_address=ray_address,
                    ray_actors=ray_actors,
                    signals=signals,
                    preflight=preflight,
                    groups_target=groups_target,
                    steps=steps,
                    policy_version=policy_version,
                    command=command,
                )
            finally:
                if agent_command is not None:
                    await policy.__aexit__(None, None, None)
                    if records is not None:
                        records.close()
                else:
                    await policy.aclose()
